// Symmetric rank-k product on tensor cores, for Newton-Schulz:
//     out[b] = alpha * X[b] X[b]^T + beta * Y[b]        X: (m, k), Y and out: (m, m), 16-bit
// Only the tiles on and above the diagonal are computed; each off-diagonal tile is stored twice
// (itself and its transpose), so ~half the FLOPs of a dense GEMM. In Newton-Schulz it serves
// both A = X X^T and B = b A + c A A (A is symmetric, so A A = A A^T), with the polynomial
// combination done in the fp32 epilogue, rounded once to the output dtype (as baddbmm does).
//
// sm_80 path: mma.sync.m16n8k16 (f16/bf16 in, f32 accumulate). 128x128 block tile, 8 warps in a
// 2x4 grid of 64x32 warp tiles, K step 32, rows padded to 40 elements so the 32-bit fragment
// loads of a warp hit 32 distinct banks. The same text runs in the CPU emulation, where the
// mma is rebuilt from the PTX fragment tables (tests/cuda_emulation/stemu.h).
#pragma once
#include "common.cuh"

namespace st {

constexpr int kSymBM = 128;   // block tile (square)
constexpr int kSymBK = 32;    // K step
constexpr int kSymLD = kSymBK + 8;  // padded smem row (elements)
constexpr int kSymOutLD = kSymBM + 8;
constexpr int kSymThreads = 256;
constexpr int kSymSmemBytes =
    (2 * kSymBM * kSymLD > kSymBM * kSymOutLD ? 2 * kSymBM * kSymLD : kSymBM * kSymOutLD) * 2;

template <class T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
  static constexpr bool value = true;
};

// d += A(16x16, row) * B(16x8, col); fragments as in the PTX ISA tables.
template <class T>
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (IsBf16<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // not built for < sm_80 (TORCH_CUDA_ARCH_LIST defaults to 8.0;9.0)
#elif defined(STEMU_ACTIVE)
  ST_MMA_M16N8K16(d, a, b, d, IsBf16<T>::value);
#endif
}

template <class T>
__device__ __forceinline__ uint32_t ld_pair(const T* tile, int row, int col, int ld) {
  return *reinterpret_cast<const uint32_t*>(tile + row * ld + col);
}

// A fragment of a 16x16 slice of a row-major [rows][ld] tile, rows r0.., columns k0..
template <class T>
__device__ __forceinline__ void load_a_frag(uint32_t a[4], const T* tile, int r0, int k0, int ld, int lane) {
  const int g = lane >> 2, c = k0 + (lane & 3) * 2;
  a[0] = ld_pair(tile, r0 + g, c, ld);
  a[1] = ld_pair(tile, r0 + g + 8, c, ld);
  a[2] = ld_pair(tile, r0 + g, c + 8, ld);
  a[3] = ld_pair(tile, r0 + g + 8, c + 8, ld);
}

// B fragment (16x8, k x n) where B[k][n] = tile[n0 + n][k0 + k], i.e. B is the transpose of a
// row-major [n][k] tile: exactly the X^T operand.
template <class T>
__device__ __forceinline__ void load_b_frag(uint32_t b[2], const T* tile, int n0, int k0, int ld, int lane) {
  const int g = lane >> 2, c = k0 + (lane & 3) * 2;
  b[0] = ld_pair(tile, n0 + g, c, ld);
  b[1] = ld_pair(tile, n0 + g, c + 8, ld);
}

// Rows [row0, row0 + kSymBM) x columns [k0, k0 + kSymBK) of X into smem, zero outside.
template <class T, bool VEC>
__device__ __forceinline__ void load_tile(T* dst, const T* X, int ldx, int m, int k, int row0, int k0) {
  const T zero = from_f32<T>(0.f);
  if (VEC) {  // 16-byte loads: k % 8 == 0, ldx % 8 == 0 and X 16-byte aligned (checked on host)
    for (int idx = threadIdx.x; idx < kSymBM * kSymBK / 8; idx += kSymThreads) {
      const int r = idx / (kSymBK / 8), cv = (idx % (kSymBK / 8)) * 8;
      uint4 v = {0u, 0u, 0u, 0u};
      if (row0 + r < m && k0 + cv < k) {
        v = *reinterpret_cast<const uint4*>(X + static_cast<int64_t>(row0 + r) * ldx + k0 + cv);
      }
      *reinterpret_cast<uint4*>(dst + r * kSymLD + cv) = v;
    }
  } else {
    for (int idx = threadIdx.x; idx < kSymBM * kSymBK; idx += kSymThreads) {
      const int r = idx / kSymBK, c = idx % kSymBK;
      dst[r * kSymLD + c] =
          (row0 + r < m && k0 + c < k) ? X[static_cast<int64_t>(row0 + r) * ldx + k0 + c] : zero;
    }
  }
}

template <class T, bool VEC>
__global__ void __launch_bounds__(kSymThreads) syrk_mma_kernel(SyrkArgs a) {
  ST_DYNAMIC_SMEM(T, smem);
  // Upper-triangle tile (ti <= tj) from the linear block index.
  int ti = 0, rem = blockIdx.x;
  while (rem >= a.tiles - ti) {
    rem -= a.tiles - ti;
    ++ti;
  }
  const int tj = ti + rem;
  const bool diag = ti == tj;
  const int64_t bi = blockIdx.y;
  const T* X = static_cast<const T*>(a.X) + bi * a.x_bs;
  const int row0 = ti * kSymBM, col0 = tj * kSymBM;
  T* As = smem;
  T* Bs = diag ? smem : smem + kSymBM * kSymLD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps, 64 x 32 each

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  for (int k0 = 0; k0 < a.k; k0 += kSymBK) {
    load_tile<T, VEC>(As, X, a.ldx, a.m, a.k, row0, k0);
    if (!diag) load_tile<T, VEC>(Bs, X, a.ldx, a.m, a.k, col0, k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSymBK; kk += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) load_a_frag(af[i], As, wm * 64 + i * 16, kk, kSymLD, lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) load_b_frag(bf[j], Bs, wn * 32 + j * 8, kk, kSymLD, lane);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], af[i], bf[j]);
    }
    __syncthreads();
  }

  // Epilogue: alpha*acc + beta*Y in fp32, one rounding, staged in smem for coalesced stores.
  T* Cs = smem;
  const T* Y = a.Y ? static_cast<const T*>(a.Y) + bi * a.y_bs : nullptr;
  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wm * 64 + i * 16 + g + 8 * (e >> 1);
        const int c = wn * 32 + j * 8 + tig * 2 + (e & 1);
        float v = a.alpha * acc[i][j][e];
        if (Y && row0 + r < a.m && col0 + c < a.m) {
          v += a.beta * to_f32(Y[static_cast<int64_t>(row0 + r) * a.ldy + col0 + c]);
        }
        Cs[r * kSymOutLD + c] = from_f32<T>(v);
      }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + bi * a.out_bs;
  for (int idx = threadIdx.x; idx < kSymBM * kSymBM; idx += kSymThreads) {
    const int r = idx / kSymBM, c = idx % kSymBM;
    if (row0 + r < a.m && col0 + c < a.m) {
      out[static_cast<int64_t>(row0 + r) * a.ldo + col0 + c] = Cs[r * kSymOutLD + c];
    }
  }
  if (!diag) {  // mirror: out[col0 + c][row0 + r] = C[r][c], consecutive threads along r
    for (int idx = threadIdx.x; idx < kSymBM * kSymBM; idx += kSymThreads) {
      const int c = idx / kSymBM, r = idx % kSymBM;
      if (row0 + r < a.m && col0 + c < a.m) {
        out[static_cast<int64_t>(col0 + c) * a.ldo + row0 + r] = Cs[r * kSymOutLD + c];
      }
    }
  }
}

// One warp: D(16x8, f32, row-major) = A(16x16, row-major) * B(16x8) with B given as Bt[n][k]
// (8x16 row-major), through the same fragment loaders and mma wrapper as the kernel above.
// The GPU tests run it on hardware and compare with the emulation: the layout cross-check.
template <class T>
__global__ void __launch_bounds__(32) mma_probe_kernel(const T* A, const T* Bt, float* D) {
  __shared__ __align__(16) T as[16 * 16];
  __shared__ __align__(16) T bs[8 * 16];
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) as[i] = A[i];
  for (int i = lane; i < 128; i += 32) bs[i] = Bt[i];
  __syncwarp();
  uint32_t af[4], bf[2];
  load_a_frag(af, as, 0, 0, 16, lane);
  load_b_frag(bf, bs, 0, 0, 16, lane);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816<T>(d, af, bf);
  const int g = lane >> 2, tig = lane & 3;
  for (int e = 0; e < 4; ++e) D[(g + 8 * (e >> 1)) * 8 + tig * 2 + (e & 1)] = d[e];
}

inline bool syrk_vectorizable(const SyrkArgs& a) {
  return a.k % 8 == 0 && a.ldx % 8 == 0 && a.x_bs % 8 == 0 &&
         reinterpret_cast<uintptr_t>(a.X) % 16 == 0;
}

template <class T>
inline void run_syrk(SyrkArgs a, Stream stream) {
  if (a.batch == 0 || a.m == 0) return;
  a.tiles = (a.m + kSymBM - 1) / kSymBM;
  const dim3 grid(static_cast<unsigned>(a.tiles * (a.tiles + 1) / 2), static_cast<unsigned>(a.batch));
  if (syrk_vectorizable(a)) {
    ST_LAUNCH(grid, dim3(kSymThreads), kSymSmemBytes, stream, syrk_mma_kernel<T, true>)(a);
  } else {
    ST_LAUNCH(grid, dim3(kSymThreads), kSymSmemBytes, stream, syrk_mma_kernel<T, false>)(a);
  }
  check_launch("syrk_mma_kernel");
}

template <class T>
inline void run_mma_probe(const T* A, const T* Bt, float* D, Stream stream) {
  ST_LAUNCH(dim3(1), dim3(32), 0, stream, mma_probe_kernel<T>)(A, Bt, D);
  check_launch("mma_probe_kernel");
}

}  // namespace st

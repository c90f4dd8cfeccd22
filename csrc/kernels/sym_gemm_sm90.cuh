// Hopper symmetric GEMM for Newton-Schulz (sm_90a: TMA + wgmma):
//     out[b] = alpha * X[b] X[b]^T + beta * C[b]      X: (m, k), C and out: (m, m), 16-bit
// With X = A (symmetric), alpha = c, beta = b, C = A this is the NS polynomial b A + c A^2.
// Only lower-triangle tiles are computed; each element below the diagonal is stored twice
// (itself and its mirror) from one fp32 -> T rounding, so the output is exactly symmetric. C
// must be symmetric: only its lower triangle is read.
//
// Block: 384 threads = warpgroup 0 (producer: one thread issues the bulk tensor copies) and
// warpgroups 1, 2 (consumers: 64 rows of the 128-row tile each, wgmma m64nBNk16). Pipeline:
// kStages shared-memory stages of (A: 128 x 64, B: BN x 64) 16-bit elements in the 128B-swizzled
// layout the copy engine writes; per stage a `full` mbarrier (producer's arrive.expect_tx +
// the copies' complete_tx) and an `empty` mbarrier (one arrival per consumer warp once its
// wgmma reading the stage completed). Persistent: gridDim.x <= #SMs blocks walk the work list
// batch x (lower-triangle BN x BN macro tiles) x (BN / 128 row halves).
// Tile shapes: BN = 128 (m < 1536) and BN = 256. In a diagonal macro tile only B is loaded
// (A is rows of it). Out-of-range rows/columns of X are zero-filled by the copy engine.
//
// Same text runs on the CPU through tests/cuda_emulation/stemu.h (the Hopper instructions are
// emulated from the PTX ISA); no GPU has run it yet (see docs/kernels.md).
#pragma once
#include "hopper.cuh"

namespace st {

constexpr int kSgBM = 128;      // rows per work item (2 consumer warpgroups x 64)
constexpr int kSgBK = 64;       // K per stage: 64 x 2 bytes = one 128-byte swizzle row
constexpr int kSgStages = 4;
constexpr int kSgThreads = 384;
constexpr int kSgConsumerWarps = 8;

struct SymGemmParams {
  sm90::TensorMap map_a;  // X as (k, m, batch), box (64, 128, 1)
  sm90::TensorMap map_b;  // box (64, BN, 1)
  void* out;
  const void* C;
  int64_t out_bs, c_bs;
  int ldo, ldc;
  int m, nk;
  int tiles;      // macro tiles per side
  int items;      // work items per matrix: tiles (tiles + 1) / 2 * (BN / 128)
  int64_t work;   // batch * items
  float alpha, beta;
};

template <int BN>
struct SgLayout {
  static constexpr int a_bytes = kSgBM * kSgBK * 2;
  static constexpr int b_bytes = BN * kSgBK * 2;
  static constexpr int stage_bytes = a_bytes + b_bytes;
  static constexpr int smem_bytes = 1024 /* alignment slack */ + kSgStages * stage_bytes + 2 * kSgStages * 8;
};

struct SgItem {
  int64_t b;
  int row0, col0;
  int half;
  bool diag;
};

template <class T>
struct alignas(4) SgPair {
  T lo, hi;
};

// Work item -> (matrix, rows, columns). Macro tile t of the lower triangle: I >= J.
template <int BN>
__device__ __forceinline__ SgItem sg_item(const SymGemmParams& p, int64_t w) {
  constexpr int halves = BN / kSgBM;
  SgItem it;
  it.b = w / p.items;
  int t = static_cast<int>(w % p.items);
  it.half = t % halves;
  t /= halves;
  int I = static_cast<int>((sqrtf(8.f * static_cast<float>(t) + 1.f) - 1.f) * 0.5f);
  while (I * (I + 1) / 2 > t) --I;
  while ((I + 1) * (I + 2) / 2 <= t) ++I;
  const int J = t - I * (I + 1) / 2;
  it.row0 = I * BN + it.half * kSgBM;
  it.col0 = J * BN;
  it.diag = I == J;
  return it;
}

template <class T, int BN>
__global__ void __launch_bounds__(kSgThreads, 1) sym_gemm_sm90_kernel(const __grid_constant__ SymGemmParams p) {
  using L = SgLayout<BN>;
  ST_DYNAMIC_SMEM(unsigned char, smem_raw);
  const uint32_t raw = sm90::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // 128B swizzle atoms need 1024-byte alignment
  auto a_stage = [&](int s) { return base + static_cast<uint32_t>(s * L::stage_bytes); };
  auto b_stage = [&](int s) { return base + static_cast<uint32_t>(s * L::stage_bytes + L::a_bytes); };
  const uint32_t bars = base + static_cast<uint32_t>(kSgStages * L::stage_bytes);
  auto full = [&](int s) { return bars + static_cast<uint32_t>(8 * s); };
  auto empty = [&](int s) { return bars + static_cast<uint32_t>(8 * (kSgStages + s)); };

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kSgStages; ++s) {
      sm90::mbar_init(full(s), 1);
      sm90::mbar_init(empty(s), kSgConsumerWarps);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    // ---------------- producer: one thread
    if (tid != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t w = blockIdx.x; w < p.work; w += gridDim.x) {
      const SgItem it = sg_item<BN>(p, w);
      if (it.row0 >= p.m) continue;  // a row half entirely below the matrix
      const int bz = static_cast<int>(it.b);
      for (int kb = 0; kb < p.nk; ++kb) {
        sm90::mbar_wait(empty(stage), phase ^ 1u);
        if (it.diag) {
          sm90::mbar_arrive_expect_tx(full(stage), L::b_bytes);
          sm90::tma_load_3d(b_stage(stage), &p.map_b, kb * kSgBK, it.col0, bz, full(stage));
        } else {
          sm90::mbar_arrive_expect_tx(full(stage), L::stage_bytes);
          sm90::tma_load_3d(a_stage(stage), &p.map_a, kb * kSgBK, it.row0, bz, full(stage));
          sm90::tma_load_3d(b_stage(stage), &p.map_b, kb * kSgBK, it.col0, bz, full(stage));
        }
        if (++stage == kSgStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    return;
  }

  // ---------------- consumers
  const int cw = wg - 1;                      // row half of the 128-row tile: 64 rows
  const int warp = (tid / 32) % 4, lane = tid % 32;
  float acc[BN / 2];
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t w = blockIdx.x; w < p.work; w += gridDim.x) {
    const SgItem it = sg_item<BN>(p, w);
    if (it.row0 >= p.m) continue;
    int prev = 0;
    for (int kb = 0; kb < p.nk; ++kb) {
      sm90::mbar_wait(full(stage), phase);
      const uint32_t a_tile =
          (it.diag ? b_stage(stage) + static_cast<uint32_t>(it.half * kSgBM * 128) : a_stage(stage)) +
          static_cast<uint32_t>(cw * 64 * 128);
      const uint32_t b_tile = b_stage(stage);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kSgBK / 16; ++kk) {
        sm90::wgmma_m64k16<T, BN>(acc, sm90::desc_k_major_sw128(a_tile + 32u * kk),
                                  sm90::desc_k_major_sw128(b_tile + 32u * kk), kb > 0 || kk > 0);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>(acc);  // the previous stage's products are done: release it
      if (kb > 0 && lane == 0) sm90::mbar_arrive(empty(prev));
      prev = stage;
      if (++stage == kSgStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
    sm90::wgmma_wait<0>(acc);
    if (lane == 0) sm90::mbar_arrive(empty(prev));

    // Epilogue: alpha acc + beta C in fp32, rounded once; (r, c) with c <= r and its mirror.
    // A thread holds column pairs (c, c + 1), c even: one 4-byte store when both are kept.
    T* out = static_cast<T*>(p.out) + it.b * p.out_bs;
    const T* C = p.C ? static_cast<const T*>(p.C) + it.b * p.c_bs : nullptr;
    const bool vec = p.ldo % 2 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0;
    const int rbase = it.row0 + cw * 64 + warp * 16 + lane / 4;
    const int cbase = it.col0 + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2) {
      const int r = rbase + 8 * ((i >> 1) & 1);
      const int c = cbase + 8 * (i >> 2);
      if (r < p.m && c <= r) {
        const bool two = c + 1 <= r;  // then c + 1 < m as well
        float v0 = p.alpha * acc[i], v1 = p.alpha * acc[i + 1];
        if (C) {
          v0 += p.beta * to_f32(C[static_cast<int64_t>(r) * p.ldc + c]);
          if (two) v1 += p.beta * to_f32(C[static_cast<int64_t>(r) * p.ldc + c + 1]);
        }
        const T o0 = from_f32<T>(v0), o1 = from_f32<T>(v1);
        T* row = out + static_cast<int64_t>(r) * p.ldo + c;
        if (two && vec) {
          *reinterpret_cast<SgPair<T>*>(row) = SgPair<T>{o0, o1};
        } else {
          row[0] = o0;
          if (two) row[1] = o1;
        }
        if (c < r) out[static_cast<int64_t>(c) * p.ldo + r] = o0;
        if (c + 1 < r) out[static_cast<int64_t>(c + 1) * p.ldo + r] = o1;
      }
    }
  }
}

// Whether the copy engine can read X as given (16-byte aligned rows and base, 16-bit type).
inline bool sym_gemm_sm90_supported(const SymGemmArgs& a) {
  return a.k % 8 == 0 && a.ldx % 8 == 0 && (a.batch == 1 || a.x_bs % 8 == 0) &&
         reinterpret_cast<uintptr_t>(a.X) % 16 == 0 && a.m > 0 && a.k > 0;
}

template <class T, int BN>
inline void run_sym_gemm_sm90_bn(const SymGemmArgs& a, Stream stream) {
  using L = SgLayout<BN>;
  SymGemmParams p;
  const int64_t x_bs = a.batch == 1 ? static_cast<int64_t>(a.m) * a.ldx : a.x_bs;
  const uint64_t dims[3] = {static_cast<uint64_t>(a.k), static_cast<uint64_t>(a.m), static_cast<uint64_t>(a.batch)};
  const uint64_t strides[2] = {static_cast<uint64_t>(a.ldx) * 2, static_cast<uint64_t>(x_bs) * 2};
  const uint32_t box_a[3] = {kSgBK, kSgBM, 1};
  const uint32_t box_b[3] = {kSgBK, BN, 1};
  p.map_a = sm90::make_tensor_map_3d<T>(a.X, dims, strides, box_a);
  p.map_b = sm90::make_tensor_map_3d<T>(a.X, dims, strides, box_b);
  p.out = a.out;
  p.C = a.C;
  p.out_bs = a.out_bs;
  p.c_bs = a.c_bs;
  p.ldo = a.ldo;
  p.ldc = a.ldc;
  p.m = a.m;
  p.nk = (a.k + kSgBK - 1) / kSgBK;
  p.tiles = (a.m + BN - 1) / BN;
  p.items = p.tiles * (p.tiles + 1) / 2 * (BN / kSgBM);
  p.work = a.batch * p.items;
  p.alpha = a.alpha;
  p.beta = a.C ? a.beta : 0.f;
  const int64_t grid = std::min<int64_t>(p.work, sm90::sm_count());
  sm90::allow_dynamic_smem(sym_gemm_sm90_kernel<T, BN>, L::smem_bytes);
  ST_LAUNCH(dim3(static_cast<unsigned>(grid)), dim3(kSgThreads), L::smem_bytes, stream,
            sym_gemm_sm90_kernel<T, BN>)(p);
  check_launch("sym_gemm_sm90_kernel");
}

template <class T>
inline void run_sym_gemm_sm90(const SymGemmArgs& a, Stream stream) {
  if (a.batch == 0 || a.m == 0) return;
  if (!sym_gemm_sm90_supported(a)) {
    throw std::invalid_argument("speedtronic: sym_gemm_sm90 needs k, the row stride and the batch stride "
                                "multiples of 8 elements and a 16-byte aligned X");
  }
  const int bn = a.tile_n ? a.tile_n : (a.m >= 1536 ? 256 : 128);
  if (bn == 256) run_sym_gemm_sm90_bn<T, 256>(a, stream);
  else if (bn == 128) run_sym_gemm_sm90_bn<T, 128>(a, stream);
  else throw std::invalid_argument("speedtronic: sym_gemm_sm90 tile_n must be 0, 128 or 256");
}

}  // namespace st

// Hopper (sm_90a) building blocks, each a tiny wrapper with an emulated twin in
// tests/cuda_emulation/stemu.h (namespace stemu::hopper), so kernels written on them run on the
// CPU under the emulator exactly as they are compiled by nvcc:
//   shared addresses, mbarrier (init / arrive / arrive.expect_tx / try_wait.parity),
//   cp.async.bulk.tensor (3-D tile load through a tensor map, completing on an mbarrier),
//   wgmma.fence / mma_async (m64nNk16, f16|bf16 -> f32, A and B from shared memory through
//   matrix descriptors) / commit_group / wait_group, and the 128B-swizzle smem descriptor.
// The semantics the emulation implements, from the PTX ISA, are spelled out in stemu.h.
// Device code is real only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); compiled for
// any other architecture every wrapper traps, so the file still builds for sm_80 / sm_90.
#pragma once
#include <type_traits>

#include "common.cuh"

#if defined(__CUDACC__)
#include <cuda.h>  // CUtensorMap and its enums (the encoder is reached through the runtime)
#endif

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ST_SM90A 1
#else
#define ST_SM90A 0
#endif

#if !defined(__CUDACC__)
#define __grid_constant__
#endif

namespace st::sm90 {

#if defined(__CUDACC__)
using TensorMap = CUtensorMap;
#else
using TensorMap = ::stemu::hopper::TensorMap;
#endif

template <class T>
constexpr bool kIsBf16 = std::is_same_v<T, __nv_bfloat16>;

// ------------------------------------------------------------------ shared memory, mbarrier
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
#if defined(STEMU_ACTIVE)
  return ::stemu::hopper::smem_addr(p);
#elif defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  return 0;
#endif
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if ST_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::mbar_init(bar, count);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Makes initialized barriers visible to the async proxy (the copy engine); then __syncthreads.
__device__ __forceinline__ void fence_barrier_init() {
#if ST_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if ST_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::mbar_arrive(bar);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if ST_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::mbar_arrive(bar, bytes);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// True once the phase with this parity has completed (may return false spuriously on hardware).
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
#if ST_SM90A
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
#elif defined(STEMU_ACTIVE)
  return ::stemu::hopper::mbar_try_wait(bar, parity);
#elif defined(__CUDA_ARCH__)
  __trap();
  return false;
#else
  return false;
#endif
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// ------------------------------------------------------------------ bulk tensor copy (TMA)
// Box at element coordinates (c0 innermost, c1, c2) of `map` -> shared `dst`; complete_tx on
// `bar` with the box's bytes. `map` must live in kernel-parameter space (__grid_constant__).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
#if ST_SM90A
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
#elif defined(STEMU_ACTIVE)
  const int32_t c[3] = {c0, c1, c2};
  ::stemu::hopper::bulk_tensor_load(dst, map, c, bar);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ------------------------------------------------------------------ wgmma
// Descriptor of a K-major operand laid out as the copy engine writes a box with 128-byte rows
// and 128B swizzle: 8-row atoms of 1024 bytes (SBO = 1024), LBO unused (1 by convention),
// start address 1024-aligned except for the k offset inside a row (+32 bytes per k16 step).
__device__ __forceinline__ uint64_t desc_k_major_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if ST_SM90A
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::wgmma_fence();
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if ST_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::wgmma_commit();
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Keeps the compiler from moving accumulator reads/writes across the async wgmma boundary.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// Wait until at most KEEP committed groups are pending; `d` is the accumulator they write.
template <int KEEP, int R>
__device__ __forceinline__ void wgmma_wait(float (&d)[R]) {
#if ST_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(KEEP) : "memory");
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::wgmma_wait(KEEP, __FILE__, __LINE__);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  fence_regs(d);
}

// Generated operand lists for the asm statements below (N/2 accumulator registers each).
#define ST_WGMMA_M64N128K16_BF16(d, da, db, acc) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "%64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)))

#define ST_WGMMA_M64N128K16_F16(d, da, db, acc) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "%64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)))

#define ST_WGMMA_M64N256K16_BF16(d, da, db, acc) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
      "%128, %129, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)))

#define ST_WGMMA_M64N256K16_F16(d, da, db, acc) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
      "%128, %129, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(da), "l"(db), "r"(static_cast<int>(acc)))

// D(64xN) (+)= A(64x16) B(16xN) for the calling warpgroup; `accumulate` false ignores D.
template <class T, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(N == 128 || N == 256, "wgmma wrappers exist for N = 128 and 256");
#if ST_SM90A
  if constexpr (N == 128) {
    if constexpr (kIsBf16<T>) ST_WGMMA_M64N128K16_BF16(d, desc_a, desc_b, accumulate);
    else ST_WGMMA_M64N128K16_F16(d, desc_a, desc_b, accumulate);
  } else {
    if constexpr (kIsBf16<T>) ST_WGMMA_M64N256K16_BF16(d, desc_a, desc_b, accumulate);
    else ST_WGMMA_M64N256K16_F16(d, desc_a, desc_b, accumulate);
  }
#elif defined(STEMU_ACTIVE)
  ::stemu::hopper::wgmma_issue(d, N, desc_a, desc_b, accumulate, kIsBf16<T>);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ------------------------------------------------------------------ host side
// 3-D tiled tensor map over 16-bit elements: dims/box innermost first, byte strides of dims 1, 2.
template <class T>
inline TensorMap make_tensor_map_3d(const void* base, const uint64_t dims[3], const uint64_t strides[2],
                                    const uint32_t box[3]) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
#if defined(__CUDACC__)
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) throw std::runtime_error("speedtronic: cuTensorMapEncodeTiled is not available from the driver");
  CUtensorMap map;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, kIsBf16<T> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                            const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error("speedtronic: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r));
  }
  return map;
#else
  return ::stemu::hopper::encode_tensor_map(base, 3, 2, dims, strides, box, 128);
#endif
}

// Multiprocessors of the current device (the emulation reports a small number so that its
// persistent loops run several tiles per block).
inline int sm_count() {
#if defined(__CUDACC__)
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    throw std::runtime_error("speedtronic: cannot read the multiprocessor count");
  }
  return n;
#else
  return ::stemu::hopper::sm_count();
#endif
}

// Compute capability (major * 10 + minor) of the current device; 90 in the emulation.
inline int device_cc() {
#if defined(__CUDACC__)
  int dev = 0, ma = 0, mi = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    throw std::runtime_error("speedtronic: cannot read the compute capability");
  }
  return ma * 10 + mi;
#else
  return 90;
#endif
}

template <class K>
inline void allow_dynamic_smem(K kernel, int bytes) {
#if defined(__CUDACC__)
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("speedtronic: cudaFuncSetAttribute failed: ") + cudaGetErrorString(e));
  }
#else
  (void)kernel;
  (void)bytes;
#endif
}

}  // namespace st::sm90

// Shared by every kernel header: portability between nvcc and the CPU emulation
// (tests/cuda_emulation/stemu.h), dtype conversion, reductions and the multi-tensor chunk table.
//
// Rules for code in csrc/kernels/ (so the same text compiles with nvcc and with g++ + stemu):
//  * launch with ST_LAUNCH(grid, block, smem, stream, kernel)(args...), never <<<>>>;
//  * dynamic shared memory through ST_DYNAMIC_SMEM(T, name), never `extern __shared__`;
//  * warp collectives with the full mask, reached by every lane of the warp (no early `return`
//    before a shuffle or barrier: use a predicate instead);
//  * inline PTX only behind one tiny wrapper with an emulated twin (see ST_MMA_M16N8K16).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "args.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#elif !defined(STEMU_ACTIVE)
#error "csrc/kernels/*.cuh compile with nvcc, or with g++ through tests/cuda_emulation/stemu.h"
#endif

namespace st {

#if defined(__CUDACC__)
using Stream = cudaStream_t;
#define ST_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define ST_DYNAMIC_SMEM(T, name)                               \
  extern __shared__ __align__(16) unsigned char st_dyn_smem_[]; \
  T* name = reinterpret_cast<T*>(st_dyn_smem_)
inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("speedtronic: launching ") + what + " failed: " +
                             cudaGetErrorString(err));
  }
}
#else
using Stream = void*;
inline void check_launch(const char*) {}
#endif


__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
struct Cast;
template <>
struct Cast<float> {
  __device__ __forceinline__ static float from(float x) { return x; }
};
template <>
struct Cast<__half> {
  __device__ __forceinline__ static __half from(float x) { return __float2half_rn(x); }
};
template <>
struct Cast<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <class T>
__device__ __forceinline__ T from_f32(float x) {
  return Cast<T>::from(x);
}

// Round a float to T's precision and back (what storing a temporary in T does).
template <class T>
__device__ __forceinline__ float round_to(float x) {
  return to_f32(from_f32<T>(x));
}

// torch's lerp (aten/native/Lerp.h): exact at both ends, one rounding per side.
__device__ __forceinline__ float lerp(float a, float b, float w) {
  return (w < 0.5f && w > -0.5f) ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

__device__ __forceinline__ float rescale_factor(int64_t numel, unsigned long long kept) {
  // numel / (kept + 1) in fp32, evaluated as the reference does: `int / tensor` in torch is
  // `tensor.reciprocal() * int`.
  return (1.0f / (static_cast<float>(kept) + 1.0f)) * static_cast<float>(numel);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ unsigned warp_sum_u(unsigned v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats of shared
// memory. Deterministic for a fixed blockDim (fixed tree). blockDim.x must be a multiple of 32
// and all threads must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x * blockDim.y + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.f;
  return warp_sum(t);
}
__device__ __forceinline__ unsigned block_sum_u(unsigned v, unsigned* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum_u(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  unsigned t = lane < nwarps ? scratch[lane] : 0u;
  return warp_sum_u(t);
}

// ---------------------------------------------------------------- multi-tensor chunk table
// Passed by value as a kernel parameter (graph-capturable, no host->device copy). A launch
// covers at most kMaxTensors tensors and kMaxBlocks chunks; the host loop below launches again
// until every chunk of every tensor is covered. Sized to stay under the classic 4 KiB parameter
// limit with L = 4 lists.

template <int L>
struct TensorChunks {
  void* ptr[L][kMaxTensors];
  int64_t numel[kMaxTensors];
  int id[kMaxTensors];  // index of the tensor in the caller's full list (for per-tensor outputs)
  uint8_t block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

// Walk `n` tensors (pointer lists `ptrs[l][i]`, `numel[i]`, global ids `ids[i]`) in chunks and
// call `launch(table, nblocks)` for each full table. Empty tensors are skipped.
template <int L, class Launch>
inline void for_each_chunk_table(int n, void* const* const* ptrs, const int64_t* numel,
                                 const int* ids, Launch&& launch) {
  TensorChunks<L> t;
  int nt = 0, nb = 0;
  for (int i = 0; i < n; ++i) {
    if (numel[i] == 0) continue;
    for (int l = 0; l < L; ++l) t.ptr[l][nt] = ptrs[l][i];
    t.numel[nt] = numel[i];
    t.id[nt] = ids[i];
    const int64_t chunks = (numel[i] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      t.block_tensor[nb] = static_cast<uint8_t>(nt);
      t.block_chunk[nb] = static_cast<int>(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == kMaxBlocks || (last_chunk && nt + 1 == kMaxTensors)) {
        launch(t, nb);
        nb = 0;
        if (last_chunk) {
          nt = -1;  // table full of tensors: start empty
        } else {    // the tensor continues in the next table, as its slot 0
          for (int l = 0; l < L; ++l) t.ptr[l][0] = t.ptr[l][nt];
          t.numel[0] = t.numel[nt];
          t.id[0] = t.id[nt];
          nt = 0;
        }
      }
    }
    ++nt;
  }
  if (nb > 0) launch(t, nb);
}

}  // namespace st

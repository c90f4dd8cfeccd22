// Multi-tensor elementwise kernels: cautious masking and the fused (cautious) AdamW step.
//
// Math matches speedtronic/kernels/ops_cautious_adamw.py (the pure-PyTorch default) operation by operation, in fp32
// registers with one rounding to the storage dtype where the reference stores:
//   cautious_mask_:  keep u where u*g > 0; with rescale, kept *= numel / (kept_count + 1)
//   adamw:           p <- p(1 - lr wd);  m <- lerp(m, g, 1-b1);  v <- b2 v + (1-b2) g^2
//                    u = m / (sqrt(v)/sqrt(1-b2^t) + eps);  [cautious mask on u vs g]
//                    p <- p - (lr / (1-b1^t)) u
// A per-tensor rescale needs the kept count before any write, so with rescale the work is two
// launches per table: count (AdamW also stores the moments there), then apply. Without rescale
// it is one pass. Counts are integers added with atomics: deterministic.
#pragma once
#include "common.cuh"

namespace st {

// Pass 1 (rescale only): count kept entries of every chunk.
template <class U, class G>
__global__ void __launch_bounds__(kThreads) cautious_count_kernel(TensorChunks<2> t, MaskArgs a) {
  __shared__ unsigned scratch[32];
  const int ti = t.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(t.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = t.numel[ti] - start < kChunk ? t.numel[ti] - start : kChunk;
  const U* u = static_cast<const U*>(t.ptr[0][ti]) + start;
  const G* g = static_cast<const G*>(t.ptr[1][ti]) + start;
  unsigned kept = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    kept += (to_f32(u[i]) * to_f32(g[i]) > 0.f) ? 1u : 0u;
  }
  kept = block_sum_u(kept, scratch);
  if (threadIdx.x == 0 && kept) atomicAdd(a.counts + t.id[ti], static_cast<unsigned long long>(kept));
}

template <class U, class G>
__global__ void __launch_bounds__(kThreads) cautious_apply_kernel(TensorChunks<2> t, MaskArgs a) {
  const int ti = t.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(t.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = t.numel[ti] - start < kChunk ? t.numel[ti] - start : kChunk;
  U* u = static_cast<U*>(t.ptr[0][ti]) + start;
  const G* g = static_cast<const G*>(t.ptr[1][ti]) + start;
  const float scale = a.rescale ? rescale_factor(t.numel[ti], a.counts[t.id[ti]]) : 1.f;
  for (int64_t base = 0; base < len; base += static_cast<int64_t>(blockDim.x) * kIlp) {
    float uv[kIlp], gv[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      uv[k] = i < len ? to_f32(u[i]) : 0.f;
      gv[k] = i < len ? to_f32(g[i]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < len) {
        const float keep = uv[k] * gv[k] > 0.f ? 1.f : 0.f;
        u[i] = from_f32<U>(uv[k] * keep * scale);
      }
    }
  }
}

// Lists: 0 params P, 1 grads G, 2 exp_avg S, 3 exp_avg_sq S.
// MODE 0: everything in one pass (no rescale). MODE 1: store moments + count kept entries.
// MODE 2: apply with the counted rescale, reading the moments MODE 1 stored.
template <class P, class G, class S, int MODE>
__global__ void __launch_bounds__(kThreads) adamw_kernel(TensorChunks<4> t, AdamArgs a) {
  __shared__ unsigned scratch[32];
  const int ti = t.block_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(t.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = t.numel[ti] - start < kChunk ? t.numel[ti] - start : kChunk;
  P* p = static_cast<P*>(t.ptr[0][ti]) + start;
  const G* g = static_cast<const G*>(t.ptr[1][ti]) + start;
  S* m = static_cast<S*>(t.ptr[2][ti]) + start;
  S* v = static_cast<S*>(t.ptr[3][ti]) + start;
  float scale = 1.f;
  if (MODE == 2) scale = rescale_factor(t.numel[ti], a.mask.counts[t.id[ti]]);
  unsigned kept = 0;
  for (int64_t base = 0; base < len; base += static_cast<int64_t>(blockDim.x) * kIlp) {
    float gv[kIlp], mv[kIlp], vv[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      // the reference first converts a gradient to the state dtype (a no-op when they match)
      gv[k] = i < len ? round_to<S>(to_f32(g[i])) : 0.f;
      mv[k] = i < len ? to_f32(m[i]) : 0.f;
      vv[k] = i < len ? to_f32(v[i]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i >= len) continue;
      if (MODE != 2) {
        // The moments round as the reference's foreach ops in the state dtype do (a no-op for
        // fp32 state).
        mv[k] = round_to<S>(lerp(mv[k], gv[k], a.w1));
        const float vb = round_to<S>(vv[k] * a.beta2);
        vv[k] = round_to<S>(vb + a.w2 * gv[k] * gv[k]);
        m[i] = from_f32<S>(mv[k]);
        v[i] = from_f32<S>(vv[k]);
      }
      // The direction in fp32 from the stored moments, as the reference computes it: rounded
      // to fp16, eps = 1e-8 is 0, and an entry with v = 0 gave 1/0 * m = NaN or inf (a whole
      // fp16 model on CUDA after one step where the fallback stayed finite).
      const float denom = sqrtf(vv[k]) / a.bias2_sqrt + a.eps;
      float u = mv[k] * (1.f / denom);
      const float keep = (!a.cautious || u * gv[k] > 0.f) ? 1.f : 0.f;
      if (MODE == 1) {
        kept += keep > 0.f ? 1u : 0u;
        continue;
      }
      if (a.cautious) u = u * keep * scale;
      float pv = to_f32(p[i]);
      if (a.has_decay) pv = round_to<P>(pv * a.decay);
      p[i] = from_f32<P>(pv + (-a.step_size) * u);
    }
  }
  if (MODE == 1) {
    kept = block_sum_u(kept, scratch);
    if (threadIdx.x == 0 && kept) {
      atomicAdd(a.mask.counts + t.id[ti], static_cast<unsigned long long>(kept));
    }
  }
}

// ---------------------------------------------------------------- host side
template <class U, class G>
inline void run_cautious_mask(int n, void* const* const* ptrs, const int64_t* numel, const int* ids,
                              MaskArgs a, Stream stream) {
  if (a.rescale) {
    for_each_chunk_table<2>(n, ptrs, numel, ids, [&](const TensorChunks<2>& t, int nb) {
      ST_LAUNCH(dim3(nb), dim3(kThreads), 0, stream, cautious_count_kernel<U, G>)(t, a);
      check_launch("cautious_count_kernel");
    });
  }
  for_each_chunk_table<2>(n, ptrs, numel, ids, [&](const TensorChunks<2>& t, int nb) {
    ST_LAUNCH(dim3(nb), dim3(kThreads), 0, stream, cautious_apply_kernel<U, G>)(t, a);
    check_launch("cautious_apply_kernel");
  });
}

template <class P, class G, class S>
inline void run_adamw(int n, void* const* const* ptrs, const int64_t* numel, const int* ids,
                      AdamArgs a, Stream stream) {
  const bool two_pass = a.cautious && a.mask.rescale;
  for_each_chunk_table<4>(n, ptrs, numel, ids, [&](const TensorChunks<4>& t, int nb) {
    if (two_pass) {
      ST_LAUNCH(dim3(nb), dim3(kThreads), 0, stream, adamw_kernel<P, G, S, 1>)(t, a);
    } else {
      ST_LAUNCH(dim3(nb), dim3(kThreads), 0, stream, adamw_kernel<P, G, S, 0>)(t, a);
    }
    check_launch("adamw_kernel");
  });
  if (!two_pass) return;
  for_each_chunk_table<4>(n, ptrs, numel, ids, [&](const TensorChunks<4>& t, int nb) {
    ST_LAUNCH(dim3(nb), dim3(kThreads), 0, stream, adamw_kernel<P, G, S, 2>)(t, a);
    check_launch("adamw_kernel");
  });
}

}  // namespace st

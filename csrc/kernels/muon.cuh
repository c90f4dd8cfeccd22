// Muon's elementwise passes around Newton-Schulz, for one shape group of b (m, n) matrices.
//
// pre:  B <- lerp(B, g, 1-mu) (fp32, in place); d = nesterov ? lerp(g, B, mu) : B;
//       out[i] = d / max(||d||_F, eps), cast to the NS dtype, written straight into the (b, m, n)
//       batch. Two launches: momentum + per-chunk sum of squares, then scale + cast (the norm
//       is a reduction over the whole matrix). Partial sums are reduced in a fixed order, so the
//       result is deterministic.
// Muon+ stats on a (b, m, n) tensor U: rinv[r] = 1/sqrt(sum_c U^2 + eps), then
//       cinv[c] = 1/sqrt(sum_r (U rinv)^2 + eps) (row strips -> fixed-order column reduction).
// post: u = O [* rinv * cinv]; [cautious: u *= (u*g > 0) * numel/(kept+1)];
//       p <- p (1 - lr wd) - lr lr_scale u, one pass over params (+ one count pass if rescaling).
#pragma once
#include "common.cuh"

namespace st {

constexpr int kMaxMats = 48;  // matrices per launch (pointer table stays < 1 KiB)

template <int L>
struct MatTable {
  void* ptr[L][kMaxMats];
  int idx[kMaxMats];  // index of each matrix in the shape group (its slice of the batch)
};

// Lists: 0 grads (G), 1 momentum buffers (fp32).
template <class G>
__global__ void __launch_bounds__(kThreads) muon_pre_momentum_kernel(MatTable<2> t, PreArgs a) {
  __shared__ float scratch[32];
  const int mat = blockIdx.y;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t len = a.numel - start < kChunk ? a.numel - start : kChunk;
  const G* g = static_cast<const G*>(t.ptr[0][mat]) + start;
  float* buf = static_cast<float*>(t.ptr[1][mat]) + start;
  float ssq = 0.f;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float gv = to_f32(g[i]);
    const float b = lerp(buf[i], gv, a.w);
    buf[i] = b;
    const float d = a.nesterov ? lerp(gv, b, a.momentum) : b;
    ssq += d * d;
  }
  ssq = block_sum(ssq, scratch);
  if (threadIdx.x == 0) a.partial[static_cast<int64_t>(t.idx[mat]) * a.chunks + blockIdx.x] = ssq;
}

template <class G, class O>
__global__ void __launch_bounds__(kThreads) muon_pre_scale_kernel(MatTable<2> t, PreArgs a, O* out) {
  __shared__ float scratch[32];
  const int mat = blockIdx.y;
  const float* part = a.partial + static_cast<int64_t>(t.idx[mat]) * a.chunks;
  float s = 0.f;
  for (int i = threadIdx.x; i < a.chunks; i += blockDim.x) s += part[i];
  s = block_sum(s, scratch);
  // torch.optim.Muon's clamp(min=eps), which keeps a NaN (fmaxf would drop it for eps, and one
  // NaN gradient entry scaled the rest of its matrix by 1/eps)
  const float denom = s != s ? s : fmaxf(sqrtf(s), a.eps);
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t len = a.numel - start < kChunk ? a.numel - start : kChunk;
  const G* g = static_cast<const G*>(t.ptr[0][mat]) + start;
  const float* buf = static_cast<const float*>(t.ptr[1][mat]) + start;
  O* o = out + static_cast<int64_t>(t.idx[mat]) * a.numel + start;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float b = buf[i];
    const float d = a.nesterov ? lerp(to_f32(g[i]), b, a.momentum) : b;
    o[i] = from_f32<O>(d / denom);
  }
}

// ---------------------------------------------------------------- Muon+ statistics
// One warp per row; 8 rows per block. The row index is warp-uniform, so the shuffles inside
// `if (row < m)` are reached by all lanes of the warp or by none.
template <class O>
__global__ void __launch_bounds__(256) row_stats_kernel(const O* U, NormStats s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + warp;
  const int64_t bi = blockIdx.y;
  if (row < s.m) {
    const O* u = U + (bi * s.m + row) * static_cast<int64_t>(s.n);
    float ssq = 0.f;
    for (int c = lane; c < s.n; c += 32) {
      const float v = to_f32(u[c]);
      ssq += v * v;
    }
    ssq = warp_sum(ssq);
    if (lane == 0) s.rinv[bi * s.m + row] = 1.f / sqrtf(ssq + s.eps);
  }
}

// Block (32, 8): 32 columns x 8 row lanes over one strip of rows; fixed-order reduction.
template <class O>
__global__ void __launch_bounds__(256) col_partial_kernel(const O* U, NormStats s) {
  __shared__ float red[8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * 32 + tx;
  const int strip = blockIdx.y;
  const int64_t bi = blockIdx.z;
  const int r0 = strip * s.rows_per_strip;
  const int r1 = r0 + s.rows_per_strip < s.m ? r0 + s.rows_per_strip : s.m;
  float acc = 0.f;
  if (col < s.n) {
    for (int r = r0 + ty; r < r1; r += 8) {
      const float v = to_f32(U[(bi * s.m + r) * static_cast<int64_t>(s.n) + col]) * s.rinv[bi * s.m + r];
      acc += v * v;
    }
  }
  red[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < s.n) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) t += red[k][tx];
    s.partial[(bi * s.strips + strip) * static_cast<int64_t>(s.n) + col] = t;
  }
}

__global__ void __launch_bounds__(256) col_finalize_kernel(NormStats s) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t bi = blockIdx.y;
  if (col >= s.n) return;  // no barriers or collectives below
  float t = 0.f;
  for (int k = 0; k < s.strips; ++k) t += s.partial[(bi * s.strips + k) * static_cast<int64_t>(s.n) + col];
  s.cinv[bi * s.n + col] = 1.f / sqrtf(t + s.eps);
}

template <class O>
__global__ void __launch_bounds__(kThreads) muon_plus_apply_kernel(const O* U, O* out, NormStats s) {
  const int64_t numel = static_cast<int64_t>(s.m) * s.n;
  const int64_t bi = blockIdx.y;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t len = numel - start < kChunk ? numel - start : kChunk;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const int64_t e = start + i;
    const int r = static_cast<int>(e / s.n), c = static_cast<int>(e % s.n);
    const float v = to_f32(U[bi * numel + e]) * s.rinv[bi * s.m + r];
    out[bi * numel + e] = from_f32<O>(v * s.cinv[bi * s.n + c]);
  }
}

template <class O>
inline void run_muon_plus_stats(const O* U, NormStats s, Stream stream) {
  if (s.b == 0 || s.m == 0 || s.n == 0) return;
  ST_LAUNCH(dim3((s.m + 7) / 8, static_cast<unsigned>(s.b)), dim3(256), 0, stream, row_stats_kernel<O>)(U, s);
  check_launch("row_stats_kernel");
  ST_LAUNCH(dim3((s.n + 31) / 32, s.strips, static_cast<unsigned>(s.b)), dim3(32, 8), 0, stream,
            col_partial_kernel<O>)(U, s);
  check_launch("col_partial_kernel");
  ST_LAUNCH(dim3((s.n + 255) / 256, static_cast<unsigned>(s.b)), dim3(256), 0, stream, col_finalize_kernel)(s);
  check_launch("col_finalize_kernel");
}

template <class O>
inline void run_muon_plus_normalize(const O* U, O* out, NormStats s, Stream stream) {
  if (s.b == 0 || s.m == 0 || s.n == 0) return;
  run_muon_plus_stats(U, s, stream);
  const int64_t numel = static_cast<int64_t>(s.m) * s.n;
  ST_LAUNCH(dim3(static_cast<unsigned>((numel + kChunk - 1) / kChunk), static_cast<unsigned>(s.b)),
            dim3(kThreads), 0, stream, muon_plus_apply_kernel<O>)(U, out, s);
  check_launch("muon_plus_apply_kernel");
}

// ---------------------------------------------------------------- post update
template <class O>
__device__ __forceinline__ float post_value(const O* orth, int64_t mat, int64_t e, const PostArgs& a) {
  float u = to_f32(orth[mat * a.numel + e]);
  if (a.muon_plus) {
    const int r = static_cast<int>(e / a.n), c = static_cast<int>(e % a.n);
    u = u * a.stats.rinv[mat * a.stats.m + r];
    u = u * a.stats.cinv[mat * a.n + c];
  }
  return u;
}

// Lists: 0 params (P), 1 grads (G).
template <class O, class G>
__global__ void __launch_bounds__(kThreads) muon_post_count_kernel(MatTable<2> t, const O* orth, PostArgs a) {
  __shared__ unsigned scratch[32];
  const int mat = blockIdx.y;
  const int64_t gm = t.idx[mat];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t len = a.numel - start < kChunk ? a.numel - start : kChunk;
  const G* g = static_cast<const G*>(t.ptr[1][mat]);
  unsigned kept = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const int64_t e = start + i;
    kept += post_value(orth, gm, e, a) * to_f32(g[e]) > 0.f ? 1u : 0u;
  }
  kept = block_sum_u(kept, scratch);
  if (threadIdx.x == 0 && kept) atomicAdd(a.counts + gm, static_cast<unsigned long long>(kept));
}

template <class P, class O, class G>
__global__ void __launch_bounds__(kThreads) muon_post_apply_kernel(MatTable<2> t, const O* orth, PostArgs a) {
  const int mat = blockIdx.y;
  const int64_t gm = t.idx[mat];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t len = a.numel - start < kChunk ? a.numel - start : kChunk;
  P* p = static_cast<P*>(t.ptr[0][mat]);
  const G* g = static_cast<const G*>(t.ptr[1][mat]);
  const float scale = (a.cautious && a.rescale) ? rescale_factor(a.numel, a.counts[gm]) : 1.f;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const int64_t e = start + i;
    float u = post_value(orth, gm, e, a);
    if (a.cautious) {
      const float keep = u * to_f32(g[e]) > 0.f ? 1.f : 0.f;
      u = u * keep * scale;
    }
    float pv = to_f32(p[e]);
    if (a.has_decay) pv = round_to<P>(pv * a.decay);
    p[e] = from_f32<P>(pv + a.alpha * u);
  }
}

template <int L, class Fn>
inline void for_each_mat_table(int b, void* const* const* lists, const int* ids, Fn&& fn) {
  for (int first = 0; first < b; first += kMaxMats) {
    MatTable<L> t;
    const int cnt = b - first < kMaxMats ? b - first : kMaxMats;
    for (int i = 0; i < cnt; ++i) {
      for (int l = 0; l < L; ++l) t.ptr[l][i] = lists[l][first + i];
      t.idx[i] = ids[first + i];
    }
    fn(t, cnt);
  }
}

// grads/bufs: b matrices; ids: their slots in the (B, m, n) output and in a.partial.
template <class G, class O>
inline void run_muon_pre(int b, void* const* grads, void* const* bufs, const int* ids, PreArgs a,
                         O* out, Stream stream) {
  if (b == 0 || a.numel == 0) return;
  void* const* lists[2] = {grads, bufs};
  for_each_mat_table<2>(b, lists, ids, [&](const MatTable<2>& t, int cnt) {
    ST_LAUNCH(dim3(a.chunks, cnt), dim3(kThreads), 0, stream, muon_pre_momentum_kernel<G>)(t, a);
    check_launch("muon_pre_momentum_kernel");
  });
  for_each_mat_table<2>(b, lists, ids, [&](const MatTable<2>& t, int cnt) {
    ST_LAUNCH(dim3(a.chunks, cnt), dim3(kThreads), 0, stream, muon_pre_scale_kernel<G, O>)(t, a, out);
    check_launch("muon_pre_scale_kernel");
  });
}

// Muon+ statistics (a.stats) must already be computed when a.muon_plus.
template <class P, class O, class G>
inline void run_muon_post(int b, void* const* params, void* const* grads, const int* ids, const O* orth,
                          PostArgs a, Stream stream) {
  if (b == 0 || a.numel == 0) return;
  void* const* lists[2] = {params, grads};
  if (a.cautious && a.rescale) {
    for_each_mat_table<2>(b, lists, ids, [&](const MatTable<2>& t, int cnt) {
      ST_LAUNCH(dim3(a.chunks, cnt), dim3(kThreads), 0, stream, muon_post_count_kernel<O, G>)(t, orth, a);
      check_launch("muon_post_count_kernel");
    });
  }
  for_each_mat_table<2>(b, lists, ids, [&](const MatTable<2>& t, int cnt) {
    ST_LAUNCH(dim3(a.chunks, cnt), dim3(kThreads), 0, stream, muon_post_apply_kernel<P, O, G>)(t, orth, a);
    check_launch("muon_post_apply_kernel");
  });
}

}  // namespace st

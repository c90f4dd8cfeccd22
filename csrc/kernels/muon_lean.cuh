// The lean Muon step's elementwise passes: ONE table for every matrix of the step, across shape
// groups, so the passes around Newton-Schulz cost 2 + 1 launches per step instead of ~6 per
// group plus the multi-tensor weight decay and update (speedtronic/optim/muon_step.py; counted
// on meta tensors at GPT-2 small size: 79 -> 51 estimated launches, benchmarks/results/
// step_dispatch_cpu.md). Hyper-parameters are read from device memory (0-d fp32 tensors), so
// an LR schedule changes nothing the host passes and the step stays CUDA-graph capturable.
//
// pre, pass 1:  M <- lerp(g, M, mu)  (torch.lerp(G, M, mu, out=M));  U = nesterov ? lerp(g, M, mu) : M;
//               per-block sum of U^2; optionally a dense fp32 copy of g (the cautious mask).
// pre, pass 2:  out = U / max(sqrt(sum of the matrix's partials), eps), in the NS dtype; the
//               partials are summed in a fixed order (deterministic).
// update:       p <- round_P(p (1 - lr wd)); u = skip ? 0 : U r_row c_col (Muon+, else U);
//               p <- p - scale round_P(lr u) (the rounding of the multi-tensor torch ops it
//               replaces: decay, lr * O, add).
// cautious:     count pass: kept entries (U g > 0) per matrix, integer atomics (exact, so any
//               order); the update masks and rescales (numel / (kept + 1)) as it writes. The
//               mask keeps signs, so it commutes with Muon+'s positive scales.
// plus stats:   Muon+'s inverse row norms r = 1 / sqrt(sum_j U_ij^2 + eps), then the inverse column
//               norms c of U r; 4 launches for every matrix of the step (row partials, rows,
//               column partials, columns), all partials summed in a fixed order. The apply is the
//               update's multiply above, so Muon+ costs two reads of U instead of an fp32 cast,
//               two reads and a read + write per shape group (GPT-2 small on meta: 15 -> 4
//               launches, counted by benchmarks/bench_step_dispatch.py).
//
// Coordinates: each matrix is walked in 32 x 32 tiles of (i, j), j fastest across a warp. The
// dense operands (momentum, out, the gradient copy; the parameter in the update) are read and
// written along j; a strided operand whose unit stride is along i (a tall matrix's gradient in
// the wide bank, a bank slice read by a tall parameter) goes through a shared-memory transpose,
// so both sides stay coalesced.
#pragma once
#include "common.cuh"

namespace st {

// The block's matrix: the last whose item_start <= blockIdx.x (binary search, <= 6 steps).
__device__ __forceinline__ int lean_find(const LeanTable& t) {
  const int item = static_cast<int>(blockIdx.x);
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.mat[mid].item_start <= item) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The 4 elements (i0 + ty + 8 r, j0 + tx), r = 0..3, of a strided operand, as floats (0 outside
// the matrix). Uniform per block (it depends on the matrix only), so the barriers are reached by
// every thread or by none.
template <class T>
__device__ __forceinline__ void lean_load(const T* p, int64_t si, int64_t sj, int i0, int j0, int rows,
                                          int cols, float (*tile)[kLeanTile + 1], float v[4]) {
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  if (si == 1 && sj != 1) {  // unit stride along i: read along i, transpose through shared memory
    __syncthreads();         // the previous tile's reads are done
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + tx, j = j0 + ty + 8 * r;
      tile[ty + 8 * r][tx] = (i < rows && j < cols) ? to_f32(p[i + j * sj]) : 0.f;  // [j - j0][i - i0]
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = tile[tx][ty + 8 * r];
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + ty + 8 * r, j = j0 + tx;
      v[r] = (i < rows && j < cols) ? to_f32(p[i * si + j * sj]) : 0.f;
    }
  }
}

// Calls fn(i, j, v, w) for this block's tiles of matrix `mt`, after loading the strided operand
// `src` (or nothing when src is null) into v[4] and `src2` (null: zeros), which has src's
// strides, into w[4]. Uniform per block: both loads reach their barriers in every thread or none.
template <class T, class Fn>
__device__ __forceinline__ void lean_tiles2(const LeanMat& mt, const T* src, const float* src2,
                                            float (*tile)[kLeanTile + 1], Fn&& fn) {
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int tiles = ((mt.rows + kLeanTile - 1) / kLeanTile) * mt.tiles_c;
  const int first = (static_cast<int>(blockIdx.x) - mt.item_start) * kLeanTilesPerItem;
  const int last = first + kLeanTilesPerItem < tiles ? first + kLeanTilesPerItem : tiles;
  for (int t = first; t < last; ++t) {
    const int i0 = (t / mt.tiles_c) * kLeanTile, j0 = (t % mt.tiles_c) * kLeanTile;
    float v[4] = {0.f, 0.f, 0.f, 0.f}, w[4] = {0.f, 0.f, 0.f, 0.f};
    if (src != nullptr) lean_load(src, mt.src_si, mt.src_sj, i0, j0, mt.rows, mt.cols, tile, v);
    if (src2 != nullptr) lean_load(src2, mt.src_si, mt.src_sj, i0, j0, mt.rows, mt.cols, tile, w);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = i0 + ty + 8 * r, j = j0 + tx;
      if (i < mt.rows && j < mt.cols) fn(i, j, v[r], w[r]);
    }
  }
}

// Calls fn(i, j, v) for this block's tiles of matrix `mt`, after loading the strided operand
// `src` (or nothing when src is null) into v[4].
template <class T, class Fn>
__device__ __forceinline__ void lean_tiles(const LeanMat& mt, const T* src, float (*tile)[kLeanTile + 1],
                                           Fn&& fn) {
  lean_tiles2(mt, src, nullptr, tile, [&](int i, int j, float v, float) { fn(i, j, v); });
}

template <class G>
__global__ void __launch_bounds__(kLeanThreads) lean_pre_momentum_kernel(LeanTable t) {
  __shared__ float tile[kLeanTile][kLeanTile + 1];
  __shared__ float scratch[32];
  const LeanMat& mt = t.mat[lean_find(t)];
  const float mu = *mt.h0;
  float ssq = 0.f;
  lean_tiles(mt, static_cast<const G*>(mt.src), tile, [&](int i, int j, float g) {
    const int64_t e = static_cast<int64_t>(i) * mt.cols + j;
    const float m = lerp(g, mt.mom[e], mu);
    mt.mom[e] = m;
    const float u = mt.nesterov ? lerp(g, m, mu) : m;
    ssq += u * u;
    if (mt.grad_copy != nullptr) mt.grad_copy[e] = g;
  });
  ssq = block_sum(ssq, scratch);
  if (threadIdx.x == 0) t.partial[mt.partial_start + static_cast<int>(blockIdx.x) - mt.item_start] = ssq;
}

template <class G, class X>
__global__ void __launch_bounds__(kLeanThreads) lean_pre_scale_kernel(LeanTable t) {
  __shared__ float tile[kLeanTile][kLeanTile + 1];
  __shared__ float scratch[32];
  const LeanMat& mt = t.mat[lean_find(t)];
  float s = 0.f;
  for (int k = threadIdx.x; k < mt.items; k += blockDim.x) s += t.partial[mt.partial_start + k];
  s = block_sum(s, scratch);
  // torch.optim.Muon's clamp(min=eps), which keeps a NaN (fmaxf would drop it for eps, and one
  // NaN gradient entry scaled the rest of its matrix by 1/eps)
  const float denom = s != s ? s : fmaxf(sqrtf(s), mt.scale);
  const float mu = *mt.h0;
  X* out = static_cast<X*>(mt.out);
  // Without Nesterov U = M: the gradient is not read again.
  const G* src = mt.nesterov ? static_cast<const G*>(mt.src) : nullptr;
  lean_tiles(mt, src, tile, [&](int i, int j, float g) {
    const int64_t e = static_cast<int64_t>(i) * mt.cols + j;
    const float m = mt.mom[e];
    const float u = mt.nesterov ? lerp(g, m, mu) : m;
    out[e] = from_f32<X>(u / denom);
  });
}

template <class P, class U>
__global__ void __launch_bounds__(kLeanThreads) lean_update_kernel(LeanTable t) {
  __shared__ float tile[kLeanTile][kLeanTile + 1];
  const LeanMat& mt = t.mat[lean_find(t)];
  const float lr = *mt.h0;
  const float decay = 1.f - lr * *mt.h1;  // torch.addcmul(1, lr, wd, value=-1), fp32
  const bool skip = mt.skip != nullptr && *mt.skip;
  P* p = static_cast<P*>(mt.dst);
  const float* rs = mt.row_scale;
  const float* cs = mt.col_scale;
  const float rescale =
      mt.kept != nullptr ? static_cast<float>(static_cast<int64_t>(mt.rows) * mt.cols) / static_cast<float>(*mt.kept + 1)
                         : 1.f;
  lean_tiles2(mt, static_cast<const U*>(mt.src), mt.cgrad, tile, [&](int i, int j, float u, float g) {
    const int64_t e = static_cast<int64_t>(i) * mt.dst_si + static_cast<int64_t>(j) * mt.dst_sj;
    const bool kept = mt.cgrad == nullptr || u * g > 0.f;  // the count pass's test, before scaling
    if (rs != nullptr) u = u * (mt.scale_swap ? rs[j] : rs[i]) * (mt.scale_swap ? cs[i] : cs[j]);
    if (mt.cgrad != nullptr) u = kept ? u * rescale : 0.f;
    const float pv = round_to<P>(to_f32(p[e]) * decay);
    const float step = skip ? 0.f : round_to<P>(u * lr);
    p[e] = from_f32<P>(pv - mt.scale * step);
  });
}

// Cautious: entries with U g > 0 per matrix, added to its counter (zeroed by the host first).
template <class U>
__global__ void __launch_bounds__(kLeanThreads) lean_cautious_count_kernel(LeanTable t) {
  __shared__ float tile[kLeanTile][kLeanTile + 1];
  __shared__ unsigned scratch[32];
  const LeanMat& mt = t.mat[lean_find(t)];
  unsigned kept = 0;
  lean_tiles2(mt, static_cast<const U*>(mt.src), mt.cgrad, tile, [&](int, int, float u, float g) {
    kept += u * g > 0.f ? 1u : 0u;
  });
  kept = block_sum_u(kept, scratch);
  if (threadIdx.x == 0 && kept) atomicAdd(mt.kept, static_cast<unsigned long long>(kept));
}

// Muon+ partial sums of squares over one 32 x 32 tile each: along j (kCols false: U_ij^2 per
// row, into [tiles_c][rows]) or along i of the row-normalized matrix (kCols true: (U_ij r_i)^2
// per column, into [tiles_r][cols], after the rows are final).
template <class U, bool kCols>
__global__ void __launch_bounds__(kLeanThreads) lean_plus_partial_kernel(LeanTable t) {
  __shared__ float tile[kLeanTile][kLeanTile + 1];
  __shared__ float red[8][kLeanTile + 1];
  const LeanMat& mt = t.mat[lean_find(t)];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int tiles_r = (mt.rows + kLeanTile - 1) / kLeanTile;
  const int tiles = tiles_r * mt.tiles_c;
  const int first = (static_cast<int>(blockIdx.x) - mt.item_start) * kLeanTilesPerItem;
  const int last = first + kLeanTilesPerItem < tiles ? first + kLeanTilesPerItem : tiles;
  float* row_part = t.partial + mt.stat_start;                                  // [tiles_c][rows]
  float* col_part = row_part + static_cast<int64_t>(mt.tiles_c) * mt.rows;     // [tiles_r][cols]
  const U* src = static_cast<const U*>(mt.src);
  for (int tt = first; tt < last; ++tt) {
    const int ti = tt / mt.tiles_c, tj = tt % mt.tiles_c;
    const int i0 = ti * kLeanTile, j0 = tj * kLeanTile;
    float v[4];
    lean_load(src, mt.src_si, mt.src_sj, i0, j0, mt.rows, mt.cols, tile, v);  // 0 outside
    if (!kCols) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // a warp holds one row of the tile: reduce across lanes
        const float s = warp_sum(v[r] * v[r]);
        const int i = i0 + ty + 8 * r;
        if (tx == 0 && i < mt.rows) row_part[static_cast<int64_t>(tj) * mt.rows + i] = s;
      }
    } else {
      float s = 0.f;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = i0 + ty + 8 * r;
        if (i < mt.rows) {
          const float w = v[r] * mt.row_scale[i];
          s += w * w;
        }
      }
      __syncthreads();  // the previous tile's column sums are read
      red[ty][tx] = s;
      __syncthreads();
      const int j = j0 + tx;
      if (ty == 0 && j < mt.cols) {
        float c = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) c += red[k][tx];
        col_part[static_cast<int64_t>(ti) * mt.cols + j] = c;
      }
    }
  }
}

// One thread per row (kCols false) or column: the inverse norm from the partials, in tile order.
template <bool kCols>
__global__ void __launch_bounds__(kLeanThreads) lean_plus_finalize_kernel(LeanTable t) {
  const LeanMat& mt = t.mat[lean_find(t)];
  const int line = (static_cast<int>(blockIdx.x) - mt.item_start) * kLeanThreads + static_cast<int>(threadIdx.x);
  const int lines = kCols ? mt.cols : mt.rows;
  if (line >= lines) return;  // no barriers below
  const int tiles_r = (mt.rows + kLeanTile - 1) / kLeanTile;
  const int parts = kCols ? tiles_r : mt.tiles_c;
  const float* part = t.partial + mt.stat_start + (kCols ? static_cast<int64_t>(mt.tiles_c) * mt.rows : 0);
  float s = 0.f;
  for (int k = 0; k < parts; ++k) s += part[static_cast<int64_t>(k) * lines + line];
  (kCols ? mt.col_scale : mt.row_scale)[line] = 1.f / sqrtf(s + mt.scale);
}

// The host side: `mats[0, n)` (one dtype combination; item fields are filled here) in tables
// of kLeanMats, one launch each. Partial sums are indexed across tables (partial_start).
template <class Launch>
inline void for_each_lean_table(const LeanMat* mats, int n, float* partial, Launch&& launch) {
  int partial_at = 0;
  for (int first = 0; first < n; first += kLeanMats) {
    LeanTable t{};
    t.partial = partial;
    int items = 0;
    for (int k = first; k < n && k < first + kLeanMats; ++k) {
      const int tiles_c = (mats[k].cols + kLeanTile - 1) / kLeanTile;
      const int tiles = ((mats[k].rows + kLeanTile - 1) / kLeanTile) * tiles_c;
      if (tiles == 0) continue;  // an empty matrix: nothing to do, no block
      LeanMat& mt = t.mat[t.count++];
      mt = mats[k];
      mt.tiles_c = tiles_c;
      mt.items = (tiles + kLeanTilesPerItem - 1) / kLeanTilesPerItem;
      mt.item_start = items;
      mt.partial_start = partial_at;
      items += mt.items;
      partial_at += mt.items;
    }
    t.total_items = items;
    if (items > 0) launch(t);
  }
}

// Sum of every matrix's blocks: the length of the pre pass's partial-sum scratch.
inline int64_t lean_partials(const LeanMat* mats, int n) {
  int64_t total = 0;
  for (int k = 0; k < n; ++k) {
    const int64_t tiles = static_cast<int64_t>((mats[k].rows + kLeanTile - 1) / kLeanTile) *
                          ((mats[k].cols + kLeanTile - 1) / kLeanTile);
    total += (tiles + kLeanTilesPerItem - 1) / kLeanTilesPerItem;
  }
  return total;
}

// Blocks of one thread per row (or column) for the Muon+ finalize passes, one launch per table.
template <class Launch>
inline void for_each_lean_lines_table(const LeanMat* mats, int n, float* partial, bool cols, Launch&& launch) {
  for (int first = 0; first < n; first += kLeanMats) {
    LeanTable t{};
    t.partial = partial;
    int items = 0;
    for (int k = first; k < n && k < first + kLeanMats; ++k) {
      // an (r, 0) matrix still gets its r row scales, 1 / sqrt(eps) (no partials to sum)
      if ((cols ? mats[k].cols : mats[k].rows) == 0) continue;
      LeanMat& mt = t.mat[t.count++];
      mt = mats[k];
      mt.tiles_c = (mats[k].cols + kLeanTile - 1) / kLeanTile;
      mt.items = ((cols ? mt.cols : mt.rows) + kLeanThreads - 1) / kLeanThreads;
      mt.item_start = items;
      items += mt.items;
    }
    t.total_items = items;
    if (items > 0) launch(t);
  }
}

// Places every matrix's Muon+ partials (stat_start) and returns their total length.
inline int64_t lean_plus_partials(LeanMat* mats, int n) {
  int64_t total = 0;
  for (int k = 0; k < n; ++k) {
    mats[k].stat_start = total;
    const int64_t tiles_r = (mats[k].rows + kLeanTile - 1) / kLeanTile;
    const int64_t tiles_c = (mats[k].cols + kLeanTile - 1) / kLeanTile;
    total += tiles_c * mats[k].rows + tiles_r * mats[k].cols;
  }
  return total;
}

template <class U>
inline void run_lean_plus_stats(const LeanMat* mats, int n, float* partial, Stream stream) {
  // Each pass needs the previous one done for every matrix: stream order gives it.
  for_each_lean_table(mats, n, partial, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_plus_partial_kernel<U, false>)(t);
    check_launch("lean_plus_partial_kernel<rows>");
  });
  for_each_lean_lines_table(mats, n, partial, false, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_plus_finalize_kernel<false>)(t);
    check_launch("lean_plus_finalize_kernel<rows>");
  });
  for_each_lean_table(mats, n, partial, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_plus_partial_kernel<U, true>)(t);
    check_launch("lean_plus_partial_kernel<cols>");
  });
  for_each_lean_lines_table(mats, n, partial, true, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_plus_finalize_kernel<true>)(t);
    check_launch("lean_plus_finalize_kernel<cols>");
  });
}

template <class U>
inline void run_lean_cautious_count(const LeanMat* mats, int n, Stream stream) {
  for_each_lean_table(mats, n, nullptr, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_cautious_count_kernel<U>)(t);
    check_launch("lean_cautious_count_kernel");
  });
}

template <class G, class X>
inline void run_lean_pre(const LeanMat* mats, int n, float* partial, Stream stream) {
  // Pass 2 of a matrix needs all its pass-1 blocks done: stream order gives it, pass 1 of every
  // table is queued first (the tables are rebuilt identically for pass 2).
  for_each_lean_table(mats, n, partial, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_pre_momentum_kernel<G>)(t);
    check_launch("lean_pre_momentum_kernel");
  });
  for_each_lean_table(mats, n, partial, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_pre_scale_kernel<G, X>)(t);
    check_launch("lean_pre_scale_kernel");
  });
}

template <class P, class U>
inline void run_lean_update(const LeanMat* mats, int n, Stream stream) {
  for_each_lean_table(mats, n, nullptr, [&](const LeanTable& t) {
    ST_LAUNCH(dim3(static_cast<unsigned>(t.total_items)), dim3(kLeanThreads), 0, stream,
              lean_update_kernel<P, U>)(t);
    check_launch("lean_update_kernel");
  });
}

}  // namespace st

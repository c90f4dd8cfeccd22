// Plain argument structs shared by the kernels (nvcc or emulation), the launchers and the
// torch glue. No CUDA, no torch: this header compiles anywhere.
#pragma once
#include <cstdint>

namespace st {

// Element types the kernels are instantiated for; csrc/ops_impl.h maps at::ScalarType onto it.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// Multi-tensor launch geometry (see TensorChunks in common.cuh).
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;     // elements per block; 512 threads x 4 ILP x 8 iterations
constexpr int kThreads = 512;
constexpr int kIlp = 4;

struct MaskArgs {
  bool rescale;
  unsigned long long* counts;  // per tensor (indexed by TensorChunks::id); pass 2 reads them
};

// Scalars that the reference forms in double precision (1 - beta1, ...) arrive precomputed, so
// the kernels see the same float the reference's foreach ops see.
struct AdamArgs {
  float w1, beta2, w2, eps, decay;     // w1 = 1 - beta1, w2 = 1 - beta2, decay = 1 - lr*wd
  float bias2_sqrt, step_size;         // sqrt(1 - b2^t), lr / (1 - b1^t)
  bool has_decay, cautious;
  MaskArgs mask;
};

struct PreArgs {
  float momentum, w, eps;  // w = 1 - momentum
  bool nesterov;
  int64_t numel;     // m * n
  int chunks;        // blocks per matrix
  float* partial;    // [b][chunks] sums of squares
};

struct NormStats {
  int64_t b;
  int m, n;
  float eps;
  int strips, rows_per_strip;
  float* rinv;     // [b][m]
  float* partial;  // [b][strips][n]
  float* cinv;     // [b][n]
};

struct PostArgs {
  int n;
  int64_t numel;
  int chunks;
  float decay, alpha;  // 1 - lr*wd ; -lr*lr_scale
  bool has_decay, muon_plus, cautious, rescale;
  NormStats stats;                 // rinv / cinv when muon_plus
  unsigned long long* counts;      // [b] kept entries when cautious && rescale
};

// The lean Muon step's passes (kernels/muon_lean.cuh): every matrix of the step in one table,
// each walked in 32 x 32 tiles in one coordinate system (i, j); element (i, j) of a strided
// operand is ptr[i * si + j * sj], of a dense one ptr[i * cols + j].
constexpr int kLeanMats = 128;       // matrices per launch (a ~20 KiB parameter table: Volta+ with CUDA >= 12.1 take 32 KiB)
constexpr int kLeanTile = 32;        // tile edge; a block of 256 threads covers a tile in 4 rows each
constexpr int kLeanTilesPerItem = 16;  // tiles per block: 16,384 elements, as kChunk
constexpr int kLeanThreads = 256;

struct LeanMat {
  const void* src;      // pre: the gradient; update: the update direction U (both strided)
  int64_t src_si, src_sj;
  void* dst;            // update: the parameter (strided); pre: unused
  int64_t dst_si, dst_sj;
  float* mom;           // pre: momentum, dense fp32
  void* out;            // pre: U / max(||U||_F, eps), dense, the Newton-Schulz dtype
  float* grad_copy;     // pre: a dense fp32 copy of the gradient (the cautious mask), or null
  const float* h0;      // pre: momentum mu; update: lr (0-d device tensors)
  const float* h1;      // update: weight decay
  const bool* skip;     // update: skip this matrix's update (a non-finite NS result), or null
  float scale;          // pre: eps; update: the shape factor (p -= lr * scale * U)
  int rows, cols;
  int tiles_c;          // tiles along j
  int item_start;       // first block of this matrix in the launch
  int items;            // its blocks
  int partial_start;    // pre: where its per-block sums of squares go
  bool nesterov;        // pre
  // Muon+ (kernels/muon_lean.cuh, plus stats / update). Stats: src is the update direction in its
  // logical orientation (rows = fan-out), scale = eps, and the inverse row norms, then the inverse
  // column norms of the row-normalized matrix, go to row_scale [rows] / col_scale [cols]; the
  // row partials at partial + stat_start ([tiles_c][rows]), the column partials after them
  // ([tiles_r][cols]). Update: u * row_scale[r] * col_scale[c], (r, c) = (i, j), or (j, i) when
  // scale_swap (the kernel walks the parameter transposed); null: no Muon+.
  float* row_scale;
  float* col_scale;
  int64_t stat_start;
  bool scale_swap;
  // Cautious mask (count / update): cgrad is the gradient, fp32 with src's strides (null: no
  // mask); an entry is kept where U * g > 0. Count: kept[0] += entries kept. Update: kept (null:
  // no rescale) scales kept entries by rows * cols / (*kept + 1), after the Muon+ scales.
  const float* cgrad;
  unsigned long long* kept;
};

struct LeanTable {
  LeanMat mat[kLeanMats];
  int count;
  int total_items;
  float* partial;       // pre: sums of squares, per block
};
static_assert(sizeof(LeanTable) <= 32764, "kernel parameters are limited to 32,764 bytes");

struct SyrkArgs {
  const void* X;
  void* out;
  const void* Y;  // may be null (then beta is ignored)
  int64_t batch;
  int m, k;
  int64_t x_bs, out_bs, y_bs;  // batch strides, elements
  int ldx, ldo, ldy;           // row strides, elements
  float alpha, beta;
  int tiles;                   // ceil(m / kSymBM), set by run_syrk
};

// Hopper symmetric GEMM (kernels/sym_gemm_sm90.cuh): out = alpha X X^T + beta C, C symmetric.
struct SymGemmArgs {
  const void* X;
  void* out;
  const void* C;  // may be null (then beta is ignored); only its lower triangle is read
  int64_t batch;
  int m, k;
  int64_t x_bs, out_bs, c_bs;  // batch strides, elements
  int ldx, ldo, ldc;           // row strides, elements
  float alpha, beta;
  int tile_n;                  // 0: by size (256 for m >= 1536, else 128); or 128 / 256
};

// Strips of rows for the column reduction: at most 32 strips, at least 8 rows each.
inline void plan_strips(NormStats& s) {
  s.rows_per_strip = s.m / 32 + (s.m % 32 != 0);
  if (s.rows_per_strip < 8) s.rows_per_strip = 8;
  s.strips = s.m == 0 ? 0 : (s.m + s.rows_per_strip - 1) / s.rows_per_strip;
}

}  // namespace st

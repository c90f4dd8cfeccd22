// b A + c A A for a batch of square matrices in ONE cuBLASLt call with C != D (poly_lt), and a
// whole standard Newton-Schulz iteration after X X^T in two (ns_step_lt, below): the Newton-Schulz
// polynomial and update without the copy of an operand into the output that torch.baddbmm makes
// before every GEMM (classic cuBLAS computes C = alpha A B + beta C in place, so ATen first copies `input` into
// `out`; on an H200 that copy was most of the ~1.3 ms of copies in a 5.8 ms GPT-2-small step,
// ../docs/kernels.md). Host code, included by ops.cpp only.
//
// cuBLASLt is reached through dlsym on the copy torch already loaded (RTLD_NOLOAD), so the
// extension gains no link-time dependency and cannot load a second, different cuBLASLt. If it is
// not there, the op raises and Newton-Schulz keeps torch.baddbmm
// (speedtronic/kernels/newton_schulz_gemm.py).
//
// Layout: torch's (b, m, m) row-major A is, read column-major, A^T. cuBLAS then computes
// D' = c A^T A^T + b A^T = (c A A + b A)^T, whose column-major storage is the row-major
// c A A + b A. So one descriptor serves A, B, C and D, with no transposes, symmetric A or not.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace st::glue {

struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string error;  // empty when usable
};

inline CublasLtApi load_cublaslt() {
  CublasLtApi api;
  void* lib = nullptr;
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // only the copy torch has loaded
    if (lib != nullptr) break;
  }
  if (lib == nullptr) {
    api.error = "libcublasLt is not loaded in this process";
    return api;
  }
  auto bind = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (fn == nullptr && api.error.empty()) api.error = std::string("libcublasLt lacks ") + symbol;
  };
  bind(api.create, "cublasLtCreate");
  bind(api.desc_create, "cublasLtMatmulDescCreate");
  bind(api.desc_destroy, "cublasLtMatmulDescDestroy");
  bind(api.desc_set, "cublasLtMatmulDescSetAttribute");
  bind(api.layout_create, "cublasLtMatrixLayoutCreate");
  bind(api.layout_destroy, "cublasLtMatrixLayoutDestroy");
  bind(api.layout_set, "cublasLtMatrixLayoutSetAttribute");
  bind(api.pref_create, "cublasLtMatmulPreferenceCreate");
  bind(api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
  bind(api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
  bind(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  bind(api.matmul, "cublasLtMatmul");
  return api;
}

inline const CublasLtApi& cublaslt() {
  static const CublasLtApi api = load_cublaslt();  // thread-safe one-time init
  return api;
}

// "ok", or why poly_lt cannot run; needs no GPU (CI checks the symbols bind).
inline std::string cublaslt_status() {
  const CublasLtApi& api = cublaslt();
  return api.error.empty() ? "ok" : api.error;
}

inline cublasLtHandle_t cublaslt_handle() {
  static const cublasLtHandle_t handle = [] {
    cublasLtHandle_t h = nullptr;
    return cublaslt().create(&h) == CUBLAS_STATUS_SUCCESS ? h : nullptr;
  }();
  TORCH_CHECK(handle != nullptr, "poly_lt: cublasLtCreate failed");
  return handle;
}

// Largest power of two <= 256 dividing every value: the alignment cuBLASLt may assume.
inline uint32_t lt_alignment(std::initializer_list<uint64_t> values) {
  uint32_t align = 256;
  for (uint64_t v : values) {
    while (align > 1 && v % align != 0) align /= 2;
  }
  return align;
}

// Owns the cuBLASLt descriptors of one call (destroyed on every exit, errors included).
struct LtDescriptors {
  const CublasLtApi& api;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t square = nullptr;  // (m, m) operands
  cublasLtMatrixLayout_t wide = nullptr;    // (m, n) operands, ns_step_lt only
  cublasLtMatmulPreference_t pref = nullptr;
  explicit LtDescriptors(const CublasLtApi& a) : api(a) {}
  ~LtDescriptors() {
    if (pref != nullptr) api.pref_destroy(pref);
    if (wide != nullptr) api.layout_destroy(wide);
    if (square != nullptr) api.layout_destroy(square);
    if (op != nullptr) api.desc_destroy(op);
  }
};

inline void lt_check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", what, " failed (cublasStatus ",
              static_cast<int>(status), ")");
}

inline void lt_check_16bit(const at::Tensor& T, const char* who, const char* name) {
  TORCH_CHECK_VALUE(T.scalar_type() == at::kHalf || T.scalar_type() == at::kBFloat16, who, ": ",
                    name, " must be float16 or bfloat16, got ", T.scalar_type());
  TORCH_CHECK_VALUE(T.is_cuda(), who, ": ", name, " must be a CUDA tensor");
}

// A column-major (rows, cols) layout with leading dimension `rows`, `batch` matrices apart by
// rows * cols elements: how cuBLAS reads a contiguous row-major (batch, cols, rows) tensor.
inline void lt_layout(const CublasLtApi& api, cublasLtMatrixLayout_t* layout, cudaDataType_t type,
                      int64_t rows, int64_t cols, int64_t batch) {
  TORCH_CHECK_VALUE(rows <= INT32_MAX && cols <= INT32_MAX && batch <= INT32_MAX,
                    "cuBLASLt: matrix too large");
  lt_check(api.layout_create(layout, type, rows, cols, rows), "cublasLtMatrixLayoutCreate");
  const int32_t count = static_cast<int32_t>(batch);
  const int64_t stride = rows * cols;
  lt_check(api.layout_set(*layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
           "set BATCH_COUNT");
  lt_check(api.layout_set(*layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                          sizeof(stride)),
           "set STRIDED_BATCH_OFFSET");
}

// fp32-accumulating, no-transpose matmul descriptor and a preference that allows torch's
// Hopper workspace and assumes `align` bytes of alignment for every operand.
inline void lt_prepare(LtDescriptors& d, uint32_t align) {
  const CublasLtApi& api = d.api;
  lt_check(api.desc_create(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t no_transpose = CUBLAS_OP_N;
  lt_check(api.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &no_transpose, sizeof(no_transpose)),
           "set TRANSA");
  lt_check(api.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)),
           "set TRANSB");
  uint64_t workspace_bytes = 32ull << 20;  // what torch gives cuBLASLt on Hopper
  lt_check(api.pref_create(&d.pref), "cublasLtMatmulPreferenceCreate");
  lt_check(api.pref_set(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                        sizeof(workspace_bytes)),
           "set MAX_WORKSPACE_BYTES");
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    lt_check(api.pref_set(d.pref, attr, &align, sizeof(align)), "set MIN_ALIGNMENT");
  }
}

// D = alpha A B + beta C on the current stream, C and D distinct buffers of one layout (cuBLASLt
// reads C and writes D: no copy of C into D first, which classic cuBLAS needs).
inline void lt_matmul(const LtDescriptors& d, const char* who, float alpha, const void* A,
                      cublasLtMatrixLayout_t a_layout, const void* B, cublasLtMatrixLayout_t b_layout,
                      float beta, const void* C, void* D, cublasLtMatrixLayout_t cd_layout,
                      const at::TensorOptions& options) {
  const CublasLtApi& api = d.api;
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  const cublasLtHandle_t handle = cublaslt_handle();
  lt_check(api.heuristic(handle, d.op, a_layout, b_layout, cd_layout, cd_layout, d.pref, 1, &best,
                         &found),
           "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(found > 0, who, ": cuBLASLt has no algorithm for this shape and dtype");
  // from torch's caching allocator: inside a CUDA-graph capture it comes from the graph's pool
  at::Tensor workspace = at::empty({static_cast<int64_t>(best.workspaceSize)},
                                   options.dtype(at::kByte));
  lt_check(api.matmul(handle, d.op, &alpha, A, a_layout, B, b_layout, &beta, C, cd_layout, D,
                      cd_layout, &best.algo,
                      best.workspaceSize > 0 ? workspace.data_ptr() : nullptr, best.workspaceSize,
                      c10::cuda::getCurrentCUDAStream().stream()),
           "cublasLtMatmul");
}

inline cudaDataType_t lt_type(const at::Tensor& T) {
  return T.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

inline uint64_t address(const at::Tensor& T) { return reinterpret_cast<uint64_t>(T.data_ptr()); }

// D = c A A + b A for A (batch, m, m) float16/bfloat16 on CUDA; fp32 accumulate and epilogue,
// rounded once (as torch.baddbmm(A, A, A, beta=b, alpha=c)).
inline at::Tensor poly_lt(const at::Tensor& A_, double b, double c) {
  TORCH_CHECK_VALUE(A_.dim() == 3 && A_.size(1) == A_.size(2),
                    "poly_lt: A must be (batch, m, m), got ", A_.sizes());
  lt_check_16bit(A_, "poly_lt", "A");
  const CublasLtApi& api = cublaslt();
  TORCH_CHECK(api.error.empty(), "poly_lt: cuBLASLt unavailable: ", api.error);
  const at::Tensor A = A_.contiguous();
  at::Tensor D = at::empty_like(A);
  const int64_t batch = A.size(0), m = A.size(1);
  if (batch == 0 || m == 0) return D;
  const uint64_t elem = A.element_size();
  LtDescriptors d(api);
  lt_prepare(d, lt_alignment({address(A), address(D), static_cast<uint64_t>(m * m) * elem,
                              static_cast<uint64_t>(m) * elem}));
  lt_layout(api, &d.square, lt_type(A), m, m, batch);
  lt_matmul(d, "poly_lt", static_cast<float>(c), A.data_ptr(), d.square, A.data_ptr(), d.square,
            static_cast<float>(b), A.data_ptr(), D.data_ptr(), d.square, A.options());
  return D;
}

// One standard Newton-Schulz iteration after A = X X^T, as two cuBLASLt calls with C != D:
//   P = b A + c A A              (batch, m, m)   as poly_lt
//   Y = a X + P X                (batch, m, n)   C = X, D = Y: the a I term rides on beta
// instead of the three launches of the fold route (A + (a/b) I, an in-place baddbmm, a bmm) or
// the copies of torch.baddbmm (it copies C into D before every GEMM). Column-major reading of
// the row-major tensors: X is an (n, m) matrix X^T, P is P^T, so cuBLAS computes
// X^T P^T + a X^T = (P X + a X)^T, whose column-major storage is the row-major P X + a X.
// P need not be exactly symmetric. fp32 accumulate, one rounding per call.
inline at::Tensor ns_step_lt(const at::Tensor& X_, const at::Tensor& A_, double a, double b,
                             double c) {
  TORCH_CHECK_VALUE(X_.dim() == 3 && A_.dim() == 3 && A_.size(0) == X_.size(0) &&
                        A_.size(1) == X_.size(1) && A_.size(2) == X_.size(1),
                    "ns_step_lt: X must be (batch, m, n) and A (batch, m, m), got ", X_.sizes(),
                    " and ", A_.sizes());
  lt_check_16bit(X_, "ns_step_lt", "X");
  TORCH_CHECK_VALUE(A_.scalar_type() == X_.scalar_type() && A_.device() == X_.device(),
                    "ns_step_lt: A must match X's dtype and device");
  const CublasLtApi& api = cublaslt();
  TORCH_CHECK(api.error.empty(), "ns_step_lt: cuBLASLt unavailable: ", api.error);
  const at::Tensor X = X_.contiguous(), A = A_.contiguous();
  at::Tensor P = at::empty_like(A), Y = at::empty_like(X);
  const int64_t batch = X.size(0), m = X.size(1), n = X.size(2);
  if (batch == 0 || m == 0 || n == 0) return Y;
  const uint64_t elem = X.element_size();
  LtDescriptors d(api);
  lt_prepare(d, lt_alignment({address(X), address(A), address(P), address(Y),
                              static_cast<uint64_t>(m * m) * elem, static_cast<uint64_t>(m * n) * elem,
                              static_cast<uint64_t>(m) * elem, static_cast<uint64_t>(n) * elem}));
  const cudaDataType_t type = lt_type(X);
  lt_layout(api, &d.square, type, m, m, batch);
  lt_layout(api, &d.wide, type, n, m, batch);
  lt_matmul(d, "ns_step_lt", static_cast<float>(c), A.data_ptr(), d.square, A.data_ptr(), d.square,
            static_cast<float>(b), A.data_ptr(), P.data_ptr(), d.square, A.options());
  lt_matmul(d, "ns_step_lt", 1.0f, X.data_ptr(), d.wide, P.data_ptr(), d.square,
            static_cast<float>(a), X.data_ptr(), Y.data_ptr(), d.wide, X.options());
  return Y;
}

}  // namespace st::glue

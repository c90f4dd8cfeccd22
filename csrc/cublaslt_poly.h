// b A + c A A for a batch of square matrices in ONE cuBLASLt call with C != D: the Newton-Schulz
// polynomial without the copy of A into the output that torch.baddbmm makes before every GEMM
// (classic cuBLAS computes C = alpha A B + beta C in place, so ATen first copies `input` into
// `out`; on an H200 that copy was most of the ~1.3 ms of copies in a 5.8 ms GPT-2-small step,
// ../docs/kernels.md). Host code, included by ops.cpp only.
//
// cuBLASLt is reached through dlsym on the copy torch already loaded (RTLD_NOLOAD), so the
// extension gains no link-time dependency and cannot load a second, different cuBLASLt. If it is
// not there, the op raises and Newton-Schulz keeps torch.baddbmm (speedtronic/newton_schulz.py).
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
  cublasLtMatrixLayout_t layout = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit LtDescriptors(const CublasLtApi& a) : api(a) {}
  ~LtDescriptors() {
    if (pref != nullptr) api.pref_destroy(pref);
    if (layout != nullptr) api.layout_destroy(layout);
    if (op != nullptr) api.desc_destroy(op);
  }
};

inline void lt_check(cublasStatus_t status, const char* what) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "poly_lt: ", what, " failed (cublasStatus ",
              static_cast<int>(status), ")");
}

// D = c A A + b A for A (batch, m, m) float16/bfloat16 on CUDA; fp32 accumulate and epilogue,
// rounded once (as torch.baddbmm(A, A, A, beta=b, alpha=c)).
inline at::Tensor poly_lt(const at::Tensor& A_, double b, double c) {
  TORCH_CHECK_VALUE(A_.dim() == 3 && A_.size(1) == A_.size(2),
                    "poly_lt: A must be (batch, m, m), got ", A_.sizes());
  TORCH_CHECK_VALUE(A_.scalar_type() == at::kHalf || A_.scalar_type() == at::kBFloat16,
                    "poly_lt: A must be float16 or bfloat16, got ", A_.scalar_type());
  TORCH_CHECK_VALUE(A_.is_cuda(), "poly_lt: A must be a CUDA tensor");
  const CublasLtApi& api = cublaslt();
  TORCH_CHECK(api.error.empty(), "poly_lt: cuBLASLt unavailable: ", api.error);
  const at::Tensor A = A_.contiguous();
  at::Tensor D = at::empty_like(A);
  const int64_t batch = A.size(0), m = A.size(1);
  if (batch == 0 || m == 0) return D;
  TORCH_CHECK_VALUE(m <= INT32_MAX && batch <= INT32_MAX, "poly_lt: matrix too large");
  const cudaDataType_t type = A.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;

  LtDescriptors d(api);
  lt_check(api.desc_create(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t no_transpose = CUBLAS_OP_N;
  lt_check(api.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &no_transpose, sizeof(no_transpose)),
           "set TRANSA");
  lt_check(api.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)),
           "set TRANSB");
  lt_check(api.layout_create(&d.layout, type, m, m, m), "cublasLtMatrixLayoutCreate");
  const int32_t count = static_cast<int32_t>(batch);
  const int64_t stride = m * m;
  lt_check(api.layout_set(d.layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
           "set BATCH_COUNT");
  lt_check(api.layout_set(d.layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                          sizeof(stride)),
           "set STRIDED_BATCH_OFFSET");

  uint64_t workspace_bytes = 32ull << 20;  // what torch gives cuBLASLt on Hopper
  lt_check(api.pref_create(&d.pref), "cublasLtMatmulPreferenceCreate");
  lt_check(api.pref_set(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                        sizeof(workspace_bytes)),
           "set MAX_WORKSPACE_BYTES");
  const uint64_t elem = A.element_size();
  const uint32_t align = lt_alignment({reinterpret_cast<uint64_t>(A.data_ptr()),
                                       reinterpret_cast<uint64_t>(D.data_ptr()),
                                       static_cast<uint64_t>(stride) * elem,
                                       static_cast<uint64_t>(m) * elem});
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    lt_check(api.pref_set(d.pref, attr, &align, sizeof(align)), "set MIN_ALIGNMENT");
  }
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  const cublasLtHandle_t handle = cublaslt_handle();
  lt_check(api.heuristic(handle, d.op, d.layout, d.layout, d.layout, d.layout, d.pref, 1, &best,
                         &found),
           "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(found > 0, "poly_lt: cuBLASLt has no algorithm for ", batch, " x ", m, " x ", m, " ",
              A.scalar_type());

  at::Tensor workspace = at::empty({static_cast<int64_t>(best.workspaceSize)},
                                   A.options().dtype(at::kByte));
  const float alpha = static_cast<float>(c), beta = static_cast<float>(b);
  lt_check(api.matmul(handle, d.op, &alpha, A.data_ptr(), d.layout, A.data_ptr(), d.layout,
                      &beta, A.data_ptr(), d.layout, D.data_ptr(), d.layout, &best.algo,
                      best.workspaceSize > 0 ? workspace.data_ptr() : nullptr, best.workspaceSize,
                      c10::cuda::getCurrentCUDAStream().stream()),
           "cublasLtMatmul");
  return D;
}

}  // namespace st::glue

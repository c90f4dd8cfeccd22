// The only file of speedtronic._C that includes torch: CUDA registrations of the speedtronic
// ops (schemas are defined in speedtronic/kernels/ops*.py) plus a few debug ops for tests/benchmarks.
// The glue itself lives in ops_impl.h so the CPU emulation tests compile the same code.
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cublaslt_poly.h"
#include "ops_impl.h"

namespace st::glue {
void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
}  // namespace st::glue

namespace {

using c10::cuda::OptionalCUDAGuard;
namespace g = st::glue;

at::Tensor muon_plus_normalize(const at::Tensor& U, double eps) {
  OptionalCUDAGuard guard(U.device());
  return g::muon_plus_normalize(U, eps);
}

void cautious_mask_(at::TensorList updates, at::TensorList grads, bool rescale) {
  if (updates.empty()) return;
  OptionalCUDAGuard guard(updates[0].device());
  g::cautious_mask_(updates, grads, rescale);
}

at::Tensor muon_pre_orthogonalize_(at::TensorList bufs, at::TensorList grads, double momentum, bool nesterov,
                                   double eps, at::ScalarType out_dtype) {
  OptionalCUDAGuard guard(bufs.empty() ? c10::Device(c10::kCUDA) : bufs[0].device());
  return g::muon_pre_orthogonalize_(bufs, grads, momentum, nesterov, eps, out_dtype);
}

void muon_post_update_(at::TensorList params, const at::Tensor& orth, at::TensorList grads, double lr,
                       double weight_decay, double lr_scale, bool muon_plus, double norm_eps, bool cautious,
                       bool cautious_rescale) {
  OptionalCUDAGuard guard(orth.device());
  g::muon_post_update_(params, orth, grads, lr, weight_decay, lr_scale, muon_plus, norm_eps, cautious,
                       cautious_rescale);
}

void cautious_adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double eps,
                          double weight_decay, int64_t step, bool cautious, bool cautious_rescale) {
  if (params.empty()) return;
  OptionalCUDAGuard guard(params[0].device());
  g::cautious_adamw_step_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
                          cautious, cautious_rescale);
}

void muon_lean_pre_(at::TensorList grads, at::TensorList momenta, at::TensorList outs, at::TensorList grad_copies,
                    at::TensorList mus, at::IntArrayRef mu_index, at::IntArrayRef nesterov,
                    c10::ArrayRef<double> eps) {
  if (grads.empty()) return;
  OptionalCUDAGuard guard(grads[0].device());
  g::muon_lean_pre_(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps);
}

void muon_lean_update_(at::TensorList params, at::TensorList updates, at::TensorList lrs,
                       at::TensorList weight_decays, at::IntArrayRef hyper_index, c10::ArrayRef<double> scales,
                       const std::optional<at::Tensor>& skip, at::IntArrayRef skip_index, at::TensorList row_scales,
                       at::TensorList col_scales, at::TensorList grads, const std::optional<at::Tensor>& kept,
                       at::IntArrayRef kept_index) {
  if (params.empty()) return;
  OptionalCUDAGuard guard(params[0].device());
  g::muon_lean_update_(params, updates, lrs, weight_decays, hyper_index, scales, skip, skip_index, row_scales,
                       col_scales, grads, kept, kept_index);
}

void muon_lean_cautious_count_(at::TensorList updates, at::TensorList grads, const at::Tensor& kept) {
  if (updates.empty()) return;
  OptionalCUDAGuard guard(updates[0].device());
  g::muon_lean_cautious_count_(updates, grads, kept);
}

void muon_lean_plus_stats_(at::TensorList updates, at::TensorList row_scales, at::TensorList col_scales,
                           c10::ArrayRef<double> eps) {
  if (updates.empty()) return;
  OptionalCUDAGuard guard(updates[0].device());
  g::muon_lean_plus_stats_(updates, row_scales, col_scales, eps);
}

at::Tensor syrk(const at::Tensor& X, double alpha, double beta, const std::optional<at::Tensor>& Y) {
  OptionalCUDAGuard guard(X.device());
  return g::syrk(X, alpha, beta, Y);
}

at::Tensor sym_gemm(const at::Tensor& X, double alpha, double beta, const std::optional<at::Tensor>& C,
                    int64_t tile_n) {
  OptionalCUDAGuard guard(X.device());
  return g::sym_gemm(X, alpha, beta, C, tile_n);
}

at::Tensor poly_lt(const at::Tensor& A, double b, double c) {
  OptionalCUDAGuard guard(A.device());
  return g::poly_lt(A, b, c);
}

at::Tensor ns_step_lt(const at::Tensor& X, const at::Tensor& A, double a, double b, double c) {
  OptionalCUDAGuard guard(X.device());
  return g::ns_step_lt(X, A, a, b, c);
}

at::Tensor mma_probe(const at::Tensor& A, const at::Tensor& Bt) {
  OptionalCUDAGuard guard(A.device());
  return g::mma_probe(A, Bt);
}

std::string arch_list() { return st::compiled_arch_list(); }

std::string cublaslt_status() { return g::cublaslt_status(); }

}  // namespace

TORCH_LIBRARY_IMPL(speedtronic, CUDA, m) {
  m.impl("muon_plus_normalize", &muon_plus_normalize);
  m.impl("cautious_mask_", &cautious_mask_);
  m.impl("muon_pre_orthogonalize_", &muon_pre_orthogonalize_);
  m.impl("muon_post_update_", &muon_post_update_);
  m.impl("cautious_adamw_step_", &cautious_adamw_step_);
  m.impl("muon_lean_pre_", &muon_lean_pre_);
  m.impl("muon_lean_update_", &muon_lean_update_);
  m.impl("muon_lean_plus_stats_", &muon_lean_plus_stats_);
  m.impl("muon_lean_cautious_count_", &muon_lean_cautious_count_);
}

// Not part of the public op set: benchmarks and GPU tests reach the symmetric kernel and the
// mma layout probe through these; Newton-Schulz offers sym_gemm, poly_lt and ns_step_lt to its per-shape
// dispatch (speedtronic/newton_schulz.py).
TORCH_LIBRARY(speedtronic_debug, m) {
  m.def("syrk(Tensor X, float alpha=1.0, float beta=0.0, Tensor? Y=None) -> Tensor");
  m.def("mma_probe(Tensor A, Tensor Bt) -> Tensor");
  m.def("sym_gemm(Tensor X, float alpha=1.0, float beta=0.0, Tensor? C=None, int tile_n=0) -> Tensor");
  m.def("poly_lt(Tensor A, float b, float c) -> Tensor");
  m.def("ns_step_lt(Tensor X, Tensor A, float a, float b, float c) -> Tensor");
  m.def("arch_list() -> str", &arch_list);
  m.def("cublaslt_status() -> str", &cublaslt_status);
}

TORCH_LIBRARY_IMPL(speedtronic_debug, CUDA, m) {
  m.impl("syrk", &syrk);
  m.impl("mma_probe", &mma_probe);
  m.impl("sym_gemm", &sym_gemm);
  m.impl("poly_lt", &poly_lt);
  m.impl("ns_step_lt", &ns_step_lt);
}

// `import speedtronic._C` needs a module object; the ops above register at load time.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C",
                            "Speedtronic CUDA kernels (registered with the torch dispatcher).", -1, nullptr};
  return PyModule_Create(&def);
}

// Test-only CPU build of the REAL kernel sources: torch headers first, then the emulation
// header, then csrc's launchers (*.cu, which include csrc/kernels/*.cuh) and csrc/ops_impl.h.
// Registers the same op schemas as speedtronic/ops.py under the `speedtronic_emu` namespace,
// with CPU kernels, plus knobs for the emulator (schedule, statistics).
#include <torch/library.h>
#include <ATen/ATen.h>

#include "stemu.h"

#include "../../csrc/elementwise.cu"
#include "../../csrc/muon.cu"
#include "../../csrc/symmetric_gemm.cu"
#include "../../csrc/ops_impl.h"

namespace st::glue {
void* current_stream() { return nullptr; }
}  // namespace st::glue

namespace {

void configure(const std::string& schedule, int64_t seed) {
  auto& s = stemu::settings();
  if (schedule == "forward") s.schedule = stemu::Schedule::Forward;
  else if (schedule == "reverse") s.schedule = stemu::Schedule::Reverse;
  else if (schedule == "random") s.schedule = stemu::Schedule::Random;
  else TORCH_CHECK_VALUE(false, "stemu: unknown schedule ", schedule, "; valid: forward, reverse, random");
  s.seed = static_cast<uint64_t>(seed);
}

std::vector<int64_t> stats() {
  auto& s = stemu::settings();
  return {s.launches, s.blocks, s.collectives};
}

// Deliberately broken kernels: the emulator must report them (tests/test_kernels_emulation.py).
__global__ void bug_divergent_barrier(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.f;
}
__global__ void bug_missing_barrier(float* out) {
  ST_DYNAMIC_SMEM(float, s);
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  // __syncthreads() missing here
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
__global__ void bug_shuffle_after_exit(float* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.f, 1);
}
__global__ void bug_deadlock(float* out) {
  // Half of warp 0 waits in a shuffle for lanes that wait at the block barrier: hangs on GPU.
  float v = 1.f;
  if ((threadIdx.x & 31) < 16) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

// Runs one of the broken kernels on 64 threads; returns the output (if it finishes).
at::Tensor run_bug(const std::string& which) {
  at::Tensor out = at::zeros({64}, at::kFloat);
  float* p = out.data_ptr<float>();
  if (which == "divergent_barrier") ST_LAUNCH(dim3(1), dim3(64), 0, nullptr, bug_divergent_barrier)(p);
  else if (which == "missing_barrier") ST_LAUNCH(dim3(1), dim3(64), 64 * sizeof(float), nullptr, bug_missing_barrier)(p);
  else if (which == "shuffle_after_exit") ST_LAUNCH(dim3(1), dim3(64), 0, nullptr, bug_shuffle_after_exit)(p);
  else if (which == "deadlock") ST_LAUNCH(dim3(1), dim3(64), 0, nullptr, bug_deadlock)(p);
  else TORCH_CHECK_VALUE(false, "unknown bug ", which);
  return out;
}

// The emulator's exceptions become RuntimeErrors (c10::Error would add C++ backtraces).
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const stemu::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY(speedtronic_emu, m) {
  m.def("muon_plus_normalize(Tensor U, float eps=1e-8) -> Tensor");
  m.def("cautious_mask_(Tensor(a!)[] updates, Tensor[] grads, bool rescale=True) -> ()");
  m.def("muon_pre_orthogonalize_(Tensor(a!)[] momentum_buffers, Tensor[] grads, float momentum, bool nesterov, "
        "float eps, ScalarType out_dtype) -> Tensor");
  m.def("muon_post_update_(Tensor(a!)[] params, Tensor orthogonalized, Tensor[] grads, float lr, "
        "float weight_decay, float lr_scale, bool muon_plus, float norm_eps, bool cautious, "
        "bool cautious_rescale) -> ()");
  m.def("cautious_adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "int step, bool cautious, bool cautious_rescale) -> ()");
  m.def("syrk(Tensor X, float alpha=1.0, float beta=0.0, Tensor? Y=None) -> Tensor");
  m.def("mma_probe(Tensor A, Tensor Bt) -> Tensor");
  m.def("configure(str schedule, int seed) -> ()", &configure);
  m.def("stats() -> int[]", &stats);
  m.def("run_bug(str which) -> Tensor", [](const std::string& w) { return guarded([&] { return run_bug(w); }); });
}

TORCH_LIBRARY_IMPL(speedtronic_emu, CompositeExplicitAutograd, m) {  // also reached by empty lists
  namespace g = st::glue;
  m.impl("muon_plus_normalize", [](const at::Tensor& U, double eps) {
    return guarded([&] { return g::muon_plus_normalize(U, eps); });
  });
  m.impl("cautious_mask_", [](at::TensorList u, at::TensorList gr, bool rescale) {
    guarded([&] { g::cautious_mask_(u, gr, rescale); });
  });
  m.impl("muon_pre_orthogonalize_", [](at::TensorList b, at::TensorList gr, double mom, bool nest, double eps,
                                       at::ScalarType dt) {
    return guarded([&] { return g::muon_pre_orthogonalize_(b, gr, mom, nest, eps, dt); });
  });
  m.impl("muon_post_update_", [](at::TensorList p, const at::Tensor& o, at::TensorList gr, double lr, double wd,
                                 double scale, bool mp, double ne, bool c, bool cr) {
    guarded([&] { g::muon_post_update_(p, o, gr, lr, wd, scale, mp, ne, c, cr); });
  });
  m.impl("cautious_adamw_step_", [](at::TensorList p, at::TensorList gr, at::TensorList m1, at::TensorList m2,
                                    double lr, double b1, double b2, double eps, double wd, int64_t step, bool c,
                                    bool cr) {
    guarded([&] { g::cautious_adamw_step_(p, gr, m1, m2, lr, b1, b2, eps, wd, step, c, cr); });
  });
  m.impl("syrk", [](const at::Tensor& X, double alpha, double beta, const std::optional<at::Tensor>& Y) {
    return guarded([&] { return g::syrk(X, alpha, beta, Y); });
  });
  m.impl("mma_probe", [](const at::Tensor& A, const at::Tensor& Bt) {
    return guarded([&] { return g::mma_probe(A, Bt); });
  });
}

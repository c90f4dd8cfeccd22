// Test-only CPU build of the REAL kernel sources: torch headers first, then the emulation
// header, then csrc's launchers (*.cu, which include csrc/kernels/*.cuh) and csrc/ops_impl.h.
// Registers the same op schemas as speedtronic/kernels/ops*.py under the `speedtronic_emu` namespace,
// with CPU kernels, plus knobs for the emulator (schedule, statistics).
#include <torch/library.h>
#include <ATen/ATen.h>

#include "stemu.h"

#include "../../../csrc/elementwise.cu"
#include "../../../csrc/muon.cu"
#include "../../../csrc/symmetric_gemm.cu"
#include "../../../csrc/sym_gemm_sm90.cu"
#include "../../../csrc/ops_impl.h"

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

// ---------------------------------------------------------------- Hopper instruction probes
// Each runs the project's sm90 wrappers (csrc/kernels/hopper.cuh) on the emulator; the tests
// compare with layouts computed in Python from the PTX ISA.
namespace sm90 = st::sm90;

// Dynamic smem <- `image` (bytes at window addresses kSmemBase..); then one warpgroup issues
// `repeat` wgmma m64nNk16 with the given descriptors into D (initialised from d_in), commits,
// waits, and writes each thread's fragment: out[thread][i].
__global__ void probe_wgmma_kernel(const uint8_t* image, int64_t bytes, uint64_t da, uint64_t db, int n, bool bf16,
                                   bool scale_d, int repeat, const float* d_in, float* out) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) sm[i] = image[i];
  __syncthreads();
  float d[128];
  for (int i = 0; i < n / 2; ++i) d[i] = d_in[threadIdx.x * (n / 2) + i];
  sm90::wgmma_fence();
  for (int r = 0; r < repeat; ++r) stemu::hopper::wgmma_issue(d, n, da, db, scale_d || r > 0, bf16);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>(d);
  for (int i = 0; i < n / 2; ++i) out[threadIdx.x * (n / 2) + i] = d[i];
}

at::Tensor probe_wgmma(const at::Tensor& image, int64_t da, int64_t db, int64_t n, bool bf16, bool scale_d,
                       int64_t repeat, const at::Tensor& d_in) {
  TORCH_CHECK_VALUE(image.scalar_type() == at::kByte && d_in.scalar_type() == at::kFloat, "probe_wgmma: dtypes");
  at::Tensor img = image.contiguous(), din = d_in.contiguous();
  at::Tensor out = at::empty({128, n / 2}, at::kFloat);
  ST_LAUNCH(dim3(1), dim3(128), static_cast<size_t>(img.numel()), nullptr, probe_wgmma_kernel)(
      img.data_ptr<uint8_t>(), img.numel(), static_cast<uint64_t>(da), static_cast<uint64_t>(db), static_cast<int>(n),
      bf16, scale_d, static_cast<int>(repeat), din.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// wait_group(N): two committed groups (D1 = A B, then D2 = 2 A B, N = 16); after
// wait_group(1) only the older is complete. out[t] = {D1[0], D2[0]} after wait(1), after wait(0).
__global__ void probe_wgmma_groups_kernel(const uint8_t* image, int64_t bytes, uint64_t da, uint64_t db,
                                          float* out) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) sm[i] = image[i];
  __syncthreads();
  float d1[8], d2[8];
  sm90::wgmma_fence();
  stemu::hopper::wgmma_issue(d1, 16, da, db, false, true);
  sm90::wgmma_commit();
  stemu::hopper::wgmma_issue(d2, 16, da, db, false, true);
  stemu::hopper::wgmma_issue(d2, 16, da, db, true, true);
  sm90::wgmma_commit();
  sm90::wgmma_wait<1>(d1);
  out[threadIdx.x * 4 + 0] = d1[0];
  out[threadIdx.x * 4 + 1] = d2[0];
  sm90::wgmma_wait<0>(d2);
  out[threadIdx.x * 4 + 2] = d1[0];
  out[threadIdx.x * 4 + 3] = d2[0];
}

at::Tensor probe_wgmma_groups(const at::Tensor& image, int64_t da, int64_t db) {
  at::Tensor img = image.contiguous();
  at::Tensor out = at::empty({128, 4}, at::kFloat);
  ST_LAUNCH(dim3(1), dim3(128), static_cast<size_t>(img.numel()), nullptr, probe_wgmma_groups_kernel)(
      img.data_ptr<uint8_t>(), img.numel(), static_cast<uint64_t>(da), static_cast<uint64_t>(db),
      out.data_ptr<float>());
  return out;
}

// One bulk tensor copy of the box at `coords` of the 3-D tensor G (16-bit, strided) into smem at
// window address `dst`, through an mbarrier; returns the box's bytes as they landed.
__global__ void probe_tma_kernel(const __grid_constant__ sm90::TensorMap map, uint32_t dst, int c0, int c1, int c2,
                                 uint32_t bytes, uint8_t* out) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  const uint32_t bar = dst + ((bytes + 7u) & ~7u);
  if (threadIdx.x == 0) {
    sm90::mbar_init(bar, 1);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sm90::mbar_arrive_expect_tx(bar, bytes);
    sm90::tma_load_3d(dst, &map, c0, c1, c2, bar);
  }
  sm90::mbar_wait(bar, 0);
  const uint8_t* src = sm + (dst - stemu::hopper::kSmemBase);
  for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = src[i];
}

at::Tensor probe_tma(const at::Tensor& G, std::vector<int64_t> box, std::vector<int64_t> coords, int64_t swizzle,
                     int64_t dst) {
  TORCH_CHECK_VALUE(G.dim() == 3 && G.element_size() == 2 && box.size() == 3 && coords.size() == 3,
                    "probe_tma: G must be 3-D 16-bit; box and coords 3 long");
  // innermost first, as the tensor map wants
  const uint64_t dims[3] = {static_cast<uint64_t>(G.size(2)), static_cast<uint64_t>(G.size(1)),
                            static_cast<uint64_t>(G.size(0))};
  const uint64_t strides[2] = {static_cast<uint64_t>(G.stride(1)) * 2, static_cast<uint64_t>(G.stride(0)) * 2};
  const uint32_t bx[3] = {static_cast<uint32_t>(box[0]), static_cast<uint32_t>(box[1]), static_cast<uint32_t>(box[2])};
  sm90::TensorMap map = stemu::hopper::encode_tensor_map(G.data_ptr(), 3, 2, dims, strides, bx,
                                                         static_cast<int>(swizzle));
  const uint32_t bytes = bx[0] * bx[1] * bx[2] * 2;
  at::Tensor out = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  const size_t smem = static_cast<size_t>(dst - stemu::hopper::kSmemBase) + bytes + 16;
  ST_LAUNCH(dim3(1), dim3(64), smem, nullptr, probe_tma_kernel)(
      map, static_cast<uint32_t>(dst), static_cast<int>(coords[0]), static_cast<int>(coords[1]),
      static_cast<int>(coords[2]), bytes, out.data_ptr<uint8_t>());
  return out;
}

// A script of mbarrier operations by one thread on one barrier: (op, arg) pairs.
//   0 init(arg)  1 arrive  2 arrive.expect_tx(arg)  3 complete_tx(arg)  4 test_wait.parity(arg)
//   5 expect_tx(arg). Returns the test_wait results in order.
__global__ void probe_mbar_kernel(const int64_t* script, int64_t n, int64_t* results) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  const uint32_t bar = sm90::smem_addr(sm + 8);
  int r = 0;
  for (int64_t i = 0; i < n; i += 2) {
    const uint32_t arg = static_cast<uint32_t>(script[i + 1]);
    switch (script[i]) {
      case 0: sm90::mbar_init(bar, arg); break;
      case 1: sm90::mbar_arrive(bar); break;
      case 2: sm90::mbar_arrive_expect_tx(bar, arg); break;
      case 3: stemu::hopper::mbar_complete_tx(bar, arg); break;
      case 4: results[r++] = stemu::hopper::mbar_test_wait(bar, arg); break;
      case 5: stemu::hopper::mbar_expect_tx(bar, arg); break;
    }
  }
}

std::vector<int64_t> probe_mbar(std::vector<int64_t> script) {
  std::vector<int64_t> res(script.size(), -1);
  ST_LAUNCH(dim3(1), dim3(1), 64, nullptr, probe_mbar_kernel)(script.data(), static_cast<int64_t>(script.size()),
                                                               res.data());
  int64_t n = 0;
  for (size_t i = 0; i < script.size(); i += 2) n += script[i] == 4;
  res.resize(n);
  return res;
}

// A two-stage TMA -> wgmma pipeline (one producer thread, one consumer warpgroup) computing
// D (64 x 128) = X[0:64] X[0:128]^T over k = 64 nk, X (128, k) bf16. mode 0: correct; 1: the
// consumer hands a stage back before its wgmma completed; 2: it never waits on the full
// barrier. The emulator must make 1 and 2 visible (wrong result or an error).
__global__ void probe_pipeline_kernel(const __grid_constant__ sm90::TensorMap map, int nk, int mode, float* out) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  const uint32_t base = (sm90::smem_addr(sm) + 1023u) & ~1023u;
  const uint32_t bars = base + 2 * 16384;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 16u + 8u * s; };
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      sm90::mbar_init(full(s), 1);
      sm90::mbar_init(empty(s), 4);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    if (threadIdx.x != 0) return;
    for (int kb = 0; kb < nk; ++kb) {
      const int s = kb % 2;
      sm90::mbar_wait(empty(s), ((kb / 2) & 1) ^ 1u);
      sm90::mbar_arrive_expect_tx(full(s), 16384);
      sm90::tma_load_3d(base + 16384u * s, &map, kb * 64, 0, 0, full(s));
    }
    return;
  }
  float acc[64];
  const int lane = threadIdx.x % 32;
  for (int kb = 0; kb < nk; ++kb) {
    const int s = kb % 2;
    if (mode != 2) sm90::mbar_wait(full(s), (kb / 2) & 1);
    const uint32_t tile = base + 16384u * s;
    sm90::wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {
      sm90::wgmma_m64k16<__nv_bfloat16, 128>(acc, sm90::desc_k_major_sw128(tile + 32u * kk),
                                             sm90::desc_k_major_sw128(tile + 32u * kk), kb > 0 || kk > 0);
    }
    sm90::wgmma_commit();
    if (mode == 1 && lane == 0) sm90::mbar_arrive(empty(s));
    sm90::wgmma_wait<0>(acc);
    if (mode != 1 && lane == 0) sm90::mbar_arrive(empty(s));
  }
  for (int i = 0; i < 64; ++i) out[(threadIdx.x - 128) * 64 + i] = acc[i];
}

at::Tensor probe_pipeline(const at::Tensor& X_, int64_t mode) {
  at::Tensor X = X_.contiguous();
  TORCH_CHECK_VALUE(X.scalar_type() == at::kBFloat16 && X.dim() == 2 && X.size(0) == 128 && X.size(1) % 64 == 0,
                    "probe_pipeline: X must be (128, 64 nk) bfloat16");
  const uint64_t dims[3] = {static_cast<uint64_t>(X.size(1)), 128, 1};
  const uint64_t strides[2] = {static_cast<uint64_t>(X.size(1)) * 2, static_cast<uint64_t>(X.size(1)) * 256};
  const uint32_t box[3] = {64, 128, 1};
  sm90::TensorMap map = sm90::make_tensor_map_3d<__nv_bfloat16>(X.data_ptr(), dims, strides, box);
  at::Tensor out = at::empty({128, 64}, at::kFloat);
  ST_LAUNCH(dim3(1), dim3(256), 2 * 16384 + 1024 + 64, nullptr, probe_pipeline_kernel)(
      map, static_cast<int>(X.size(1) / 64), static_cast<int>(mode), out.data_ptr<float>());
  return out;
}

// Misuse the Hopper emulation must report (or, for early_read, poison).
__global__ void bug_hopper(int which, float* out) {
  ST_DYNAMIC_SMEM(uint8_t, sm);
  const uint32_t base = (sm90::smem_addr(sm) + 1023u) & ~1023u;
  for (int i = threadIdx.x; i < 20480; i += blockDim.x) sm[i] = 0;
  __syncthreads();
  const uint64_t desc = sm90::desc_k_major_sw128(base);
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 1.f;
  if (which == 0) {  // no wgmma.fence before the first wgmma
    sm90::wgmma_m64k16<__nv_bfloat16, 128>(d, desc, desc, true);
  } else if (which == 1) {  // threads of the warpgroup disagree on the descriptor
    sm90::wgmma_fence();
    sm90::wgmma_m64k16<__nv_bfloat16, 128>(d, desc + (threadIdx.x == 5 ? 2 : 0), desc, true);
  } else if (which == 2) {  // reads the accumulator before wgmma.wait_group
    sm90::wgmma_fence();
    sm90::wgmma_m64k16<__nv_bfloat16, 128>(d, desc, desc, true);
    sm90::wgmma_commit();
    out[threadIdx.x] = d[0];
    sm90::wgmma_wait<0>(d);
    return;
  } else if (which == 3) {  // waits on an mbarrier nobody arrives at
    if (threadIdx.x == 0) sm90::mbar_init(base + 18432, 1);
    __syncthreads();
    sm90::mbar_wait(base + 18432, 0);
  } else if (which == 4) {  // exits without waiting for its wgmma
    sm90::wgmma_fence();
    sm90::wgmma_m64k16<__nv_bfloat16, 128>(d, desc, desc, true);
    sm90::wgmma_commit();
    return;
  }
  sm90::wgmma_fence();
  sm90::wgmma_m64k16<__nv_bfloat16, 128>(d, desc, desc, true);
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>(d);
  out[threadIdx.x] = d[0];
}

at::Tensor run_hopper_bug(const std::string& which) {
  static const std::vector<std::string> names = {"no_fence", "divergent_desc", "early_read", "mbar_deadlock",
                                                 "exit_in_flight"};
  auto it = std::find(names.begin(), names.end(), which);
  TORCH_CHECK_VALUE(it != names.end(), "unknown hopper bug ", which);
  at::Tensor out = at::zeros({128}, at::kFloat);
  ST_LAUNCH(dim3(1), dim3(128), 20480, nullptr, bug_hopper)(static_cast<int>(it - names.begin()),
                                                            out.data_ptr<float>());
  return out;
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
  m.def("muon_lean_pre_(Tensor[] grads, Tensor(a!)[] momenta, Tensor(b!)[] outs, Tensor(c!)[] grad_copies, "
        "Tensor[] mus, int[] mu_index, int[] nesterov, float[] eps) -> ()");
  m.def("muon_lean_update_(Tensor(a!)[] params, Tensor[] updates, Tensor[] lrs, Tensor[] weight_decays, "
        "int[] hyper_index, float[] scales, Tensor? skip, int[] skip_index, Tensor[] row_scales, "
        "Tensor[] col_scales, Tensor[] grads, Tensor? kept, int[] kept_index) -> ()");
  m.def("muon_lean_cautious_count_(Tensor[] updates, Tensor[] grads, Tensor(a!) kept) -> ()");
  m.def("muon_lean_plus_stats_(Tensor[] updates, Tensor(a!)[] row_scales, Tensor(b!)[] col_scales, "
        "float[] eps) -> ()");
  m.def("syrk(Tensor X, float alpha=1.0, float beta=0.0, Tensor? Y=None) -> Tensor");
  m.def("mma_probe(Tensor A, Tensor Bt) -> Tensor");
  m.def("sym_gemm(Tensor X, float alpha=1.0, float beta=0.0, Tensor? C=None, int tile_n=0) -> Tensor");
  m.def("configure(str schedule, int seed) -> ()", &configure);
  m.def("set_sm_count(int n) -> ()", [](int64_t n) { stemu::hopper::sm_count() = static_cast<int>(n); });
  m.def("hopper_smem_base() -> int", []() -> int64_t { return stemu::hopper::kSmemBase; });
  m.def("probe_wgmma(Tensor image, int da, int db, int n, bool bf16, bool scale_d, int repeat, Tensor d_in) -> Tensor",
        [](const at::Tensor& im, int64_t da, int64_t db, int64_t n, bool bf, bool sd, int64_t rep, const at::Tensor& d) {
          return guarded([&] { return probe_wgmma(im, da, db, n, bf, sd, rep, d); });
        });
  m.def("probe_wgmma_groups(Tensor image, int da, int db) -> Tensor",
        [](const at::Tensor& im, int64_t da, int64_t db) { return guarded([&] { return probe_wgmma_groups(im, da, db); }); });
  m.def("probe_tma(Tensor G, int[] box, int[] coords, int swizzle, int dst) -> Tensor",
        [](const at::Tensor& G, std::vector<int64_t> box, std::vector<int64_t> co, int64_t sw, int64_t dst) {
          return guarded([&] { return probe_tma(G, box, co, sw, dst); });
        });
  m.def("probe_mbar(int[] script) -> int[]",
        [](std::vector<int64_t> s) { return guarded([&] { return probe_mbar(s); }); });
  m.def("probe_pipeline(Tensor X, int mode) -> Tensor",
        [](const at::Tensor& X, int64_t mode) { return guarded([&] { return probe_pipeline(X, mode); }); });
  m.def("run_hopper_bug(str which) -> Tensor",
        [](const std::string& w) { return guarded([&] { return run_hopper_bug(w); }); });
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
  m.impl("muon_lean_pre_", [](at::TensorList gr, at::TensorList mo, at::TensorList out, at::TensorList gc,
                              at::TensorList mus, at::IntArrayRef mi, at::IntArrayRef nest,
                              c10::ArrayRef<double> eps) {
    guarded([&] { g::muon_lean_pre_(gr, mo, out, gc, mus, mi, nest, eps); });
  });
  m.impl("muon_lean_update_", [](at::TensorList p, at::TensorList u, at::TensorList lrs, at::TensorList wds,
                                 at::IntArrayRef hi, c10::ArrayRef<double> sc, const std::optional<at::Tensor>& sk,
                                 at::IntArrayRef si, at::TensorList rs, at::TensorList cs, at::TensorList gr,
                                 const std::optional<at::Tensor>& kept, at::IntArrayRef ki) {
    guarded([&] { g::muon_lean_update_(p, u, lrs, wds, hi, sc, sk, si, rs, cs, gr, kept, ki); });
  });
  m.impl("muon_lean_cautious_count_", [](at::TensorList u, at::TensorList gr, const at::Tensor& kept) {
    guarded([&] { g::muon_lean_cautious_count_(u, gr, kept); });
  });
  m.impl("muon_lean_plus_stats_", [](at::TensorList u, at::TensorList rs, at::TensorList cs,
                                     c10::ArrayRef<double> eps) {
    guarded([&] { g::muon_lean_plus_stats_(u, rs, cs, eps); });
  });
  m.impl("syrk", [](const at::Tensor& X, double alpha, double beta, const std::optional<at::Tensor>& Y) {
    return guarded([&] { return g::syrk(X, alpha, beta, Y); });
  });
  m.impl("sym_gemm", [](const at::Tensor& X, double alpha, double beta, const std::optional<at::Tensor>& C,
                        int64_t tile_n) { return guarded([&] { return g::sym_gemm(X, alpha, beta, C, tile_n); }); });
  m.impl("mma_probe", [](const at::Tensor& A, const at::Tensor& Bt) {
    return guarded([&] { return g::mma_probe(A, Bt); });
  });
}

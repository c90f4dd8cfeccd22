// Torch-facing glue for every speedtronic op: argument checks (same messages as
// speedtronic/kernels/ops*.py), dtype grouping, contiguity, scratch allocation, then the launchers of
// launch.h. Included by ops.cpp (the CUDA registrations) AND by the CPU emulation binding
// (tests/kernels/cuda_emulation/binding.cpp), so the emulation tests cover this file too. The includer
// defines st::glue::current_stream().
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "launch.h"

namespace st::glue {

void* current_stream();

inline DType dtype_of(const at::Tensor& t, const char* op, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default:
      TORCH_CHECK_VALUE(false, "speedtronic::", op, ": ", what, " has dtype ", t.scalar_type(),
                        "; the CUDA kernels take float32, float16 or bfloat16 (set "
                        "SPEEDTRONIC_DISABLE_KERNELS=1 to use the PyTorch ops)");
  }
  return DType::F32;
}

// Contiguous stand-ins for tensors the kernels write; copied back by finish().
struct Writeback {
  std::vector<std::pair<at::Tensor, at::Tensor>> pending;
  at::Tensor prepare(const at::Tensor& t) {
    if (t.is_contiguous()) return t;
    at::Tensor c = t.contiguous();
    pending.emplace_back(t, c);
    return c;
  }
  void finish() {
    for (auto& [orig, copy] : pending) orig.copy_(copy);
  }
};

inline void check_pair(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* what,
                       size_t i) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "speedtronic::", op, ": ", what, "[", i, "] is on ",
                    t.device(), " but the first tensor is on ", ref.device());
  TORCH_CHECK_VALUE(t.numel() == ref.numel(), "speedtronic::", op, ": ", what, "[", i, "] has ",
                    t.numel(), " elements, expected ", ref.numel());
  // Paired element by element after .contiguous(): a (6, 4) gradient beside a (4, 6) update
  // was silently matched by flat index, where the PyTorch implementation refuses it.
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "speedtronic::", op, ": ", what, "[", i,
                    "] has shape ", t.sizes(), ", expected ", ref.sizes());
}

inline at::Tensor zeros_i64(int64_t n, const at::Device& dev) {
  return at::zeros({n}, at::TensorOptions().dtype(at::kLong).device(dev));
}

// ---------------------------------------------------------------- cautious_mask_
inline void cautious_mask_(at::TensorList updates, at::TensorList grads, bool rescale) {
  TORCH_CHECK_VALUE(updates.size() == grads.size(), "cautious_mask_: ", updates.size(),
                    " updates but ", grads.size(), " grads");
  const int n = static_cast<int>(updates.size());
  if (n == 0) return;
  const at::Device dev = updates[0].device();
  Writeback wb;
  std::vector<at::Tensor> U(n), G(n);
  for (int i = 0; i < n; ++i) {
    check_pair(updates[i], grads[i], "cautious_mask_", "grads", i);
    TORCH_CHECK_VALUE(updates[i].device() == dev, "cautious_mask_: updates[", i, "] is on ",
                      updates[i].device(), ", updates[0] on ", dev);
    U[i] = wb.prepare(updates[i]);
    G[i] = grads[i].contiguous();
  }
  at::Tensor counts = rescale ? zeros_i64(n, dev) : at::Tensor();
  std::map<std::pair<int, int>, std::vector<int>> groups;
  for (int i = 0; i < n; ++i) {
    groups[{static_cast<int>(dtype_of(U[i], "cautious_mask_", "updates")),
            static_cast<int>(dtype_of(G[i], "cautious_mask_", "grads"))}]
        .push_back(i);
  }
  for (auto& [key, idx] : groups) {
    std::vector<void*> up, gp;
    std::vector<int64_t> numel;
    for (int i : idx) {
      up.push_back(U[i].data_ptr());
      gp.push_back(G[i].data_ptr());
      numel.push_back(U[i].numel());
    }
    MaskArgs a{rescale, rescale ? reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()) : nullptr};
    launch_cautious_mask(static_cast<DType>(key.first), static_cast<DType>(key.second),
                         static_cast<int>(idx.size()), up.data(), gp.data(), numel.data(), idx.data(), a,
                         current_stream());
  }
  wb.finish();
}

// ---------------------------------------------------------------- cautious_adamw_step_
inline void cautious_adamw_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                 at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, int64_t step, bool cautious,
                                 bool cautious_rescale) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                    "cautious_adamw_step_: params, grads, exp_avgs and exp_avg_sqs must have the "
                    "same length");
  TORCH_CHECK_VALUE(step >= 1, "cautious_adamw_step_: step must be >= 1 (1-based), got ", step);
  if (n == 0) return;
  const at::Device dev = params[0].device();
  Writeback wb;
  std::vector<at::Tensor> P(n), G(n), M(n), V(n);
  std::map<std::tuple<int, int, int>, std::vector<int>> groups;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(params[i].device() == dev, "cautious_adamw_step_: params[", i, "] is on ",
                      params[i].device(), ", params[0] on ", dev);
    check_pair(params[i], grads[i], "cautious_adamw_step_", "grads", i);
    check_pair(params[i], exp_avgs[i], "cautious_adamw_step_", "exp_avgs", i);
    check_pair(params[i], exp_avg_sqs[i], "cautious_adamw_step_", "exp_avg_sqs", i);
    const DType dp = dtype_of(params[i], "cautious_adamw_step_", "params");
    const DType dg = dtype_of(grads[i], "cautious_adamw_step_", "grads");
    const DType dm = dtype_of(exp_avgs[i], "cautious_adamw_step_", "exp_avgs");
    const DType dv = dtype_of(exp_avg_sqs[i], "cautious_adamw_step_", "exp_avg_sqs");
    TORCH_CHECK_VALUE(dm == dv && (dm == DType::F32 || dm == dp), "cautious_adamw_step_: ",
                      "exp_avgs[", i, "] and exp_avg_sqs[", i, "] must both be float32 or the "
                      "parameter's dtype, got ", exp_avgs[i].scalar_type(), " and ",
                      exp_avg_sqs[i].scalar_type());
    P[i] = wb.prepare(params[i]);
    G[i] = grads[i].contiguous();
    M[i] = wb.prepare(exp_avgs[i]);
    V[i] = wb.prepare(exp_avg_sqs[i]);
    groups[{static_cast<int>(dp), static_cast<int>(dg), static_cast<int>(dm)}].push_back(static_cast<int>(i));
  }
  const bool rescale = cautious && cautious_rescale;
  at::Tensor counts = rescale ? zeros_i64(static_cast<int64_t>(n), params[0].device()) : at::Tensor();
  AdamArgs a;
  a.w1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.w2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.has_decay = weight_decay != 0.0;
  a.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  a.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  a.cautious = cautious;
  a.mask = MaskArgs{rescale, rescale ? reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()) : nullptr};
  for (auto& [key, idx] : groups) {
    std::vector<void*> lists[4];
    std::vector<int64_t> numel;
    for (int i : idx) {
      lists[0].push_back(P[i].data_ptr());
      lists[1].push_back(G[i].data_ptr());
      lists[2].push_back(M[i].data_ptr());
      lists[3].push_back(V[i].data_ptr());
      numel.push_back(P[i].numel());
    }
    void* const* ptrs[4] = {lists[0].data(), lists[1].data(), lists[2].data(), lists[3].data()};
    launch_adamw(static_cast<DType>(std::get<0>(key)), static_cast<DType>(std::get<1>(key)),
                 static_cast<DType>(std::get<2>(key)), static_cast<int>(idx.size()), ptrs, numel.data(),
                 idx.data(), a, current_stream());
  }
  wb.finish();
}

// ---------------------------------------------------------------- muon_pre_orthogonalize_
inline void check_same_shape(at::TensorList ts, const char* what) {
  TORCH_CHECK_VALUE(!ts.empty(), what, ": needs at least one tensor");
  for (const auto& t : ts) {
    TORCH_CHECK_VALUE(t.dim() == 2 && t.sizes() == ts[0].sizes(), what,
                      ": all tensors must be 2-D with one shape, got ", t.sizes(), " and ", ts[0].sizes());
  }
}

inline at::Tensor muon_pre_orthogonalize_(at::TensorList bufs, at::TensorList grads, double momentum,
                                          bool nesterov, double eps, at::ScalarType out_dtype) {
  check_same_shape(bufs, "muon_pre_orthogonalize_");
  TORCH_CHECK_VALUE(grads.size() == bufs.size(), "muon_pre_orthogonalize_: ", bufs.size(),
                    " buffers but ", grads.size(), " grads");
  const int b = static_cast<int>(bufs.size());
  const int64_t m = bufs[0].size(0), n = bufs[0].size(1);
  at::Tensor out = at::empty({b, m, n}, bufs[0].options().dtype(out_dtype));  // (b, m, n)
  const DType dout = dtype_of(out, "muon_pre_orthogonalize_", "out_dtype");
  Writeback wb;
  std::vector<at::Tensor> B(b), G(b);
  std::map<int, std::vector<int>> groups;
  for (int i = 0; i < b; ++i) {
    TORCH_CHECK_VALUE(bufs[i].scalar_type() == at::kFloat,
                      "muon_pre_orthogonalize_: momentum buffers must be float32, got ", bufs[i].scalar_type());
    check_pair(bufs[i], grads[i], "muon_pre_orthogonalize_", "grads", i);
    check_pair(bufs[0], bufs[i], "muon_pre_orthogonalize_", "momentum_buffers", i);
    B[i] = wb.prepare(bufs[i]);
    G[i] = grads[i].contiguous();
    groups[static_cast<int>(dtype_of(G[i], "muon_pre_orthogonalize_", "grads"))].push_back(i);
  }
  const int64_t numel = m * n;
  if (numel == 0) return out;
  PreArgs a;
  a.momentum = static_cast<float>(momentum);
  a.w = static_cast<float>(1.0 - momentum);
  a.eps = static_cast<float>(eps);
  a.nesterov = nesterov;
  a.numel = numel;
  a.chunks = static_cast<int>((numel + kChunk - 1) / kChunk);
  at::Tensor partial = at::empty({static_cast<int64_t>(b) * a.chunks}, bufs[0].options().dtype(at::kFloat));
  a.partial = partial.data_ptr<float>();
  for (auto& [dg, idx] : groups) {
    std::vector<void*> gp, bp;
    for (int i : idx) {
      gp.push_back(G[i].data_ptr());
      bp.push_back(B[i].data_ptr());
    }
    launch_muon_pre(static_cast<DType>(dg), dout, static_cast<int>(idx.size()), gp.data(), bp.data(),
                    idx.data(), a, out.data_ptr(), current_stream());
  }
  wb.finish();
  return out;
}

// ---------------------------------------------------------------- Muon+ statistics
struct Stats {
  NormStats s;
  at::Tensor rinv, partial, cinv;  // keep the scratch alive until the launches are queued
};

inline Stats make_stats(const at::Tensor& U3, double eps) {  // U3: contiguous (b, m, n)
  Stats st;
  st.s.b = U3.size(0);
  st.s.m = static_cast<int>(U3.size(1));
  st.s.n = static_cast<int>(U3.size(2));
  st.s.eps = static_cast<float>(eps);
  plan_strips(st.s);
  auto opts = U3.options().dtype(at::kFloat);
  st.rinv = at::empty({st.s.b * st.s.m}, opts);
  st.partial = at::empty({st.s.b * st.s.strips * st.s.n}, opts);
  st.cinv = at::empty({st.s.b * st.s.n}, opts);
  st.s.rinv = st.rinv.data_ptr<float>();
  st.s.partial = st.partial.data_ptr<float>();
  st.s.cinv = st.cinv.data_ptr<float>();
  return st;
}

inline at::Tensor muon_plus_normalize(const at::Tensor& U, double eps) {
  TORCH_CHECK_VALUE((U.dim() == 2 || U.dim() == 3) && U.is_floating_point(),
                    "muon_plus_normalize expects a floating (m, n) or (b, m, n) tensor, got ",
                    U.scalar_type(), " ", U.sizes());
  if (U.scalar_type() == at::kDouble) {  // no fp64 kernel: the reference math in ATen
    at::Tensor rows = U.square().sum(-1, true).add_(eps).rsqrt_();
    at::Tensor out = U * rows;
    at::Tensor cols = out.square().sum(-2, true).add_(eps).rsqrt_();
    return out.mul_(cols);
  }
  const DType dt = dtype_of(U, "muon_plus_normalize", "U");
  at::Tensor U3 = (U.dim() == 3 ? U : U.unsqueeze(0)).contiguous();  // (b, m, n)
  at::Tensor out = at::empty_like(U3);
  if (U3.numel() > 0) {
    Stats st = make_stats(U3, eps);
    launch_muon_plus_normalize(dt, U3.data_ptr(), out.data_ptr(), st.s, current_stream());
  }
  return U.dim() == 3 ? out : out.squeeze(0);
}

// ---------------------------------------------------------------- muon_post_update_
inline void muon_post_update_(at::TensorList params, const at::Tensor& orthogonalized, at::TensorList grads,
                              double lr, double weight_decay, double lr_scale, bool muon_plus,
                              double norm_eps, bool cautious, bool cautious_rescale) {
  TORCH_CHECK_VALUE(orthogonalized.dim() == 3 && orthogonalized.size(0) == static_cast<int64_t>(params.size()),
                    "muon_post_update_: orthogonalized must be (b, m, n) with b=", params.size(),
                    ", got ", orthogonalized.sizes());
  TORCH_CHECK_VALUE(grads.size() == params.size(), "muon_post_update_: ", params.size(), " params but ",
                    grads.size(), " grads");
  const int b = static_cast<int>(params.size());
  if (b == 0) return;
  const at::Tensor O = orthogonalized.contiguous();  // (b, m, n)
  const DType dout = dtype_of(O, "muon_post_update_", "orthogonalized");
  const int64_t numel = O.size(1) * O.size(2);
  Writeback wb;
  std::vector<at::Tensor> P(b), G(b);
  std::map<std::pair<int, int>, std::vector<int>> groups;
  for (int i = 0; i < b; ++i) {
    TORCH_CHECK_VALUE(params[i].numel() == numel && params[i].device() == O.device(), "muon_post_update_: params[",
                      i, "] (", params[i].sizes(), " on ", params[i].device(), ") does not match orthogonalized[", i,
                      "] (", O.sizes().slice(1), " on ", O.device(), ")");
    check_pair(params[i], grads[i], "muon_post_update_", "grads", i);
    P[i] = wb.prepare(params[i]);
    G[i] = grads[i].contiguous();
    groups[{static_cast<int>(dtype_of(P[i], "muon_post_update_", "params")),
            static_cast<int>(dtype_of(G[i], "muon_post_update_", "grads"))}]
        .push_back(i);
  }
  if (numel == 0) return;
  PostArgs a;
  a.n = static_cast<int>(O.size(2));
  a.numel = numel;
  a.chunks = static_cast<int>((numel + kChunk - 1) / kChunk);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.alpha = static_cast<float>(-lr * lr_scale);
  a.has_decay = weight_decay != 0.0;
  a.muon_plus = muon_plus;
  a.cautious = cautious;
  a.rescale = cautious && cautious_rescale;
  Stats st;
  if (muon_plus) {
    st = make_stats(O, norm_eps);
    launch_muon_plus_stats(dout, O.data_ptr(), st.s, current_stream());
  }
  a.stats = st.s;
  at::Tensor counts = a.rescale ? zeros_i64(b, O.device()) : at::Tensor();
  a.counts = a.rescale ? reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()) : nullptr;
  for (auto& [key, idx] : groups) {
    std::vector<void*> pp, gp;
    for (int i : idx) {
      pp.push_back(P[i].data_ptr());
      gp.push_back(G[i].data_ptr());
    }
    launch_muon_post(static_cast<DType>(key.first), dout, static_cast<DType>(key.second),
                     static_cast<int>(idx.size()), pp.data(), gp.data(), idx.data(), O.data_ptr(), a,
                     current_stream());
  }
  wb.finish();
}

// ---------------------------------------------------------------- lean step passes
inline void check_hyper(at::TensorList hyper, const at::Tensor& ref, const char* op, const char* what) {
  for (size_t k = 0; k < hyper.size(); ++k) {
    TORCH_CHECK_VALUE(hyper[k].dim() == 0 && hyper[k].scalar_type() == at::kFloat && hyper[k].device() == ref.device(),
                      "speedtronic::", op, ": ", what, "[", k, "] must be a 0-d float32 tensor on ", ref.device(),
                      ", got ", hyper[k].scalar_type(), " ", hyper[k].sizes(), " on ", hyper[k].device());
  }
}

inline void check_index(int64_t v, size_t size, const char* op, const char* what, size_t i, bool allow_none) {
  TORCH_CHECK_VALUE((allow_none && v == -1) || (v >= 0 && v < static_cast<int64_t>(size)), "speedtronic::", op,
                    ": ", what, "[", i, "] = ", v, " is out of range for ", size, " entries");
}

inline void check_dense(const at::Tensor& t, const at::Tensor& like, const char* op, const char* what, size_t i) {
  TORCH_CHECK_VALUE(t.sizes() == like.sizes() && t.is_contiguous() && t.device() == like.device(), "speedtronic::",
                    op, ": ", what, "[", i, "] must be a contiguous ", like.sizes(), " tensor on ", like.device(),
                    ", got ", t.sizes(), (t.is_contiguous() ? "" : " (strided)"), " on ", t.device());
}

inline void muon_lean_pre_(at::TensorList grads, at::TensorList momenta, at::TensorList outs,
                           at::TensorList grad_copies, at::TensorList mus, at::IntArrayRef mu_index,
                           at::IntArrayRef nesterov, c10::ArrayRef<double> eps) {
  const char* op = "muon_lean_pre_";
  const size_t n = grads.size();
  TORCH_CHECK_VALUE(momenta.size() == n && outs.size() == n && mu_index.size() == n && nesterov.size() == n &&
                        eps.size() == n && (grad_copies.empty() || grad_copies.size() == n),
                    "speedtronic::muon_lean_pre_: grads, momenta, outs, mu_index, nesterov, eps (and grad_copies "
                    "unless empty) must have one entry per matrix; got ", n, ", ", momenta.size(), ", ",
                    outs.size(), ", ", mu_index.size(), ", ", nesterov.size(), ", ", eps.size(), " (",
                    grad_copies.size(), ")");
  if (n == 0) return;
  check_hyper(mus, grads[0], op, "mus");
  std::map<std::pair<int, int>, std::vector<LeanMat>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(g.dim() == 2 && g.device() == grads[0].device(), "speedtronic::muon_lean_pre_: grads[", i,
                      "] must be 2-D on ", grads[0].device(), ", got ", g.sizes(), " on ", g.device());
    TORCH_CHECK_VALUE(momenta[i].scalar_type() == at::kFloat,
                      "speedtronic::muon_lean_pre_: momenta must be float32, got ", momenta[i].scalar_type());
    check_dense(momenta[i], g, op, "momenta", i);
    check_dense(outs[i], g, op, "outs", i);
    if (!grad_copies.empty()) {
      check_dense(grad_copies[i], g, op, "grad_copies", i);
      TORCH_CHECK_VALUE(grad_copies[i].scalar_type() == at::kFloat,
                        "speedtronic::muon_lean_pre_: grad_copies must be float32");
    }
    check_index(mu_index[i], mus.size(), op, "mu_index", i, false);
    TORCH_CHECK_VALUE(g.size(0) < INT_MAX && g.size(1) < INT_MAX, "speedtronic::muon_lean_pre_: matrix too large");
    LeanMat mt{};
    mt.src = g.data_ptr();
    mt.src_si = g.stride(0);
    mt.src_sj = g.stride(1);
    mt.mom = momenta[i].data_ptr<float>();
    mt.out = outs[i].data_ptr();
    mt.grad_copy = grad_copies.empty() ? nullptr : grad_copies[i].data_ptr<float>();
    mt.h0 = mus[mu_index[i]].data_ptr<float>();
    mt.scale = static_cast<float>(eps[i]);
    mt.rows = static_cast<int>(g.size(0));
    mt.cols = static_cast<int>(g.size(1));
    mt.nesterov = nesterov[i] != 0;
    groups[{static_cast<int>(dtype_of(g, op, "grads")), static_cast<int>(dtype_of(outs[i], op, "outs"))}]
        .push_back(mt);
  }
  for (auto& [key, mats] : groups) {
    const int count = static_cast<int>(mats.size());
    at::Tensor partial = at::empty({lean_pre_partials(mats.data(), count)}, grads[0].options().dtype(at::kFloat));
    launch_lean_pre(static_cast<DType>(key.first), static_cast<DType>(key.second), mats.data(), count,
                    partial.data_ptr<float>(), current_stream());
  }
}

// A Muon+ scale vector: 1-D, contiguous fp32 of `len` entries on `ref`'s device.
inline void check_scale(const at::Tensor& s, int64_t len, const at::Tensor& ref, const char* op, const char* what,
                        size_t i) {
  TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == len && s.is_contiguous() && s.scalar_type() == at::kFloat &&
                        s.device() == ref.device(),
                    "speedtronic::", op, ": ", what, "[", i, "] must be a contiguous float32 tensor of ", len,
                    " entries on ", ref.device(), ", got ", s.scalar_type(), " ", s.sizes(), " on ", s.device());
}

inline void muon_lean_plus_stats_(at::TensorList updates, at::TensorList row_scales, at::TensorList col_scales,
                                  c10::ArrayRef<double> eps) {
  const char* op = "muon_lean_plus_stats_";
  const size_t n = updates.size();
  TORCH_CHECK_VALUE(row_scales.size() == n && col_scales.size() == n && eps.size() == n,
                    "speedtronic::muon_lean_plus_stats_: updates, row_scales, col_scales and eps must have one "
                    "entry per matrix; got ", n, ", ", row_scales.size(), ", ", col_scales.size(), ", ", eps.size());
  if (n == 0) return;
  std::map<int, std::vector<LeanMat>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& u = updates[i];
    TORCH_CHECK_VALUE(u.dim() == 2 && u.device() == updates[0].device(), "speedtronic::muon_lean_plus_stats_: updates[",
                      i, "] must be 2-D on ", updates[0].device(), ", got ", u.sizes(), " on ", u.device());
    TORCH_CHECK_VALUE(u.size(0) < INT_MAX && u.size(1) < INT_MAX, "speedtronic::muon_lean_plus_stats_: matrix too large");
    check_scale(row_scales[i], u.size(0), u, op, "row_scales", i);
    check_scale(col_scales[i], u.size(1), u, op, "col_scales", i);
    LeanMat mt{};
    mt.src = u.data_ptr();
    mt.src_si = u.stride(0);
    mt.src_sj = u.stride(1);
    mt.row_scale = row_scales[i].data_ptr<float>();
    mt.col_scale = col_scales[i].data_ptr<float>();
    mt.scale = static_cast<float>(eps[i]);
    mt.rows = static_cast<int>(u.size(0));
    mt.cols = static_cast<int>(u.size(1));
    groups[static_cast<int>(dtype_of(u, op, "updates"))].push_back(mt);
  }
  for (auto& [key, mats] : groups) {
    const int count = static_cast<int>(mats.size());
    at::Tensor partial = at::empty({lean_plus_stat_partials(mats.data(), count)}, updates[0].options().dtype(at::kFloat));
    launch_lean_plus_stats(static_cast<DType>(key), mats.data(), count, partial.data_ptr<float>(), current_stream());
  }
}

// A cautious gradient: fp32, the update's shape and strides (the kernels read both through one
// pair of strides); an empty tensor means no mask for that matrix.
inline bool check_cautious_grad(const at::Tensor& g, const at::Tensor& u, const char* op, size_t i) {
  if (g.numel() == 0) return false;
  TORCH_CHECK_VALUE(g.scalar_type() == at::kFloat && g.sizes() == u.sizes() && g.strides() == u.strides() &&
                        g.device() == u.device(),
                    "speedtronic::", op, ": grads[", i, "] must be float32 with updates[", i, "]'s shape ",
                    u.sizes(), " and strides ", u.strides(), " on ", u.device(), ", got ", g.scalar_type(), " ",
                    g.sizes(), " strides ", g.strides(), " on ", g.device());
  return true;
}

inline void check_kept(const at::Tensor& kept, const at::Tensor& ref, const char* op) {
  TORCH_CHECK_VALUE(kept.dim() == 1 && kept.scalar_type() == at::kLong && kept.is_contiguous() &&
                        kept.device() == ref.device(),
                    "speedtronic::", op, ": kept must be a contiguous 1-D int64 tensor on ", ref.device(),
                    ", got ", kept.scalar_type(), " ", kept.sizes(), " on ", kept.device());
}

inline void muon_lean_cautious_count_(at::TensorList updates, at::TensorList grads, const at::Tensor& kept) {
  const char* op = "muon_lean_cautious_count_";
  const size_t n = updates.size();
  TORCH_CHECK_VALUE(grads.size() == n, "speedtronic::muon_lean_cautious_count_: ", n, " updates but ",
                    grads.size(), " grads");
  if (n == 0) return;
  check_kept(kept, updates[0], op);
  TORCH_CHECK_VALUE(kept.size(0) == static_cast<int64_t>(n), "speedtronic::muon_lean_cautious_count_: kept has ",
                    kept.size(0), " entries for ", n, " matrices");
  kept.zero_();
  auto* counts = reinterpret_cast<unsigned long long*>(kept.data_ptr<int64_t>());
  std::map<int, std::vector<LeanMat>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& u = updates[i];
    TORCH_CHECK_VALUE(u.dim() == 2 && u.device() == updates[0].device(), "speedtronic::muon_lean_cautious_count_: updates[",
                      i, "] must be 2-D on ", updates[0].device(), ", got ", u.sizes(), " on ", u.device());
    TORCH_CHECK_VALUE(u.size(0) < INT_MAX && u.size(1) < INT_MAX, "speedtronic::muon_lean_cautious_count_: matrix too large");
    TORCH_CHECK_VALUE(check_cautious_grad(grads[i], u, op, i) || u.numel() == 0,
                      "speedtronic::muon_lean_cautious_count_: grads[", i, "] is empty");
    LeanMat mt{};
    mt.src = u.data_ptr();
    mt.src_si = u.stride(0);
    mt.src_sj = u.stride(1);
    mt.cgrad = grads[i].data_ptr<float>();
    mt.kept = counts + i;
    mt.rows = static_cast<int>(u.size(0));
    mt.cols = static_cast<int>(u.size(1));
    groups[static_cast<int>(dtype_of(u, op, "updates"))].push_back(mt);
  }
  for (auto& [key, mats] : groups) {
    launch_lean_cautious_count(static_cast<DType>(key), mats.data(), static_cast<int>(mats.size()), current_stream());
  }
}

inline void muon_lean_update_(at::TensorList params, at::TensorList updates, at::TensorList lrs,
                              at::TensorList weight_decays, at::IntArrayRef hyper_index, c10::ArrayRef<double> scales,
                              const std::optional<at::Tensor>& skip, at::IntArrayRef skip_index,
                              at::TensorList row_scales, at::TensorList col_scales, at::TensorList grads,
                              const std::optional<at::Tensor>& kept, at::IntArrayRef kept_index) {
  const char* op = "muon_lean_update_";
  const size_t n = params.size();
  TORCH_CHECK_VALUE(updates.size() == n && hyper_index.size() == n && scales.size() == n && skip_index.size() == n,
                    "speedtronic::muon_lean_update_: params, updates, hyper_index, scales and skip_index must have "
                    "one entry per matrix; got ", n, ", ", updates.size(), ", ", hyper_index.size(), ", ",
                    scales.size(), ", ", skip_index.size());
  TORCH_CHECK_VALUE(row_scales.size() == col_scales.size() && (row_scales.empty() || row_scales.size() == n),
                    "speedtronic::muon_lean_update_: row_scales and col_scales must both be empty or have one "
                    "entry per matrix; got ", row_scales.size(), " and ", col_scales.size(), " for ", n);
  TORCH_CHECK_VALUE((grads.empty() || grads.size() == n) && (kept_index.empty() || kept_index.size() == n),
                    "speedtronic::muon_lean_update_: grads and kept_index must be empty or have one entry per "
                    "matrix; got ", grads.size(), " and ", kept_index.size(), " for ", n);
  const bool has_kept = kept.has_value() && kept->defined();
  TORCH_CHECK_VALUE(lrs.size() == weight_decays.size(), "speedtronic::muon_lean_update_: ", lrs.size(),
                    " lrs but ", weight_decays.size(), " weight_decays");
  if (n == 0) return;
  check_hyper(lrs, params[0], op, "lrs");
  check_hyper(weight_decays, params[0], op, "weight_decays");
  const bool has_skip = skip.has_value() && skip->defined();
  if (has_skip) {
    TORCH_CHECK_VALUE(skip->dim() == 1 && skip->scalar_type() == at::kBool && skip->device() == params[0].device(),
                      "speedtronic::muon_lean_update_: skip must be a 1-D bool tensor on ", params[0].device());
  }
  std::map<std::pair<int, int>, std::vector<LeanMat>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& u = updates[i];
    TORCH_CHECK_VALUE(p.dim() == 2 && u.sizes() == p.sizes() && u.device() == p.device() &&
                          p.device() == params[0].device(),
                      "speedtronic::muon_lean_update_: updates[", i, "] must match params[", i, "] (", p.sizes(),
                      " on ", p.device(), "), got ", u.sizes(), " on ", u.device());
    check_index(hyper_index[i], lrs.size(), op, "hyper_index", i, false);
    check_index(skip_index[i], has_skip ? static_cast<size_t>(skip->size(0)) : 0, op, "skip_index", i, true);
    TORCH_CHECK_VALUE(p.size(0) < INT_MAX && p.size(1) < INT_MAX, "speedtronic::muon_lean_update_: matrix too large");
    // The kernel writes along j: make j the parameter's unit-stride axis (a tall parameter stored
    // transposed, p.mT, is walked in its memory order; the update then reads through the tile).
    const bool swap = p.stride(0) == 1 && p.stride(1) != 1;
    const int a = swap ? 1 : 0, b = swap ? 0 : 1;
    LeanMat mt{};
    mt.src = u.data_ptr();
    mt.src_si = u.stride(a);
    mt.src_sj = u.stride(b);
    mt.dst = p.data_ptr();
    mt.dst_si = p.stride(a);
    mt.dst_sj = p.stride(b);
    mt.h0 = lrs[hyper_index[i]].data_ptr<float>();
    mt.h1 = weight_decays[hyper_index[i]].data_ptr<float>();
    mt.skip = skip_index[i] >= 0 ? skip->data_ptr<bool>() + skip_index[i] * skip->stride(0) : nullptr;
    mt.scale = static_cast<float>(scales[i]);
    mt.rows = static_cast<int>(p.size(a));
    mt.cols = static_cast<int>(p.size(b));
    if (!row_scales.empty() && (row_scales[i].numel() > 0 || col_scales[i].numel() > 0)) {
      // Muon+ (a pair of empty tensors: none for this matrix); the scales are indexed by the
      // update's (row, col), so they swap with the walk
      check_scale(row_scales[i], u.size(0), u, op, "row_scales", i);
      check_scale(col_scales[i], u.size(1), u, op, "col_scales", i);
      mt.row_scale = row_scales[i].data_ptr<float>();
      mt.col_scale = col_scales[i].data_ptr<float>();
      mt.scale_swap = swap;
    }
    if (!grads.empty() && check_cautious_grad(grads[i], u, op, i)) {  // the mask (same walk as u)
      mt.cgrad = grads[i].data_ptr<float>();
      const int64_t k = kept_index.empty() ? -1 : kept_index[i];
      if (k >= 0) {
        TORCH_CHECK_VALUE(has_kept, "speedtronic::muon_lean_update_: kept_index[", i, "] = ", k, " but no kept");
        check_kept(*kept, p, op);
        check_index(k, static_cast<size_t>(kept->size(0)), op, "kept_index", i, false);
        mt.kept = reinterpret_cast<unsigned long long*>(kept->data_ptr<int64_t>()) + k;
      }
    }
    groups[{static_cast<int>(dtype_of(p, op, "params")), static_cast<int>(dtype_of(u, op, "updates"))}]
        .push_back(mt);
  }
  for (auto& [key, mats] : groups) {
    launch_lean_update(static_cast<DType>(key.first), static_cast<DType>(key.second), mats.data(),
                       static_cast<int>(mats.size()), current_stream());
  }
}

// ---------------------------------------------------------------- symmetric product
// out = alpha X X^T + beta Y for X (m, k) or (b, m, k) in float16/bfloat16.
inline at::Tensor syrk(const at::Tensor& X_, double alpha, double beta, const std::optional<at::Tensor>& Y_) {
  TORCH_CHECK_VALUE(X_.dim() == 2 || X_.dim() == 3, "syrk: X must be (m, k) or (b, m, k), got ", X_.sizes());
  TORCH_CHECK_VALUE(X_.scalar_type() == at::kHalf || X_.scalar_type() == at::kBFloat16,
                    "syrk: X must be float16 or bfloat16, got ", X_.scalar_type());
  at::Tensor X = X_.dim() == 3 ? X_ : X_.unsqueeze(0);
  if (X.stride(-1) != 1 || X.stride(-2) < X.size(-1)) X = X.contiguous();
  const int64_t b = X.size(0), m = X.size(1), k = X.size(2);
  TORCH_CHECK_VALUE(m < INT_MAX && k < INT_MAX && X.stride(1) < INT_MAX, "syrk: matrix too large");
  at::Tensor out = at::empty({b, m, m}, X.options());  // (b, m, m)
  at::Tensor Y;
  if (Y_.has_value() && Y_->defined()) {
    Y = (Y_->dim() == 3 ? *Y_ : Y_->unsqueeze(0)).contiguous();
    TORCH_CHECK_VALUE(Y.sizes() == out.sizes() && Y.scalar_type() == X.scalar_type() && Y.device() == X.device(),
                      "syrk: Y must be ", out.sizes(), " ", X.scalar_type(), ", got ", Y.sizes(), " ", Y.scalar_type());
  }
  SyrkArgs a{};
  a.X = X.data_ptr();
  a.out = out.data_ptr();
  a.Y = Y.defined() ? Y.data_ptr() : nullptr;
  a.batch = b;
  a.m = static_cast<int>(m);
  a.k = static_cast<int>(k);
  a.x_bs = X.stride(0);
  a.out_bs = m * m;
  a.y_bs = m * m;
  a.ldx = static_cast<int>(X.stride(1));
  a.ldo = static_cast<int>(m);
  a.ldy = static_cast<int>(m);
  a.alpha = static_cast<float>(alpha);
  a.beta = static_cast<float>(beta);
  launch_syrk(X.scalar_type() == at::kHalf ? DType::F16 : DType::BF16, a, current_stream());
  return X_.dim() == 3 ? out : out.squeeze(0);
}

// out = alpha X X^T + beta C on Hopper (TMA + wgmma), C symmetric (only its lower triangle is
// read). X is copied only when the copy engine cannot read it as given (inner stride != 1, row
// or batch stride not a multiple of 8 elements, misaligned base), and k is zero-padded to a
// multiple of 8 (X X^T does not change).
inline at::Tensor sym_gemm(const at::Tensor& X_, double alpha, double beta, const std::optional<at::Tensor>& C_,
                           int64_t tile_n) {
  TORCH_CHECK_VALUE(X_.dim() == 2 || X_.dim() == 3, "sym_gemm: X must be (m, k) or (b, m, k), got ", X_.sizes());
  TORCH_CHECK_VALUE(X_.scalar_type() == at::kHalf || X_.scalar_type() == at::kBFloat16,
                    "sym_gemm: X must be float16 or bfloat16, got ", X_.scalar_type());
  TORCH_CHECK_VALUE(tile_n == 0 || tile_n == 128 || tile_n == 256, "sym_gemm: tile_n must be 0, 128 or 256");
  TORCH_CHECK(sym_gemm_sm90_device_ok(), "sym_gemm: the TMA + wgmma kernel needs an sm_90 (Hopper) GPU");
  at::Tensor X = X_.dim() == 3 ? X_ : X_.unsqueeze(0);
  const int64_t b = X.size(0), m = X.size(1);
  int64_t k = X.size(2);
  if (k % 8) {
    X = at::constant_pad_nd(X, {0, 8 - k % 8});
    k = X.size(2);
  }
  auto readable = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) % 8 == 0 && (t.size(0) == 1 || t.stride(0) % 8 == 0) &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(1) >= t.size(2);
  };
  if (!readable(X)) X = X.contiguous();
  TORCH_CHECK_VALUE(m < INT_MAX && k < INT_MAX && X.stride(1) < INT_MAX, "sym_gemm: matrix too large");
  at::Tensor out = at::empty({b, m, m}, X.options());
  at::Tensor C;
  if (C_.has_value() && C_->defined()) {
    C = (C_->dim() == 3 ? *C_ : C_->unsqueeze(0)).contiguous();
    TORCH_CHECK_VALUE(C.sizes() == out.sizes() && C.scalar_type() == X.scalar_type() && C.device() == X.device(),
                      "sym_gemm: C must be ", out.sizes(), " ", X.scalar_type(), ", got ", C.sizes(), " ",
                      C.scalar_type());
  }
  if (b == 0 || m == 0) return X_.dim() == 3 ? out : out.squeeze(0);
  if (k == 0) {
    out = C.defined() ? (C.to(at::kFloat) * beta).to(X.scalar_type()) : at::zeros_like(out);
    return X_.dim() == 3 ? out : out.squeeze(0);
  }
  SymGemmArgs a{};
  a.X = X.data_ptr();
  a.out = out.data_ptr();
  a.C = C.defined() ? C.data_ptr() : nullptr;
  a.batch = b;
  a.m = static_cast<int>(m);
  a.k = static_cast<int>(k);
  a.x_bs = X.stride(0);
  a.out_bs = m * m;
  a.c_bs = m * m;
  a.ldx = static_cast<int>(X.stride(1));
  a.ldo = static_cast<int>(m);
  a.ldc = static_cast<int>(m);
  a.alpha = static_cast<float>(alpha);
  a.beta = static_cast<float>(beta);
  a.tile_n = static_cast<int>(tile_n);
  launch_sym_gemm_sm90(X.scalar_type() == at::kHalf ? DType::F16 : DType::BF16, a, current_stream());
  return X_.dim() == 3 ? out : out.squeeze(0);
}

// D (16, 8) fp32 = A (16, 16) @ Bt (8, 16)^T through one mma.sync: the layout probe.
inline at::Tensor mma_probe(const at::Tensor& A, const at::Tensor& Bt) {
  TORCH_CHECK_VALUE(A.sizes() == at::IntArrayRef({16, 16}) && Bt.sizes() == at::IntArrayRef({8, 16}) &&
                        A.scalar_type() == Bt.scalar_type(),
                    "mma_probe: A must be (16, 16) and Bt (8, 16), same dtype");
  at::Tensor D = at::empty({16, 8}, A.options().dtype(at::kFloat));
  launch_mma_probe(dtype_of(A, "mma_probe", "A"), A.contiguous().data_ptr(), Bt.contiguous().data_ptr(),
                   D.data_ptr<float>(), current_stream());
  return D;
}

}  // namespace st::glue

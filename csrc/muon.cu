// Launchers for csrc/kernels/muon.cuh (Muon pre/post passes, Muon+ normalization).
#include "kernels/muon.cuh"
#include "kernels/muon_lean.cuh"
#include "launch.h"

namespace st {

void launch_muon_pre(DType g, DType out, int b, void* const* grads, void* const* bufs, const int* ids,
                     PreArgs a, void* out_ptr, void* stream) {
  ST_DISPATCH(g, G, ST_DISPATCH(out, O, run_muon_pre<G, O>(b, grads, bufs, ids, a, static_cast<O*>(out_ptr), static_cast<Stream>(stream))));
}

void launch_muon_plus_normalize(DType t, const void* U, void* out, NormStats s, void* stream) {
  ST_DISPATCH(t, T, run_muon_plus_normalize<T>(static_cast<const T*>(U), static_cast<T*>(out), s, static_cast<Stream>(stream)));
}

void launch_muon_plus_stats(DType t, const void* U, NormStats s, void* stream) {
  ST_DISPATCH(t, T, run_muon_plus_stats<T>(static_cast<const T*>(U), s, static_cast<Stream>(stream)));
}

void launch_muon_post(DType p, DType o, DType g, int b, void* const* params, void* const* grads,
                      const int* ids, const void* orth, PostArgs a, void* stream) {
  ST_DISPATCH(p, P, ST_DISPATCH(o, O, ST_DISPATCH(g, G, run_muon_post<P, O, G>(b, params, grads, ids, static_cast<const O*>(orth), a, static_cast<Stream>(stream)))));
}

void launch_lean_pre(DType g, DType out, const LeanMat* mats, int n, float* partial, void* stream) {
  ST_DISPATCH(g, G, ST_DISPATCH(out, X, run_lean_pre<G, X>(mats, n, partial, static_cast<Stream>(stream))));
}

int64_t lean_pre_partials(const LeanMat* mats, int n) { return lean_partials(mats, n); }

void launch_lean_plus_stats(DType u, const LeanMat* mats, int n, float* partial, void* stream) {
  ST_DISPATCH(u, U, run_lean_plus_stats<U>(mats, n, partial, static_cast<Stream>(stream)));
}

int64_t lean_plus_stat_partials(LeanMat* mats, int n) { return lean_plus_partials(mats, n); }

void launch_lean_cautious_count(DType u, const LeanMat* mats, int n, void* stream) {
  ST_DISPATCH(u, U, run_lean_cautious_count<U>(mats, n, static_cast<Stream>(stream)));
}

void launch_lean_update(DType p, DType u, const LeanMat* mats, int n, void* stream) {
  ST_DISPATCH(p, P, ST_DISPATCH(u, U, run_lean_update<P, U>(mats, n, static_cast<Stream>(stream))));
}

}  // namespace st

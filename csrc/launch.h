// Host entry points of the CUDA kernels: plain C++ (no torch, no CUDA headers), so the torch
// glue (ops_impl.h) compiles with the host compiler and the launchers (*.cu) never include
// torch/extension.h. `stream` is a cudaStream_t (a void* in the CPU emulation).
#pragma once
#include <cstdint>

#include "kernels/args.h"

namespace st {

void launch_cautious_mask(DType u, DType g, int n, void* const* u_ptrs, void* const* g_ptrs,
                          const int64_t* numel, const int* ids, MaskArgs a, void* stream);

// ptrs: params, grads, exp_avgs, exp_avg_sqs (each n long); exp_avg and exp_avg_sq share `s`.
void launch_adamw(DType p, DType g, DType s, int n, void* const* const* ptrs, const int64_t* numel,
                  const int* ids, AdamArgs a, void* stream);

// ids: each matrix's slot in the (B, m, n) output (lets the glue group mixed dtypes).
void launch_muon_pre(DType g, DType out, int b, void* const* grads, void* const* bufs, const int* ids,
                     PreArgs a, void* out_ptr, void* stream);

void launch_muon_plus_normalize(DType t, const void* U, void* out, NormStats s, void* stream);
void launch_muon_plus_stats(DType t, const void* U, NormStats s, void* stream);

// ids: each param's slot in the (B, m, n) `orth` batch; Muon+ stats must be computed first.
void launch_muon_post(DType p, DType o, DType g, int b, void* const* params, void* const* grads,
                      const int* ids, const void* orth, PostArgs a, void* stream);

// The lean step's passes over `mats[0, n)` of one dtype combination (kernels/muon_lean.cuh):
// pre = momentum, Nesterov, Frobenius normalization into each matrix's `out` (2 launches per
// table of kLeanMats); `partial` holds lean_pre_partials(mats, n) floats. update = decay and
// the parameter update (1 launch per table).
void launch_lean_pre(DType g, DType out, const LeanMat* mats, int n, float* partial, void* stream);
int64_t lean_pre_partials(const LeanMat* mats, int n);
void launch_lean_update(DType p, DType u, const LeanMat* mats, int n, void* stream);
// Muon+ statistics of `mats[0, n)` (src: the update direction, logical orientation, dtype u) into
// each matrix's row_scale / col_scale (4 launches per table); `partial` holds
// lean_plus_partials(mats, n) floats, which also places each matrix's partials (stat_start).
void launch_lean_plus_stats(DType u, const LeanMat* mats, int n, float* partial, void* stream);
int64_t lean_plus_stat_partials(LeanMat* mats, int n);
// Cautious kept counts (src: the update direction, dtype u; cgrad: fp32 with src's strides) added
// to each matrix's `kept` (1 launch per table).
void launch_lean_cautious_count(DType u, const LeanMat* mats, int n, void* stream);

// t must be F16 or BF16.
void launch_syrk(DType t, SyrkArgs a, void* stream);
void launch_mma_probe(DType t, const void* A, const void* Bt, float* D, void* stream);

// Hopper TMA + wgmma symmetric GEMM (sym_gemm_sm90.cu, built for sm_90a only); t F16 or BF16.
// usable: the copy engine can read X as laid out. device_ok: the current GPU is sm_90.
void launch_sym_gemm_sm90(DType t, SymGemmArgs a, void* stream);
bool sym_gemm_sm90_usable(const SymGemmArgs& a);
int sym_gemm_sm90_device_ok();

// Architectures compiled into this binary ("800,900"; empty in the emulation).
const char* compiled_arch_list();

}  // namespace st

// Dispatch a DType onto a C++ element type named T inside the body.
#define ST_DISPATCH(dt, T, ...)                   \
  switch (dt) {                                   \
    case ::st::DType::F32: {                      \
      using T = float;                            \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
    case ::st::DType::F16: {                      \
      using T = __half;                           \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
    case ::st::DType::BF16: {                     \
      using T = __nv_bfloat16;                    \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
  }

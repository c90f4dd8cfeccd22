// Launchers for csrc/kernels/elementwise.cuh (cautious mask, fused AdamW). Thin on purpose: no
// torch headers here, so this file compiles in seconds.
#include "kernels/elementwise.cuh"
#include "launch.h"

namespace st {

void launch_cautious_mask(DType u, DType g, int n, void* const* u_ptrs, void* const* g_ptrs,
                          const int64_t* numel, const int* ids, MaskArgs a, void* stream) {
  void* const* ptrs[2] = {u_ptrs, g_ptrs};
  ST_DISPATCH(u, U, ST_DISPATCH(g, G, run_cautious_mask<U, G>(n, ptrs, numel, ids, a, static_cast<Stream>(stream))));
}

void launch_adamw(DType p, DType g, DType s, int n, void* const* const* ptrs, const int64_t* numel,
                  const int* ids, AdamArgs a, void* stream) {
  // State is fp32 or the parameter's dtype (what torch.optim.AdamW creates); anything else is
  // converted by the glue before it gets here.
  const bool state_f32 = s == DType::F32;
  ST_DISPATCH(p, P, ST_DISPATCH(g, G, {
    if (state_f32) {
      run_adamw<P, G, float>(n, ptrs, numel, ids, a, static_cast<Stream>(stream));
    } else {
      run_adamw<P, G, P>(n, ptrs, numel, ids, a, static_cast<Stream>(stream));
    }
  }));
}

}  // namespace st

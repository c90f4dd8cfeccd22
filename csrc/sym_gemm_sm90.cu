// Launcher for csrc/kernels/sym_gemm_sm90.cuh (Hopper TMA + wgmma symmetric GEMM). setup.py
// compiles this file on its own for sm_90a (-gencode arch=compute_90a,code=sm_90a); built for
// any other architecture (the CI's sm_80 / sm_90 loop) its device code is a trap stub.
#include <algorithm>
#include <stdexcept>

#include "kernels/sym_gemm_sm90.cuh"
#include "launch.h"

namespace st {

void launch_sym_gemm_sm90(DType t, SymGemmArgs a, void* stream) {
  switch (t) {
    case DType::BF16: run_sym_gemm_sm90<__nv_bfloat16>(a, static_cast<Stream>(stream)); break;
    case DType::F16: run_sym_gemm_sm90<__half>(a, static_cast<Stream>(stream)); break;
    default: throw std::invalid_argument("speedtronic: sym_gemm_sm90 takes float16 or bfloat16");
  }
}

bool sym_gemm_sm90_usable(const SymGemmArgs& a) { return sym_gemm_sm90_supported(a); }

int sym_gemm_sm90_device_ok() {
#if defined(__CUDACC__)
  return sm90::device_cc() == 90;
#else
  return 1;
#endif
}

}  // namespace st

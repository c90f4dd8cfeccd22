// Launchers for csrc/kernels/symmetric_gemm.cuh (tensor-core X X^T, mma layout probe).
#include <stdexcept>

#include "kernels/symmetric_gemm.cuh"
#include "launch.h"

namespace st {

void launch_syrk(DType t, SyrkArgs a, void* stream) {
  switch (t) {
    case DType::BF16: run_syrk<__nv_bfloat16>(a, static_cast<Stream>(stream)); break;
    case DType::F16: run_syrk<__half>(a, static_cast<Stream>(stream)); break;
    default: throw std::invalid_argument("speedtronic: the symmetric kernel takes float16 or bfloat16");
  }
}

void launch_mma_probe(DType t, const void* A, const void* Bt, float* D, void* stream) {
  switch (t) {
    case DType::BF16:
      run_mma_probe(static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(Bt), D,
                    static_cast<Stream>(stream));
      break;
    case DType::F16:
      run_mma_probe(static_cast<const __half*>(A), static_cast<const __half*>(Bt), D, static_cast<Stream>(stream));
      break;
    default: throw std::invalid_argument("speedtronic: the mma probe takes float16 or bfloat16");
  }
}

#define ST_STR2(...) #__VA_ARGS__
#define ST_STR(...) ST_STR2(__VA_ARGS__)
const char* compiled_arch_list() {
#if defined(__CUDA_ARCH_LIST__)
  return ST_STR(__CUDA_ARCH_LIST__);  // nvcc >= 11.5 defines it in every pass, e.g. 800,900
#else
  return "";
#endif
}

}  // namespace st

// Read by speedtronic/kernels.py through ctypes (after the import), for `speedtronic env`.
extern "C" __attribute__((visibility("default"))) const char* speedtronic_cuda_arch_list() {
  return st::compiled_arch_list();
}

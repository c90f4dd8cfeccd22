// Fused fp32 CPU kernels for the reference model's eager one-thread path: SwiGLU and RMSNorm,
// forward and backward. Python reaches them through ctypes (speedtronic/cpu_kernels.py), so this
// file includes no torch or Python header: it compiles in well under a second, and a plain
// `pip install -e .` (build isolation, no torch in the build environment) can build it.
//
// Why: on a CPU step these ops are memory-bound, and torch runs each as several passes over
// (B, T, hidden) tensors. SwiGLU in torch is silu + mul forward and mul, silu_backward, mul
// backward (12 tensor reads/writes of (B, T, hidden)); fused it is 8. RMSNorm is norm, rsqrt, two
// muls forward and five ops backward; fused it is one pass each way. Forward + backward, fp32,
// one thread (benchmarks/results/cpu_layers.md): SwiGLU at (8, 128, 384) 1384 -> 856 us, RMSNorm
// at (8, 128, 128) 549 -> 231 us; the short-run model's step 63.2 -> 55.3 ms.
//
// Numerics: fp32 throughout, fixed reduction order (no -ffast-math, so inf and nan keep their
// meaning); exp is evaluated by range reduction and a degree-7 Taylor polynomial (remainder
// < 6e-9 relative on |r| <= ln2/2, below fp32 epsilon), which GCC vectorizes, where expf from libm
// would stay scalar. Every entry point assumes contiguous, non-aliasing buffers; the Python side
// checks that before calling.

#include <cstdint>
#include <cstring>

// One binary for every x86-64 CPU: GCC/clang emit an AVX-512, an AVX2 and a baseline copy of each
// kernel and pick one at load time (ifunc). Elsewhere (aarch64, no ifunc) the plain -O3 build.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define ST_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#define ST_HAVE_CLONES 1
#endif
#endif
#ifndef ST_CLONES
#define ST_CLONES
#endif

#define ST_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// exp(x) for x in fp32 range: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2 so that
// n ln2 is exact), exp(r) by Horner, 2^n by building the exponent bits. The clamp keeps 2^n a
// normal float; outside it exp over/underflows in fp32 anyway. A nan input stays nan through r.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // round(x / ln2) by the 1.5 * 2^23 trick: exact without -ffast-math, and it vectorizes.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln2 high part: 10 significant bits, so n * it is exact
  r = r + n * 2.12194440e-4f;      // minus the low part of ln2
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // A nan x leaves n nan: cast 0 instead (float -> int of nan is undefined); p is nan anyway.
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

constexpr int kLanes = 16;

// sum(a[c] * b[c]) with kLanes partial sums: a fixed order GCC vectorizes without reassociation.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.0f};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[c + j] * b[c + j];
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

}  // namespace

// Bumped whenever a signature below changes; the loader refuses a library with another value.
ST_EXPORT int32_t speedtronic_cpu_abi(void) { return 1; }

// Which copy of the kernels runs here: "avx512f", "avx2", or "baseline".
ST_EXPORT const char* speedtronic_cpu_isa(void) {
#ifdef ST_HAVE_CLONES
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512f";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "baseline";
}

// h = silu(g) * u over n elements.
ST_EXPORT ST_CLONES void speedtronic_swiglu_fwd(const float* g, const float* u, float* h,
                                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    h[i] = x * sigmoid(x) * u[i];
  }
}

// From dh: du = dh * silu(g), dg = dh * u * silu'(g), silu'(x) = s (1 + x (1 - s)), s = sigmoid(x).
ST_EXPORT ST_CLONES void speedtronic_swiglu_bwd(const float* dh, const float* g, const float* u,
                                                float* dg, float* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float s = sigmoid(x);
    const float d = dh[i];
    du[i] = d * x * s;
    dg[i] = d * u[i] * s * (1.0f + x * (1.0f - s));
  }
}

// y = x * rstd * w per row of c; rstd[r] = 1 / sqrt(mean(x_r^2) + eps) is kept for the backward.
ST_EXPORT ST_CLONES void speedtronic_rmsnorm_fwd(const float* x, const float* w, float* y,
                                                 float* rstd, int64_t rows, int64_t c,
                                                 float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    float* yr = y + r * c;
    const float inv = 1.0f / __builtin_sqrtf(dot(xr, xr, c) / static_cast<float>(c) + eps);
    rstd[r] = inv;
    for (int64_t k = 0; k < c; ++k) yr[k] = xr[k] * inv * w[k];
  }
}

// dx = rstd * (dy*w - xhat * mean(dy*w * xhat)), xhat = x * rstd. When dw is not null it receives
// sum over rows of dy * xhat: summed in fp32 over blocks of 64 rows, the blocks in fp64, so the
// error does not grow with the row count (1024 rows in fp32 alone: 7e-5 absolute against 1e-5
// for torch's reduction). scratch: 2 * c floats.
ST_EXPORT ST_CLONES void speedtronic_rmsnorm_bwd(const float* dy, const float* x, const float* w,
                                                 const float* rstd, float* dx, double* dw,
                                                 float* scratch, int64_t rows, int64_t c) {
  float* gw = scratch;         // dy_r * w
  float* block = scratch + c;  // this block's partial sum of dy * xhat
  if (dw) {
    for (int64_t k = 0; k < c; ++k) dw[k] = 0.0, block[k] = 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * c;
    const float* xr = x + r * c;
    float* dxr = dx + r * c;
    const float inv = rstd[r];
    for (int64_t k = 0; k < c; ++k) gw[k] = dyr[k] * w[k];
    const float proj = dot(gw, xr, c) * inv * inv / static_cast<float>(c);
    for (int64_t k = 0; k < c; ++k) dxr[k] = inv * (gw[k] - xr[k] * proj);
    if (dw) {
      for (int64_t k = 0; k < c; ++k) block[k] += dyr[k] * xr[k] * inv;
      if ((r + 1) % 64 == 0 || r + 1 == rows) {
        for (int64_t k = 0; k < c; ++k) dw[k] += block[k], block[k] = 0.0f;
      }
    }
  }
}

// Fused fp32 CPU kernels for the reference model's eager one-thread path: SwiGLU and RMSNorm,
// forward and backward. Python reaches them through ctypes (speedtronic/cpu_kernels.py), so this
// file includes no torch or Python header: it compiles in well under a second, and a plain
// `pip install -e .` (build isolation, no torch in the build environment) can build it.
//
// Why: on a CPU step these ops are memory-bound, and torch runs each as several passes over
// (B, T, hidden) tensors. SwiGLU in torch is silu + mul forward and mul, silu_backward, mul
// backward (14 tensor reads and writes of (B, T, hidden)); fused it is 8. RMSNorm is norm, rsqrt,
// two muls forward and five ops backward; fused it is one pass each way. Forward + backward, fp32,
// one thread (benchmarks/results/cpu_layers.md): SwiGLU at (8, 128, 384) 1385 -> 909 us, RMSNorm
// at (8, 128, 128) 530 -> 258 us; the short-run model's step 66.9 -> 59.5 ms.
//
// Numerics: fp32 throughout, fixed reduction order (no -ffast-math, so inf and nan keep their
// meaning); exp is evaluated by range reduction and a degree-7 Taylor polynomial (remainder
// < 8e-9 relative on |r| <= ln2/2, below fp32 epsilon), which GCC vectorizes, where expf from libm
// would stay scalar. setup.py adds -fno-trapping-math: without it GCC keeps the selects below as
// branches and leaves the AVX2 copy scalar (the SwiGLU pair, forward + backward at (8, 128, 384):
// 2.46 ms against 0.51 ms; the values are the same). Every entry point assumes contiguous,
// non-aliasing fp32 buffers; the Python side checks that before calling. (Timings in this file:
// one thread on an AVX-512 Xeon, the library's entry points called directly.)

#include <cstdint>
#include <cstring>

// One binary for every x86-64 CPU: each kernel body below is compiled three times, for AVX-512,
// for AVX2 + FMA and for the baseline, and the first call picks the copy this CPU supports
// (kernels() at the end). On the AVX2 copy FMA matters: the SwiGLU pair took 0.50 ms with it and
// 0.63 ms without, against 0.44 ms for the AVX-512 copy (one thread, (8, 128, 384)). Elsewhere
// (aarch64) one copy for the compiler's own flags; ST_SINGLE_COPY forces that (the benchmark's
// AVX2 row builds the library with -mavx2 -mfma -DST_SINGLE_COPY). The file needs GCC or clang
// (GNU attributes and builtins): under MSVC the install reports the library as not built.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(ST_SINGLE_COPY)
#define ST_X86_COPIES 1
#endif

#define ST_EXPORT extern "C" __attribute__((visibility("default")))
// Bodies and helpers are inlined into each copy, so they are compiled for its instruction set.
#define ST_INLINE inline __attribute__((always_inline))

namespace {

// exp(x) in fp32: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2 so that n ln2 is
// exact), exp(r) by Horner, 2^n as the product of two powers of two built from exponent bits
// (each stays a normal float for n in [-150, 128], so the product covers fp32's whole range,
// denormals and the top binade included). Like expf: inf above ln(FLT_MAX) = 88.7228, 0 below
// -103.97. The clamp is written so that a nan x becomes -104 (comparisons with nan are false),
// keeping the float -> int cast defined; exp(nan) is then finite, which the kernels below accept
// because x itself is a factor of every output.
ST_INLINE float exp_approx(float x) {
  float xc = x > -104.0f ? x : -104.0f;
  xc = xc < 88.7228f ? xc : 88.7228f;
  // round(x / ln2) by the 1.5 * 2^23 trick: exact without -ffast-math, and it vectorizes.
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;  // ln2 high part: 9 significant bits, so n * it is exact
  r = r + n * 2.12194440e-4f;       // minus the low part of ln2
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t half = ni >> 1;  // 2^n = 2^half * 2^(n - half)
  const int32_t bits_a = (half + 127) << 23, bits_b = (ni - half + 127) << 23;
  float scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, sizeof scale_a);
  std::memcpy(&scale_b, &bits_b, sizeof scale_b);
  float e = p * scale_a * scale_b;
  e = x > 88.72284f ? __builtin_inff() : e;
  return x < -103.973f ? 0.0f : e;
}

// 1 / (1 + exp(-x)): 0 for x below -88.72 (exp(-x) overflows, as in torch), 1 for large x.
ST_INLINE float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

constexpr int kLanes = 16;

// sum(a[c] * b[c]) with kLanes partial sums: a fixed order GCC vectorizes without reassociation.
ST_INLINE float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.0f};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[c + j] * b[c + j];
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// h = silu(g) * u over n elements.
ST_INLINE void swiglu_fwd(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    h[i] = x * sigmoid(x) * u[i];
  }
}

// From dh: du = dh * silu(g), dg = dh * u * silu'(g), silu'(x) = s (1 + x (1 - s)), s = sigmoid(x).
ST_INLINE void swiglu_bwd(const float* dh, const float* g, const float* u, float* dg, float* du,
                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float s = sigmoid(x);
    const float d = dh[i];
    du[i] = d * x * s;
    dg[i] = d * u[i] * s * (1.0f + x * (1.0f - s));
  }
}

// y = x * rstd * w per row of c; rstd[r] = 1 / sqrt(mean(x_r^2) + eps) is kept for the backward.
ST_INLINE void rmsnorm_fwd(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                           int64_t c, float eps) {
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
ST_INLINE void rmsnorm_bwd(const float* dy, const float* x, const float* w, const float* rstd,
                           float* dx, double* dw, float* scratch, int64_t rows, int64_t c) {
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

// One copy of every kernel, for the instruction set TARGET names.
struct Kernels {
  const char* isa;
  void (*swiglu_fwd)(const float*, const float*, float*, int64_t);
  void (*swiglu_bwd)(const float*, const float*, const float*, float*, float*, int64_t);
  void (*rmsnorm_fwd)(const float*, const float*, float*, float*, int64_t, int64_t, float);
  void (*rmsnorm_bwd)(const float*, const float*, const float*, const float*, float*, double*,
                      float*, int64_t, int64_t);
};

#define ST_COPY(NAME, TARGET)                                                                   \
  TARGET void NAME##_swiglu_fwd(const float* g, const float* u, float* h, int64_t n) {          \
    swiglu_fwd(g, u, h, n);                                                                     \
  }                                                                                             \
  TARGET void NAME##_swiglu_bwd(const float* dh, const float* g, const float* u, float* dg,     \
                                float* du, int64_t n) {                                         \
    swiglu_bwd(dh, g, u, dg, du, n);                                                            \
  }                                                                                             \
  TARGET void NAME##_rmsnorm_fwd(const float* x, const float* w, float* y, float* rstd,         \
                                 int64_t rows, int64_t c, float eps) {                          \
    rmsnorm_fwd(x, w, y, rstd, rows, c, eps);                                                   \
  }                                                                                             \
  TARGET void NAME##_rmsnorm_bwd(const float* dy, const float* x, const float* w,               \
                                 const float* rstd, float* dx, double* dw, float* scratch,      \
                                 int64_t rows, int64_t c) {                                     \
    rmsnorm_bwd(dy, x, w, rstd, dx, dw, scratch, rows, c);                                      \
  }                                                                                             \
  constexpr Kernels NAME##_kernels = {#NAME, NAME##_swiglu_fwd, NAME##_swiglu_bwd,              \
                                      NAME##_rmsnorm_fwd, NAME##_rmsnorm_bwd};

#ifdef ST_X86_COPIES
ST_COPY(avx512f, __attribute__((target("avx512f"))))
ST_COPY(avx2, __attribute__((target("avx2,fma"))))
ST_COPY(baseline, )

const Kernels& kernels() {
  static const Kernels chosen = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return avx512f_kernels;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2_kernels;
    return baseline_kernels;
  }();
  return chosen;
}
#else
ST_COPY(single, )

const Kernels& kernels() { return single_kernels; }
#endif

}  // namespace

// Bumped whenever a signature or a result changes (2: exp saturates like expf), so that a library
// built from older sources (an editable checkout pulled without a rebuild) is refused, not run.
ST_EXPORT int32_t speedtronic_cpu_abi(void) { return 2; }

// Which copy of the kernels runs on this CPU: "avx512f", "avx2" (with FMA), "baseline", or
// "single" where the library has one copy.
ST_EXPORT const char* speedtronic_cpu_isa(void) { return kernels().isa; }

ST_EXPORT void speedtronic_swiglu_fwd(const float* g, const float* u, float* h, int64_t n) {
  kernels().swiglu_fwd(g, u, h, n);
}

ST_EXPORT void speedtronic_swiglu_bwd(const float* dh, const float* g, const float* u, float* dg,
                                      float* du, int64_t n) {
  kernels().swiglu_bwd(dh, g, u, dg, du, n);
}

ST_EXPORT void speedtronic_rmsnorm_fwd(const float* x, const float* w, float* y, float* rstd,
                                       int64_t rows, int64_t c, float eps) {
  kernels().rmsnorm_fwd(x, w, y, rstd, rows, c, eps);
}

ST_EXPORT void speedtronic_rmsnorm_bwd(const float* dy, const float* x, const float* w,
                                       const float* rstd, float* dx, double* dw, float* scratch,
                                       int64_t rows, int64_t c) {
  kernels().rmsnorm_bwd(dy, x, w, rstd, dx, dw, scratch, rows, c);
}

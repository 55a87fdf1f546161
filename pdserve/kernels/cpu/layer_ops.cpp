// The small per-layer ops of a decoder step, one call each instead of five to seven torch ops:
// at batch 1 a step of the real model ran ~2,800 torch ops, and their dispatch, not their
// arithmetic, was a quarter of it.
//
//   rms_norm(x, w, eps)          w * (x * rsqrt(mean(x^2) + eps))        x [T, D] fp32
//   add_rms_norm(x, r, w, eps)   (s, rms_norm(s)) with s = x + r         the residual and the norm
//   rotary(q, k, cos, sin)       q * cos + rotate_half(q) * sin, the same for k
//                                q [T, H, D], k [T, KVH, D] (rows may be strided), cos/sin [T, 1, D]
//   silu_mul(x)                  silu(x[:, :I]) * x[:, I:]               x [T, 2I] (gate | up)
//
// rotary rounds exactly as the torch expression does (each product, then the sum: the library
// builds with -ffp-contract=off), so it is bitwise the reference. The norms sum squares in
// double, where torch sums floats in its own order: they agree to a few ulp, not bitwise.
// silu_mul computes silu as ATen's CPU kernel does, through ATen's own vector type (its exp
// is Sleef's, exported by libtorch_cpu), in the same chunks (two vectors, then a scalar tail
// with std::exp), so it is F.silu(gate) * up bitwise on a build of the ISA torch dispatches
// to (tests/kernels/test_layer_ops.py).

// Before any ATen header: the vector type's implementation follows these, as in ATen's own
// per-ISA builds of its kernels.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/cpu/vec/vec.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / static_cast<double>(d));
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0),
              "rms_norm: x [T, D], weight [D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: fp32 only");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t t = xc.size(0), d = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      norm_row(xp + i * d, wp, static_cast<float>(eps), d, yp + i * d);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
  check_norm(x, w);
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == at::kFloat,
              "add_rms_norm: the residual must be x's shape, fp32");
  const at::Tensor xc = x.contiguous(), rc = r.contiguous(), wc = w.contiguous();
  at::Tensor s = at::empty_like(xc), y = at::empty_like(xc);
  const int64_t t = xc.size(0), d = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* rp = rc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      for (int64_t j = 0; j < d; ++j) sp[i * d + j] = xp[i * d + j] + rp[i * d + j];
      norm_row(sp + i * d, wp, static_cast<float>(eps), d, yp + i * d);
    }
  });
  return {s, y};
}

// One [T, H, D] tensor (strides of T and H free, D contiguous) into a contiguous output.
void rotate(const at::Tensor& q, const float* cp, const float* sp, at::Tensor& out) {
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2), half = d / 2;
  const int64_t st = q.stride(0), sh = q.stride(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cp + i * d;
      const float* s = sp + i * d;
      for (int64_t j = 0; j < h; ++j) {
        const float* src = qp + i * st + j * sh;
        float* dst = op + (i * h + j) * d;
        for (int64_t m = 0; m < half; ++m) dst[m] = src[m] * c[m] + (-src[m + half]) * s[m];
        for (int64_t m = half; m < d; ++m) dst[m] = src[m] * c[m] + src[m - half] * s[m];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary: q [T, H, D], k [T, KVH, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary: fp32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
              "rotary: the head dimension must be contiguous and even");
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK(cos.numel() == t * d && sin.numel() == t * d, "rotary: cos and sin [T, 1, D]");
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qo = at::empty({t, q.size(1), d}, q.options());
  at::Tensor ko = at::empty({t, k.size(1), d}, k.options());
  rotate(q, cc.data_ptr<float>(), sc.data_ptr<float>(), qo);
  rotate(k, cc.data_ptr<float>(), sc.data_ptr<float>(), ko);
  return {qo, ko};
}

// The MLP's activation: at batch 1 the chunk, silu and mul were three torch calls and two
// allocations a layer for 1536 values.
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.scalar_type() == at::kFloat,
              "silu_mul: x [T, 2I] fp32 (gate, then up)");
  const at::Tensor xc = x.contiguous();
  const int64_t t = xc.size(0), half = xc.size(1) / 2;
  at::Tensor y = at::empty({t, half}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kStep = 2 * Vec::size();  // ATen's vectorised loop takes two at a time
  const Vec one(1.f);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = xp + r * 2 * half;
      const float* u = g + half;
      float* o = yp + r * half;
      int64_t i = 0;
      for (; i + kStep <= half; i += kStep)
        for (int64_t v = i; v < i + kStep; v += Vec::size()) {
          const Vec gv = Vec::loadu(g + v);
          ((gv / (one + gv.neg().exp())) * Vec::loadu(u + v)).store(o + v);
        }
      for (; i < half; ++i) o[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_layers, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_layers, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_mul", &silu_mul);
}

// The fp32 vector of the quantised-matmul kernels (int8_linear.cpp, int4_linear.cpp): one set
// of names over AVX-512 (16 lanes) or AVX2 + FMA + F16C (8 lanes), chosen by the build's
// flags. PDSERVE_SIMD is defined when either is there; without it the kernels run their
// scalar loops.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>

#define PDSERVE_SIMD 1

// For the small helpers that take or fill a vec array: gcc left the AVX2 widen_block out of
// line at -O3, so the vectors of every block went through the stack (the M = 1 GEMV ran at
// half speed).
#define PDSERVE_ALWAYS_INLINE inline __attribute__((always_inline))

namespace pdserve_simd {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset1(float v) { return _mm512_set1_ps(v); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset1(float v) { return _mm256_set1_ps(v); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sh = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(sh, _mm_shuffle_ps(sh, sh, 1)));
}
#endif

}  // namespace pdserve_simd

#endif

// Paged attention and KV write for the CPU, reading the cache blocks in place.
//
// Cache of one layer: [num_blocks, 2, num_kv_heads, block_size, head_dim] (0 = K, 1 = V),
// contiguous, so one head's rows of one block are block_size * head_dim contiguous values.
// Work is split over (request, KV head) pairs: each pair reads its K rows once for all the
// query heads of its group (GQA) and all its query tokens, then its V rows once: the
// context is never copied. Accumulation is in fp32 whatever the storage dtype.
//
// Two paths compute a pair. fp32 with head_dim a multiple of 8 on an AVX2/FMA build (the
// engine's case) runs `attend_pair_avx2`: scores of 8 keys at a time (8 FMA chains, one
// transposing horizontal add), V accumulated in registers 64 dims at a time, and the next
// blocks of the table prefetched while one is computed (blocks are scattered, so the hardware
// prefetcher would restart at every 4 KiB block). Anything else runs the portable
// `attend_pair`. Pairs (or runs of a pair's rows, for a costly pair) are handed to the threads
// of torch's pool (at::parallel_for, so torch.set_num_threads governs it) in contiguous runs
// of equal cost (query rows x the keys they see), not of equal count: a ragged batch's long
// requests would otherwise sit on one thread. A run of rows reads keys only up to its last
// query token, so a prompt's causal half is not computed.
//
// Registered as torch ops (pdserve_cpu::paged_attention, pdserve_cpu::write_kv) so they can
// be called from Python and traced by torch.compile.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace {

template <typename T>
inline const float* as_float_row(const T* src, float* buf, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

inline const float* as_float_row(const float* src, float*, int64_t) { return src; }

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* acc, float p, const float* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * v[i];
}

// exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial, a few ulp, branch
// free so the softmax loop vectorises (std::exp does not without -ffast-math).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

struct Shape {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
};

// Softmax in place over each query row's visible keys (row r0 + r of the pair = query
// (r0 + r) / g sees keys [low, hi], hi = first_hi + (r0 + r) / g); the other keys of the row
// get probability 0. Rows are `span` scores long, covering keys [lo, lo + span). total[r]:
// the row's sum of exps.
inline void softmax_rows(float* scores, float* total, int64_t r0, int64_t rows, int64_t g,
                         int64_t span, int64_t lo, int64_t first_hi, int64_t window) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hi = first_hi + (r0 + r) / g;
    const int64_t low = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
    float* sc = scores + r * span - lo;  // indexed by absolute key position
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = low; t <= hi; ++t) m = std::max(m, sc[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = low; t <= hi; ++t) {
      sc[t] = exp_nonpositive(sc[t] - m);
      sum += sc[t];
    }
    for (int64_t t = lo; t < low; ++t) sc[t] = 0.f;
    for (int64_t t = hi + 1; t < lo + span; ++t) sc[t] = 0.f;
    total[r] = sum;
  }
}

// Rows [r0, r1) of one (request, KV head) pair: the pair's `qlen` query tokens start at row
// `q0` of q/out, and its row r is query head r % g of token r / g, which sees keys
// [lo_j, hi_j] with hi_j = ctx - qlen + j and lo_j = hi_j - window + 1 (or 0). Rows are
// computed independently (the same operations whichever rows a call takes), so a pair split
// over threads gives the same bits; a call reads keys only up to its last row's hi_j.
// D > 0 fixes head_dim at compile time (unrolled, vectorised rows); D == 0 reads s.head_dim.
struct Rows {
  int64_t first_hi, lo, end, span;  // keys [lo, end) are read; end - lo = span
};
inline Rows rows_keys(int64_t ctx, int64_t qlen, int64_t g, int64_t r0, int64_t r1,
                      int64_t window) {
  const int64_t first_hi = ctx - qlen;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_hi + r0 / g - window + 1) : 0;
  const int64_t end = first_hi + (r1 - 1) / g + 1;
  return Rows{first_hi, lo, end, end - lo};
}

template <typename T, int64_t D>
void attend_pair(const T* q, T* out, const T* cache, const int64_t* table, int64_t q0,
                 int64_t qlen, int64_t ctx, int64_t kvh, int64_t r0, int64_t r1, const Shape& s,
                 float scale, int64_t window) {
  const int64_t d = D > 0 ? D : s.head_dim, g = s.group, rows = r1 - r0;
  const auto [first_hi, lo, end, span] = rows_keys(ctx, qlen, g, r0, r1, window);
  std::vector<float> qf(rows * d), acc(rows * d, 0.f), scores(rows * span, 0.f), row(d);
  for (int64_t r = r0; r < r1; ++r) {
    const T* src = q + ((q0 + r / g) * s.heads + kvh * g + r % g) * d;
    float* dst = qf.data() + (r - r0) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  }
  const int64_t head_rows = s.block_size * d;  // one head's slice of one block
  auto kv_row = [&](int64_t t, int64_t which) {
    const int64_t block = table[t / s.block_size];
    return cache + ((block * 2 + which) * s.kv_heads + kvh) * head_rows +
           (t % s.block_size) * d;
  };
  for (int64_t t = lo; t < end; ++t) {
    const float* k = as_float_row(kv_row(t, 0), row.data(), d);
    for (int64_t r = 0; r < rows; ++r) scores[r * span + (t - lo)] = dot(qf.data() + r * d, k, d);
  }
  std::vector<float> total(rows);
  softmax_rows(scores.data(), total.data(), r0, rows, g, span, lo, first_hi, window);
  for (int64_t t = lo; t < end; ++t) {
    const float* v = as_float_row(kv_row(t, 1), row.data(), d);
    for (int64_t r = 0; r < rows; ++r) axpy(acc.data() + r * d, scores[r * span + (t - lo)], v, d);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const float inv = 1.f / total[r - r0];
    T* dst = out + ((q0 + r / g) * s.heads + kvh * g + r % g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[(r - r0) * d + i] * inv);
  }
}

#ifdef PDSERVE_AVX2
// The 8 lanes of the result are the sums of a0 .. a7 (each over its own 8 lanes).
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  // u0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], u1 likewise for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp_nonpositive on 8 lanes (the same Cephes polynomial).
inline __m256 exp256_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, x), x, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// softmax_rows, 8 keys at a time (gcc does not vectorise the portable loops well).
inline void softmax_rows_avx2(float* scores, float* total, int64_t r0, int64_t rows, int64_t g,
                              int64_t span, int64_t lo, int64_t first_hi, int64_t window) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hi = first_hi + (r0 + r) / g;
    const int64_t low = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
    float* sc = scores + r * span - lo;  // indexed by absolute key position
    const int64_t n = hi + 1 - low;
    float* x = sc + low;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
    for (; t < n; ++t) m = std::max(m, x[t]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
      const __m256 e = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + t), mb));
      _mm256_storeu_ps(x + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; t < n; ++t) {
      x[t] = exp_nonpositive(x[t] - m);
      sum += x[t];
    }
    for (int64_t u = lo; u < low; ++u) sc[u] = 0.f;
    for (int64_t u = hi + 1; u < lo + span; ++u) sc[u] = 0.f;
    total[r] = sum;
  }
}

// out[0, 8) = q . k_j for 8 consecutive key rows k_j = k + j * d (d a multiple of 8): one FMA
// chain each, so the adds do not wait on each other, and one transposing horizontal add.
inline void score_8_keys(const float* q, const float* k, int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0;
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + c), a0);
    a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + d + c), a1);
    a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 2 * d + c), a2);
    a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 3 * d + c), a3);
    a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 4 * d + c), a4);
    a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 5 * d + c), a5);
    a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 6 * d + c), a6);
    a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + 7 * d + c), a7);
  }
  _mm256_storeu_ps(out, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
}

// scores[r * span + j] = q_r . k_j for `rows` query rows q_r = q + r * d and the n consecutive
// key rows k_j = k + j * d, 8 keys at a time. The last n % 8 keys are copied once into a
// zero-padded group of 8 and scored the same way, so a key's score is the same bits wherever
// its block ends: a prompt chunked differently, or the same key scored at a later step, gives
// the same attention (the batch-invariant mode relies on it).
template <int64_t D>
inline void score_keys(const float* q, int64_t rows, const float* k, int64_t n, int64_t dim,
                       float* scores, int64_t span) {
  const int64_t d = D > 0 ? D : dim, whole = n / 8 * 8;
  thread_local std::vector<float> pad;  // reused across blocks and calls: no allocation
  if (whole < n) {
    pad.assign(8 * d, 0.f);
    std::memcpy(pad.data(), k + whole * d, (n - whole) * d * sizeof(float));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d;
    float* out = scores + r * span;
    for (int64_t j = 0; j < whole; j += 8) score_8_keys(qr, k + j * d, d, out + j);
    if (whole < n) {
      float got[8];
      score_8_keys(qr, pad.data(), d, got);
      std::copy(got, got + (n - whole), out + whole);
    }
  }
}

// acc[0, 8 NV) += sum_j p[j] * v_j[0, 8 NV) over n value rows v_j = v + j * stride,
// the accumulator held in NV registers.
template <int NV>
inline void accumulate(float* acc, const float* p, const float* v, int64_t n, int64_t stride) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    const float* vj = v + j * stride;
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}

// acc[0, d) += sum_j p[j] * v_j, 64 dims (8 registers) at a time.
inline void accumulate_rows(float* acc, const float* p, const float* v, int64_t n, int64_t d) {
  for (int64_t c = 0; c < d; c += 64) {
    switch (std::min<int64_t>(64, d - c) / 8) {
      case 8: accumulate<8>(acc + c, p, v + c, n, d); break;
      case 7: accumulate<7>(acc + c, p, v + c, n, d); break;
      case 6: accumulate<6>(acc + c, p, v + c, n, d); break;
      case 5: accumulate<5>(acc + c, p, v + c, n, d); break;
      case 4: accumulate<4>(acc + c, p, v + c, n, d); break;
      case 3: accumulate<3>(acc + c, p, v + c, n, d); break;
      case 2: accumulate<2>(acc + c, p, v + c, n, d); break;
      default: accumulate<1>(acc + c, p, v + c, n, d); break;
    }
  }
}

inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float))
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

constexpr int64_t kPrefetchBlocks = 2;  // how far ahead of the block being computed

// attend_pair for fp32 with head_dim a multiple of 8: the same two passes (all scores, one
// softmax per row, then V), block by block, prefetching kPrefetchBlocks ahead.
template <int64_t D>
void attend_pair_avx2(const float* q, float* out, const float* cache, const int64_t* table,
                      int64_t q0, int64_t qlen, int64_t ctx, int64_t kvh, int64_t r0, int64_t r1,
                      const Shape& s, float scale, int64_t window) {
  const int64_t d = D > 0 ? D : s.head_dim, g = s.group, rows = r1 - r0, bs = s.block_size;
  const auto [first_hi, lo, end, span] = rows_keys(ctx, qlen, g, r0, r1, window);
  thread_local std::vector<float> scratch;  // reused across pairs and calls: no allocation
  scratch.resize(2 * rows * d + rows * span + rows);
  float* qf = scratch.data();
  float* acc = qf + rows * d;
  float* scores = acc + rows * d;
  float* total = scores + rows * span;
  for (int64_t r = r0; r < r1; ++r) {
    const float* src = q + ((q0 + r / g) * s.heads + kvh * g + r % g) * d;
    float* dst = qf + (r - r0) * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale;
  }
  std::fill(acc, acc + rows * d, 0.f);
  const int64_t head_rows = bs * d;  // one head's slice of one block
  auto block = [&](int64_t b, int64_t which) {
    return cache + ((table[b] * 2 + which) * s.kv_heads + kvh) * head_rows;
  };
  const int64_t b_lo = lo / bs, b_end = (end - 1) / bs + 1;
  auto prefetch_ahead = [&](int64_t from, int64_t which) {
    for (int64_t b = from; b < std::min(from + kPrefetchBlocks, b_end); ++b)
      prefetch(block(b, which), head_rows);
  };
  prefetch_ahead(b_lo, 0);
  for (int64_t b = b_lo; b < b_end; ++b) {
    if (b + kPrefetchBlocks < b_end) prefetch(block(b + kPrefetchBlocks, 0), head_rows);
    const int64_t t0 = std::max(lo, b * bs), t1 = std::min(end, (b + 1) * bs);
    const float* k = block(b, 0) + (t0 - b * bs) * d;
    score_keys<D>(qf, rows, k, t1 - t0, d, scores + (t0 - lo), span);
  }
  prefetch_ahead(b_lo, 1);  // V's first blocks arrive during the softmax
  softmax_rows_avx2(scores, total, r0, rows, g, span, lo, first_hi, window);
  for (int64_t b = b_lo; b < b_end; ++b) {
    if (b + kPrefetchBlocks < b_end) prefetch(block(b + kPrefetchBlocks, 1), head_rows);
    const int64_t t0 = std::max(lo, b * bs), t1 = std::min(end, (b + 1) * bs);
    const float* v = block(b, 1) + (t0 - b * bs) * d;
    for (int64_t r = 0; r < rows; ++r)
      accumulate_rows(acc + r * d, scores + r * span + (t0 - lo), v, t1 - t0, d);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const float inv = 1.f / total[r - r0];
    float* dst = out + ((q0 + r / g) * s.heads + kvh * g + r % g) * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = acc[(r - r0) * d + i] * inv;
  }
}
#endif  // PDSERVE_AVX2

template <typename T>
using PairFn = void (*)(const T*, T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, const Shape&, float, int64_t);

template <typename T>
PairFn<T> pick_pair_fn(int64_t head_dim) {
#ifdef PDSERVE_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (head_dim % 8 == 0) {
      switch (head_dim) {
        case 64: return &attend_pair_avx2<64>;
        case 128: return &attend_pair_avx2<128>;
        default: return &attend_pair_avx2<0>;
      }
    }
  }
#endif
  switch (head_dim) {
    case 64: return &attend_pair<T, 64>;
    case 128: return &attend_pair<T, 128>;
    case 96: return &attend_pair<T, 96>;
    case 80: return &attend_pair<T, 80>;
    case 256: return &attend_pair<T, 256>;
    default: return &attend_pair<T, 0>;
  }
}

// Runs fn(w) for every work unit w in [0, n), handing each thread of torch's pool one
// contiguous run of units of about equal total cost (`start[w]`: the cost of the units
// before w, start[n] the total).
template <typename F>
void for_units_balanced(const std::vector<int64_t>& start, const F& fn) {
  const int64_t n = static_cast<int64_t>(start.size()) - 1;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  auto first_of = [&](int64_t part) {  // first unit whose cost starts at or after the cut
    const int64_t cut = start[n] * part / parts;
    return std::lower_bound(start.begin(), start.begin() + n, cut) - start.begin();
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part)
      for (int64_t w = first_of(part), last = first_of(part + 1); w < last; ++w) fn(w);
  });
}

void check_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache,
                  const at::Tensor& tables, const at::Tensor& seq_lens,
                  const at::Tensor& query_start, const at::Tensor& seqs) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "q [T, H, D] and cache [nb, 2, KVH, bs, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && cache.is_contiguous(),
              "q, out and cache must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be like q");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "cache dtype must equal q dtype");
  TORCH_CHECK(cache.size(1) == 2 && cache.size(4) == q.size(2), "cache/q head_dim mismatch");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0, "query heads must be a multiple of KV heads");
  for (const auto* t : {&tables, &seq_lens, &query_start, &seqs})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "metadata must be contiguous int64 CPU tensors");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seq_lens.size(0) &&
                  query_start.size(0) == seq_lens.size(0) + 1,
              "block_tables [B, nb], seq_lens [B], query_start [B + 1]");
}

}  // namespace

// Attention for the requests listed in `seqs` (indices into the batch); other rows of `out`
// are left untouched. window <= 0: no sliding window.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start, const at::Tensor& seqs, double scale,
                     int64_t window) {
  check_inputs(out, q, cache, block_tables, seq_lens, query_start, seqs);
  const Shape s{q.size(1), cache.size(2), q.size(1) / cache.size(2), q.size(2), cache.size(3),
                block_tables.size(1)};
  const int64_t n = seqs.size(0);
  const int64_t* seq = seqs.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = seq[i];
    TORCH_CHECK(b >= 0 && b < seq_lens.size(0), "seqs index out of range");
    const int64_t qlen = qs[b + 1] - qs[b];
    TORCH_CHECK(qlen >= 1 && lens[b] >= qlen && qs[b + 1] <= q.size(0),
                "bad query_start / seq_lens for request ", b);
    TORCH_CHECK((lens[b] + s.block_size - 1) / s.block_size <= s.max_blocks,
                "block table too short for request ", b);
  }
  // Work units: rows of (request, KV head) pairs. A unit's cost: its rows times the keys
  // they read, plus a fixed overhead. A pair of several query tokens (a prompt chunk, a
  // speculative verification) whose cost is over a quarter of a thread's share is split into
  // runs of rows: a prompt's later rows see ever more keys, which sit in cache for the next
  // run, and one request's pairs are too few to share out (3 KV heads on two threads left one
  // idle a third of the time). A decode pair stays whole: each run would read its keys from
  // memory again (split in two they took 1.15x the time at 192 keys). Rows are computed
  // independently, so a split never changes a result.
  struct Unit {
    int64_t pair, r0, r1;
  };
  auto unit_cost = [&](int64_t b, int64_t r0, int64_t r1) {
    const int64_t qlen = qs[b + 1] - qs[b];
    const Rows k = rows_keys(lens[b], qlen, s.group, r0, r1, window);
    return (r1 - r0) * k.span + 64;
  };
  const int64_t pairs = n * s.kv_heads;
  std::vector<int64_t> pair_cost(pairs);
  int64_t total = 0;
  for (int64_t w = 0; w < pairs; ++w) {
    const int64_t b = seq[w / s.kv_heads];
    pair_cost[w] = unit_cost(b, 0, (qs[b + 1] - qs[b]) * s.group);
    total += pair_cost[w];
  }
  const int64_t most = std::max<int64_t>(1, total / (4 * at::get_num_threads()));
  std::vector<Unit> units;
  std::vector<int64_t> start{0};
  for (int64_t w = 0; w < pairs; ++w) {
    const int64_t b = seq[w / s.kv_heads], rows = (qs[b + 1] - qs[b]) * s.group;
    const int64_t runs = rows > s.group ? std::clamp<int64_t>(pair_cost[w] / most, 1, rows) : 1;
    if (runs == 1) {
      units.push_back(Unit{w, 0, rows});
      start.push_back(start.back() + pair_cost[w]);
      continue;
    }
    for (int64_t i = 0; i < runs; ++i) {
      const int64_t r0 = rows * i / runs, r1 = rows * (i + 1) / runs;
      units.push_back(Unit{w, r0, r1});
      start.push_back(start.back() + unit_cost(b, r0, r1));
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attn", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* cp = cache.data_ptr<scalar_t>();
    const PairFn<scalar_t> attend = pick_pair_fn<scalar_t>(s.head_dim);
    for_units_balanced(start, [&](int64_t u) {
      const Unit& t = units[u];
      const int64_t b = seq[t.pair / s.kv_heads], kvh = t.pair % s.kv_heads;
      attend(qp, op, cp, tables + b * s.max_blocks, qs[b], qs[b + 1] - qs[b], lens[b], kvh,
             t.r0, t.r1, s, static_cast<float>(scale), window);
    });
  });
}

// cache[slot // bs, 0, :, slot % bs] = k[t]; likewise V. Negative slots are skipped.
void write_kv(at::Tensor cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  // k and v may be strided views (v is a slice of the fused qkv projection): only each head's
  // row must be contiguous, so the decode loop writes them without a copy first.
  TORCH_CHECK(cache.is_contiguous() && k.stride(-1) == 1 && v.stride(-1) == 1,
              "the cache must be contiguous, and each head row of k and v");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k/v dtype must equal the cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.size(2) &&
                  k.size(2) == cache.size(4) && slot_mapping.size(0) == k.size(0),
              "k, v [T, KVH, D] matching the cache and slot_mapping [T]");
  const int64_t tokens = k.size(0), kvh = k.size(1), d = k.size(2), bs = cache.size(3);
  const int64_t slots_total = cache.size(0) * bs;
  const int64_t kt = k.stride(0), kh = k.stride(1), vt = v.stride(0), vh = v.stride(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < slots_total, "slot ", slots[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* cp = cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / bs, off = slots[t] % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        scalar_t* kd = cp + (((block * 2 + 0) * kvh + h) * bs + off) * d;
        scalar_t* vd = cp + (((block * 2 + 1) * kvh + h) * bs + off) * d;
        std::copy_n(kp + t * kt + h * kh, d, kd);
        std::copy_n(vp + t * vt + h * vh, d, vd);
      }
    }
  });
}

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start, Tensor seqs, float scale, int window) -> ()");
  m.def("write_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

// Paged attention and KV write for the CPU, reading the cache blocks in place.
//
// Cache of one layer: [num_blocks, 2, num_kv_heads, block_size, head_dim] (0 = K, 1 = V),
// contiguous, so one head's rows of one block are block_size * head_dim contiguous values.
// Work is split over (request, KV head) pairs with at::parallel_for (torch's own OpenMP
// pool, so torch.set_num_threads governs it). Each pair reads its K rows once for all the
// query heads of its group (GQA) and all its query tokens, then its V rows once: the
// context is never copied. Accumulation is in fp32 whatever the storage dtype.
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
#include <vector>

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

// One (request, KV head) pair: `qlen` query tokens starting at row `q0` of q/out; query j
// sees keys [lo_j, hi_j] with hi_j = ctx - qlen + j and lo_j = hi_j - window + 1 (or 0).
// D > 0 fixes head_dim at compile time (unrolled, vectorised rows); D == 0 reads s.head_dim.
template <typename T, int64_t D>
void attend_pair(const T* q, T* out, const T* cache, const int64_t* table, int64_t q0,
                 int64_t qlen, int64_t ctx, int64_t kvh, const Shape& s, float scale,
                 int64_t window) {
  const int64_t d = D > 0 ? D : s.head_dim, g = s.group, rows = qlen * g;
  const int64_t first_hi = ctx - qlen;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_hi - window + 1) : 0;
  const int64_t span = ctx - lo;
  std::vector<float> qf(rows * d), acc(rows * d, 0.f), scores(rows * span, 0.f), row(d);
  for (int64_t j = 0; j < qlen; ++j)
    for (int64_t k = 0; k < g; ++k) {
      const T* src = q + ((q0 + j) * s.heads + kvh * g + k) * d;
      float* dst = qf.data() + (j * g + k) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
    }
  const int64_t head_rows = s.block_size * d;  // one head's slice of one block
  auto kv_row = [&](int64_t t, int64_t which) {
    const int64_t block = table[t / s.block_size];
    return cache + ((block * 2 + which) * s.kv_heads + kvh) * head_rows +
           (t % s.block_size) * d;
  };
  for (int64_t t = lo; t < ctx; ++t) {
    const float* k = as_float_row(kv_row(t, 0), row.data(), d);
    for (int64_t r = 0; r < rows; ++r) scores[r * span + (t - lo)] = dot(qf.data() + r * d, k, d);
  }
  // Softmax per query row over its visible keys; the others keep probability 0.
  std::vector<float> total(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t hi = first_hi + r / g;
    const int64_t low = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
    float* sc = scores.data() + r * span - lo;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = low; t <= hi; ++t) m = std::max(m, sc[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = low; t <= hi; ++t) {
      sc[t] = exp_nonpositive(sc[t] - m);
      sum += sc[t];
    }
    for (int64_t t = lo; t < low; ++t) sc[t] = 0.f;
    for (int64_t t = hi + 1; t < ctx; ++t) sc[t] = 0.f;
    total[r] = sum;
  }
  for (int64_t t = lo; t < ctx; ++t) {
    const float* v = as_float_row(kv_row(t, 1), row.data(), d);
    for (int64_t r = 0; r < rows; ++r) axpy(acc.data() + r * d, scores[r * span + (t - lo)], v, d);
  }
  for (int64_t j = 0; j < qlen; ++j)
    for (int64_t k = 0; k < g; ++k) {
      const int64_t r = j * g + k;
      const float inv = 1.f / total[r];
      T* dst = out + ((q0 + j) * s.heads + kvh * g + k) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[r * d + i] * inv);
    }
}

template <typename T>
using PairFn = void (*)(const T*, T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                        int64_t, const Shape&, float, int64_t);

template <typename T>
PairFn<T> pick_pair_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &attend_pair<T, 64>;
    case 128: return &attend_pair<T, 128>;
    case 96: return &attend_pair<T, 96>;
    case 80: return &attend_pair<T, 80>;
    case 256: return &attend_pair<T, 256>;
    default: return &attend_pair<T, 0>;
  }
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attn", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* cp = cache.data_ptr<scalar_t>();
    const PairFn<scalar_t> attend = pick_pair_fn<scalar_t>(s.head_dim);
    at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = seq[w / s.kv_heads], kvh = w % s.kv_heads;
        attend(qp, op, cp, tables + b * s.max_blocks, qs[b], qs[b + 1] - qs[b],
                              lens[b], kvh, s, static_cast<float>(scale), window);
      }
    });
  });
}

// cache[slot // bs, 0, :, slot % bs] = k[t]; likewise V. Negative slots are skipped.
void write_kv(at::Tensor cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(cache.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "cache, k and v must be contiguous");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k/v dtype must equal the cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == cache.size(2) &&
                  k.size(2) == cache.size(4) && slot_mapping.size(0) == k.size(0),
              "k, v [T, KVH, D] matching the cache and slot_mapping [T]");
  const int64_t tokens = k.size(0), kvh = k.size(1), d = k.size(2), bs = cache.size(3);
  const int64_t slots_total = cache.size(0) * bs;
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
        std::copy_n(kp + (t * kvh + h) * d, d, kd);
        std::copy_n(vp + (t * kvh + h) * d, d, vd);
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

// y = x @ dequant(w)^T for an int8 weight with one fp32 scale per group of `g` consecutive
// inputs of a row (w[n, i] * scale[n, i / g]), fp32 activations in and fp32 out: the LM
// head's 8-bit copy (`quant/int8_head.py`).
//
// Why a kernel of our own: torch's `_weight_int8pack_mm` is vectorised on the CPU only for
// bf16 activations and returns bf16, and bf16 logits (8 mantissa bits) tie tokens that fp32
// logits tell apart; its fp32 variant is ~9x slower than an fp32 matmul. This one reads each
// int8 row once for all M activation rows (decode batches are small), widens 8 (AVX2) or 16
// (AVX-512) weights at a time to fp32, scales them and accumulates with FMA. Rows are split
// over torch's thread pool (at::parallel_for), and a row's result never depends on the other
// rows of x, so batching and speculative verification change nothing (bitwise).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowsPerTile = 8;  // activation rows accumulated at once per weight row
constexpr int64_t kGemvMaxRows = 16;  // above this (and below kTiledMaxRows), tiled()
constexpr int64_t kTiledMaxRows = 128;
// Software prefetch distance in bytes of the weight stream. The RW rows a GEMV tile walks are
// adjacent in w, so they are one stream: each line is fetched once, in address order, this
// far ahead. 2048 bytes ahead in each of four rows read the head at 9.4 GB/s on one Zen 4
// core and 18.5 on two (the last-level cache flushed between calls, as a decode step's other
// weights flush it); this way, 17-18 and 26-28 (docs/perf.md).
constexpr int64_t kAhead = 8192;

// The dot products of one int8 weight row with R activation rows (R fixed at compile time so
// the R accumulators stay in registers), the weight dequantised to fp32 once for all R. The
// accumulation order of a row does not depend on R: batching changes no result.
#if defined(PDSERVE_SIMD)
using namespace pdserve_simd;  // NOLINT: the kernel's own vector vocabulary
#if defined(__AVX512F__)
inline vec vwiden(const int8_t* w) {  // 16 int8 -> 16 floats
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
#else
inline vec vwiden(const int8_t* w) {  // 8 int8 -> 8 floats
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
#endif
#endif

// Scalar products of one weight row: rows, widths or groups the vectors do not tile.
template <int R>
inline void dot_tile_scalar(const int8_t* w, const float* scale, const float* x, int64_t k,
                            int64_t g, float* out) {
  for (int r = 0; r < R; ++r) out[r] = 0.f;
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += g, ++gi) {
    for (int64_t i = g0; i < g0 + g; ++i) {
      const float wi = static_cast<float>(w[i]) * scale[gi];
      for (int r = 0; r < R; ++r) out[r] += wi * x[r * k + i];
    }
  }
}

// RW weight rows (n apart in w and out) with R activation rows. Each (weight row, activation
// row) pair is one FMA chain over the row's vectors in order, whatever RW and R: at M = 1 a
// lone chain waits on its FMA's latency (the head ran at half the memory's speed), so small
// batches walk several weight rows at once, which changes no result (bitwise).
template <int RW, int R>
inline void dot_tile(const int8_t* w, const float* scale, const float* x, int64_t k,
                     int64_t g, float* out, int64_t n) {
#if defined(PDSERVE_SIMD)
  if (g % kLanes == 0) {
    // Each vector of weights lies in one group: widen, scale (the dequantised fp32 weight,
    // exactly), then one FMA per activation row.
    const int64_t groups = k / g;
    vec acc[RW][R];
    for (int a = 0; a < RW; ++a)
      for (int r = 0; r < R; ++r) acc[a][r] = vzero();
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += g, ++gi) {
      // The rows stream from memory (the head is read whole once per step): fetch ahead.
      for (int a = 0; a < RW; ++a)
        _mm_prefetch(reinterpret_cast<const char*>(w + (gi * RW + a) * g + kAhead),
                     _MM_HINT_T0);
      vec sv[RW];
      for (int a = 0; a < RW; ++a) sv[a] = vset1(scale[a * groups + gi]);
      for (int64_t i = g0; i < g0 + g; i += kLanes) {
        vec xv[R];
        for (int r = 0; r < R; ++r) xv[r] = vload(x + r * k + i);
        for (int a = 0; a < RW; ++a) {
          const vec wv = vmul(vwiden(w + a * k + i), sv[a]);
          for (int r = 0; r < R; ++r) acc[a][r] = vfma(wv, xv[r], acc[a][r]);
        }
      }
    }
    for (int a = 0; a < RW; ++a)
      for (int r = 0; r < R; ++r) out[r * n + a] = vsum(acc[a][r]);
    return;
  }
#endif
  for (int a = 0; a < RW; ++a) {
    float o[R];
    dot_tile_scalar<R>(w + a * k, scale + a * (k / g), x, k, g, o);
    for (int r = 0; r < R; ++r) out[r * n + a] = o[r];
  }
}

// One weight row against activation rows [0, rows): y [rows, n] at out.
inline void dot_rows(int64_t rows, const int8_t* w, const float* scale, const float* x,
                     int64_t k, int64_t g, float* out, int64_t n) {
  switch (rows) {
    case 1: return dot_tile<1, 1>(w, scale, x, k, g, out, n);
    case 2: return dot_tile<1, 2>(w, scale, x, k, g, out, n);
    case 3: return dot_tile<1, 3>(w, scale, x, k, g, out, n);
    case 4: return dot_tile<1, 4>(w, scale, x, k, g, out, n);
    case 5: return dot_tile<1, 5>(w, scale, x, k, g, out, n);
    case 6: return dot_tile<1, 6>(w, scale, x, k, g, out, n);
    case 7: return dot_tile<1, 7>(w, scale, x, k, g, out, n);
    default: return dot_tile<1, 8>(w, scale, x, k, g, out, n);
  }
}

#if defined(PDSERVE_SIMD)
// Decode batches of 17+ rows (the head at batch 32 was a fifth of a step in the GEMV, which
// loads an activation vector per FMA). Each task dequantises kTiledRows weight rows once;
// the micro-kernel keeps kRW x kRX vector accumulators in registers, kRW + kRX loads to
// kRW * kRX FMAs. Each output is the GEMV's one chain over the row's vectors in order and
// the same reduction, so a row's result stays bitwise the same whatever the batch.
#if defined(__AVX512F__)
constexpr int kRW = 4, kRX = 4;  // 16 accumulators + 5 operands of 32 registers
#else
constexpr int kRW = 4, kRX = 2;  // 8 + 5 of AVX2's 16
#endif
constexpr int64_t kTiledRows = 48;  // weight rows dequantised per task (a multiple of kRW)

// One weight row as fp32, w * scale: the vectors the GEMV multiplies by x (g % kLanes == 0).
inline void dequant_row(const int8_t* w, const float* scale, int64_t k, int64_t g, float* out) {
  for (int64_t i = 0, gi = 0; i < k; ++gi) {
    const vec sv = vset1(scale[gi]);
    for (const int64_t end = i + g; i < end; i += kLanes) vstore(out + i, vmul(vwiden(w + i), sv));
  }
}

inline void tile_sums(const float* w, const float* x, int64_t k, vec (&sums)[kRW][kRX]) {
  vec acc[kRW][kRX];  // local, so they stay in registers (through `sums` they spilled)
  for (int a = 0; a < kRW; ++a)
    for (int b = 0; b < kRX; ++b) acc[a][b] = vzero();
  for (int64_t i = 0; i < k; i += kLanes) {
    vec wv[kRW];
    for (int a = 0; a < kRW; ++a) wv[a] = vload(w + a * k + i);
    for (int b = 0; b < kRX; ++b) {
      const vec xv = vload(x + b * k + i);
      for (int a = 0; a < kRW; ++a) acc[a][b] = vfma(wv[a], xv, acc[a][b]);
    }
  }
  for (int a = 0; a < kRW; ++a)
    for (int b = 0; b < kRX; ++b) sums[a][b] = acc[a][b];
}

// Requires g % kLanes == 0 (each vector of weights in one group, as the GEMV's fast path).
void tiled(const float* x, const int8_t* w, const float* scale, int64_t m, int64_t n,
           int64_t k, int64_t g, float* y) {
  // Activation rows padded with zeros to a whole number of micro-tiles (copied only then).
  const int64_t mp = (m + kRX - 1) / kRX * kRX;
  std::vector<float> xpad;
  const float* xs = x;
  if (mp != m) {
    xpad.assign(mp * k, 0.f);
    std::memcpy(xpad.data(), x, m * k * sizeof(float));
    xs = xpad.data();
  }
  const int64_t groups = k / g;
  at::parallel_for(0, (n + kTiledRows - 1) / kTiledRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(kTiledRows * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTiledRows, rows = std::min(kTiledRows, n - r0);
      for (int64_t r = 0; r < rows; ++r)
        dequant_row(w + (r0 + r) * k, scale + (r0 + r) * groups, k, g, wf.data() + r * k);
      const int64_t padded = (rows + kRW - 1) / kRW * kRW;
      std::fill(wf.begin() + rows * k, wf.begin() + padded * k, 0.f);
      for (int64_t i0 = 0; i0 < rows; i0 += kRW)
        for (int64_t j0 = 0; j0 < m; j0 += kRX) {
          vec acc[kRW][kRX];
          tile_sums(wf.data() + i0 * k, xs + j0 * k, k, acc);
          for (int b = 0; b < kRX && j0 + b < m; ++b)
            for (int a = 0; a < kRW && i0 + a < rows; ++a)
              y[(j0 + b) * n + r0 + i0 + a] = vsum(acc[a][b]);
        }
    }
  });
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 2, "int8_linear: x [M, K], "
              "w [N, K], scale [N, K / group]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat,
              "int8_linear: x and scale fp32, w int8");
  TORCH_CHECK(x.size(1) == w.size(1) && scale.size(0) == w.size(0) && scale.size(1) > 0 &&
                  w.size(1) % scale.size(1) == 0,
              "int8_linear: shapes do not match");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor sc = scale.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = wc.size(0);
  const int64_t groups = sc.size(1), g = k / groups;
  at::Tensor y = at::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(PDSERVE_SIMD)
  if (m > kGemvMaxRows && m < kTiledMaxRows && g % kLanes == 0) {
    tiled(xp, wp, sp, m, n, k, g, yp);
    return y;
  }
#endif
  // ~64 rows per task: large enough to amortise the task, small enough to balance 2+ cores.
  // Up to two activation rows, four weight rows at a time (their FMA chains overlap).
  const bool quads = m <= 2;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    if (quads)
      for (; row + 4 <= end; row += 4) {
        const int8_t* w4 = wp + row * k;
        const float* s4 = sp + row * groups;
        if (m == 1) dot_tile<4, 1>(w4, s4, xp, k, g, yp + row, n);
        else dot_tile<4, 2>(w4, s4, xp, k, g, yp + row, n);
      }
    for (; row < end; ++row)
      for (int64_t r0 = 0; r0 < m; r0 += kRowsPerTile)
        dot_rows(std::min(kRowsPerTile, m - r0), wp + row * k, sp + row * groups,
                    xp + r0 * k, k, g, yp + r0 * n + row, n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(pdserve_layers, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_layers, CPU, m) { m.impl("int8_linear", &int8_linear); }

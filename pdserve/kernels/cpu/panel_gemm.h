// y = x @ w^T for fp32 x [M, K] and a quantised w [N, K] dequantised a tile of rows at a
// time: int4_linear.cpp's matmul for decode batches past its GEMV's rows and for short
// prefills, below kMaxRows, where at::mm on small tiles is mostly call overhead, the GEMV is
// bound by loading an activation vector per FMA (and a reduction per output), and a whole
// dequantised weight costs its round trip through memory.
//
// x is transposed once per call into panels of W rows (xt[kk][j] = x[j][kk]). Each task
// dequantises kTile weight rows into an fp32 scratch; the micro-kernel then broadcasts one
// weight per weight row against a panel's activations, R x V accumulators in registers, over
// chunks of k that stay in L1. Two panel shapes: `Wide` (V = 2, R = 6: 12 FMAs to 8 loads)
// and `Narrow` (V = 1, R = 12, half as wide, for batches of at most one vector of rows, which
// a wide panel would half waste). Every output is one FMA chain over k in order whatever the
// shape, so a row's result is the same bits in either shape and whatever the other rows of
// the batch (but differs in rounding from the GEMV's, which sums lanes and then reduces).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "simd.h"

#if defined(PDSERVE_SIMD)
namespace panel_gemm {

using pdserve_simd::kLanes;
using pdserve_simd::vec;

template <int V, int R>
struct Shape {
  static constexpr int kVecs = V;                   // activation vectors per micro-tile
  static constexpr int kRows = R;                   // weight rows per micro-tile
  static constexpr int64_t kWidth = V * kLanes;     // activation rows per panel
};
using Wide = Shape<2, 6>;     // 12 accumulators + 2 + 1 (AVX2 has 16 registers)
using Narrow = Shape<1, 12>;  // 12 accumulators + 1 + 1

constexpr int64_t kTile = 48;       // weight rows dequantised per task (both shapes' R divide it)
constexpr int64_t kChunk = 128;     // inputs per pass over a panel
// From here the whole weight dequantised once and a oneDNN product (int4_linear.cpp) are
// faster. Below it the panels win because they never write the fp32 weight out: a 128-token
// prefill of the default model took 0.86x the time through them, 256 tokens 0.96x, 384 1.01x
// and 512 1.04x (docs/perf.md).
constexpr int64_t kMaxRows = 384;

// c[i][j] += sum_k w[i][k] xt[k][j] over one chunk of k: w is R rows `ldw` floats apart, xt
// k rows of W, c R rows of W. Chunks go in order of k and each starts from the last one's sums.
template <class S>
inline void micro_kernel(const float* w, int64_t ldw, const float* xt, int64_t k, bool first,
                         float* c) {
  using namespace pdserve_simd;  // NOLINT: the kernel's own vector vocabulary
  constexpr int V = S::kVecs, R = S::kRows;
  constexpr int64_t W = S::kWidth;
  vec acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = first ? vzero() : vload(c + i * W + v * kLanes);
  for (int64_t kk = 0; kk < k; ++kk) {
    vec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = vload(xt + kk * W + v * kLanes);
    for (int i = 0; i < R; ++i) {
      const vec wb = vset1(w[i * ldw + kk]);
      for (int v = 0; v < V; ++v) acc[i][v] = vfma(wb, xv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) vstore(c + i * W + v * kLanes, acc[i][v]);
}

// y[j][i] = c[i][j] for i < rows, j < cols: c is `ldc` floats a row, y `ldy`. 8 x 8 blocks go
// through registers (the scalar copy took ~8% of a 128-row product at K = 576), the edges
// one float at a time.
inline void transpose8(const float* c, int64_t ldc, float* y, int64_t ldy) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(c + i * ldc);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      r[i + h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + h + 2] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // r[q]: column kOrder[q] of rows 0-3 in its low half, column kOrder[q] + 4 in its high
  // half; r[q + 4] the same of rows 4-7. Column j of c is row j of y.
  constexpr int kOrder[4] = {0, 2, 1, 3};
  for (int q = 0; q < 4; ++q) {
    const int j = kOrder[q];
    _mm256_storeu_ps(y + j * ldy, _mm256_permute2f128_ps(r[q], r[q + 4], 0x20));
    _mm256_storeu_ps(y + (j + 4) * ldy, _mm256_permute2f128_ps(r[q], r[q + 4], 0x31));
  }
}

inline void store_transposed(const float* c, int64_t ldc, int64_t rows, int64_t cols, float* y,
                             int64_t ldy) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t i = 0; i < rows8; i += 8)
    for (int64_t j = 0; j < cols8; j += 8) transpose8(c + i * ldc + j, ldc, y + j * ldy + i, ldy);
  for (int64_t j = 0; j < cols; ++j)
    for (int64_t i = j < cols8 ? rows8 : 0; i < rows; ++i) y[j * ldy + i] = c[i * ldc + j];
}

// xt[p][kk][j] = x[p * W + j][kk], zero past the last row. Split over k between the threads:
// done by the calling thread alone it was ~2% of a batch-32 decode step, the other waiting.
template <int64_t W>
inline std::unique_ptr<float[]> transpose_panels(const float* x, int64_t m, int64_t k) {
  const int64_t panels = (m + W - 1) / W;
  std::unique_ptr<float[]> xt(new float[panels * k * W]);
  at::parallel_for(0, k, kChunk, [&](int64_t k0, int64_t k1) {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t rows = std::min(W, m - p * W);
      const float* xp = x + p * W * k;
      float* out = xt.get() + p * k * W;
      for (int64_t kk = k0; kk < k1; ++kk) {
        float* o = out + kk * W;
        for (int64_t j = 0; j < rows; ++j) o[j] = xp[j * k + kk];
        std::fill(o + rows, o + W, 0.f);
      }
    }
  });
  return xt;
}

// `dequant(r0, rows, out)` writes weight rows r0 .. r0 + rows - 1 as fp32, k apart, to out.
template <class S, class Dequant>
void matmul_as(const float* x, int64_t m, int64_t n, int64_t k, float* y,
               const Dequant& dequant) {
  constexpr int R = S::kRows;
  constexpr int64_t W = S::kWidth;
  const int64_t panels = (m + W - 1) / W;
  const std::unique_ptr<float[]> xt = transpose_panels<W>(x, m, k);
  const int64_t tasks = (n + kTile - 1) / kTile;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Scratch left uninitialised: every value read is written first (padding rows below).
    std::unique_ptr<float[]> wbuf(new float[kTile * k]), cbuf(new float[kTile * W]);
    float* w = wbuf.get();
    float* c = cbuf.get();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTile, rows = std::min(kTile, n - r0);
      dequant(r0, rows, w);
      const int64_t padded = (rows + R - 1) / R * R;
      std::fill(w + rows * k, w + padded * k, 0.f);
      for (int64_t p = 0; p < panels; ++p) {
        const float* xp = xt.get() + p * k * W;
        for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
          const int64_t kn = std::min(kChunk, k - k0);
          for (int64_t i0 = 0; i0 < rows; i0 += R)
            micro_kernel<S>(w + i0 * k + k0, k, xp + k0 * W, kn, k0 == 0, c + i0 * W);
        }
        store_transposed(c, W, rows, std::min(W, m - p * W), y + p * W * n + r0, n);
      }
    }
  });
}

// The narrow shape for a batch of at most one vector of rows, else the wide one.
template <class Dequant>
void matmul(const float* x, int64_t m, int64_t n, int64_t k, float* y, const Dequant& dequant) {
  if (m <= Narrow::kWidth) {
    matmul_as<Narrow>(x, m, n, k, y, dequant);
  } else {
    matmul_as<Wide>(x, m, n, k, y, dequant);
  }
}

}  // namespace panel_gemm
#endif

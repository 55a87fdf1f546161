// y = x @ w^T for fp32 x [M, K] and a quantised w [N, K] dequantised a tile of rows at a
// time: int4_linear.cpp's matmul for decode batches between its GEMV's 16 rows and kMaxRows,
// where at::mm on small tiles is mostly call overhead and the GEMV is bound by loading an
// activation vector per FMA.
//
// x is transposed once per call into panels of kWidth rows (xt[kk][j] = x[j][kk]). Each task
// dequantises kTile weight rows into an fp32 scratch; the micro-kernel then broadcasts one
// weight per weight row against a panel's activations, kRows x kVecs accumulators in
// registers (12 FMAs to 8 loads), over chunks of k that stay in L1. Every output is one FMA
// chain over k in order, so a row's result does not depend on the other rows of the batch
// (but differs in rounding from the GEMV's, which sums 16 lanes and then reduces).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

#if defined(PDSERVE_SIMD)
namespace panel_gemm {

using pdserve_simd::kLanes;
using pdserve_simd::vec;

constexpr int kRows = 6;                     // weight rows per micro-tile (15 of AVX2's 16)
constexpr int kVecs = 2;                     // activation vectors per micro-tile
constexpr int64_t kWidth = kVecs * kLanes;   // activation rows per panel
constexpr int64_t kTile = 8 * kRows;         // weight rows dequantised per task
constexpr int64_t kChunk = 128;              // inputs per pass over a panel
constexpr int64_t kMaxRows = 128;            // from here at::mm on wide tiles is faster

// c[i][j] += sum_k w[i][k] xt[k][j] over one chunk of k: w is kRows rows `ldw` floats
// apart, xt k rows of kWidth, c kRows rows of kWidth. Chunks go in order of k and each starts
// from the last one's sums.
inline void micro_kernel(const float* w, int64_t ldw, const float* xt, int64_t k, bool first,
                         float* c) {
  using namespace pdserve_simd;  // NOLINT: the kernel's own vector vocabulary
  vec acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v)
      acc[i][v] = first ? vzero() : vload(c + i * kWidth + v * kLanes);
  for (int64_t kk = 0; kk < k; ++kk) {
    vec xv[kVecs];
    for (int v = 0; v < kVecs; ++v) xv[v] = vload(xt + kk * kWidth + v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const vec wb = vset1(w[i * ldw + kk]);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = vfma(wb, xv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) vstore(c + i * kWidth + v * kLanes, acc[i][v]);
}

// xt[p][kk][j] = x[p * kWidth + j][kk], zero past the last row. Written in order and read
// from kWidth streams of x (column by column, every store landed on a new cache line).
inline std::vector<float> transpose_panels(const float* x, int64_t m, int64_t k) {
  const int64_t panels = (m + kWidth - 1) / kWidth;
  std::vector<float> xt(panels * k * kWidth, 0.f);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t rows = std::min(kWidth, m - p * kWidth);
    const float* xp = x + p * kWidth * k;
    float* out = xt.data() + p * k * kWidth;
    for (int64_t kk = 0; kk < k; ++kk, out += kWidth)
      for (int64_t j = 0; j < rows; ++j) out[j] = xp[j * k + kk];
  }
  return xt;
}

// `dequant(r0, rows, out)` writes weight rows r0 .. r0 + rows - 1 as fp32, k apart, to out.
template <class Dequant>
void matmul(const float* x, int64_t m, int64_t n, int64_t k, float* y, const Dequant& dequant) {
  const int64_t panels = (m + kWidth - 1) / kWidth;
  const std::vector<float> xt = transpose_panels(x, m, k);
  const int64_t tasks = (n + kTile - 1) / kTile;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kTile * k), c(kTile * kWidth);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * kTile, rows = std::min(kTile, n - r0);
      dequant(r0, rows, w.data());
      const int64_t padded = (rows + kRows - 1) / kRows * kRows;
      std::fill(w.begin() + rows * k, w.begin() + padded * k, 0.f);
      for (int64_t p = 0; p < panels; ++p) {
        const float* xp = xt.data() + p * k * kWidth;
        for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
          const int64_t kn = std::min(kChunk, k - k0);
          for (int64_t i0 = 0; i0 < rows; i0 += kRows)
            micro_kernel(w.data() + i0 * k + k0, k, xp + k0 * kWidth, kn, k0 == 0,
                         c.data() + i0 * kWidth);
        }
        const int64_t xrows = std::min(kWidth, m - p * kWidth);
        for (int64_t j = 0; j < xrows; ++j)
          for (int64_t i = 0; i < rows; ++i) y[(p * kWidth + j) * n + r0 + i] = c[i * kWidth + j];
      }
    }
  });
}

}  // namespace panel_gemm
#endif

// y = x @ dequant(w)^T for a 4-bit weight, fp32 activations in and fp32 out: the CPU W4A16
// matmul (`quant/int4_kernels.py`, backend "cpu").
//
//   w[n, k] = q[n, k] * scale[n, k / g] + offset[n, k / g]      q in [0, 15], g >= 16
//
// Layout: blocks of 32 inputs, 16 bytes a row; byte j of a row's block holds input j in its
// low nibble and input j + 16 in its high one (GGUF's Q4_0 / Q4_1 order). Rows go in quads,
// and block b of rows 4q..4q+3 is one 64-byte unit with the four rows' bytes interleaved:
// byte 4j + r is row r's byte j. The packed tensor is [ceil(N / 4), K / 32, 16, 4] bytes
// (`pack_block32` in kernels/int4_pack.py), so the decode kernel, which walks four rows at
// once, reads one sequential stream (four row-major streams measured 1.6x slower once the
// weights no longer fit in cache). scale and offset are fp16 [N, K / g].
//
// Why interleaved bytes: with AVX-512, lane j of the unit's 16 dwords then holds input j and
// j + 16 of all four rows, so one load and shifts by 8r (and 8r + 4) put row r's nibbles in
// the low bits of every lane, where vpermps reads its index, for 16 inputs in natural order.
// Against a widening load per row (vpmovzxbd, then a shift) that is 7 shifts for 8 lookups
// where it was 4 widenings and 4 shifts. The M = 1 GEMV is bound by these vector operations:
// the default model's 120 GEMVs (bench/gemv_bound.py, one thread) took 5.8-5.9 ms where they
// took 6.1-6.4 (docs/perf.md). AVX2 takes a row's bytes out with one in-lane byte shuffle
// per 8 inputs, as many operations as its widening loads took. Activations are read as they
// are.
//
// Why a kernel of our own: torch's `_weight_int4pack_mm_for_cpu` is fast only with bf16
// activations, and bf16 activations are what separated W4A16 from the fp32 model on a Q4_1
// GGUF whose 4-bit values are exactly the fp32 model's weights. Here everything is fp32, so
// the two differ by rounding at the level of summation order.
//
// Small decode batches (M <= kGemvMaxRows): a GEMV that walks the packed weight once per
// tile of up to 8 activation rows (four weight rows at once when M = 1), with software
// prefetch of the stream ahead; rows are split over torch's thread pool. Larger M: each task
// dequantises a tile of weight rows into a scratch matrix (q * scale, then + offset, two
// roundings as the fp32 loader does). Decode batches and prompts below 384 rows multiply it
// with the register-blocked panel kernel (panel_gemm.h); longer prefills dequantise the whole
// weight for one oneDNN product, or without oneDNN use at::mm on tiles of 64-512 rows (two
// tasks a thread), writing y in place, so prefill runs at GEMM speed. At M = 8 the fp32 FMAs
// are the bound (torch's bf16 dot products do twice the work per instruction there).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "onednn.h"
#include "panel_gemm.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;       // inputs per 16-byte block
constexpr int64_t kTile = 8;         // activation rows per pass over a weight row
// Rows up to which the GEMV beats the panel kernel (panel_gemm.h; measured on SmolLM2's
// shapes, 2 threads): past them, dequantise, then panels, then at::mm. The GEMV's cost grows
// with every row (an activation load per FMA, a reduction per output) where a narrow panel's
// is flat up to its width: 12 of 16 with AVX-512, 5 of 8 with AVX2.
#if defined(__AVX512F__)
constexpr int64_t kGemvMaxRows = 12;
#elif defined(__AVX2__)
constexpr int64_t kGemvMaxRows = 5;
#else
constexpr int64_t kGemvMaxRows = 16;  // no panel kernel: the GEMV, then at::mm
#endif
constexpr int64_t kGemmRowsMin = 64;   // weight rows dequantised per at::mm task: at least,
constexpr int64_t kGemmRowsMax = 512;  // at most, and otherwise two tasks per thread
constexpr int64_t kWideTileRows = 128;  // activation rows from which tiles grow past the least
constexpr int64_t kQuad = 4;         // rows interleaved block by block
constexpr int64_t kBlockStride = kQuad * 16;  // bytes from one block of a row to its next

// Block 0 of the quad that holds weight row `row` (the row is lane row % kQuad of it).
inline const uint8_t* quad_blocks(const uint8_t* packed, int64_t row, int64_t k) {
  return packed + (row / kQuad) * (kQuad * k / 2);
}
inline int quad_lane(int64_t row) { return static_cast<int>(row % kQuad); }

inline float half_to_float(uint16_t h) {
#if defined(PDSERVE_SIMD)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A row's fp16 scales or offsets as fp32 (the kernels broadcast them from memory).
inline void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
#if defined(PDSERVE_SIMD)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

// Scalar dequantisation of row `lane`'s part of one block: out[0..31] = q * scale + offset,
// per group.
[[maybe_unused]] inline void dequant_block_scalar(const uint8_t* p, int lane, const float* scale,
                                                  const float* offset, int64_t k0, int gshift,
                                                  float* out) {
  for (int j = 0; j < 16; ++j) {
    const uint8_t b = p[kQuad * j + lane];
    const int64_t lo = k0 + j, hi = k0 + 16 + j;
    const float slo = scale[lo >> gshift], olo = offset[lo >> gshift];
    const float shi = scale[hi >> gshift], ohi = offset[hi >> gshift];
    // Two roundings, as the fp32 loader's q * d + m: the library builds with -ffp-contract=off.
    out[j] = static_cast<float>(b & 0xF) * slo + olo;
    out[16 + j] = static_cast<float>(b >> 4) * shi + ohi;
  }
}

// The decode kernels, except the AVX-512 ones on groups of 32 (which look the weights up
// whole: weight_table below), take each group's offset out of the sum:
//
//   sum_k w[n, k] x[k] = sum_k (q[n, k] scale[n, g(k)]) x[k] + sum_g offset[n, g] X[g]
//
// with X[g] the group sums of x, computed once per call. Per 32 weights that is one widening
// of 16 bytes, two int->float conversions and two multiplies by the scale (shared by every
// activation row), then two FMAs per activation row. Each row keeps two accumulators (even
// and odd vectors of a block), so consecutive FMAs do not wait on each other; the same
// operations in the same order for every tile size, so a row's sums never depend on the batch.
#if defined(PDSERVE_SIMD)
using namespace pdserve_simd;  // NOLINT: the kernel's own vector vocabulary
#endif
#if defined(PDSERVE_SIMD) && defined(__AVX512F__)
constexpr int kVecs = 2;                  // vectors of 16 inputs per block
constexpr int kVecOffset[kVecs] = {0, 16};
// A unit's 16 dwords; lane j holds byte j of each of the quad's four rows.
PDSERVE_ALWAYS_INLINE __m512i load_unit(const uint8_t* p) {
  return _mm512_loadu_si512(p);
}
// Row `lane`'s low and high nibbles in the low 4 bits of every dword (higher bits: other rows').
PDSERVE_ALWAYS_INLINE __m512i low_nibbles(__m512i v, int lane) {
  return _mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * lane));
}
PDSERVE_ALWAYS_INLINE __m512i high_nibbles(__m512i v, int lane) {
  return _mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * lane + 4));
}
PDSERVE_ALWAYS_INLINE void widen_block(const uint8_t* p, int lane, vec* q) {
  const __m512i v = load_unit(p), mask = _mm512_set1_epi32(0xF);
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(low_nibbles(v, lane), mask));
  q[1] = _mm512_cvtepi32_ps(_mm512_and_si512(high_nibbles(v, lane), mask));
}
// The 16 values a block's nibbles stand for, t[q] = q * scale (+ offset): each rounded as the
// arithmetic on the widened q would round it, so a lookup gives the same bits.
inline vec nibble_table(float scale) {
  return vmul(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
              vset1(scale));
}
// The 16 weights a group's nibbles stand for, q * scale + offset with the fp32 loader's two
// roundings: the same bits as dequant_row's, so a GEMV through it multiplies the model's
// fp32 weights exactly, and no offsets' term is left to add.
inline vec weight_table(float scale, float offset) {
  return vadd(nibble_table(scale), vset1(offset));
}
// Row `lane`'s two vectors of a unit `v` through tables (one per vector: the groups of its 16
// inputs). vpermps reads only each lane's low 4 bits, so the nibbles need no mask, and the
// lookup replaces the conversion and the multiply, in the kernels that are bound by them (the
// M = 1 GEMV, the dequantisation ahead of the panels).
PDSERVE_ALWAYS_INLINE void lookup_block(__m512i v, int lane, vec t0, vec t1, vec* q) {
  q[0] = _mm512_permutexvar_ps(low_nibbles(v, lane), t0);
  q[1] = _mm512_permutexvar_ps(high_nibbles(v, lane), t1);
}
#define PDSERVE_NIBBLE_TABLES 1
constexpr bool kWeightTables = true;  // groups of 32 look up q * scale + offset
#elif defined(PDSERVE_SIMD)
constexpr bool kWeightTables = false;
constexpr int kVecs = 4;                  // vectors of 8 inputs per block
constexpr int kVecOffset[kVecs] = {0, 16, 8, 24};
// Row `lane`'s bytes 0-7 (inputs 0-7, 16-23), then 8-15 (8-15, 24-31): each half of the unit
// through one in-lane byte shuffle that moves byte 4j + lane to the low byte of dword j.
PDSERVE_ALWAYS_INLINE void widen_block(const uint8_t* p, int lane, vec* q) {
  const __m256i mask = _mm256_set1_epi32(0xF);
  // Control bytes 4j + lane, then three 0x80s (zeros), per dword; indices are per 16 bytes.
  const __m256i pick = _mm256_or_si256(
      _mm256_set1_epi32(static_cast<int>(0x80808000u)),
      _mm256_add_epi32(_mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12), _mm256_set1_epi32(lane)));
  for (int half = 0; half < 2; ++half) {
    const __m256i v = _mm256_shuffle_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half)), pick);
    q[2 * half] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    q[2 * half + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
}
#else
constexpr bool kWeightTables = false;
#endif
// Whether the decode kernels look a group's weights up whole (no offsets' term, no group sums
// of x): AVX-512 on groups of 32.
constexpr bool weight_tables(int gshift) { return kWeightTables && gshift == 5; }

// One weight row (K / 32 blocks; lane `lane` of the quad at `p`) dequantised to fp32: the
// prefill path and the tests' oracle. q * scale, then + offset: the scalar and vector forms
// round alike. `buf` holds 2 * K / g floats.
void dequant_row(const uint8_t* p, int lane, const uint16_t* scale, const uint16_t* offset,
                 int64_t k, int gshift, float* buf, float* out) {
  const int64_t groups = k >> gshift;
  halves_to_floats(scale, groups, buf);
  halves_to_floats(offset, groups, buf + groups);
  const float* sc = buf;
  const float* of = buf + groups;
  for (int64_t k0 = 0; k0 < k; k0 += kBlock, p += kBlockStride) {
#if defined(PDSERVE_NIBBLE_TABLES)
    // Inputs k0.. and k0 + 16..: one group unless groups are 16 wide.
    const int64_t g0 = k0 >> gshift, g1 = (k0 + 16) >> gshift;
    const vec t0 = weight_table(sc[g0], of[g0]);
    const vec t1 = g1 == g0 ? t0 : weight_table(sc[g1], of[g1]);
    vec q[kVecs];
    lookup_block(load_unit(p), lane, t0, t1, q);
    for (int v = 0; v < kVecs; ++v) vstore(out + k0 + kVecOffset[v], q[v]);
#elif defined(PDSERVE_SIMD)
    vec q[kVecs];
    widen_block(p, lane, q);
    for (int v = 0; v < kVecs; ++v) {
      const int64_t g = (k0 + kVecOffset[v]) >> gshift;
      vstore(out + k0 + kVecOffset[v], vadd(vmul(q[v], vset1(sc[g])), vset1(of[g])));
    }
#else
    dequant_block_scalar(p, lane, sc, of, k0, gshift, out + k0);
#endif
  }
}

// sum_g offset[g] X[g]: once per weight row and activation row, so vectorised over the
// groups (scalar, it was a third of a 16-row batch's work).
inline float offset_term(const float* offset, const float* xsum, int64_t groups) {
  float s = 0.f;
  int64_t g = 0;
#if defined(PDSERVE_SIMD)
  vec acc = vzero();
  for (; g + kLanes <= groups; g += kLanes) acc = vfma(vload(offset + g), vload(xsum + g), acc);
  s = vsum(acc);
#endif
  for (; g < groups; ++g) s += offset[g] * xsum[g];
  return s;
}

#if defined(PDSERVE_SIMD)
#if !defined(PDSERVE_NIBBLE_TABLES)
// AVX2, one group per block: the block's dot product with its integer values first, then
// one multiply by the scale (two partial sums, even and odd vectors, into the row's two
// accumulators). Against scaling each vector before its FMA this is 5 FP multiplies and
// FMAs a block where that was 8: the GEMV was bound by them, at 17 GB/s streamed on a
// 2-core Zen 3 whose plain read runs at 26 (this form: 25.5; the throwaway /work/mb/gemv).
PDSERVE_ALWAYS_INLINE void block_fma(const vec* q, vec x0, vec x1, vec x2, vec x3, vec scale,
                                     vec* total) {
  total[0] = vfma(vfma(q[2], x2, vmul(q[0], x0)), scale, total[0]);
  total[1] = vfma(vfma(q[3], x3, vmul(q[1], x1)), scale, total[1]);
}
#endif
// Accumulator indices are compile-time constants throughout (a runtime index would keep the
// accumulators on the stack, a store and reload per FMA).
template <int R>
inline void dot_tile(const uint8_t* p, int lane, const float* scale, const float* offset,
                     const float* xsum, const float* x, int64_t k, int gshift, float* out) {
  const int64_t groups = k >> gshift;
  vec total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = vzero();
  vec q[kVecs];
  if (gshift == 5) {  // one group per block (GGUF's Q4_0 / Q4_1): even blocks, odd blocks
    for (int64_t k0 = 0, gi = 0; k0 < k; k0 += kBlock, ++gi, p += kBlockStride) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 2048), _MM_HINT_T0);
#if defined(PDSERVE_NIBBLE_TABLES)
      const vec t = weight_table(scale[gi], offset[gi]);
      lookup_block(load_unit(p), lane, t, t, q);  // the weights, once for all R
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v)
          total[r][v & 1] = vfma(q[v], vload(x + r * k + k0 + kVecOffset[v]), total[r][v & 1]);
#else
      widen_block(p, lane, q);
      const vec sv = vset1(scale[gi]);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * k + k0;
        block_fma(q, vload(xr), vload(xr + 16), vload(xr + 8), vload(xr + 24), sv, total[r]);
      }
#endif
    }
  } else if (gshift > 5) {  // several blocks per group
    const int64_t g = int64_t{1} << gshift;
    for (int64_t g0 = 0, gi = 0; g0 < k; g0 += g, ++gi) {
      vec acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
      for (int64_t k0 = g0; k0 < g0 + g; k0 += kBlock, p += kBlockStride) {
        widen_block(p, lane, q);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kVecs; ++v)
            acc[r][v & 1] = vfma(q[v], vload(x + r * k + k0 + kVecOffset[v]), acc[r][v & 1]);
      }
      const vec sv = vset1(scale[gi]);
      for (int r = 0; r < R; ++r) total[r][0] = vfma(vadd(acc[r][0], acc[r][1]), sv, total[r][0]);
    }
  } else {  // groups of 16: each vector lies in one group
    for (int64_t k0 = 0; k0 < k; k0 += kBlock, p += kBlockStride) {
      widen_block(p, lane, q);
      for (int v = 0; v < kVecs; ++v) {
        const vec sv = vset1(scale[(k0 + kVecOffset[v]) >> 4]);
        for (int r = 0; r < R; ++r)
          total[r][v & 1] =
              vfma(vmul(q[v], vload(x + r * k + k0 + kVecOffset[v])), sv, total[r][v & 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = vsum(vadd(total[r][0], total[r][1])) +
             (weight_tables(gshift) ? 0.f : offset_term(offset, xsum + r * groups, groups));
}

// M = 1, groups of 32: four weight rows at once, so the rows' FMA chains overlap and each
// activation vector is loaded once for all four. Per row, exactly the operations of
// dot_tile<R> above in the same order, so a row's result is the same bitwise whatever the
// batch.
constexpr int kRows1 = 4;

inline void dot_rows_m1(const uint8_t* p, const float* so, int64_t groups, const float* xsum,
                        const float* x, int64_t k, float* out) {
  vec total[kRows1][2];
  for (int i = 0; i < kRows1; ++i) total[i][0] = total[i][1] = vzero();
  vec q[kVecs];
  for (int64_t k0 = 0, gi = 0; k0 < k; k0 += kBlock, ++gi, p += kBlockStride) {
    // The stream ahead: hardware prefetch alone left ~30% of DRAM bandwidth unused here.
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048), _MM_HINT_T0);
    vec xv[kVecs];
    for (int v = 0; v < kVecs; ++v) xv[v] = vload(x + k0 + kVecOffset[v]);
#if defined(PDSERVE_NIBBLE_TABLES)
    const __m512i unit = load_unit(p);  // once for the four rows
#endif
    for (int i = 0; i < kRows1; ++i) {
#if defined(PDSERVE_NIBBLE_TABLES)
      const vec t = weight_table(so[i * groups + gi], so[(kQuad + i) * groups + gi]);
      lookup_block(unit, i, t, t, q);
      for (int v = 0; v < kVecs; ++v) total[i][v & 1] = vfma(q[v], xv[v], total[i][v & 1]);
#else
      widen_block(p, i, q);
      block_fma(q, xv[0], xv[1], xv[2], xv[3], vset1(so[i * groups + gi]), total[i]);
#endif
    }
  }
  for (int i = 0; i < kRows1; ++i)
    out[i] = vsum(vadd(total[i][0], total[i][1])) +
             (weight_tables(5) ? 0.f : offset_term(so + (kQuad + i) * groups, xsum, groups));
}
#else
template <int R>
inline void dot_tile(const uint8_t* p, int lane, const float* scale, const float* offset,
                     const float* xsum, const float* x, int64_t k, int gshift, float* out) {
  const int64_t groups = k >> gshift;
  for (int r = 0; r < R; ++r) out[r] = offset_term(offset, xsum + r * groups, groups);
  for (int64_t k0 = 0; k0 < k; k0 += kBlock, p += kBlockStride) {
    for (int j = 0; j < 16; ++j) {
      const uint8_t b = p[kQuad * j + lane];
      const float lo = static_cast<float>(b & 0xF) * scale[(k0 + j) >> gshift];
      const float hi = static_cast<float>(b >> 4) * scale[(k0 + 16 + j) >> gshift];
      for (int r = 0; r < R; ++r) out[r] += lo * x[r * k + k0 + j] + hi * x[r * k + k0 + 16 + j];
    }
  }
}
#endif

inline void dot_rows(int64_t rows, const uint8_t* p, int lane, const float* scale,
                     const float* offset, const float* xsum, const float* x, int64_t k,
                     int gshift, float* out) {
  switch (rows) {
    case 1: return dot_tile<1>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 2: return dot_tile<2>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 3: return dot_tile<3>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 4: return dot_tile<4>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 5: return dot_tile<5>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 6: return dot_tile<6>(p, lane, scale, offset, xsum, x, k, gshift, out);
    case 7: return dot_tile<7>(p, lane, scale, offset, xsum, x, k, gshift, out);
    default: return dot_tile<8>(p, lane, scale, offset, xsum, x, k, gshift, out);
  }
}

struct Int4Args {
  const float* x;
  const uint8_t* packed;
  const uint16_t* scale;
  const uint16_t* offset;
  float* y;
  int64_t m, n, k, groups;
  int gshift;
};

void gemv(const Int4Args& a) {
  // X[r, g]: each activation row's group sums, for the offsets' term (none where the weight
  // tables carry the offsets).
  const bool sums = !weight_tables(a.gshift);
  std::vector<float> xsum(sums ? a.m * a.groups : 0);
  const int64_t g = a.k / a.groups;
  for (int64_t r = 0; sums && r < a.m; ++r)
    for (int64_t gi = 0; gi < a.groups; ++gi) {
      float s = 0.f;
      for (int64_t j = 0; j < g; ++j) s += a.x[r * a.k + gi * g + j];
      xsum[r * a.groups + gi] = s;
    }
  const int64_t quads = (a.n + kQuad - 1) / kQuad;
  at::parallel_for(0, quads, 4, [&](int64_t begin, int64_t end) {
    float out[kTile];
    std::vector<float> so(2 * a.groups * kQuad);
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t row0 = quad * kQuad, rows_here = std::min(kQuad, a.n - row0);
      // The quad's rows are contiguous in scale and offset: one conversion each, no tails
      // (a row at a time, K = 576's 18 groups left two scalar conversions a row).
      halves_to_floats(a.scale + row0 * a.groups, rows_here * a.groups, so.data());
      halves_to_floats(a.offset + row0 * a.groups, rows_here * a.groups,
                       so.data() + kQuad * a.groups);
#if defined(PDSERVE_SIMD)
      if (a.m == 1 && a.gshift == 5 && rows_here == kQuad) {
        dot_rows_m1(quad_blocks(a.packed, row0, a.k), so.data(), a.groups, xsum.data(), a.x,
                    a.k, out);
        for (int64_t i = 0; i < kQuad; ++i) a.y[row0 + i] = out[i];
        continue;
      }
#endif
      for (int64_t i = 0; i < rows_here; ++i) {
        const uint8_t* p = quad_blocks(a.packed, row0, a.k);
        const float* sc = so.data() + i * a.groups;
        for (int64_t r0 = 0; r0 < a.m; r0 += kTile) {
          const int64_t rows = std::min(kTile, a.m - r0);
          dot_rows(rows, p, quad_lane(i), sc, sc + kQuad * a.groups, xsum.data() + r0 * a.groups,
                   a.x + r0 * a.k, a.k, a.gshift, out);
          for (int64_t r = 0; r < rows; ++r) a.y[(r0 + r) * a.n + row0 + i] = out[r];
        }
      }
    }
  });
}

#if defined(PDSERVE_SIMD)
// Decode batches above the GEMV's rows: at::mm on a dequantised 64-row tile ran at 0.4x
// of its large-M speed there (a 32 x 64 x 576 product is all call overhead to MKL), so the
// register-blocked panel kernel (panel_gemm.h) multiplies the same fp32 rows instead. A
// kernel that kept the GEMV's order of summation (vector accumulators per output, a
// reduction and the offsets' term per output) measured no faster than the GEMV at K = 576.
void gemm_panels(const Int4Args& a) {
  panel_gemm::matmul(a.x, a.m, a.n, a.k, a.y, [&](int64_t r0, int64_t rows, float* out) {
    std::vector<float> buf(2 * a.groups);
    for (int64_t r = 0; r < rows; ++r)
      dequant_row(quad_blocks(a.packed, r0 + r, a.k), quad_lane(r0 + r),
                  a.scale + (r0 + r) * a.groups, a.offset + (r0 + r) * a.groups, a.k, a.gshift,
                  buf.data(), out + r * a.k);
  });
}
#endif

// Rows per task. Prefill-sized M: wide enough that at::mm runs near GEMM speed (64-row tiles
// left a 256-token prefill at 0.8x of the fp32 GEMM), narrow enough that every thread gets two
// tasks. Decode-sized M (which reaches here only in builds without the panel kernel) kept 64
// (wider tiles measured slower there).
int64_t gemm_rows(int64_t m, int64_t n) {
  if (m < kWideTileRows) return kGemmRowsMin;
  const int64_t per_task = (n + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  return std::clamp((per_task + 15) / 16 * 16, kGemmRowsMin, kGemmRowsMax);
}

void gemm(const Int4Args& a, const at::Tensor& x, at::Tensor& y) {
  const int64_t tile = gemm_rows(a.m, a.n);
  const int64_t tasks = (a.n + tile - 1) / tile;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    // Pool threads do not inherit the caller's inference mode: no autograd here. Each task
    // writes its own columns of y in place (a BLAS-strided view: no copy of its product).
    c10::InferenceMode guard;
    at::Tensor w = at::empty({tile, a.k}, x.options());
    std::vector<float> buf(2 * a.groups);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * tile, rows = std::min(tile, a.n - r0);
      float* wp = w.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        dequant_row(quad_blocks(a.packed, r0 + r, a.k), quad_lane(r0 + r),
                    a.scale + (r0 + r) * a.groups, a.offset + (r0 + r) * a.groups, a.k,
                    a.gshift, buf.data(), wp + r * a.k);
      at::Tensor cols = y.narrow(1, r0, rows);
      at::mm_out(cols, x, w.narrow(0, 0, rows).t());
    }
  });
}

// Prefill with oneDNN (onednn.h): the whole weight dequantised (rows split over the pool),
// then one oneDNN product, threaded inside, at 2x MKL's rate on AMD CPUs. The weight's fp32
// copy (K x N x 4 bytes, a few MiB) costs ~3% of the product at 1024 rows.
at::Tensor gemm_onednn(const Int4Args& a, const at::Tensor& x) {
  at::Tensor w = at::empty({a.n, a.k}, x.options());
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, a.n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * a.groups);
    for (int64_t r = begin; r < end; ++r)
      dequant_row(quad_blocks(a.packed, r, a.k), quad_lane(r), a.scale + r * a.groups,
                  a.offset + r * a.groups, a.k, a.gshift, buf.data(), wp + r * a.k);
  });
  return pdserve_onednn::product(x, w, std::nullopt);
}

int log2_exact(int64_t g) {
  int s = 0;
  while ((int64_t{1} << s) < g) ++s;
  return (int64_t{1} << s) == g ? s : -1;
}

void check_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                const at::Tensor& offset, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scale.dim() == 2 && offset.dim() == 2,
              "int4_linear: x [M, K], packed [N / 4, 2 K], scale and offset [N, K / group]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte &&
                  scale.scalar_type() == at::kHalf && offset.scalar_type() == at::kHalf,
              "int4_linear: x fp32, packed uint8, scale and offset fp16");
  const int64_t k = x.size(1), n = scale.size(0);
  TORCH_CHECK(group >= 16 && log2_exact(group) >= 0 && k % kBlock == 0 && k % group == 0,
              "int4_linear: group must be a power of two >= 16 and K a multiple of 32 and of "
              "the group");
  TORCH_CHECK(packed.size(0) == (n + kQuad - 1) / kQuad && packed.size(1) == kQuad * k / 2 &&
                  offset.size(0) == n &&
                  scale.size(1) == k / group && offset.size(1) == k / group,
              "int4_linear: shapes do not match");
}

// y = x @ w^T. `rowwise`: every row through one kernel whatever M, so a row's result is the
// same bits in a batch of any size, where the default switches kernels (and so rounding)
// past kGemvMaxRows and at panel_gemm::kMaxRows: the engine's batch-invariant mode. That kernel is the
// panel kernel where the build has it (one FMA chain per output, in either panel shape; near
// at::mm's speed at prefill sizes, but at batch 1 it computes a whole narrow panel: ~5x the
// GEMV in these matmuls), else the GEMV, whose rows are independent too.
at::Tensor multiply(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                    const at::Tensor& offset, int64_t group, bool rowwise) {
  check_args(x, packed, scale, offset, group);
  const at::Tensor xc = x.contiguous(), pc = packed.contiguous();
  const at::Tensor sc = scale.contiguous(), oc = offset.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = sc.size(0);
#if defined(PDSERVE_SIMD)
  const int64_t onednn_rows = panel_gemm::kMaxRows;
#else
  const int64_t onednn_rows = kWideTileRows;
#endif
  // Prefill-sized M through oneDNN, which returns its own output; every other path writes y.
  const bool onednn = !rowwise && m >= onednn_rows && pdserve_onednn::enabled();
  at::Tensor y = onednn ? at::Tensor() : at::empty({m, n}, xc.options());
  const Int4Args a{xc.data_ptr<float>(),
                   pc.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>()),
                   reinterpret_cast<const uint16_t*>(oc.data_ptr<at::Half>()),
                   onednn ? nullptr : y.data_ptr<float>(), m, n, k, k / group,
                   log2_exact(group)};
  if (onednn) return gemm_onednn(a, xc);
#if defined(PDSERVE_SIMD)
  if (rowwise) {
    gemm_panels(a);
  } else if (m <= kGemvMaxRows) {
    gemv(a);
  } else if (m < panel_gemm::kMaxRows) {
    gemm_panels(a);
  } else {
    gemm(a, xc, y);
  }
#else
  if (rowwise || m <= kGemvMaxRows) {
    gemv(a);
  } else {
    gemm(a, xc, y);
  }
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group) {
  return multiply(x, packed, scale, offset, group, false);
}

at::Tensor int4_linear_rowwise(const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& scale, const at::Tensor& offset,
                               int64_t group) {
  return multiply(x, packed, scale, offset, group, true);
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset, int64_t group) {
  const int64_t n = scale.size(0), k = packed.size(1) * 2 / kQuad;
  check_args(at::empty({0, k}, scale.options().dtype(at::kFloat)), packed, scale, offset, group);
  const at::Tensor pc = packed.contiguous(), sc = scale.contiguous(), oc = offset.contiguous();
  at::Tensor w = at::empty({n, k}, scale.options().dtype(at::kFloat));
  const auto* s = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  const auto* o = reinterpret_cast<const uint16_t*>(oc.data_ptr<at::Half>());
  const int gshift = log2_exact(group);
  std::vector<float> buf(2 * (k / group));
  for (int64_t r = 0; r < n; ++r)
    dequant_row(quad_blocks(pc.data_ptr<uint8_t>(), r, k), quad_lane(r), s + r * (k / group),
                o + r * (k / group), k, gshift, buf.data(), w.data_ptr<float>() + r * k);
  return w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_layers, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("int4_linear_rowwise(Tensor x, Tensor packed, Tensor scale, Tensor offset, int group) "
        "-> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, Tensor offset, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_layers, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_rowwise", &int4_linear_rowwise);
  m.impl("int4_dequantize", &int4_dequantize);
}

// bfloat16 products by a weight in panels of 32 output features, shared by nxdplug's C++
// operators (built with this folder on the include path by nxdplug.runtime.cpp_ops).
//
// A panel holds 32 output features (the last panel of a weight may be narrower) of an [out, in]
// weight with the in-feature pairs outermost, [in / 2][width][2]: one 64-byte read gives two
// in-features of 16 outputs, the operands of vdpbf16ps. The inductor backend stores bf16 linear
// weights so; the quantization plugin dequantizes a panel at a time into this layout for prompts.
//
// A panel is multiplied by 8 rows of x at a time over a stretch of its pairs (32 KB), then the
// next 8 rows by the same stretch while it is in the L1 cache. Sums are float32, rounded to bf16
// once (to nearest, ties to even). Tried and not kept: prefetches spread over every 8-row tile
// (3% slower for prompts), 16 rows x 16 outputs a tile for 9-16 rows (30% slower: 16 broadcasts
// to a weight vector).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nxdplug::panels {
namespace {

constexpr int64_t PANEL = 32;      // output features a panel holds
constexpr int64_t ROWS = 8;        // rows of x a tile multiplies
constexpr int64_t STRETCH = 256;   // k-pairs multiplied before the next 8 rows (32 KB of a panel)
constexpr int64_t PREFETCH = 256;  // k-pairs ahead of the one multiplied (32 KB)

// Whether this CPU runs the products (x86-64 with AVX512-BF16).
inline bool usable() {
#if defined(__x86_64__)
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

#if defined(__x86_64__)
#define NXDPLUG_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define NXDPLUG_BF16_INLINE NXDPLUG_BF16 __attribute__((always_inline)) inline

// What a tile writes: float32 partial sums to carry to the next stretch, or the bf16 result.
struct TileOutput {
  float* partial;      // [ROWS][PANEL], read unless `first`, written unless `last`
  bool first, last;
  uint16_t* out;       // row 0's first feature of this panel
  int64_t out_stride;  // out_features
  const float* bias;   // this panel's first feature's bias (float32), or nullptr
  int64_t width;       // features in this panel (PANEL but for the last)
};

// Two bf16 values as one 32-bit word (a copy, not a cast: the data are uint16_t).
inline int32_t two_values(const uint16_t* values) {
  int32_t word;
  std::memcpy(&word, values, sizeof(word));
  return word;
}

// One k-pair of a panel (`w`: its 32 outputs x 2 bf16; `low` / `high` mask a narrower last
// panel's two halves) multiplied by R rows' pair at `x` and added to their sums.
template <int R>
NXDPLUG_BF16_INLINE void add_pair(__m512 (&sums)[R][2], const uint16_t* x, int64_t x_stride,
                                  const uint16_t* w, bool full, __mmask32 low, __mmask32 high) {
  const __m512bh w0 =
      (__m512bh)(full ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi16(low, w));
  const __m512bh w1 =
      (__m512bh)(full ? _mm512_loadu_si512(w + 32) : _mm512_maskz_loadu_epi16(high, w + 32));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(two_values(x + r * x_stride));
    sums[r][0] = _mm512_dpbf16_ps(sums[r][0], xr, w0);
    sums[r][1] = _mm512_dpbf16_ps(sums[r][1], xr, w1);
  }
}

// `rows` (at most ROWS) rows of x, starting at x, by `pairs` k-pairs of one panel (`panel`
// points at the first pair; each pair is `width` features x 2 bf16). Rows below 4 keep two sets
// of sums (even and odd pairs) so that the adds do not wait on each other. Inlined into
// multiply_panel: GCC 12 compiles it on its own with its sums spilled to the stack, 2.5x slower.
template <int R>
NXDPLUG_BF16_INLINE void tile(const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                              int64_t pairs, const TileOutput& o) {
  constexpr int SETS = R < 4 ? 2 : 1;
  const bool full = o.width == PANEL;
  const int64_t pair_stride = 2 * o.width;
  const __mmask32 low =
      full ? ~0u : (__mmask32)((1ull << (2 * std::min<int64_t>(o.width, 16))) - 1);
  const __mmask32 high =
      full ? ~0u : (__mmask32)((1ull << (2 * std::max<int64_t>(o.width - 16, 0))) - 1);
  __m512 sums[SETS][R][2];
  for (int s = 0; s < SETS; ++s) {
    for (int r = 0; r < R; ++r) {
      const bool carried = s == 0 && !o.first;
      sums[s][r][0] = carried ? _mm512_loadu_ps(o.partial + r * PANEL) : _mm512_setzero_ps();
      sums[s][r][1] = carried ? _mm512_loadu_ps(o.partial + r * PANEL + 16) : _mm512_setzero_ps();
    }
  }
  int64_t p = 0;
  for (; p + SETS <= pairs; p += SETS) {
#pragma GCC unroll 2
    for (int s = 0; s < SETS; ++s) {
      const uint16_t* w = panel + (p + s) * pair_stride;
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH * pair_stride), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH * pair_stride + 32), _MM_HINT_T0);
      add_pair<R>(sums[s], x + 2 * (p + s), x_stride, w, full, low, high);
    }
  }
  for (; p < pairs; ++p) {  // an odd last pair when keeping two sets
    add_pair<R>(sums[0], x + 2 * p, x_stride, panel + p * pair_stride, full, low, high);
  }
  for (int r = 0; r < R; ++r) {
    for (int s = 1; s < SETS; ++s) {
      sums[0][r][0] = _mm512_add_ps(sums[0][r][0], sums[s][r][0]);
      sums[0][r][1] = _mm512_add_ps(sums[0][r][1], sums[s][r][1]);
    }
  }
  if (!o.last) {
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o.partial + r * PANEL, sums[0][r][0]);
      _mm512_storeu_ps(o.partial + r * PANEL + 16, sums[0][r][1]);
    }
    return;
  }
  const __mmask16 first_half = (__mmask16)((1u << std::min<int64_t>(o.width, 16)) - 1);
  const __mmask16 second_half = (__mmask16)((1u << std::max<int64_t>(o.width - 16, 0)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (o.bias != nullptr) {
    bias0 = _mm512_maskz_loadu_ps(first_half, o.bias);
    bias1 = _mm512_maskz_loadu_ps(second_half, o.bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    uint16_t* row = o.out + r * o.out_stride;
    const __m256bh low_out = _mm512_cvtneps_pbh(_mm512_add_ps(sums[0][r][0], bias0));
    const __m256bh high_out = _mm512_cvtneps_pbh(_mm512_add_ps(sums[0][r][1], bias1));
    _mm256_mask_storeu_epi16(row, first_half, (__m256i)low_out);
    _mm256_mask_storeu_epi16(row + 16, second_half, (__m256i)high_out);
  }
}

NXDPLUG_BF16_INLINE void rows_tile(int64_t rows, const uint16_t* x, int64_t x_stride,
                                   const uint16_t* panel, int64_t pairs, const TileOutput& o) {
  switch (rows) {
    case 1: return tile<1>(x, x_stride, panel, pairs, o);
    case 2: return tile<2>(x, x_stride, panel, pairs, o);
    case 3: return tile<3>(x, x_stride, panel, pairs, o);
    case 4: return tile<4>(x, x_stride, panel, pairs, o);
    case 5: return tile<5>(x, x_stride, panel, pairs, o);
    case 6: return tile<6>(x, x_stride, panel, pairs, o);
    case 7: return tile<7>(x, x_stride, panel, pairs, o);
    default: return tile<8>(x, x_stride, panel, pairs, o);
  }
}

// out[:, first_feature .. first_feature + width) (+ bias) = x [m, k] times one panel (k even):
// its pairs in stretches (one stretch when x has at most ROWS rows), every ROWS rows of x by a
// stretch before the next. `partial`: the caller's scratch, resized here.
NXDPLUG_BF16 inline void multiply_panel(const uint16_t* x, int64_t m, int64_t k,
                                        const uint16_t* panel, int64_t width, int64_t first_feature,
                                        int64_t n, const float* bias, uint16_t* out,
                                        std::vector<float>& partial) {
  const int64_t pairs = k / 2;
  const int64_t stretch = m <= ROWS ? pairs : STRETCH;
  if (m > ROWS) partial.resize(m * PANEL);
  for (int64_t p = 0; p < pairs; p += stretch) {
    const int64_t count = std::min(stretch, pairs - p);
    for (int64_t row = 0; row < m; row += ROWS) {
      const TileOutput o{partial.data() + row * PANEL, p == 0, p + count == pairs,
                         out + row * n + first_feature, n,
                         bias == nullptr ? nullptr : bias + first_feature, width};
      rows_tile(std::min(ROWS, m - row), x + row * k + 2 * p, k, panel + p * 2 * width, count, o);
    }
  }
}

// Panels [begin, end) of a weight [n, k] stored as consecutive panels, times x [m, k].
NXDPLUG_BF16 inline void multiply_panels(const uint16_t* x, int64_t m, int64_t k,
                                         const uint16_t* weight, int64_t n, const float* bias,
                                         uint16_t* out, int64_t begin, int64_t end) {
  std::vector<float> partial;
  for (int64_t panel = begin; panel < end; ++panel) {
    const int64_t first_feature = panel * PANEL;
    multiply_panel(x, m, k, weight + first_feature * k, std::min(PANEL, n - first_feature),
                   first_feature, n, bias, out, partial);
  }
}

// dst[j * dst_stride + i] = src[i * src_stride + j] for a 16 x 16 block of 32-bit words.
NXDPLUG_BF16 inline void transpose_words(const uint32_t* src, int64_t src_stride, uint32_t* dst,
                                         int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  // Within each 128-bit lane: rows 2i and 2i+1 interleaved by word...
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // ... then by pairs of words: u[4q + c] holds, in lane j, column 4j + c of rows 4q .. 4q+3.
  for (int q = 0; q < 4; ++q) {
    r[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    r[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    r[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  // Lanes gathered across registers: column 4j + c takes lane j of r[c], r[4 + c], r[8 + c],
  // r[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512i even01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    const __m512i odd01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i even23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(even01, even23, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(odd01, odd23, 0x88));
    _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(even01, even23, 0xDD));
    _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(odd01, odd23, 0xDD));
  }
}

// One panel from `width` (at most PANEL) bf16 rows of `k` values (k even), row i at
// rows + i * row_stride: the panel layout [k / 2][width][2].
NXDPLUG_BF16 inline void rows_to_panel(const uint16_t* rows, int64_t row_stride, int64_t width,
                                       int64_t k, uint16_t* panel) {
  const auto* words = reinterpret_cast<const uint32_t*>(rows);
  auto* out = reinterpret_cast<uint32_t*>(panel);
  const int64_t pairs = k / 2, word_stride = row_stride / 2;
  int64_t p = 0;
  if (width == PANEL && row_stride % 2 == 0) {
    for (; p + 16 <= pairs; p += 16)
      for (int64_t half = 0; half < PANEL; half += 16)
        transpose_words(words + half * word_stride + p, word_stride, out + p * PANEL + half, PANEL);
  }
  for (; p < pairs; ++p)
    for (int64_t i = 0; i < width; ++i) {
      uint32_t word;
      std::memcpy(&word, rows + i * row_stride + 2 * p, sizeof(word));
      out[p * width + i] = word;
    }
}

// out [m, n] = x [m, k] (k even) times a weight that is not held in panels: each thread takes
// whole panels, has `dequantize(first_row, width, rows)` write the panel's `width` weight rows
// as bf16 (row i at rows + i * row_stride, k values used), turns them into one panel in the
// cache and multiplies every row of x by it. No bf16 copy of the whole weight is made.
template <typename Dequantize>
void multiply_dequantized_panels(const uint16_t* x, int64_t m, int64_t k, int64_t n,
                                 int64_t row_stride, Dequantize&& dequantize, uint16_t* out) {
  at::parallel_for(0, (n + PANEL - 1) / PANEL, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> rows, panel;
    thread_local std::vector<float> partial;
    rows.resize(PANEL * row_stride);
    panel.resize(PANEL * k);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * PANEL, width = std::min(PANEL, n - first);
      dequantize(first, width, rows.data());
      rows_to_panel(rows.data(), row_stride, width, k, panel.data());
      multiply_panel(x, m, k, panel.data(), width, first, n, nullptr, out, partial);
    }
  });
}

#undef NXDPLUG_BF16_INLINE
#undef NXDPLUG_BF16
#endif  // __x86_64__

}  // namespace
}  // namespace nxdplug::panels

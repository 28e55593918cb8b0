// int4 weights in the plugin's own layout: a matmul that reads the weight in its 4 bits (an
// integer path for a few rows of x, bfloat16 dot products for more, and for prompts the weight
// dequantized a panel at a time for the bf16 panel kernel; see int4_matmul below), and the
// dequantization.
//
// A weight W [N, K] is W[n, k] = (u[n, k] - 8 - z[n, g]) * s[n, g] for unsigned nibbles u, a
// signed zero point z and a scale s (float16, or float32 in float32 models) per row and group g
// of `group` input features (32, or a multiple of 64; one group per row for per-channel scales).
// Symmetric weights have no zero points (the ops take None: z = 0, nothing read).
//
// The layout (int4.py's to_kernel_layout): K is padded with zero weights to Kp, a multiple of
// 128. Row n's packed bytes are Kp / 2 bytes in blocks of 64, byte i of block b holding column
// 128 b + i in its low nibble and column 128 b + 64 + i in its high nibble. The rows are in
// tiles of four, and a tile holds its rows' first blocks one after the other, then their second
// blocks, and so on (kernel.py's tile_rows, 64 bytes a lane): one sequential stream of memory. The
// last N % 4 rows are on their own. Scales and zero points (int8, when there are any) are
// [N, groups] in the same tiled order, one value a lane.
//
// The integer path: each 64-column chunk c of a row of x is scaled by a power of two a_c so that its
// largest magnitude is below 2^B, rounded to integers v, and v is written as D signed base-256
// digits (B = 8 D - 2; bfloat16 rows take D = 2, float32 rows D = 3). Then for each chunk
//   sum_k v_k u_k = sum_p 256^p sum_k d_pk u_k
// is integer arithmetic that AVX512-VNNI's vpdpbusd does 64 nibbles at a time (unsigned x signed
// bytes), converted to float once a chunk and scaled by s_g a_c. The zero terms, sum_g s_g
// (8 + z_g) sum_{k in g} a_c v_k, take one short dot product a row over the groups rather than
// work in the inner loop. Per 64 weights and row: D vpdpbusd and a handful of other
// instructions, against llama.cpp's q4_0 which rounds activations to 8 bits a block of 32: here
// a bfloat16 value within 2^-6 of its chunk's largest is taken exactly.
//
// Why not PyTorch's _weight_int4pack_mm_for_cpu: it converts the nibbles to floats, and read
// its weights at about a third of this machine's memory bandwidth (2026-11-28).
//
// x86 CPUs without AVX512-VNNI, and rows holding an infinity or a NaN, take a plain loop
// instead of the integer path; CPUs without AVX512-BF16 take the integer path instead of the
// bfloat16 one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <nxdplug_bf16_panels.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;            // columns per vpdpbusd, and per activation scale
constexpr int64_t kBlock = 2 * kChunk;    // columns per 64 packed bytes
constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kOffset = 8;            // u - kOffset is the signed 4-bit value
constexpr int64_t kBytesPerTask = 65536;  // packed bytes below which a thread is not worth it

template <typename T>
constexpr int kDigits = std::is_same_v<T, float> ? 3 : 2;

// Scales are float16 in bfloat16 and float16 models (half the bytes, 11 significant bits) and
// float32 in float32 ones (exactly a float32 checkpoint's).
inline float value(float s) { return s; }
inline float value(c10::Half s) { return static_cast<float>(s); }

// 4, 8 or up to 16 scales as floats.
template <typename S>
__attribute__((target("avx512f,avx512vl,f16c"), always_inline)) inline __m128 four_scales(
    const S* s) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm_loadu_ps(s);
  } else {
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  }
}
template <typename S>
__attribute__((target("avx512f,avx512vl,f16c"), always_inline)) inline __m256 eight_scales(
    const S* s) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(s);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
}
template <typename S>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512 scales_present(
    const S* s, __mmask16 present) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(present, s);
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, s));
  }
}

struct Layout {
  int64_t rows;        // N
  int64_t padded_k;    // Kp
  int64_t group;       // input features per scale
  int64_t groups;      // scales per row

  // Where the tiled value (row n, lane j of `width` elements, rows of `row` elements) is.
  int64_t tiled(int64_t n, int64_t lane, int64_t row, int64_t width) const {
    const int64_t tile_rows = n < rows / kRowsPerTile * kRowsPerTile ? kRowsPerTile : 1;
    const int64_t first = n - n % tile_rows;
    return first * row + lane * width * tile_rows + (n - first) * width;
  }
  int64_t byte_of(int64_t n, int64_t k) const {
    return tiled(n, k / kBlock, padded_k / 2, kChunk) + k % kChunk;
  }
  int64_t group_of(int64_t n, int64_t k) const { return tiled(n, k / group, groups, 1); }
};

// The zero points from `offset` on; nullptr (symmetric weights: none) stays nullptr.
inline const int8_t* zeros_from(const int8_t* zeros, int64_t offset) {
  return zeros == nullptr ? nullptr : zeros + offset;
}

// W[n, k] in float32.
template <typename S>
inline float weight_at(const uint8_t* packed, const S* scales, const int8_t* zeros,
                       const Layout& layout, int64_t n, int64_t k) {
  const uint8_t byte = packed[layout.byte_of(n, k)];
  const int u = k % kBlock < kChunk ? byte & 0xF : byte >> 4;
  const int64_t g = layout.group_of(n, k);
  const int z = zeros == nullptr ? 0 : zeros[g];
  return static_cast<float>(u - kOffset - z) * value(scales[g]);
}

// float to T, rounding to nearest even for bfloat16 without a branch (the values are finite).
template <typename T>
inline T from_float(float value) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(value);
  }
}

// ---- the matmul ---------------------------------------------------------------------------

// Activation rows as integer digits, reused by the calls of one thread.
struct Digits {
  int64_t padded_k = 0;
  int64_t groups = 0;
  int count = 0;
  std::vector<int8_t> planes;      // [M][count][Kp]
  std::vector<float> chunk_scale;  // [M][Kp / 64]: x = v * chunk_scale
  std::vector<float> group_sums;   // [M][groups][4]: sum over group g of v * chunk_scale

  int8_t* plane(int64_t m, int p) { return planes.data() + (m * count + p) * padded_k; }
  const int8_t* plane(int64_t m, int p) const {
    return planes.data() + (m * count + p) * padded_k;
  }
  const float* scales(int64_t m) const {
    return chunk_scale.data() + m * (padded_k / kChunk);
  }
  const float* sums(int64_t m) const { return group_sums.data() + m * groups * kRowsPerTile; }
};

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m512 load_floats(const T* data,
                                                                       __mmask16 mask) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, data);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, data);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// The lanes of a 16-float load that hold elements when `left` of them remain.
inline __mmask16 floats_present(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// The digits, chunk scales and group sums of x [rows, K]; false when x holds an infinity or a
// NaN, which integers cannot carry.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) bool fill_digits(const T* x, int64_t rows,
                                                                      int64_t K,
                                                                      const Layout& layout,
                                                                      Digits& digits) {
  constexpr int D = kDigits<T>;
  constexpr int B = 8 * D - 2;
  const int64_t Kp = layout.padded_k, chunks = Kp / kChunk;
  digits.count = D;
  digits.padded_k = Kp;
  digits.groups = layout.groups;
  digits.planes.assign(rows * D * Kp, 0);
  digits.chunk_scale.assign(rows * chunks, 0.f);
  digits.group_sums.assign(rows * layout.groups * kRowsPerTile, 0.f);
  const __m512i bias = _mm512_set1_epi32(128), low_byte = _mm512_set1_epi32(255);
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * K;
    float* sums = digits.group_sums.data() + m * layout.groups * kRowsPerTile;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * kChunk;
      __m512 largest = _mm512_setzero_ps();
      __mmask16 not_finite = 0;
      for (int64_t k = first; k < first + kChunk; k += 16) {
        const __mmask16 mask = floats_present(K - k);
        const __m512 magnitude = _mm512_abs_ps(load_floats(row + k, mask));
        not_finite |= _mm512_mask_cmp_ps_mask(mask, magnitude, infinity, _CMP_NLT_UQ);
        largest = _mm512_max_ps(largest, magnitude);
      }
      if (not_finite) return false;
      int exponent = 0;
      const float peak = _mm512_reduce_max_ps(largest);
      if (peak > 0.f) std::frexp(peak, &exponent);
      const float scale = std::ldexp(1.0f, exponent - B);
      digits.chunk_scale[m * chunks + c] = scale;
      const __m512 to_integer = _mm512_set1_ps(std::ldexp(1.0f, B - exponent));
      for (int64_t k = first; k < first + kChunk; k += 16) {
        __m512i v = _mm512_cvtps_epi32(
            _mm512_mul_ps(load_floats(row + k, floats_present(K - k)), to_integer));
        const float part = static_cast<float>(_mm512_reduce_add_epi32(v)) * scale;
        for (int r = 0; r < kRowsPerTile; ++r) sums[(k / layout.group) * kRowsPerTile + r] += part;
        for (int p = 0; p < D; ++p) {
          const __m512i digit =
              _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, bias), low_byte), bias);
          _mm512_mask_cvtepi32_storeu_epi8(digits.plane(m, p) + k, 0xFFFF, digit);
          v = _mm512_srai_epi32(_mm512_sub_epi32(v, digit), 8);
        }
      }
    }
  }
  return true;
}

// sum_k v_k u_k of one chunk, per lane: the digit planes' products combined, 256^p each.
template <int D>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline __m512i chunk_products(
    __m512i u, const __m512i (&d)[D]) {
  __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, d[D - 1]);
  for (int p = D - 2; p >= 0; --p) t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), u, d[p]);
  return t;
}

// s_g a_c for chunk c of each row of a tile, lane by lane (groups of 32: lanes 0-7 hold group
// 2c's, 8-15 group 2c + 1's). `scales` holds the tile's [groups][R] values: the R rows' scales of
// a group are one load, scaled once, then spread to each row's register.
template <int R, bool kPairs, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) inline void chunk_scales(
    const S* scales, int64_t c, int64_t group, __m512 a, __m512 (&s)[R]) {
  if constexpr (R == kRowsPerTile) {
    if constexpr (kPairs) {
      // [group 2c: rows 0-3, group 2c + 1: rows 0-3]
      const __m512 both =
          _mm512_mul_ps(_mm512_castps256_ps512(eight_scales(scales + 2 * c * R)), a);
      for (int r = 0; r < R; ++r)
        s[r] = _mm512_permutexvar_ps(
            _mm512_set_epi32(4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, r, r, r, r,
                             r, r, r, r),
            both);
    } else {
      const __m512 rows =
          _mm512_mul_ps(_mm512_castps128_ps512(four_scales(scales + (c * kChunk / group) * R)), a);
      for (int r = 0; r < R; ++r) s[r] = _mm512_permutexvar_ps(_mm512_set1_epi32(r), rows);
    }
  } else if constexpr (kPairs) {
    s[0] = _mm512_mul_ps(_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(value(scales[2 * c])),
                                              _mm512_set1_ps(value(scales[2 * c + 1]))),
                         a);
  } else {
    s[0] = _mm512_mul_ps(_mm512_set1_ps(value(scales[c * kChunk / group])), a);
  }
}

// out[m, n .. n + R) for a tile of R rows (R = 4, or 1 for a last row): `tile` its packed bytes,
// `scales` and `zeros` its [groups][R] values (`zeros` nullptr: none). Group 32 (`kPairs`) puts
// two groups in a chunk.
template <int D, int R, bool kPairs, typename T, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void vnni_tile(
    const Digits& digits, int64_t m, const uint8_t* tile, const S* scales,
    const int8_t* zeros, const Layout& layout, T* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t Kp = layout.padded_k;
  const float* chunk_scale = digits.scales(m);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    __m512i nibbles[2][R];
    for (int r = 0; r < R; ++r) {
      const __m512i bytes = _mm512_loadu_si512(tile + (b * R + r) * kChunk);
      nibbles[0][r] = _mm512_and_si512(bytes, low4);
      nibbles[1][r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t c = 2 * b + h;
      __m512i d[D];
      for (int p = 0; p < D; ++p) d[p] = _mm512_loadu_si512(digits.plane(m, p) + c * kChunk);
      __m512 s[R];
      chunk_scales<R, kPairs>(scales, c, layout.group, _mm512_set1_ps(chunk_scale[c]), s);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_products<D>(nibbles[h][r], d)), s[r],
                                 acc[r]);
    }
  }
  // The zero terms: sum_g s_g (8 + z_g) sum_{k in g} x_k, over [groups][R] values.
  const float* sums = digits.sums(m);
  float zero_terms[R] = {};
  if constexpr (R == kRowsPerTile) {
    __m512 terms = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi32(kOffset);
    const int64_t values = layout.groups * R;
    for (int64_t j = 0; j < values; j += 16) {
      const __mmask16 mask = floats_present(values - j);
      const __m512 s = scales_present(scales + j, mask);
      const __m512i z = zeros == nullptr
                            ? _mm512_setzero_si512()
                            : _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, zeros + j));
      const __m512 o = _mm512_cvtepi32_ps(_mm512_add_epi32(z, offset));
      terms = _mm512_fmadd_ps(_mm512_mul_ps(s, o), _mm512_maskz_loadu_ps(mask, sums + j), terms);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, terms);
    for (int i = 0; i < 16; ++i) zero_terms[i % R] += lanes[i];
  } else {
    for (int64_t g = 0; g < layout.groups; ++g) {
      const int z = zeros == nullptr ? 0 : zeros[g];
      zero_terms[0] += value(scales[g]) * static_cast<float>(kOffset + z) * sums[g * kRowsPerTile];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = static_cast<T>(_mm512_reduce_add_ps(acc[r]) - zero_terms[r]);
}

// Each thread takes whole tiles and runs every row of x over a tile while it is in the L1
// cache, so that the weight is read from memory once whatever the rows. False, with nothing
// written, when x is not all finite.
template <bool kPairs, typename T, typename S>
bool vnni_matmul(const T* x, int64_t rows, int64_t K, const uint8_t* packed, const S* scales,
                 const int8_t* zeros, const Layout& layout, T* out) {
  constexpr int D = kDigits<T>;
  thread_local Digits this_thread;
  Digits& digits = this_thread;  // the caller's, which the workers below must read, not theirs
  if (!fill_digits(x, rows, K, layout, digits)) return false;
  const int64_t N = layout.rows, row_bytes = layout.padded_k / 2;
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (kRowsPerTile * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kRowsPerTile;
      for (int64_t m = 0; m < rows; ++m) {
        if (n + kRowsPerTile <= N) {
          vnni_tile<D, kRowsPerTile, kPairs>(digits, m, packed + n * row_bytes,
                                             scales + n * layout.groups,
                                             zeros_from(zeros, n * layout.groups), layout,
                                             out + m * N + n);
        } else {
          for (int64_t i = n; i < N; ++i)
            vnni_tile<D, 1, kPairs>(digits, m, packed + i * row_bytes, scales + i * layout.groups,
                                    zeros_from(zeros, i * layout.groups), layout,
                                    out + m * N + i);
        }
      }
    }
  });
  return true;
}

template <typename T, typename S>
void plain_matmul(const T* x, int64_t rows, int64_t K, const uint8_t* packed, const S* scales,
                  const int8_t* zeros, const Layout& layout, T* out) {
  const int64_t N = layout.rows;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < rows; ++m) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k)
          sum += static_cast<float>(x[m * K + k]) * weight_at(packed, scales, zeros, layout, n, k);
        out[m * N + n] = static_cast<T>(sum);
      }
  });
}

// ---- several bfloat16 rows: dequantize a tile once, then bfloat16 dot products --------------
//
// The integer path costs about as much for each row of x as for the first. With more rows it
// pays to dequantize each tile of weights once, to bfloat16 in the L1 cache (a 16-entry table
// of a group's values, (u - 8 - z) s rounded as the dequantization rounds them, looked up 32
// nibbles at a time), and multiply every row by it with AVX512-BF16's vdpbf16ps: products
// exact in float32, sums in float32, as a bfloat16 GEMM by the dequantized weight computes.

constexpr int64_t kDotColumns = 32;  // bfloat16 pairs per vdpbf16ps
constexpr int64_t kDotRowsAtOnce = 4;  // rows of x sharing each load of the tile

// Each row's table of a group's 16 values, (u - 8 - z) s in bfloat16 (z = 0 when `zeros` is
// nullptr). The tile's [groups][R] layout puts a group's R scales and zero points side by side:
// one load each, spread by row.
template <int R, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void
group_tables(const S* scales, const int8_t* zeros, int64_t g, __m512i (&tables)[R]) {
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 present = static_cast<__mmask16>((1u << R) - 1);
  const __m512 s = scales_present(scales + g * R, present);
  const __m512i z = zeros == nullptr
                        ? _mm512_setzero_si512()
                        : _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(present, zeros + g * R));
  const __m512 o = _mm512_cvtepi32_ps(_mm512_add_epi32(z, _mm512_set1_epi32(kOffset)));
  for (int r = 0; r < R; ++r) {
    const __m512i row = _mm512_set1_epi32(r);
    const __m256bh table = _mm512_cvtneps_pbh(
        _mm512_mul_ps(_mm512_sub_ps(values, _mm512_permutexvar_ps(row, o)),
                      _mm512_permutexvar_ps(row, s)));
    tables[r] = _mm512_castsi256_si512((__m256i)table);
  }
}

// The tile's rows [R][Kp] in bfloat16, each value (u - 8 - z) s rounded as the dequantization
// rounds it.
template <int R, typename S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dequantize_tile_bf16(
    const uint8_t* tile, const S* scales, const int8_t* zeros, const Layout& layout,
    c10::BFloat16* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int64_t Kp = layout.padded_k;
  __m512i tables[R];
  int64_t tables_group = -1;
  for (int64_t b = 0; b < Kp / kBlock; ++b) {
    __m512i halves[R][2];
    for (int r = 0; r < R; ++r) {
      const __m512i bytes = _mm512_loadu_si512(tile + (b * R + r) * kChunk);
      halves[r][0] = _mm512_and_si512(bytes, low4);
      halves[r][1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    }
    for (int q = 0; q < kBlock / kDotColumns; ++q) {
      const int64_t column = b * kBlock + q * kDotColumns;
      const int64_t g = column / layout.group;
      if (g != tables_group) {
        group_tables<R>(scales, zeros, g, tables);
        tables_group = g;
      }
      for (int r = 0; r < R; ++r) {
        const __m512i nibbles = halves[r][q / 2];
        const __m256i quarter =
            q % 2 ? _mm512_extracti64x4_epi64(nibbles, 1) : _mm512_castsi512_si256(nibbles);
        const __m512i words = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(quarter), tables[r]);
        _mm512_storeu_si512(w + r * Kp + column, words);
      }
    }
  }
}

// out[m0 .. m0 + MC, n .. n + R) from the tile's bfloat16 rows and x's padded rows.
template <int R, int MC>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile_dot_products(
    const c10::BFloat16* w, const c10::BFloat16* x, int64_t m0, int64_t Kp, int64_t N,
    c10::BFloat16* out) {
  __m512 acc[MC][R];
  for (int i = 0; i < MC; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += kDotColumns) {
    __m512bh rows[R];
    for (int r = 0; r < R; ++r) rows[r] = (__m512bh)_mm512_loadu_si512(w + r * Kp + k);
    for (int i = 0; i < MC; ++i) {
      const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * Kp + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], rows[r], xs);
    }
  }
  for (int i = 0; i < MC; ++i) {
    if constexpr (R == kRowsPerTile) {
      // The four sums of a row of x at once, pairwise across registers (about 10 instructions
      // against four reductions of 8), rounded to bfloat16 together.
      const __m512 pairs01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[i][0], acc[i][1]),
                                           _mm512_unpackhi_ps(acc[i][0], acc[i][1]));
      const __m512 pairs23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[i][2], acc[i][3]),
                                           _mm512_unpackhi_ps(acc[i][2], acc[i][3]));
      // Each 128-bit lane now holds one partial sum of outputs 0, 1, 2, 3, in that order.
      const __m512d low01 = _mm512_castps_pd(pairs01), low23 = _mm512_castps_pd(pairs23);
      const __m512 quads = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(low01, low23)),
                                         _mm512_castpd_ps(_mm512_unpackhi_pd(low01, low23)));
      const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(quads), 1));
      const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(quads), high);
      const __m128 totals =
          _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (m0 + i) * N),
                       (__m128i)_mm_cvtneps_pbh(totals));
    } else {
      for (int r = 0; r < R; ++r)
        out[(m0 + i) * N + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[i][r]));
    }
  }
}

template <int R>
void tile_products(const c10::BFloat16* w, const c10::BFloat16* x, int64_t rows, int64_t Kp,
                   int64_t N, c10::BFloat16* out) {
  for (int64_t m0 = 0; m0 < rows; m0 += kDotRowsAtOnce) {
    switch (std::min(kDotRowsAtOnce, rows - m0)) {
      case 4: tile_dot_products<R, 4>(w, x, m0, Kp, N, out); break;
      case 3: tile_dot_products<R, 3>(w, x, m0, Kp, N, out); break;
      case 2: tile_dot_products<R, 2>(w, x, m0, Kp, N, out); break;
      default: tile_dot_products<R, 1>(w, x, m0, Kp, N, out); break;
    }
  }
}

template <typename S>
void bf16_matmul(const c10::BFloat16* x, int64_t rows, int64_t K, const uint8_t* packed,
                 const S* scales, const int8_t* zeros, const Layout& layout,
                 c10::BFloat16* out) {
  const int64_t N = layout.rows, Kp = layout.padded_k, row_bytes = Kp / 2;
  thread_local std::vector<c10::BFloat16> this_thread;
  std::vector<c10::BFloat16>& padded = this_thread;  // the caller's, read by the workers
  padded.assign(rows * Kp, c10::BFloat16(0.f));
  for (int64_t m = 0; m < rows; ++m) std::copy(x + m * K, x + (m + 1) * K, padded.data() + m * Kp);
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (kRowsPerTile * row_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<c10::BFloat16> tile_weights;
    tile_weights.resize(kRowsPerTile * Kp);
    c10::BFloat16* w = tile_weights.data();
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kRowsPerTile;
      if (n + kRowsPerTile <= N) {
        dequantize_tile_bf16<kRowsPerTile>(packed + n * row_bytes, scales + n * layout.groups,
                                           zeros_from(zeros, n * layout.groups), layout, w);
        tile_products<kRowsPerTile>(w, padded.data(), rows, Kp, N, out + n);
      } else {
        for (int64_t i = n; i < N; ++i) {
          dequantize_tile_bf16<1>(packed + i * row_bytes, scales + i * layout.groups,
                                  zeros_from(zeros, i * layout.groups), layout, w);
          tile_products<1>(w, padded.data(), rows, Kp, N, out + i);
        }
      }
    }
  });
}

// ---- prompts: a panel of 32 rows at a time, dequantized for the bf16 panel kernel ------------
//
// With more rows the dot products' reductions and their reloading of x for every tile of four
// rows cost more than the products: there the weight goes a panel of 32 rows at a time
// through the bfloat16 dequantization above into the panel layout of nxdplug_bf16_panels.h (the
// inductor backend's kernel for bf16 weights) in the cache, and every row is multiplied by it.
// No bfloat16 copy of the whole weight is written to memory and read back.
template <typename S>
void panel_matmul(const c10::BFloat16* x, int64_t rows, int64_t K, const uint8_t* packed,
                  const S* scales, const int8_t* zeros, const Layout& layout,
                  c10::BFloat16* out) {
  const int64_t N = layout.rows, Kp = layout.padded_k, row_bytes = Kp / 2;
  const auto dequantize_panel = [&](int64_t first, int64_t width, uint16_t* dense) {
    for (int64_t n = first; n < first + width;) {
      auto* w = reinterpret_cast<c10::BFloat16*>(dense) + (n - first) * Kp;
      const uint8_t* tile = packed + n * row_bytes;
      const S* s = scales + n * layout.groups;
      const int8_t* z = zeros_from(zeros, n * layout.groups);
      if (n + kRowsPerTile <= N) {
        dequantize_tile_bf16<kRowsPerTile>(tile, s, z, layout, w);
        n += kRowsPerTile;
      } else {
        dequantize_tile_bf16<1>(tile, s, z, layout, w);
        n += 1;
      }
    }
  };
  nxdplug::panels::multiply_dequantized_panels(reinterpret_cast<const uint16_t*>(x), rows, K, N,
                                               Kp, dequantize_panel,
                                               reinterpret_cast<uint16_t*>(out));
}

bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bf16") &&
                                std::getenv("NXDPLUG_INT4_MATMUL_PORTABLE") == nullptr;
  return supported;
}

// NXDPLUG_INT4_MATMUL_PORTABLE=1 takes the plain loop on any CPU (to check it where it would
// not otherwise run).
bool has_vnni() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512vnni") &&
                                std::getenv("NXDPLUG_INT4_MATMUL_PORTABLE") == nullptr;
  return supported;
}

template <typename T, typename S>
void matmul(const T* x, int64_t rows, int64_t K, const uint8_t* packed, const S* scales,
            const int8_t* zeros, const Layout& layout, T* out) {
  const bool pairs = layout.group == kChunk / 2;
  // Infinities and NaNs take the plain loop too, which carries them to the output.
  const bool done = has_vnni() &&
                    (pairs ? vnni_matmul<true>(x, rows, K, packed, scales, zeros, layout, out)
                           : vnni_matmul<false>(x, rows, K, packed, scales, zeros, layout, out));
  if (!done) plain_matmul(x, rows, K, packed, scales, zeros, layout, out);
}

// f(S{}) with S the scales' element type, float or c10::Half.
template <typename F>
auto with_scale_type(const at::Tensor& scales, F&& f) {
  if (scales.scalar_type() == at::kFloat) return f(float{});
  return f(c10::Half{});
}

// The zero points' data, nullptr for none (symmetric weights).
const int8_t* zero_data(const std::optional<at::Tensor>& zero_points) {
  return zero_points.has_value() ? zero_points->data_ptr<int8_t>() : nullptr;
}

Layout checked_layout(const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zero_points, int64_t group,
                      const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              op, ": a contiguous uint8 [out, in / 2] weight expected, got ", packed.sizes());
  const int64_t N = packed.size(0), Kp = packed.size(1) * 2;
  TORCH_CHECK(Kp % kBlock == 0, op, ": in features padded to a multiple of ", kBlock,
              " expected, got ", Kp);
  TORCH_CHECK(group == kChunk / 2 || (group > 0 && group % kChunk == 0), op,
              ": groups of 32 or a multiple of 64 input features expected, got ", group);
  const int64_t groups = (Kp + group - 1) / group;
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
                  scales.is_contiguous() &&
                  scales.numel() == N * groups,
              op, ": float16 or float32 scales [", N, ", ", groups, "] expected, got ",
              scales.scalar_type(),
              " ", scales.sizes());
  if (zero_points.has_value()) {
    const at::Tensor& z = *zero_points;
    TORCH_CHECK(z.scalar_type() == at::kChar && z.is_contiguous() && z.numel() == N * groups,
                op, ": int8 zero points [", N, ", ", groups, "] (or None) expected, got ",
                z.scalar_type(), " ", z.sizes());
  }
  TORCH_CHECK(packed.device().is_cpu(), op, ": CPU tensors only");
  return Layout{N, Kp, group, groups};
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zero_points, int64_t group,
                           int64_t in_features, at::ScalarType dtype);

// Which way a product of `rows` rows goes. The integer path's cost grows by about a GEMV a row;
// the bfloat16 dot products dequantize each tile once, then cost about a fifth of that a row;
// the panels (from kPanelRows bfloat16 rows) cost about what the bf16 panel kernel does, plus
// a dequantization of each panel; float32 rows past kIntegerMaxRows get the whole weight
// dequantized for a GEMM. Measured on this machine's 2 cores, forty 2048x768 and 768x2048 weights
// in groups of 32, bfloat16 rows: integer 5.1, 6.9, 10.0 ms at 4, 5, 8 rows, dot products 5.7,
// 6.0, 7.1. One thread, a Llama-120m layer's four weights (2026-11-29): dot products 1.53, 2.69,
// 9.34 ms at 16, 32, 128 rows, panels 1.59, 2.57, 7.84 (the bf16 panel kernel: 0.92, 1.89, 7.2).
constexpr int64_t kBf16DotRows = 5;     // from here bfloat16 rows take the dot products,
constexpr int64_t kPanelRows = 24;      // from here the panels
constexpr int64_t kIntegerMaxRows = 24;  // float32 rows take the integer path up to here

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zero_points, int64_t group) {
  const Layout layout = checked_layout(packed, scales, zero_points, group, "int4_matmul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= layout.padded_k, "int4_matmul: x [M, K <= ",
              layout.padded_k, "] expected, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_matmul: float32 or bfloat16 x expected, got ", x.scalar_type());
  const int64_t rows = x.size(0), K = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (bf16 && rows >= kPanelRows && K % 2 == 0 && has_bf16_dot()) {
    at::Tensor out = at::empty({rows, layout.rows}, x.options());
    const at::Tensor inputs = x.contiguous();
    with_scale_type(scales, [&](auto type) {
      using S = decltype(type);
      panel_matmul(inputs.data_ptr<c10::BFloat16>(), rows, K, packed.data_ptr<uint8_t>(),
                   scales.data_ptr<S>(), zero_data(zero_points), layout,
                   out.data_ptr<c10::BFloat16>());
    });
    return out;
  }
  const bool dot = bf16 && rows >= kBf16DotRows && has_bf16_dot();
  if (!dot && rows > kIntegerMaxRows) {
    return at::linear(x, int4_dequantize(packed, scales, zero_points, group, K,
                                         x.scalar_type()));
  }
  const at::Tensor inputs = x.contiguous();
  at::Tensor out = at::empty({rows, layout.rows}, x.options());
  const auto* bytes = packed.data_ptr<uint8_t>();
  const int8_t* z = zero_data(zero_points);
  with_scale_type(scales, [&](auto type) {
    using S = decltype(type);
    const S* s = scales.data_ptr<S>();
    if (dot) {
      bf16_matmul(inputs.data_ptr<c10::BFloat16>(), rows, K, bytes, s, z, layout,
                  out.data_ptr<c10::BFloat16>());
    } else if (bf16) {
      matmul(inputs.data_ptr<c10::BFloat16>(), rows, K, bytes, s, z, layout,
             out.data_ptr<c10::BFloat16>());
    } else {
      matmul(inputs.data_ptr<float>(), rows, K, bytes, s, z, layout, out.data_ptr<float>());
    }
  });
  return out;
}

// ---- the dequantization -------------------------------------------------------------------

// Rows [n, n + R) of W [N, in_features]: block b of row r holds 128 columns.
template <int R, typename T, typename S>
void dequantize_tile(const uint8_t* tile, const S* scales, const int8_t* zeros,
                     const Layout& layout, int64_t in_features, T* out) {
  for (int64_t b = 0; b < layout.padded_k / kBlock; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* bytes = tile + (b * R + r) * kChunk;
      T* row = out + r * in_features;
      for (int h = 0; h < 2; ++h) {
        const int64_t first = b * kBlock + h * kChunk;
        const int64_t count = std::min<int64_t>(kChunk, in_features - first);
        if (count <= 0) break;
        // A chunk lies in one group, or (groups of 32) in two.
        for (int64_t half = 0; half < count; half += layout.group < kChunk ? layout.group : kChunk) {
          const int64_t g = (first + half) / layout.group;
          const float s = value(scales[g * R + r]);
          const int z = zeros == nullptr ? 0 : zeros[g * R + r];
          const float o = static_cast<float>(kOffset + z);
          const int64_t end = std::min<int64_t>(count, half + std::min(layout.group, kChunk));
          for (int64_t i = half; i < end; ++i) {
            const int u = h == 0 ? bytes[i] & 0xF : bytes[i] >> 4;
            row[first + i] = from_float<T>((static_cast<float>(u) - o) * s);
          }
        }
      }
    }
  }
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zero_points, int64_t group,
                           int64_t in_features, at::ScalarType dtype) {
  const Layout layout = checked_layout(packed, scales, zero_points, group, "int4_dequantize");
  TORCH_CHECK(in_features > 0 && in_features <= layout.padded_k,
              "int4_dequantize: in_features in 1..", layout.padded_k, " expected, got ",
              in_features);
  const int64_t N = layout.rows, row_bytes = layout.padded_k / 2;
  at::Tensor out = at::empty({N, in_features}, packed.options().dtype(dtype));
  const auto* bytes = packed.data_ptr<uint8_t>();
  const int8_t* z = zero_data(zero_points);
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int4_dequantize", [&] {
    scalar_t* w = out.data_ptr<scalar_t>();
    with_scale_type(scales, [&](auto type) {
      const auto* s = scales.data_ptr<decltype(type)>();
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t tile = begin; tile < end; ++tile) {
          const int64_t n = tile * kRowsPerTile;
          if (n + kRowsPerTile <= N) {
            dequantize_tile<kRowsPerTile>(bytes + n * row_bytes, s + n * layout.groups,
                                          zeros_from(z, n * layout.groups), layout,
                                          in_features, w + n * in_features);
          } else {
            for (int64_t i = n; i < N; ++i)
              dequantize_tile<1>(bytes + i * row_bytes, s + i * layout.groups,
                                 zeros_from(z, i * layout.groups), layout, in_features,
                                 w + i * in_features);
          }
        }
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nxdplug_int4, m) {
  // x [M, K] times W^T -> [M, out], in x's dtype; zero_points None for symmetric weights.
  m.def("int4_matmul(Tensor x, Tensor packed, Tensor scales, Tensor? zero_points, int group) "
        "-> Tensor");
  // -> W [out, in_features] in dtype.
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor? zero_points, int group, "
        "int in_features, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdplug_int4, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
}

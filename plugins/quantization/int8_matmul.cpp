// out[m, n] = scale[n] * sum_k x[m, k] * weight[n, k] for a few rows of x (decoding) and an int8
// weight [N, K]: the weight is read once, in its 8 bits, and never widened to a float copy.
//
// Why not PyTorch's _weight_int8pack_mm: it converts every weight byte to float32 for an FMA
// (three vector instructions per 16 weights), which keeps it well under memory bandwidth on an
// AVX-512 CPU (~16 GB/s of weights a core on a Zen 4); and it reads out of bounds (a crash) for
// bfloat16 inputs of 4 or more rows when K is not a multiple of 32 (torch 2.13).
//
// Here the activations become integers instead: each row of x is scaled by a power of two so
// that its largest magnitude is below 2^B, rounded to an integer v, and v is written as D signed
// base-256 digits, v = sum_p 256^p d_p (each in [-128, 127]); B = 8 D - 2. Then
//   sum_k v_k w_k = sum_p 256^p sum_k d_pk w_k
// and each inner sum is integer arithmetic that AVX512-VNNI's vpdpbusd does 64 bytes at a time
// (unsigned x signed bytes, so the weight goes in as w + 128 and 128 * sum_k d_pk comes off).
// The integer sums are exact; the only roundings are v's, at 2^-B of the row's largest value,
// and one float64 product with the two scales at the end. bfloat16 rows take D = 3 (B = 22:
// every element within 2^-14 of the largest is taken exactly), float32 rows D = 4 (B = 30).
// D vpdpbusd per 64 weights and row, against twelve instructions in the float32 way.
//
// The weight is read in the tiled order the layers hold it in (kernel.py's tile_rows): the rows
// in tiles of four, and within a tile the four rows' first 64 bytes, then their next 64, ...,
// then the four rows' last K % 64 bytes; the last N % 4 rows as they are. A tile is then one
// sequential stream, which the CPU's prefetchers follow: reading the four rows as four streams
// ran at 10-13 GB/s on 2 cores of this machine's EPYC, the tiled order at 21-31 (100 MB of
// cold weights, /tmp benchmark, 2026-11-29).
//
// The integer path costs about a GEMV for each row of x. From kPanelRows bfloat16 rows (prompts)
// the weight goes a panel of 32 rows at a time, dequantized into the bfloat16 panel layout in the
// cache, to the bf16 panel kernel (nxdplug_bf16_panels.h, the inductor backend's kernel for bf16
// weights), which multiplies every row by it: no bfloat16 copy of the whole weight is written to
// memory and read back. Float32 rows past kIntegerMaxRows, and CPUs without AVX512-BF16, get the
// whole weight dequantized for ATen's GEMM.
//
// x86 CPUs without AVX512-VNNI take a plain loop (float32 accumulation) for the rows the integer
// path would take; other CPUs do not build this file, and the layers dequantize instead.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <nxdplug_bf16_panels.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLane = 64;         // weight bytes per vpdpbusd
constexpr int64_t kMaxK = 65536;      // |sum of K products of 255 x 128| stays in int32
constexpr int64_t kRowsPerTile = 4;   // weight rows that share each digit load, tiled together
constexpr int64_t kBytesPerTask = 65536;  // weight bytes below which a thread is not worth it
// Measured on this machine (one thread, a Llama-120m layer's four weights: the integer path
// takes 1.07 ms at 8 rows, 2.2 at 16, 4.3 at 32; the panels 1.09, 1.6, 2.4, then 1.1x the bf16
// panel kernel's time at 128 rows and 1.02x at 512; 2026-11-29):
constexpr int64_t kPanelRows = 12;       // bfloat16 rows from here take the panels
constexpr int64_t kIntegerMaxRows = 32;  // other rows take a GEMM past here

// Digits per activation: enough for a bfloat16 row's 8 significant bits well below its largest
// value; float32 rows get one more.
template <typename T>
constexpr int kDigits = std::is_same_v<T, float> ? 4 : 3;

// Activation rows as integer digits, zero-padded to a multiple of kLane. Reused by the calls of
// one thread, so that decoding allocates nothing here.
struct Digits {
  int count = 0;
  int64_t padded_k = 0;
  std::vector<int8_t> planes;     // [M][count][padded_k]
  std::vector<int64_t> sums;      // [M][count]: sum_k d_pk
  std::vector<double> row_scale;  // [M]: x = v * row_scale

  const int8_t* plane(int64_t m, int p) const {
    return planes.data() + (m * count + p) * padded_k;
  }
  int8_t* plane(int64_t m, int p) { return planes.data() + (m * count + p) * padded_k; }
  int64_t& sum(int64_t m, int p) { return sums[m * count + p]; }
  int64_t sum(int64_t m, int p) const { return sums[m * count + p]; }
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
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// v = round(x * 2^(B - e)) with |x| < 2^e, as D signed base-256 digits per element; false (and
// the digits unusable) when x holds an infinity or a NaN, which integers cannot carry.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) bool fill_digits(const T* x, int64_t rows,
                                                                      int64_t K, Digits& digits) {
  constexpr int D = kDigits<T>;
  constexpr int B = 8 * D - 2;
  digits.count = D;
  digits.padded_k = (K + kLane - 1) / kLane * kLane;
  digits.planes.assign(rows * D * digits.padded_k, 0);
  digits.sums.assign(rows * D, 0);
  digits.row_scale.assign(rows, 1.0);
  const __m512i bias = _mm512_set1_epi32(128), low_byte = _mm512_set1_epi32(255);
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * K;
    __m512 largest = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = floats_present(K - k);
      const __m512 magnitude = _mm512_abs_ps(load_floats(row + k, mask));
      not_finite |= _mm512_mask_cmp_ps_mask(mask, magnitude, infinity, _CMP_NLT_UQ);
      largest = _mm512_max_ps(largest, magnitude);
    }
    if (not_finite) return false;
    int exponent = 0;
    const float peak = _mm512_reduce_max_ps(largest);
    if (peak > 0.f) std::frexp(peak, &exponent);
    const __m512 to_integer = _mm512_set1_ps(std::ldexp(1.0f, B - exponent));
    digits.row_scale[m] = std::ldexp(1.0, exponent - B);
    __m512i sums[D];
    for (int p = 0; p < D; ++p) sums[p] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = floats_present(K - k);
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_floats(row + k, mask), to_integer));
      for (int p = 0; p < D; ++p) {
        const __m512i digit =
            _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, bias), low_byte), bias);
        _mm512_mask_cvtepi32_storeu_epi8(digits.plane(m, p) + k, mask, digit);
        sums[p] = _mm512_add_epi32(sums[p], digit);
        v = _mm512_srai_epi32(_mm512_sub_epi32(v, digit), 8);
      }
    }
    for (int p = 0; p < D; ++p) digits.sum(m, p) = _mm512_reduce_add_epi32(sums[p]);
  }
  return true;
}

// sums[p][r] += the 64 products of digit plane p (row m, from k) with weight lane w[r].
template <int D, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline void accumulate(
    __m512i (&sums)[D][R], const __m512i (&w)[R], const Digits& digits, int64_t m, int64_t k) {
  for (int p = 0; p < D; ++p) {
    const __m512i d = _mm512_loadu_si512(digits.plane(m, p) + k);
    for (int r = 0; r < R; ++r) sums[p][r] = _mm512_dpbusd_epi32(sums[p][r], w[r], d);
  }
}

// totals[r] = the sum of the 16 lanes of sums[r]. Four rows are summed together, pairwise
// across registers (13 instructions against 4 separate reductions of 7 each), which matters
// for short rows: a 768-long row takes 12 vpdpbusd per digit plane.
template <int R>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void lane_totals(
    const __m512i (&sums)[R], int32_t (&totals)[R]) {
  if constexpr (R == 4) {
    const __m512i pairs01 = _mm512_add_epi32(_mm512_unpacklo_epi32(sums[0], sums[1]),
                                             _mm512_unpackhi_epi32(sums[0], sums[1]));
    const __m512i pairs23 = _mm512_add_epi32(_mm512_unpacklo_epi32(sums[2], sums[3]),
                                             _mm512_unpackhi_epi32(sums[2], sums[3]));
    // Each 128-bit lane now holds one partial sum of rows 0, 1, 2, 3, in that order.
    const __m512i quads = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs01, pairs23),
                                           _mm512_unpackhi_epi64(pairs01, pairs23));
    const __m256i halves = _mm256_add_epi32(_mm512_castsi512_si256(quads),
                                            _mm512_extracti64x4_epi64(quads, 1));
    const __m128i total = _mm_add_epi32(_mm256_castsi256_si128(halves),
                                        _mm256_extracti128_si256(halves, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(totals), total);
  } else {
    for (int r = 0; r < R; ++r) totals[r] = _mm512_reduce_add_epi32(sums[r]);
  }
}

// Rows [n, n + R) of the output for activation row m: a tile of R rows (or R = 1, a last row).
// Bytes [k, k + width) of the tile's row r lie at tile + k * R + r * width, width being 64 but
// for the last lane.
template <int D, int R, typename T>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_tile(
    const Digits& digits, int64_t m, const int8_t* weight, int64_t K, int64_t n,
    const float* scale, int64_t scale_stride, T* out, int64_t N) {
  const __m512i to_unsigned = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* tile = weight + n * K;
  __m512i sums[D][R];
  for (int p = 0; p < D; ++p)
    for (int r = 0; r < R; ++r) sums[p][r] = _mm512_setzero_si512();
  __m512i w[R];
  int64_t k = 0;
  for (; k + kLane <= K; k += kLane) {
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_xor_si512(_mm512_loadu_si512(tile + k * R + r * kLane), to_unsigned);
    accumulate<D, R>(sums, w, digits, m, k);
  }
  if (k < K) {  // masked loads are slow on some CPUs (AMD Zen 4): only for the last lane
    const int64_t width = K - k;
    const __mmask64 present = (1ULL << width) - 1;
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(present, tile + k * R + r * width),
                              to_unsigned);
    accumulate<D, R>(sums, w, digits, m, k);
  }
  int32_t totals[D][R];
  for (int p = 0; p < D; ++p) lane_totals<R>(sums[p], totals[p]);
  for (int r = 0; r < R; ++r) {
    int64_t exact = 0;
    for (int p = D - 1; p >= 0; --p) exact = exact * 256 + totals[p][r] - 128 * digits.sum(m, p);
    out[m * N + n + r] = static_cast<T>(static_cast<float>(
        static_cast<double>(exact) * digits.row_scale[m] * scale[(n + r) * scale_stride]));
  }
}

// Each thread takes whole tiles of weight rows and runs every activation row over a tile while
// it is in the L1 cache, so that the weight is read from memory once whatever the rows. False,
// with nothing written, when x is not all finite.
template <typename T>
bool vnni_matmul(const T* x, int64_t rows, int64_t K, const int8_t* weight, int64_t N,
                 const float* scale, int64_t scale_stride, T* out) {
  constexpr int D = kDigits<T>;
  thread_local Digits this_thread;
  Digits& digits = this_thread;  // the caller's, which the workers below must read, not theirs
  if (!fill_digits(x, rows, K, digits)) return false;
  const int64_t tiles = (N + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / (kRowsPerTile * K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kRowsPerTile;
      for (int64_t m = 0; m < rows; ++m) {
        if (n + kRowsPerTile <= N) {
          vnni_tile<D, kRowsPerTile>(digits, m, weight, K, n, scale, scale_stride, out, N);
        } else {
          for (int64_t i = n; i < N; ++i)
            vnni_tile<D, 1>(digits, m, weight, K, i, scale, scale_stride, out, N);
        }
      }
    }
  });
  return true;
}

// Where element k of weight row n lies in the tiled order (see the top of this file).
inline int64_t tiled_offset(int64_t n, int64_t k, int64_t N, int64_t K) {
  const int64_t rows = n < N / kRowsPerTile * kRowsPerTile ? kRowsPerTile : 1;
  const int64_t first = n - n % rows;
  const int64_t lane = k / kLane * kLane;
  const int64_t width = std::min(kLane, K - lane);
  return first * K + lane * rows + (n - first) * width + (k - lane);
}

template <typename T>
void plain_matmul(const T* x, int64_t rows, int64_t K, const int8_t* weight, int64_t N,
                  const float* scale, int64_t scale_stride, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < rows; ++m) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k)
          sum += static_cast<float>(x[m * K + k]) *
                 static_cast<float>(weight[tiled_offset(n, k, N, K)]);
        out[m * N + n] = static_cast<T>(sum * scale[n * scale_stride]);
      }
  });
}

bool has_vnni();

template <typename T>
void matmul(const T* x, int64_t rows, int64_t K, const int8_t* weight, int64_t N,
            const float* scale, int64_t scale_stride, T* out) {
  // Infinities and NaNs take the plain loop too, which carries them to the output.
  if (!(has_vnni() && K <= kMaxK && vnni_matmul(x, rows, K, weight, N, scale, scale_stride, out))) {
    plain_matmul(x, rows, K, weight, N, scale, scale_stride, out);
  }
}

// NXDPLUG_INT8_MATMUL_PORTABLE=1 takes the plain loop on any CPU (to check it where it would
// not otherwise run).
bool has_vnni() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vnni") &&
                                std::getenv("NXDPLUG_INT8_MATMUL_PORTABLE") == nullptr;
  return supported;
}

// The scales as float32: their own data when they are float32 already, else converted into a
// buffer of the calling thread (the checkpoint cast may have made them bfloat16).
const float* float_scales(const at::Tensor& scale) {
  TORCH_CHECK(scale.is_contiguous(), "int8_matmul: contiguous scales expected");
  if (scale.scalar_type() == at::kFloat) return scale.data_ptr<float>();
  thread_local std::vector<float> converted;
  converted.resize(scale.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scale.scalar_type(), "scales", [&] {
    const auto* values = scale.data_ptr<scalar_t>();
    for (int64_t i = 0; i < scale.numel(); ++i) converted[i] = static_cast<float>(values[i]);
  });
  return converted.data();
}

// Row r of a tile of R rows (K bytes each, in the tiled order) times `scale` in float32, rounded
// once to the row's type (to nearest), as dequantizing in PyTorch rounds it.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dequantize_row(
    const int8_t* tile, int64_t R, int64_t r, int64_t K, float scale, float* row) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t lane = 0; lane < K; lane += kLane) {
    const int64_t width = std::min(kLane, K - lane);
    const int8_t* bytes = tile + lane * R + r * width;
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 mask = floats_present(width - i);
      const __m512i wide = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, bytes + i));
      _mm512_mask_storeu_ps(row + lane + i, mask, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dequantize_row(
    const int8_t* tile, int64_t R, int64_t r, int64_t K, float scale, c10::BFloat16* row) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t lane = 0; lane < K; lane += kLane) {
    const int64_t width = std::min(kLane, K - lane);
    const int8_t* bytes = tile + lane * R + r * width;
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 mask = floats_present(width - i);
      const __m512i wide = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, bytes + i));
      const __m256bh words = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
      _mm256_mask_storeu_epi16(row + lane + i, mask, (__m256i)words);
    }
  }
}

// Weight rows [n, n + count) (whole tiles, or untiled last rows) dequantized, row i at
// out + i * K (`vector`: float32 rows need AVX-512, bfloat16 ones AVX512-BF16 too); a plain
// loop where the CPU has neither.
template <typename T>
void dequantize_rows(const int8_t* weight, int64_t N, int64_t K, int64_t n, int64_t count,
                     const float* scale, int64_t scale_stride, T* out) {
  const bool vector = std::is_same_v<T, float> ? has_vnni() : nxdplug::panels::usable();
  if (!vector) {
    for (int64_t i = 0; i < count; ++i) {
      const float row_scale = scale[(n + i) * scale_stride];
      for (int64_t k = 0; k < K; ++k)
        out[i * K + k] =
            static_cast<T>(static_cast<float>(weight[tiled_offset(n + i, k, N, K)]) * row_scale);
    }
    return;
  }
  for (int64_t first = n; first < n + count;) {
    const int64_t R = first < N / kRowsPerTile * kRowsPerTile ? kRowsPerTile : 1;
    for (int64_t r = 0; r < R; ++r)
      dequantize_row(weight + first * K, R, r, K, scale[(first + r) * scale_stride],
                     out + (first - n + r) * K);
    first += R;
  }
}

// The whole weight dequantized, [N, K] float32 (for a GEMM where the panels do not run).
at::Tensor dequantized(const int8_t* weight, int64_t N, int64_t K, const float* scale,
                       int64_t scale_stride) {
  at::Tensor dense = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  float* out = dense.data_ptr<float>();
  const int64_t tiles = N / kRowsPerTile;
  at::parallel_for(0, tiles + 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n = tile * kRowsPerTile;
      const int64_t count = tile < tiles ? kRowsPerTile : N - n;
      if (count > 0) dequantize_rows(weight, N, K, n, count, scale, scale_stride, out + n * K);
    }
  });
  return dense;
}

// bfloat16 rows (K even) by the weight a panel at a time (see the top of this file).
void panel_matmul(const c10::BFloat16* x, int64_t rows, int64_t K, const int8_t* weight,
                  int64_t N, const float* scale, int64_t scale_stride, c10::BFloat16* out) {
  nxdplug::panels::multiply_dequantized_panels(
      reinterpret_cast<const uint16_t*>(x), rows, K, N, K,
      [&](int64_t n, int64_t width, uint16_t* dense) {
        dequantize_rows(weight, N, K, n, width, scale, scale_stride,
                        reinterpret_cast<c10::BFloat16*>(dense));
      },
      reinterpret_cast<uint16_t*>(out));
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "int8_matmul: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar, "int8_matmul: an int8 weight expected, got ",
              weight.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_matmul: float32 or bfloat16 x expected, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "int8_matmul: CPU tensors only");
  const int64_t rows = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(scale.numel() == N || scale.numel() == 1, "int8_matmul: scale of ", N,
              " or 1 values expected, got ", scale.numel());
  const at::Tensor inputs = x.contiguous();
  const at::Tensor weights = weight.contiguous();
  const float* scales = float_scales(scale);
  const int64_t scale_stride = scale.numel() == 1 ? 0 : 1;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (bf16 && rows >= kPanelRows && K % 2 == 0 && nxdplug::panels::usable()) {
    at::Tensor out = at::empty({rows, N}, x.options());
    panel_matmul(inputs.data_ptr<c10::BFloat16>(), rows, K, weights.data_ptr<int8_t>(), N,
                 scales, scale_stride, out.data_ptr<c10::BFloat16>());
    return out;
  }
  if (rows > kIntegerMaxRows) {
    const at::Tensor dense = dequantized(weights.data_ptr<int8_t>(), N, K, scales, scale_stride);
    return at::linear(inputs, dense.to(x.scalar_type()));
  }
  at::Tensor out = at::empty({rows, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    matmul(inputs.data_ptr<float>(), rows, K, weights.data_ptr<int8_t>(), N, scales,
           scale_stride, out.data_ptr<float>());
  } else {
    matmul(inputs.data_ptr<c10::BFloat16>(), rows, K, weights.data_ptr<int8_t>(), N, scales,
           scale_stride, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(nxdplug_quantization, m) {
  m.def("int8_matmul(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdplug_quantization, CPU, m) { m.impl("int8_matmul", &int8_matmul); }

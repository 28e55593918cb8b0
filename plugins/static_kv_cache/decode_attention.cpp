// softmax(q k^T * scale, masked) v for a few queries a row (decoding, speculation, short
// prompts), reading each row's keys and values where they are: in the static cache ([lines,
// kv_heads, positions, dim], decode_attention: row b reads line seq_ids[b]) or in blocks
// ([blocks, kv_heads, block_size, dim], paged_decode_attention: position j of row b lies in block
// block_tables[b, j / block_size] at j % block_size). Both walk a row's positions block by block
// (a line is one block), so they share the code below.
//
// Why not the graph's own attention: it gathers each row's line up to the bucket's width (a copy
// of K and V), widens K to float32 (another), then runs two batched matmuls, so it moves about
// three times the bytes of the cache it reads, masked positions included. Here one task takes a
// row and a K/V head, with the query heads that share it, and reads the positions its queries
// may see, once, prefetching ahead (a 16-row decode step of a 12-layer ~120M Llama with 64 to
// 128 cached positions: 8.7 ms against 10.2, examples/decode_attention.py on 2 AVX-512 cores).
// Scores are made 16 keys at a time, their dot products summed across lanes together; values
// are read once for up to 16 / (dim / 16) query rows. Those two made a call on 16 rows x 12
// heads (4 K/V heads) x 64-128 keys in bf16 7-14% faster (26-63 us against 29-68, both builds
// timed in turns in one process) and the decode step above 7.24 ms against 8.97 gathering.
// A task stops at the last position its queries see (the mask is as wide as the bucket): 70.6
// us against 80.7 a call with 64-124 of 128 positions seen and the caches out of L2.
//
// The numbers follow nxdplug.modules.attention.grouped_attention (and PyTorch's fused CPU
// attention): float32 products, exp(score - max) rounded to the cache's dtype, float32 sums of
// the values they weigh divided by the exps' float32 total and rounded once at the end; a query
// that may see no key gets the mean of all the mask's positions (a softmax over equal scores).
//
// x86 CPUs with AVX-512 (F, BW, VL) take the vector path for head sizes 16, 32, 64, 128 and 256;
// other head sizes and CPUs take a plain loop (NXDPLUG_DECODE_ATTENTION_PORTABLE=1 forces it).
// The vector path scores 16 keys of a block at a time and a block's last few (all of them in a
// block of fewer than 16) one by one: blocks of a multiple of 16 positions are the fast ones.
// With AVX512-BF16, bf16 scores multiply pairs of values without widening them (head sizes from
// 32): 70 against 77 us a call (16 rows seeing 64-124 of 128 positions, caches out of L2), 796
// against 877 for 64-query prompts, alongside a group's query heads taking each value together.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();
constexpr int64_t kPrefetchPositions = 16;  // how far ahead the first query head reads keys

// `keys`: the positions a task computes (see visible_span); `mask_keys`: the mask's width;
// `block_size`: the positions a block holds (a line's positions in the static cache).
struct Shapes {
  int64_t heads, kv_heads, queries, dim, block_size, keys, mask_keys;
  int64_t groups() const { return heads / kv_heads; }
  int64_t rows() const { return groups() * queries; }
};

// One task: the query heads of one batch row that share one K/V head.
template <typename T>
struct Task {
  const T* q;             // [rows][dim]: row i is query (i % queries) of the group's head i / queries
  const T* k;             // [block_size][dim]: this K/V head's keys in block 0; block n's are
  const T* v;             //   block_stride elements on (values alike)
  const int64_t* blocks;  // the row's block table: position j lies in block blocks[j / block_size]
  int64_t block_size, block_stride;
  const bool* mask;  // [queries][mask_keys]
  T* out;            // [rows][dim]
};

// Positions [first, end) of a task, all in one block: position j's key at k + (j - first) * dim
// (values alike). `next_k`, `next_v`: the next block's first `next_count` keys and values
// (prefetched; none after the task's last position).
template <typename T>
struct Run {
  int64_t first, end;
  const T* k;
  const T* v;
  const T* next_k;
  const T* next_v;
  int64_t next_count;
};

// The run of a task's positions (of `keys`) in the row's block `index`, starting at `first`
// (index * block_size). Loops go over runs as
//   for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size)
template <typename T>
inline Run<T> run_at(const Task<T>& task, int64_t index, int64_t first, int64_t keys) {
  const int64_t offset = task.blocks[index] * task.block_stride;
  const int64_t end = std::min(keys, first + task.block_size);
  const int64_t next_count = std::min(keys, end + task.block_size) - end;
  const int64_t next = next_count > 0 ? task.blocks[index + 1] * task.block_stride : 0;
  return {first, end, task.k + offset, task.v + offset, task.k + next, task.v + next, next_count};
}

template <typename T>
float rounded(float p) {
  return static_cast<float>(static_cast<T>(p));
}

// Whether a row of scores (scaled q . k, -inf where the query may not see the key) has a key.
bool row_sees_a_key(const float* row, int64_t keys) {
  return std::any_of(row, row + keys, [](float s) { return s != kMasked; });
}

// Each row of ``scores`` becomes its exp(score - max), rounded to T; the unrounded exps' total
// is written after the rows (scores + rows * keys + i), to divide the weighted values by.
template <typename T>
void softmax_rows_portable(float* scores, int64_t rows, int64_t keys) {
  float* totals = scores + rows * keys;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * keys;
    if (!row_sees_a_key(row, keys)) {
      std::fill(row, row + keys, 1.0f);
      totals[i] = static_cast<float>(keys);
      continue;
    }
    const float top = *std::max_element(row, row + keys);
    float total = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      row[j] = row[j] == kMasked ? 0.0f : std::exp(row[j] - top);
      total += row[j];
    }
    for (int64_t j = 0; j < keys; ++j) row[j] = rounded<T>(row[j]);
    totals[i] = total;
  }
}

template <typename T>
void attend_portable(const Task<T>& task, const Shapes& s, float scale, float* scores) {
  const int64_t rows = s.rows(), dim = s.dim, keys = s.keys;
  for (int64_t i = 0; i < rows; ++i) {
    const bool* sees = task.mask + (i % s.queries) * s.mask_keys;
    const T* q = task.q + i * dim;
    for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size) {
      const Run<T> run = run_at(task, n, first, keys);
      for (int64_t j = first; j < run.end; ++j) {
        const T* key = run.k + (j - first) * dim;
        float dot = 0.0f;
        if (sees[j]) {
          for (int64_t d = 0; d < dim; ++d) dot += static_cast<float>(q[d]) * static_cast<float>(key[d]);
        }
        scores[i * keys + j] = sees[j] ? dot * scale : kMasked;
      }
    }
  }
  softmax_rows_portable<T>(scores, rows, keys);
  std::vector<float> sum(dim);
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size) {
      const Run<T> run = run_at(task, n, first, keys);
      for (int64_t j = first; j < run.end; ++j) {
        const float p = scores[i * keys + j];
        if (p == 0.0f) continue;
        const T* value = run.v + (j - first) * dim;
        for (int64_t d = 0; d < dim; ++d) sum[d] += p * static_cast<float>(value[d]);
      }
    }
    const float total = scores[rows * keys + i];
    for (int64_t d = 0; d < dim; ++d) task.out[i * dim + d] = static_cast<T>(sum[d] / total);
  }
}

#if defined(__x86_64__)
#define NXDPLUG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

NXDPLUG_AVX512 inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

template <typename T>
NXDPLUG_AVX512 inline __m512 load_floats(const T* data, __mmask16 lanes = 0xFFFF) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(lanes, data);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(lanes, data);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// float32 -> bfloat16 -> float32, to nearest even (finite values, as c10::BFloat16 rounds them).
NXDPLUG_AVX512 inline __m512 round_to_bfloat16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

template <typename T>
NXDPLUG_AVX512 inline void store_floats(T* data, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(data, x);
  } else {
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_to_bfloat16(x)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(data), _mm512_cvtepi32_epi16(bits));
  }
}

// e^x for x <= 0, 0 for -inf: x = n ln2 + r, |r| <= ln2 / 2, Cephes' expf polynomial for e^r.
NXDPLUG_AVX512 inline __m512 exp_of_nonpositive(__m512 x) {
  const __mmask16 above_underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e_r = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(above_underflow, _mm512_scalef_ps(e_r, n));
}

template <typename T>
NXDPLUG_AVX512 void softmax_rows_avx512(float* scores, int64_t rows, int64_t keys) {
  float* totals = scores + rows * keys;
  for (int64_t i = 0; i < rows; ++i) {
    float* row = scores + i * keys;
    __m512 top = _mm512_set1_ps(kMasked);
    for (int64_t j = 0; j < keys; j += 16) {
      const __mmask16 lanes = first_lanes(keys - j);
      top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, row + j));
    }
    const float highest = _mm512_reduce_max_ps(top);
    if (highest == kMasked) {
      std::fill(row, row + keys, 1.0f);
      totals[i] = static_cast<float>(keys);
      continue;
    }
    const __m512 shift = _mm512_set1_ps(highest);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
      const __mmask16 lanes = first_lanes(keys - j);
      const __m512 e = exp_of_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + j), shift));
      _mm512_mask_storeu_ps(row + j, lanes, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
    }
    totals[i] = _mm512_reduce_add_ps(total);
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t j = 0; j < keys; j += 16) {
        const __mmask16 lanes = first_lanes(keys - j);
        _mm512_mask_storeu_ps(row + j, lanes, round_to_bfloat16(_mm512_maskz_loadu_ps(lanes, row + j)));
      }
    }
  }
}

// The first query head reads ahead: the key kPrefetchPositions on into L1 (the other heads find
// the keys there), in this block or the next, and the value of position j into L2 (the values
// come next). Nothing past the task's last position.
template <typename T>
NXDPLUG_AVX512 inline void prefetch_position(const Run<T>& run, int64_t j, int64_t dim) {
  const int64_t ahead = j + kPrefetchPositions;
  const T* key = ahead < run.end                         ? run.k + (ahead - run.first) * dim
                 : ahead - run.end < run.next_count ? run.next_k + (ahead - run.end) * dim
                                                        : nullptr;
  const char* value = reinterpret_cast<const char*>(run.v + (j - run.first) * dim);
  for (int64_t b = 0; b < dim * int64_t(sizeof(T)); b += 64) {
    if (key != nullptr) _mm_prefetch(reinterpret_cast<const char*>(key) + b, _MM_HINT_T0);
    _mm_prefetch(value + b, _MM_HINT_T1);
  }
}

// As the first query head starts a block, the whole next block's keys and values, at once:
// blocks lie anywhere (a 32-position bf16 block of head size 64 is one 4 KiB page), so the CPU's
// own prefetching, which follows addresses within a page, starts afresh at each. 16 rows x 12
// heads (4 K/V heads) x 256 positions in bf16 blocks of 32, one thread of an AMD EPYC: 477-519 us
// a call against 639-700 without it, the blocks out of the caches (in lines: 414-440); 262
// against 248 with them in L2 (in lines: 238). Spreading the prefetches over the block, or
// reading two blocks ahead, gained nothing. A line (decode_attention) is one block: no next one.
template <typename T>
NXDPLUG_AVX512 inline void prefetch_next_block(const Run<T>& run, int64_t dim) {
  const char* keys = reinterpret_cast<const char*>(run.next_k);
  const char* values = reinterpret_cast<const char*>(run.next_v);
  for (int64_t b = 0; b < run.next_count * dim * int64_t(sizeof(T)); b += 64) {
    _mm_prefetch(keys + b, _MM_HINT_T1);
    _mm_prefetch(values + b, _MM_HINT_T1);
  }
}

// The sums of 16 vectors' lanes, as one vector (lane k: the sum of dots[k]): pairs of vectors
// are interleaved and added within 128-bit lanes, then across them (45 instructions against
// 16 horizontal sums of ~10).
NXDPLUG_AVX512 inline __m512 lane_sums(const __m512 (&dots)[16]) {
  __m512 pairs[8];
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(dots[2 * k], dots[2 * k + 1]),
                             _mm512_unpackhi_ps(dots[2 * k], dots[2 * k + 1]));
  }
  __m512 quads[4];
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(pairs[2 * k]), b = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[k], 128-bit lane l: the part of dots[4k .. 4k+3] in lane l; now across the lanes.
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Rows [first, first + kRows) of the output: each row's probabilities (``scores``) times the values.
template <typename T, int kChunks, int kRows>
NXDPLUG_AVX512 void weighted_values(const Task<T>& task, const Shapes& s, const float* scores, int64_t first) {
  const int64_t keys = s.keys, dim = s.dim;
  const float* p = scores + first * keys;
  __m512 sum[kRows][kChunks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) sum[r][c] = _mm512_setzero_ps();
  for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size) {
    const Run<T> run = run_at(task, n, first, keys);
    for (int64_t j = first; j < run.end; ++j) {
      bool seen = false;  // a position no row sees (padding) is not read
      for (int r = 0; r < kRows; ++r) seen |= p[r * keys + j] != 0.0f;
      if (!seen) continue;
      const T* value = run.v + (j - first) * dim;
      __m512 v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = load_floats(value + 16 * c);
      for (int r = 0; r < kRows; ++r) {
        const __m512 weight = _mm512_set1_ps(p[r * keys + j]);
        for (int c = 0; c < kChunks; ++c) sum[r][c] = _mm512_fmadd_ps(weight, v[c], sum[r][c]);
      }
    }
  }
  const float* totals = scores + s.rows() * keys;
  for (int r = 0; r < kRows; ++r) {
    const __m512 total = _mm512_set1_ps(totals[first + r]);
    for (int c = 0; c < kChunks; ++c)
      store_floats(task.out + (first + r) * dim + 16 * c, _mm512_div_ps(sum[r][c], total));
  }
}

// weighted_values for `count` (1 to kRows) rows: a group's query heads (3 for 12 heads over 4
// K/V heads) take each value together rather than one by one.
template <typename T, int kChunks, int kRows>
NXDPLUG_AVX512 void weighted_value_rows(const Task<T>& task, const Shapes& s, const float* scores, int64_t first,
                                        int64_t count) {
  if constexpr (kRows > 1) {
    if (count < kRows) return weighted_value_rows<T, kChunks, kRows - 1>(task, s, scores, first, count);
  }
  weighted_values<T, kChunks, kRows>(task, s, scores, first);
}

// Which of the 16 keys from `sees` a query may see, as lanes.
NXDPLUG_AVX512 inline __mmask16 visible_lanes(const bool* sees) {
  return _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sees))),
                                _mm512_set1_epi32(1));
}

// One key's scaled score for a query widened to float32 (`q`: kChunks registers).
template <typename T, int kChunks>
NXDPLUG_AVX512 inline float score_of_key(const __m512 (&q)[kChunks], const T* key, float scale) {
  __m512 dot = _mm512_mul_ps(q[0], load_floats(key));
  for (int c = 1; c < kChunks; ++c) dot = _mm512_fmadd_ps(q[c], load_floats(key + 16 * c), dot);
  return _mm512_reduce_add_ps(dot) * scale;
}

// The scaled scores of every row's query (``scores`` [rows][keys], -inf where masked), keys
// widened to float32. kChunks = dim / 16: a query is kChunks registers.
template <typename T, int kChunks>
NXDPLUG_AVX512 void score_rows(const Task<T>& task, const Shapes& s, float scale, float* scores) {
  const int64_t keys = s.keys, dim = s.dim;
  const __m512 scales = _mm512_set1_ps(scale), masked = _mm512_set1_ps(kMasked);
  for (int64_t i = 0; i < s.rows(); ++i) {
    const bool* sees = task.mask + (s.queries == 1 ? 0 : (i % s.queries) * s.mask_keys);
    __m512 q[kChunks];
    for (int c = 0; c < kChunks; ++c) q[c] = load_floats(task.q + i * dim + 16 * c);
    float* row = scores + i * keys;
    for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size) {
      const Run<T> run = run_at(task, n, first, keys);
      if (i == 0) prefetch_next_block(run, dim);
      int64_t j = first;
      for (; j + 16 <= run.end; j += 16) {  // 16 keys at a time, within the block
        if (i == 0) {
          for (int64_t ahead = j; ahead < j + 16; ++ahead) prefetch_position(run, ahead, dim);
        }
        __m512 dots[16];
        for (int k = 0; k < 16; ++k) {
          const T* key = run.k + (j - first + k) * dim;
          dots[k] = _mm512_mul_ps(q[0], load_floats(key));
          for (int c = 1; c < kChunks; ++c) dots[k] = _mm512_fmadd_ps(q[c], load_floats(key + 16 * c), dots[k]);
        }
        _mm512_storeu_ps(row + j, _mm512_mask_mul_ps(masked, visible_lanes(sees + j), lane_sums(dots), scales));
      }
      for (; j < run.end; ++j) {  // the block's (or the task's) last few, one by one
        if (i == 0) prefetch_position(run, j, dim);
        row[j] = sees[j] ? score_of_key<T, kChunks>(q, run.k + (j - first) * dim, scale) : kMasked;
      }
    }
  }
}

#define NXDPLUG_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// NXDPLUG_DECODE_ATTENTION_WIDEN_BF16=1 widens bf16 keys, as CPUs without AVX512-BF16 do.
bool bf16_pairs_usable() {
  static const bool usable = __builtin_cpu_supports("avx512bf16") &&
                             std::getenv("NXDPLUG_DECODE_ATTENTION_WIDEN_BF16") == nullptr;
  return usable;
}

// score_rows for bfloat16 queries and keys on CPUs with AVX512-BF16: vdpbf16ps multiplies
// pairs of bf16 values (exactly, in float32) and adds them to float32 sums, so keys are not
// widened first (a third of the instructions; the sums are added in another order, float32
// all the same). It reads bf16 denormals (below 1.2e-38) as zero, as the panel GEMM does.
// kChunks / 2 registers of 32 values a query.
template <int kChunks>
NXDPLUG_AVX512_BF16 void score_rows_bf16(const Task<c10::BFloat16>& task, const Shapes& s, float scale,
                                         float* scores) {
  constexpr int kPairs = kChunks / 2;
  const int64_t keys = s.keys, dim = s.dim;
  const __m512 scales = _mm512_set1_ps(scale), masked = _mm512_set1_ps(kMasked);
  for (int64_t i = 0; i < s.rows(); ++i) {
    const bool* sees = task.mask + (s.queries == 1 ? 0 : (i % s.queries) * s.mask_keys);
    const auto* query = reinterpret_cast<const uint16_t*>(task.q + i * dim);
    __m512bh q[kPairs];
    for (int c = 0; c < kPairs; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
    float* row = scores + i * keys;
    for (int64_t n = 0, first = 0; first < keys; ++n, first += task.block_size) {
      const Run<c10::BFloat16> run = run_at(task, n, first, keys);
      if (i == 0) prefetch_next_block(run, dim);
      int64_t j = first;
      for (; j + 16 <= run.end; j += 16) {
        if (i == 0) {
          for (int64_t ahead = j; ahead < j + 16; ++ahead) prefetch_position(run, ahead, dim);
        }
        __m512 dots[16];
        for (int k = 0; k < 16; ++k) {
          const auto* key = reinterpret_cast<const uint16_t*>(run.k + (j - first + k) * dim);
          dots[k] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(key));
          for (int c = 1; c < kPairs; ++c) {
            dots[k] = _mm512_dpbf16_ps(dots[k], q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
          }
        }
        _mm512_storeu_ps(row + j, _mm512_mask_mul_ps(masked, visible_lanes(sees + j), lane_sums(dots), scales));
      }
      if (j < run.end) {  // the block's (or the task's) last few, one by one
        __m512 widened[kChunks];
        for (int c = 0; c < kChunks; ++c) widened[c] = load_floats(task.q + i * dim + 16 * c);
        for (; j < run.end; ++j) {
          if (i == 0) prefetch_position(run, j, dim);
          const c10::BFloat16* key = run.k + (j - first) * dim;
          row[j] = sees[j] ? score_of_key<c10::BFloat16, kChunks>(widened, key, scale) : kMasked;
        }
      }
    }
  }
}

template <typename T, int kChunks>
NXDPLUG_AVX512 void attend_avx512(const Task<T>& task, const Shapes& s, float scale, float* scores) {
  const int64_t rows = s.rows(), keys = s.keys;
  if constexpr (std::is_same_v<T, c10::BFloat16> && kChunks % 2 == 0) {
    if (bf16_pairs_usable()) {
      score_rows_bf16<kChunks>(task, s, scale, scores);
    } else {
      score_rows<T, kChunks>(task, s, scale, scores);
    }
  } else {
    score_rows<T, kChunks>(task, s, scale, scores);
  }
  softmax_rows_avx512<T>(scores, rows, keys);
  // Up to kBlock rows at a time take each value (read and widened once for them all).
  constexpr int kBlock = kChunks >= 16 ? 1 : 16 / kChunks;
  for (int64_t first = 0; first < rows; first += kBlock) {
    weighted_value_rows<T, kChunks, kBlock>(task, s, scores, first, std::min<int64_t>(kBlock, rows - first));
  }
}

bool vector_path_usable() {
  static const bool usable = std::getenv("NXDPLUG_DECODE_ATTENTION_PORTABLE") == nullptr &&
                             __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  return usable;
}
#endif

template <typename T>
void attend(const Task<T>& task, const Shapes& s, float scale, float* scores) {
#if defined(__x86_64__)
  if (vector_path_usable()) {
    switch (s.dim) {
      case 16: return attend_avx512<T, 1>(task, s, scale, scores);
      case 32: return attend_avx512<T, 2>(task, s, scale, scores);
      case 64: return attend_avx512<T, 4>(task, s, scale, scores);
      case 128: return attend_avx512<T, 8>(task, s, scale, scores);
      case 256: return attend_avx512<T, 16>(task, s, scale, scores);
      default: break;
    }
  }
#endif
  attend_portable<T>(task, s, scale, scores);
}

// The positions a task computes: up to the last one any of its queries sees, rounded up to 16
// (the vector path's step) within the mask; the positions past it are masked for every query,
// and neither their keys nor their values are read. The whole mask where a query sees no
// position (it gets the mean over all of them).
int64_t visible_span(const bool* mask, const Shapes& s) {
  int64_t span = 0;
  for (int64_t q = 0; q < s.queries; ++q) {
    const bool* sees = mask + q * s.mask_keys;
    int64_t last = s.mask_keys;
    while (last > 0 && !sees[last - 1]) --last;
    if (last == 0) return s.mask_keys;
    span = std::max(span, last);
  }
  return std::min(s.mask_keys, (span + 15) / 16 * 16);
}

// Row b's position j lies in block table[b * table_stride + j / block_size] of k and v ([blocks,
// kv_heads, block_size, dim]), at j % block_size; a static cache's line is one block.
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* table,
                int64_t table_stride, const at::Tensor& mask, const at::Tensor& out, const Shapes& s,
                float scale) {
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const bool* mask_data = mask.data_ptr<bool>();
  T* out_data = out.data_ptr<T>();
  const int64_t batch = q.size(0);
  const int64_t block_stride = s.kv_heads * s.block_size * s.dim;
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    scores.resize(s.rows() * (s.keys + 1));  // the rows' scores, then their totals
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / s.kv_heads, head = t % s.kv_heads;
      const int64_t head_offset = head * s.block_size * s.dim;
      const int64_t first_row = (b * s.heads + head * s.groups()) * s.queries * s.dim;
      const Task<T> task{q_data + first_row,
                         k_data + head_offset,
                         v_data + head_offset,
                         table + b * table_stride,
                         s.block_size,
                         block_stride,
                         mask_data + b * s.queries * s.mask_keys,
                         out_data + first_row};
      Shapes seen = s;
      seen.keys = visible_span(task.mask, s);
      attend<T>(task, seen, scale, scores.data());
    }
  });
}

// The checks both layouts share: `op` names the operator, `storage` the caches or blocks, `shape`
// their shape and `width` the mask's widest.
void check_operands(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& mask, int64_t keys, const char* storage, const char* shape,
                    const char* width) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q [batch, heads, queries, dim] and ",
              storage, " ", shape, " expected");
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": K and V ", storage, " differ in shape");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), op, ": contiguous ", storage, " expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op, ": q and the ",
              storage, " must have one dtype");
  TORCH_CHECK(q.size(3) == k.size(3), op, ": q's head size differs from the ", storage, "'");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
              ": the query heads must divide into the K/V heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && mask.size(0) == q.size(0) &&
                  mask.size(1) == 1 && mask.size(2) == q.size(2) && mask.size(3) > 0 && mask.size(3) <= keys,
              op, ": mask [batch, 1, queries, keys <= ", width, "] bool expected");
}

template <typename... Args>
void attend_all_of_dtype(const at::Tensor& q, const Args&... args) {
  AT_DISPATCH_SWITCH(q.scalar_type(), "decode_attention",
                     AT_DISPATCH_CASE(at::kFloat, [&] { attend_all<float>(q, args...); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { attend_all<c10::BFloat16>(q, args...); }));
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& seq_ids,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(k_cache.dim() == 4,
              "decode_attention: q [batch, heads, queries, dim] and caches [lines, kv_heads, "
              "positions, dim] expected");
  check_operands("decode_attention", q, k_cache, v_cache, mask, k_cache.size(2), "caches",
                 "[lines, kv_heads, positions, dim]", "positions");
  TORCH_CHECK(seq_ids.scalar_type() == at::kLong && seq_ids.dim() == 1 && seq_ids.size(0) == q.size(0),
              "decode_attention: seq_ids [batch] int64 expected");
  const auto lines = seq_ids.contiguous();
  const int64_t* line = lines.data_ptr<int64_t>();
  for (int64_t b = 0; b < lines.size(0); ++b) {
    TORCH_CHECK(line[b] >= 0 && line[b] < k_cache.size(0), "decode_attention: seq_ids[", b, "] = ",
                line[b], " is not a cache line");
  }
  // Each row's line is its one block, of all the cache's positions.
  const Shapes s{q.size(1), k_cache.size(1), q.size(2), q.size(3), k_cache.size(2), mask.size(3), mask.size(3)};
  const auto queries = q.contiguous();
  const auto sees = mask.contiguous();
  auto out = at::empty_like(queries);
  attend_all_of_dtype(queries, k_cache, v_cache, line, int64_t(1), sees, out, s, float(scale));
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_blocks,
                                  const at::Tensor& v_blocks, const at::Tensor& block_tables,
                                  const at::Tensor& mask, double scale) {
  TORCH_CHECK(k_blocks.dim() == 4 && block_tables.dim() == 2,
              "paged_decode_attention: q [batch, heads, queries, dim], blocks [blocks, kv_heads, "
              "block_size, dim] and block_tables [batch, blocks_per_row] expected");
  const int64_t block_size = k_blocks.size(2);
  check_operands("paged_decode_attention", q, k_blocks, v_blocks, mask, block_tables.size(1) * block_size,
                 "blocks", "[blocks, kv_heads, block_size, dim]", "blocks_per_row * block_size");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.size(0) == q.size(0),
              "paged_decode_attention: block_tables [batch, blocks_per_row] int64 expected");
  const auto tables = block_tables.contiguous();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t per_row = tables.size(1), covered = (mask.size(3) + block_size - 1) / block_size;
  for (int64_t b = 0; b < tables.size(0); ++b) {
    for (int64_t n = 0; n < covered; ++n) {
      const int64_t block = table[b * per_row + n];
      TORCH_CHECK(block >= 0 && block < k_blocks.size(0), "paged_decode_attention: block_tables[", b, ", ", n,
                  "] = ", block, " is not a block (there are ", k_blocks.size(0), ")");
    }
  }
  const Shapes s{q.size(1), k_blocks.size(1), q.size(2), q.size(3), block_size, mask.size(3), mask.size(3)};
  const auto queries = q.contiguous();
  const auto sees = mask.contiguous();
  auto out = at::empty_like(queries);
  attend_all_of_dtype(queries, k_blocks, v_blocks, table, per_row, sees, out, s, float(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY(nxdplug_static_kv_cache, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_ids, Tensor mask, "
      "float scale) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_blocks, Tensor v_blocks, Tensor block_tables, "
      "Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdplug_static_kv_cache, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
}

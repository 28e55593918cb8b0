// x @ weight^T + bias for bfloat16 x and weight on x86 CPUs with AVX512-BF16, the weight stored
// in panels of 32 output features (see bf16_linear.py for the layout).
//
// Why not oneDNN's prepacked linear: decoding multiplies 1 to 16 rows by every weight, and a
// 12-layer ~120M Llama's weights (200 MB) come from memory at each step; oneDNN's bf16 GEMM
// keeps the cores waiting on those reads. examples/bf16_linear.py times one forward pass's 49
// linears both ways (2 Zen 5 cores, 2026-11-27): x1.22 here at 1 row, x1.37-1.48 at 16 rows,
// x1.13-1.15 at 64 (a prompt), x1.03-1.10 at 128.
//
// Each thread takes a contiguous range of panels (32 output features: two 16-float vectors a
// row) and reads their weights once, in order, prefetched 32 KB ahead; 8 rows of x at a time
// are multiplied by a stretch of a panel (vdpbf16ps: two bf16 products summed into float32),
// then the next 8 rows by the same stretch while it is in the L1 cache. Sums are float32,
// rounded to bf16 once (to nearest, ties to even). Tried and not kept: panels handed out
// dynamically (no faster with a busy server), prefetches spread over every 8-row tile (3%
// slower for prompts), 16 rows x 16 outputs a tile for 9-16 rows (30% slower: 16 broadcasts
// to a weight vector).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t PANEL = 32;       // output features a panel holds
constexpr int64_t ROWS = 8;         // rows of x a tile multiplies
constexpr int64_t STRETCH = 256;    // k-pairs multiplied before the next 8 rows (32 KB of a panel)
constexpr int64_t PREFETCH = 256;   // k-pairs ahead of the one multiplied (32 KB)

bool vector_path_usable() {
#if defined(__x86_64__)
  static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return usable;
#else
  return false;
#endif
}

#if defined(__x86_64__)
#define NXDPLUG_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// What a tile writes: float32 partial sums to carry to the next stretch, or the bf16 result.
struct TileOutput {
  float* partial;          // [ROWS][PANEL], read unless `first`, written unless `last`
  bool first, last;
  uint16_t* out;           // row 0's first feature of this panel
  int64_t out_stride;      // out_features
  const float* bias;       // this panel's first feature's bias (float32), or nullptr
  int64_t width;           // features in this panel (PANEL but for the last)
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
NXDPLUG_BF16 inline void add_pair(__m512 (&sums)[R][2], const uint16_t* x, int64_t x_stride,
                                  const uint16_t* w, bool full, __mmask32 low, __mmask32 high) {
  const __m512bh w0 = (__m512bh)(full ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi16(low, w));
  const __m512bh w1 = (__m512bh)(full ? _mm512_loadu_si512(w + 32) : _mm512_maskz_loadu_epi16(high, w + 32));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512bh xr = (__m512bh)_mm512_set1_epi32(two_values(x + r * x_stride));
    sums[r][0] = _mm512_dpbf16_ps(sums[r][0], xr, w0);
    sums[r][1] = _mm512_dpbf16_ps(sums[r][1], xr, w1);
  }
}

// `rows` (at most ROWS) rows of x, starting at x, by `pairs` k-pairs of one panel (`panel`
// points at the first pair; each pair is `width` features x 2 bf16). Rows below 4 keep two sets
// of sums (even and odd pairs) so that the adds do not wait on each other.
template <int R>
NXDPLUG_BF16 void tile(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
                       const TileOutput& o) {
  constexpr int SETS = R < 4 ? 2 : 1;
  const bool full = o.width == PANEL;
  const int64_t pair_stride = 2 * o.width;
  const __mmask32 low = full ? ~0u : (__mmask32)((1ull << (2 * std::min<int64_t>(o.width, 16))) - 1);
  const __mmask32 high = full ? ~0u : (__mmask32)((1ull << (2 * std::max<int64_t>(o.width - 16, 0))) - 1);
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

NXDPLUG_BF16 void rows_tile(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                            int64_t pairs, const TileOutput& o) {
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

// Panels [begin, end) of the output: each panel's pairs in stretches (one stretch when x has
// at most ROWS rows), every ROWS rows of x by a stretch before the next.
NXDPLUG_BF16 void multiply_panels(const uint16_t* x, int64_t m, int64_t k, const uint16_t* weight,
                                  int64_t n, const float* bias, uint16_t* out, int64_t begin,
                                  int64_t end) {
  const int64_t pairs = k / 2;
  const int64_t stretch = m <= ROWS ? pairs : STRETCH;
  std::vector<float> partial(m > ROWS ? m * PANEL : 0);
  for (int64_t panel = begin; panel < end; ++panel) {
    const int64_t first_feature = panel * PANEL;
    const int64_t width = std::min(PANEL, n - first_feature);
    const uint16_t* panel_weights = weight + first_feature * k;
    for (int64_t p = 0; p < pairs; p += stretch) {
      const int64_t count = std::min(stretch, pairs - p);
      for (int64_t row = 0; row < m; row += ROWS) {
        const TileOutput o{partial.data() + row * PANEL, p == 0, p + count == pairs,
                           out + row * n + first_feature, n,
                           bias == nullptr ? nullptr : bias + first_feature, width};
        rows_tile(std::min(ROWS, m - row), x + row * k + 2 * p, k, panel_weights + p * 2 * width,
                  count, o);
      }
    }
  }
}
#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(vector_path_usable(),
              "nxdplug_bf16_linear::linear needs an x86-64 CPU with AVX512-BF16; this graph was "
              "compiled where one was: compile the model again on this machine");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_linear takes bfloat16 x and weight, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  const int64_t k = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && k % 2 == 0 && k > 0 &&
                  weight.numel() % k == 0,
              "bf16_linear: weight must be the 1-D panels of an [out, in] matrix with even in = ",
              "x's last size (", k, "), got ", weight.sizes());
  const int64_t n = weight.numel() / k;
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bf16_linear: bias has ", bias->numel(), " values for ", n,
                " out-features");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  if (m == 0 || n == 0) {
    return out;
  }
#if defined(__x86_64__)
  const auto* x_data = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const auto* w_data = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* b_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto* out_data = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t panels = (n + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    multiply_panels(x_data, m, k, w_data, n, b_data, out_data, begin, end);
  });
#endif
  return out;
}

bool usable() { return vector_path_usable(); }

}  // namespace

TORCH_LIBRARY(nxdplug_bf16_linear, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("usable() -> bool", &usable);
}

TORCH_LIBRARY_IMPL(nxdplug_bf16_linear, CPU, m) { m.impl("linear", &linear); }

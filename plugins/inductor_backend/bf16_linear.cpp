// x @ weight^T + bias for bfloat16 x and weight on x86 CPUs with AVX512-BF16, the weight stored
// in panels of 32 output features (nxdplug_bf16_panels.h, in nxdplug's runtime, holds the layout
// and the products; bf16_linear.py says how the weights get there).
//
// Why not oneDNN's prepacked linear: decoding multiplies 1 to 16 rows by every weight, and a
// 12-layer ~120M Llama's weights (200 MB) come from memory at each step; oneDNN's bf16 GEMM
// keeps the cores waiting on those reads. examples/bf16_linear.py times one forward pass's 49
// linears both ways (2 Zen 5 cores, 2026-11-27): x1.22 here at 1 row, x1.37-1.48 at 16 rows,
// x1.13-1.15 at 64 (a prompt), x1.03-1.10 at 128.
//
// Each thread takes a contiguous range of panels and reads their weights once, in order,
// prefetched 32 KB ahead. Tried and not kept: panels handed out dynamically (no faster with a
// busy server).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <nxdplug_bf16_panels.h>

#include <cstdint>
#include <optional>

namespace {

using nxdplug::panels::PANEL;

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(nxdplug::panels::usable(),
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
    nxdplug::panels::multiply_panels(x_data, m, k, w_data, n, b_data, out_data, begin, end);
  });
#endif
  return out;
}

bool usable() { return nxdplug::panels::usable(); }

}  // namespace

TORCH_LIBRARY(nxdplug_bf16_linear, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("usable() -> bool", &usable);
}

TORCH_LIBRARY_IMPL(nxdplug_bf16_linear, CPU, m) { m.impl("linear", &linear); }

// int4 weights dequantized for a prompt's GEMM, transposed: out[k, r] = (Q[r, k] - 8) *
// scale[g, r] + zero[g, r], g = k / group, for Q in the layout of
// aten._convert_weight_to_int4pack_for_cpu (int4.py's from_kernel_layout): rows in blocks of 64,
// each block [K][32] bytes, byte (k, j) holding row j in its low nibble and row j + 32 in its
// high one; rows past the last whole block in pairs, [K][tail / 2] bytes, byte (k, p) holding
// rows 2p and 2p + 1.
//
// Transposed because that is the layout's own order: the 32 bytes of (block, k) become 64
// consecutive outputs, a loop the compiler vectorizes, and the GEMM takes W^T as it is.
// Inductor's code for the same unpacking (and its transpose to [out, in]) took ~2 ns a weight
// on this machine (2 cores), three times the GEMM it feeds at 128 rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kBlockRows = 64;
constexpr int64_t kHalf = kBlockRows / 2;

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

// The 64 rows of block `b`: out[k, b * 64 + j] for every k.
template <typename T>
void unpack_block(const uint8_t* bytes, int64_t b, int64_t N, int64_t K, const T* scales,
                  int64_t group, T* out) {
  float scale[kBlockRows], zero[kBlockRows];
  for (int64_t k = 0; k < K; ++k) {
    if (k % group == 0) {
      const T* pairs = scales + ((k / group) * N + b * kBlockRows) * 2;
      for (int64_t j = 0; j < kBlockRows; ++j) {
        scale[j] = static_cast<float>(pairs[2 * j]);
        zero[j] = static_cast<float>(pairs[2 * j + 1]);
      }
    }
    const uint8_t* src = bytes + k * kHalf;
    T* dst = out + k * N + b * kBlockRows;
    for (int64_t j = 0; j < kHalf; ++j) {
      const int low = (src[j] & 0xF) - 8, high = (src[j] >> 4) - 8;
      dst[j] = from_float<T>(static_cast<float>(low) * scale[j] + zero[j]);
      dst[j + kHalf] = from_float<T>(static_cast<float>(high) * scale[j + kHalf] + zero[j + kHalf]);
    }
  }
}

// The rows past the last whole block, in pairs.
template <typename T>
void unpack_tail(const uint8_t* bytes, int64_t first, int64_t N, int64_t K, const T* scales,
                 int64_t group, T* out) {
  const int64_t pairs = (N - first) / 2;
  for (int64_t k = 0; k < K; ++k) {
    const T* sz = scales + (k / group) * N * 2;
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t byte = bytes[k * pairs + p];
      for (int nibble = 0; nibble < 2; ++nibble) {
        const int64_t row = first + 2 * p + nibble;
        const int value = ((byte >> (4 * nibble)) & 0xF) - 8;
        out[k * N + row] = from_float<T>(static_cast<float>(value) * static_cast<float>(sz[2 * row]) +
                                         static_cast<float>(sz[2 * row + 1]));
      }
    }
  }
}

template <typename T>
void dequantize(const uint8_t* packed, int64_t N, int64_t K, const T* scales, int64_t group,
                T* out) {
  const int64_t blocks = N / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      unpack_block(packed + b * kBlockRows * K / 2, b, N, K, scales, group, out);
  });
  if (blocks * kBlockRows < N)
    unpack_tail(packed + blocks * kBlockRows * K / 2, blocks * kBlockRows, N, K, scales, group,
                out);
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                           int64_t in_features) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2,
              "int4_dequantize: a uint8 [out, in / 2] weight expected, got ", packed.sizes());
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % 2 == 0, "int4_dequantize: an even number of rows expected, got ", N);
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2 && K % scales_and_zeros.size(0) == 0,
              "int4_dequantize: scales_and_zeros [groups, ", N, ", 2] expected, got ",
              scales_and_zeros.sizes());
  TORCH_CHECK(in_features <= K, "int4_dequantize: in_features ", in_features, " > ", K);
  const at::Tensor sz = scales_and_zeros.contiguous();
  const at::Tensor bytes = packed.contiguous();
  const int64_t group = K / sz.size(0);
  at::Tensor out = at::empty({K, N}, sz.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4", [&] {
    dequantize(bytes.data_ptr<uint8_t>(), N, K, sz.data_ptr<scalar_t>(), group,
               out.data_ptr<scalar_t>());
  });
  return in_features == K ? out : out.narrow(0, 0, in_features);
}

}  // namespace

TORCH_LIBRARY(nxdplug_int4, m) {
  // -> W^T [in_features, out], in the scales' dtype.
  m.def("int4_dequantize(Tensor packed, Tensor scales_and_zeros, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdplug_int4, CPU, m) { m.impl("int4_dequantize", &int4_dequantize); }

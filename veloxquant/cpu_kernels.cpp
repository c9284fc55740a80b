// MLX's float32 CPU softmax over the last axis, bit for bit, with its exp run eight lanes at a
// time (AVX2 + FMA). veloxquant/cpu_kernels.py builds, loads and documents this module.
//
// Why it exists: MLX's x86 wheels are built for baseline x86-64, where its `simd::exp` runs one
// element at a time and calls libm for every `fma` and `floor`: about 30 ns per element, most
// of a forward pass of a small model at 1K tokens. The arithmetic below is the same sequence of
// IEEE operations MLX performs for each element (mlx/backend/cpu/simd/math.h `exp`, and
// mlx/backend/cpu/softmax.cpp with one lane: the row's maximum, exp(x - max), the normalizer
// summed in index order, its reciprocal, the product), so each result has the same bits (a
// NaN's payload aside: which operand's an x86 instruction passes on depends on the operand
// order each compiler picked). A hardware fma rounds once, as libm's `fmaf` does;
// `floor(x + 0.5)` is taken in double, as MLX's `x + 0.5` promotes to double.

#include <immintrin.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <limits>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x_init) {
  const __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256d half = _mm256_set1_pd(0.5);
  const __m256d lo = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), half));
  const __m256d hi =
      _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), half));
  const __m256 ipart =
      _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
  const __m256 fpart = _mm256_sub_ps(x, ipart);

  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));

  // C++'s float-to-int conversion truncates, and x86 gives 0x80000000 out of range, as
  // _mm256_cvttps_epi32 does; those lanes are replaced below anyway.
  const __m256i epart = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  result = _mm256_blendv_ps(result, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  result = _mm256_blendv_ps(
      result,
      _mm256_set1_ps(std::numeric_limits<float>::infinity()),
      _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  result = _mm256_blendv_ps(
      result, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  return result;
}

// The maximum of a row as MLX takes it: its running maximum takes each NaN it meets, so a row
// with NaNs has the last of them; ties keep the earlier value, which only tells -0 from +0, and
// x - (-0) and x - (+0) have the same exp.
__attribute__((target("avx2,fma"))) float row_max(const float* in, int64_t n) {
  float maximum = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  __m256 vmax = _mm256_set1_ps(maximum);
  __m256 vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(in + j);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) maximum = v > maximum ? v : maximum;
  bool has_nan = _mm256_movemask_ps(vnan) != 0;
  for (; j < n; ++j) {
    has_nan |= in[j] != in[j];
    maximum = in[j] > maximum ? in[j] : maximum;
  }
  if (has_nan) {
    for (int64_t k = n - 1; k >= 0; --k) {
      if (in[k] != in[k]) return in[k];
    }
  }
  return maximum;
}

// out[j] = exp(in[j] - maximum) for j < n, and their sum in index order, one at a time, as
// MLX's one-lane loops add them.
__attribute__((target("avx2,fma"))) float exps_and_sum(
    const float* in, float* out, int64_t n, float maximum) {
  const __m256 vm = _mm256_set1_ps(maximum);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(in + j), vm)));
  }
  if (j < n) {
    alignas(32) float tail[8] = {0};
    std::memcpy(tail, in + j, sizeof(float) * (n - j));
    _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), vm)));
    std::memcpy(out + j, tail, sizeof(float) * (n - j));
  }
  float normalizer = 0.0f;
  for (int64_t k = 0; k < n; ++k) normalizer += out[k];
  return normalizer;
}

__attribute__((target("avx2,fma"))) void scale_row(float* out, int64_t n, float factor) {
  const __m256 vf = _mm256_set1_ps(factor);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), vf));
  }
  for (; j < n; ++j) out[j] = out[j] * factor;
}

// mlx/backend/cpu/softmax.cpp (float32): max, exps and their sum, 1 / sum, the products.
void softmax_row(const float* in, float* out, int64_t n) {
  const float maximum = row_max(in, n);
  const float normalizer = exps_and_sum(in, out, n, maximum);
  scale_row(out, n, 1 / normalizer);
}

// The softmax of the row with its entries from `visible` on replaced by the float32 lowest
// value, as `mx.softmax(mx.where(causal_mask, scores, lowest))` computes it. When the visible
// maximum is finite and above the lowest value, every replaced entry's exp is exactly +0
// (lowest - max < -88), adding +0 to the sum (at least 1, the maximum's exp) changes nothing,
// and +0 times the reciprocal is +0: so only the visible entries are computed. Any other row
// is written out in full and taken as a whole.
void causal_softmax_row(const float* in, float* out, int64_t n, int64_t visible, float* scratch) {
  const float lowest = std::numeric_limits<float>::lowest();
  const float maximum = row_max(in, visible);
  if (visible < n && !(std::isfinite(maximum) && maximum > lowest)) {
    std::memcpy(scratch, in, sizeof(float) * visible);
    std::fill(scratch + visible, scratch + n, lowest);
    softmax_row(scratch, out, n);
    return;
  }
  const float normalizer = exps_and_sum(in, out, visible, maximum);
  scale_row(out, visible, 1 / normalizer);
  std::fill(out + visible, out + n, 0.0f);
}

// mlx/backend/cpu/logsumexp.cpp (float32): max, the sum of the exps, then log(sum) + max, or
// the maximum itself when it is infinite. std::log is the libm logf MLX calls.
float logsumexp_row(const float* in, int64_t n, float* scratch) {
  const float maximum = row_max(in, n);
  const float normalizer = exps_and_sum(in, scratch, n, maximum);
  return std::isinf(maximum) ? maximum : std::log(normalizer) + maximum;
}

// mlx_lm's swiglu, `nn.silu(gate) * up` = (gate * sigmoid(gate)) * up, with MLX's sigmoid
// (mlx/backend/cpu/unary_ops.h): y = 1 / (1 + exp(|x|)), then y for x < 0 and 1 - y otherwise.
__attribute__((target("avx2,fma"))) void swiglu_span(
    const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t j = 0;
  alignas(32) float g_tail[8] = {0}, u_tail[8] = {0}, o_tail[8];
  while (j < n) {
    const bool full = j + 8 <= n;
    if (!full) {
      std::memcpy(g_tail, gate + j, sizeof(float) * (n - j));
      std::memcpy(u_tail, up + j, sizeof(float) * (n - j));
    }
    const __m256 g = full ? _mm256_loadu_ps(gate + j) : _mm256_load_ps(g_tail);
    const __m256 u = full ? _mm256_loadu_ps(up + j) : _mm256_load_ps(u_tail);
    const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_andnot_ps(sign, g))));
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 s = _mm256_blendv_ps(_mm256_sub_ps(one, y), y, negative);
    const __m256 o = _mm256_mul_ps(_mm256_mul_ps(g, s), u);
    if (full) {
      _mm256_storeu_ps(out + j, o);
    } else {
      _mm256_store_ps(o_tail, o);
      std::memcpy(out + j, o_tail, sizeof(float) * (n - j));
    }
    j += 8;
  }
}

__attribute__((target("avx2,fma"))) void exp_span(const float* in, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_loadu_ps(in + j)));
  if (j < n) {
    alignas(32) float tail[8] = {0};
    std::memcpy(tail, in + j, sizeof(float) * (n - j));
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    std::memcpy(out + j, tail, sizeof(float) * (n - j));
  }
}

void check_row_contiguous(const mx::array& a) {
  if (!a.flags().row_contiguous) {
    throw std::runtime_error("[veloxquant.cpu_kernels] expected a row-contiguous input");
  }
}

enum class Kind { exp, softmax, causal_softmax, logsumexp, swiglu };

// One primitive for the kernels: each output element depends on its own row (or, for exp and
// swiglu, its own element), so a row-contiguous input and a fresh output are all they need.
class RowKernel : public mx::Primitive {
 public:
  RowKernel(mx::Stream stream, Kind kind, int64_t offset)
      : mx::Primitive(stream), kind_(kind), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& a : inputs) check_row_contiguous(a);
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const float* in = inputs[0].data<float>();
    float* o = out.data<float>();
    const int64_t n = inputs[0].ndim() == 0 ? 1 : inputs[0].shape().back();
    const int64_t rows = n == 0 ? 0 : static_cast<int64_t>(inputs[0].size()) / n;
    switch (kind_) {
      case Kind::exp: {
        const int64_t size = static_cast<int64_t>(out.size());
        encoder.dispatch([=]() { exp_span(in, o, size); });
        break;
      }
      case Kind::softmax:
        encoder.dispatch([=]() {
          for (int64_t r = 0; r < rows; ++r) softmax_row(in + r * n, o + r * n, n);
        });
        break;
      case Kind::causal_softmax: {
        const int64_t queries = inputs[0].shape(-2);
        const int64_t offset = offset_;
        encoder.dispatch([=]() {
          std::vector<float> scratch(n);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = std::min(n, offset + r % queries + 1);
            causal_softmax_row(in + r * n, o + r * n, n, visible, scratch.data());
          }
        });
        break;
      }
      case Kind::logsumexp:
        encoder.dispatch([=]() {
          std::vector<float> scratch(n);
          for (int64_t r = 0; r < rows; ++r) o[r] = logsumexp_row(in + r * n, n, scratch.data());
        });
        break;
      case Kind::swiglu: {
        const float* up = inputs[1].data<float>();
        const int64_t size = static_cast<int64_t>(out.size());
        encoder.dispatch([=]() { swiglu_span(in, up, o, size); });
        break;
      }
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[veloxquant.cpu_kernels] runs on the CPU only");
  }

  const char* name() const override {
    return "VeloxquantCpuRowKernel";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RowKernel&>(other);
    return kind_ == o.kind_ && offset_ == o.offset_;
  }

 private:
  Kind kind_;
  int64_t offset_;
};

mx::Stream cpu_stream() {
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device.type != mx::Device::DeviceType::cpu) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] runs on the CPU stream only");
  }
  return stream;
}

void check_float32(const mx::array& x, int min_ndim) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] takes float32 only");
  }
  if (x.ndim() < min_ndim) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] takes an array of at least " + std::to_string(min_ndim) +
        " axes");
  }
}

// The op: a RowKernel of `kind` on x (made row-contiguous first) giving an array of `shape`.
mx::array row_op(const mx::array& x, Kind kind, int64_t offset, const mx::Shape& shape) {
  const mx::Stream s = cpu_stream();
  return mx::array(
      shape, mx::float32, std::make_shared<RowKernel>(s, kind, offset),
      {mx::contiguous(x, false, s)});
}

mx::array exp_op(const mx::array& x) {
  check_float32(x, 0);
  return row_op(x, Kind::exp, 0, x.shape());
}

mx::array softmax(const mx::array& x) {
  check_float32(x, 1);
  return row_op(x, Kind::softmax, 0, x.shape());
}

mx::array causal_softmax(const mx::array& scores, int64_t offset) {
  check_float32(scores, 2);
  if (offset < 0) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] causal offset must be >= 0");
  }
  return row_op(scores, Kind::causal_softmax, offset, scores.shape());
}

mx::array logsumexp(const mx::array& x) {
  check_float32(x, 1);
  mx::Shape shape = x.shape();
  shape.back() = 1;
  return row_op(x, Kind::logsumexp, 0, shape);
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  check_float32(gate, 0);
  check_float32(up, 0);
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] swiglu takes two arrays of one shape");
  }
  const mx::Stream s = cpu_stream();
  return mx::array(
      gate.shape(), mx::float32, std::make_shared<RowKernel>(s, Kind::swiglu, 0),
      {mx::contiguous(gate, false, s), mx::contiguous(up, false, s)});
}

// The exp alone, over a buffer of float32s, for the exhaustive comparison with mx.exp.
__attribute__((target("avx2,fma"))) nb::bytes exp_float32(nb::bytes data) {
  if (data.size() % (8 * sizeof(float)) != 0) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] exp_float32 takes 8k float32s");
  }
  std::string out(data.size(), '\0');
  const float* in = reinterpret_cast<const float*>(data.c_str());
  float* o = reinterpret_cast<float*>(out.data());
  for (size_t j = 0; j < data.size() / sizeof(float); j += 8) {
    _mm256_storeu_ps(o + j, exp8(_mm256_loadu_ps(in + j)));
  }
  return nb::bytes(out.data(), out.size());
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

NB_MODULE(_cpu_kernels, m) {
  m.def("exp", &exp_op, nb::arg("x"));
  m.def("softmax", &softmax, nb::arg("x"));
  m.def("causal_softmax", &causal_softmax, nb::arg("scores"), nb::arg("offset"));
  m.def("logsumexp", &logsumexp, nb::arg("x"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("up"));
  m.def("exp_float32", &exp_float32, nb::arg("data"));
  m.def("cpu_supported", &cpu_supported);
}

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
#include <thread>
#include <exception>

#include <sched.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

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

// mlx/backend/cpu/quantized.cpp's affine quantized matmul (float32, one lane): each weight is
// `scale * q + bias` and each product `x * w` is added to a sum that starts at 0, in the order of
// the inner index, every operation rounded on its own (the build has -ffp-contract=off, so no
// multiply-add is fused). Here the weights of one batch entry are dequantized once, into
// `dense` [K, N], and eight or sixteen outputs of a row are summed side by side, each still in
// the inner index's order: the same additions, so the same bits.

// Code i of a row of `bits`-bit codes, which MLX packs as one little-endian bit stream.
inline uint32_t code_at(const uint8_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const uint8_t* p = row + (bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  uint32_t v = static_cast<uint32_t>(p[0]) >> shift;
  if (shift + bits > 8) v |= static_cast<uint32_t>(p[1]) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// w [rows, cols] codes (row_bytes each), scales/biases [rows, cols / group] -> dense [K, N]:
// dense[k][n] = w[n][k] when transposed (w is [N, K]), else w[k][n].
void dequantize_block(
    const uint8_t* w, const float* scales, const float* biases, float* dense, int64_t rows,
    int64_t cols, int64_t row_bytes, int group, int bits, bool transposed) {
  const int64_t groups = cols / group;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* codes = w + r * row_bytes;
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[r * groups + c / group];
      const float bias = biases[r * groups + c / group];
      float value = scale * static_cast<float>(code_at(codes, c, bits));
      value = value + bias;
      if (transposed) {
        dense[c * rows + r] = value;
      } else {
        dense[r * cols + c] = value;
      }
    }
  }
}

// out[m][n] = sum over k = 0, 1, ... of x[m][k] * b[k][n], for R rows of x at a time.
template <int R>
__attribute__((target("avx2,fma"))) void sequential_gemm_rows(
    const float* x, const float* b, float* out, int64_t N, int64_t K) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * N + n);
      const __m256 b1 = _mm256_loadu_ps(b + k * N + n + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * K + k]);
        acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_mul_ps(xr, b0));
        acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_mul_ps(xr, b1));
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * N + n, acc[r][0]);
      _mm256_storeu_ps(out + r * N + n + 8, acc[r][1]);
    }
  }
  for (; n + 8 <= N; n += 8) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b + k * N + n);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_set1_ps(x[r * K + k]), b0));
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N + n, acc[r]);
  }
  for (; n < N; ++n) {
    for (int r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float product = x[r * K + k] * b[k * N + n];
        sum = sum + product;
      }
      out[r * N + n] = sum;
    }
  }
}

void sequential_gemm(const float* x, const float* b, float* out, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) sequential_gemm_rows<4>(x + m * K, b, out + m * N, N, K);
  for (; m < M; ++m) sequential_gemm_rows<1>(x + m * K, b, out + m * N, N, K);
}

void check_row_contiguous(const mx::array& a) {
  if (!a.flags().row_contiguous) {
    throw std::runtime_error("[veloxquant.cpu_kernels] expected a row-contiguous input");
  }
}

// The start of every kernel's eval: the inputs checked row-contiguous, the outputs allocated, both
// registered with the CPU stream's encoder (which keeps them alive until the task has run).
mx::cpu::CommandEncoder& begin_eval(
    mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (const auto& a : inputs) check_row_contiguous(a);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  return encoder;
}

// Per-thread flags of a failed check, raised as one error after the threads have joined.
void throw_if_any(const std::vector<char>& flags, const char* message) {
  if (std::any_of(flags.begin(), flags.end(), [](char f) { return f != 0; })) {
    throw std::runtime_error(message);
  }
}

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[veloxquant.cpu_kernels] runs on the CPU only");
  }
};

enum class Kind { exp, softmax, causal_softmax, logsumexp, swiglu };

// One primitive for the kernels: each output element depends on its own row (or, for exp and
// swiglu, its own element), so a row-contiguous input and a fresh output are all they need.
class RowKernel : public CpuPrimitive {
 public:
  RowKernel(mx::Stream stream, Kind kind, int64_t offset)
      : CpuPrimitive(stream), kind_(kind), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    mx::array& out = outputs[0];
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

// x [batch, M, K] @ the dequantized w of each batch entry, inputs (x, w, scales, biases,
// source) row-contiguous: source [batch] int32 names the entry of w's own batch (and of the
// scales' and biases') that each of x's uses, so a w broadcast over query heads is neither
// copied nor dequantized again.
class QuantizedMatmul : public CpuPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, bool transposed, int group, int bits)
      : CpuPrimitive(stream), transposed_(transposed), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const mx::array &x = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    mx::array& out = outputs[0];
    const int64_t K = x.shape(-1), M = x.shape(-2), N = out.shape(-1);
    const int64_t batch = M * K == 0 ? 0 : static_cast<int64_t>(x.size()) / (M * K);
    const int64_t w_rows = w.shape(-2), w_cols = transposed_ ? K : N;
    const int64_t row_bytes = w.shape(-1) * 4;
    const int64_t scale_step = scales.shape(-2) * scales.shape(-1);
    const float *xp = x.data<float>(), *sp = scales.data<float>(), *bp = biases.data<float>();
    const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
    const int32_t* source = inputs[4].data<int32_t>();
    float* op = out.data<float>();
    const bool transposed = transposed_;
    const int group = group_, bits = bits_;
    encoder.dispatch([=]() {
      std::vector<float> dense(K * N);
      int64_t dequantized = -1;
      for (int64_t i = 0; i < batch; ++i) {
        const int64_t j = source[i];  // which of w's batch entries this one broadcasts
        if (j != dequantized) {
          dequantize_block(
              wp + j * w_rows * row_bytes, sp + j * scale_step, bp + j * scale_step,
              dense.data(), w_rows, w_cols, row_bytes, group, bits, transposed);
          dequantized = j;
        }
        sequential_gemm(xp + i * M * K, dense.data(), op + i * M * N, M, N, K);
      }
    });
  }

  const char* name() const override {
    return "VeloxquantCpuQuantizedMatmul";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return transposed_ == o.transposed_ && group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  bool transposed_;
  int group_;
  int bits_;
};

// veloxquant/kmeans.py's assignment and cluster sums, with its bits. Its nearest centroid is
// the argmin over centroids j of the GEMM [x | 1] @ [-2c_j | |c_j|^2], which OpenBLAS's Haswell
// sgemm kernel (pinned by veloxquant._platform) sums as one fused multiply-add per term, in
// order, from zero: s = fma(x_0, -2c_j0, 0), s = fma(x_i, -2c_ji, s), ..., s + |c_j|^2, where
// |c_j|^2 and |x|^2 are MLX's one-lane sums of the rounded squares. The first smallest score
// wins, as numpy's argmin takes it; the error is max(score + |x|^2, 0). Eight points (sixteen
// with AVX-512) run side by side against one centroid at a time, without a score block in memory.

// Runs fn(part, parts) on `parts` threads (this one included), each over its own part of the
// work (the result of each part does not depend on how many there are, so neither do the bits).
// Every thread is joined before an exception of any of them is rethrown.
template <typename Fn>
void run_parts(int64_t parts, Fn fn) {
  parts = std::max<int64_t>(1, parts);
  std::vector<std::exception_ptr> errors(parts);
  auto guarded = [&](int64_t part) {
    try {
      fn(part, parts);
    } catch (...) {
      errors[part] = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> threads;  // joined when this scope ends, however it ends
    for (int64_t t = 1; t < parts; ++t) threads.emplace_back(guarded, t);
    guarded(0);
  }
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Threads for `work` units: one below a million, else the cores this process may run on (its
// affinity mask, which containers and taskset narrow), at most eight.
int64_t worker_threads(int64_t work) {
  if (work < (int64_t{1} << 20)) return 1;
  cpu_set_t set;
  const int64_t cores = sched_getaffinity(0, sizeof(set), &set) == 0
                            ? CPU_COUNT(&set)
                            : std::max(1u, std::thread::hardware_concurrency());
  return std::clamp<int64_t>(cores, 1, 8);
}

// Points [begin, end) of one group: x [n, D] row-major, aug [k, D] = -2c, norms [k] = |c|^2.
// Four blocks of eight points go through the centroids together, so that the compare-and-keep
// of one block does not wait on the previous centroid's (min(score, best) keeps best unless
// score < best, as the first-minimum rule does). Returns whether any score was NaN. The loops
// over blocks and dimensions are unrolled so that xs, best and best_j stay in registers (left
// rolled, GCC kept them in memory and every score waited on a store: 2-3x slower).
template <int D>
__attribute__((target("avx2,fma"))) bool nearest_points(
    const float* x, const float* aug, const float* norms, int64_t begin, int64_t end, int64_t k,
    uint32_t* codes, float* err) {
  constexpr int B = 4;
  const __m256 zero = _mm256_setzero_ps();
  __m256 any_nan = zero;
  alignas(32) float lanes[B][D][8];
  alignas(32) uint32_t best_code[B][8];
  alignas(32) float best_err[B][8];
  for (int64_t p = begin; p < end; p += 8 * B) {
    __m256 xs[B][D], best[B], x_sq[B];
    __m256i best_j[B];
#pragma GCC unroll 8
    for (int blk = 0; blk < B; ++blk) {
#pragma GCC unroll 8
      for (int i = 0; i < D; ++i) {
        for (int q = 0; q < 8; ++q) {
          const int64_t point = p + blk * 8 + q;
          lanes[blk][i][q] = point < end ? x[point * D + i] : 0.0f;
        }
        xs[blk][i] = _mm256_load_ps(lanes[blk][i]);
      }
      x_sq[blk] = zero;
#pragma GCC unroll 8
      for (int i = 0; i < D; ++i) {
        x_sq[blk] = _mm256_add_ps(x_sq[blk], _mm256_mul_ps(xs[blk][i], xs[blk][i]));
      }
      best[blk] = _mm256_set1_ps(std::numeric_limits<float>::infinity());
      best_j[blk] = _mm256_setzero_si256();
    }
    for (int64_t j = 0; j < k; ++j) {
      const float* a = aug + j * D;
      __m256 av[D];
      for (int i = 0; i < D; ++i) av[i] = _mm256_set1_ps(a[i]);
      const __m256 norm = _mm256_set1_ps(norms[j]);
      const __m256 jv = _mm256_castsi256_ps(_mm256_set1_epi32(int(j)));
#pragma GCC unroll 8
      for (int blk = 0; blk < B; ++blk) {
        __m256 score = _mm256_fmadd_ps(xs[blk][0], av[0], zero);
#pragma GCC unroll 8
        for (int i = 1; i < D; ++i) score = _mm256_fmadd_ps(xs[blk][i], av[i], score);
        score = _mm256_add_ps(score, norm);
        const __m256 less = _mm256_cmp_ps(score, best[blk], _CMP_LT_OQ);
        any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(score, score, _CMP_UNORD_Q));
        best[blk] = _mm256_min_ps(score, best[blk]);
        best_j[blk] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(best_j[blk]), jv, less));
      }
    }
#pragma GCC unroll 8
    for (int blk = 0; blk < B; ++blk) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(best_code[blk]), best_j[blk]);
      _mm256_store_ps(best_err[blk], _mm256_max_ps(_mm256_add_ps(best[blk], x_sq[blk]), zero));
      for (int q = 0; q < 8; ++q) {
        const int64_t point = p + blk * 8 + q;
        if (point < end) {
          codes[point] = best_code[blk][q];
          err[point] = best_err[blk][q];
        }
      }
    }
  }
  return _mm256_movemask_ps(any_nan) != 0;
}

// nearest_points with sixteen lanes (AVX-512): the same operations per lane, so the same bits.
// B blocks of sixteen points keep xs, best and best_j in the 32 vector registers; the running
// NaN check is one mask OR per score.
template <int D>
__attribute__((target("avx512f"))) bool nearest_points16(
    const float* x, const float* aug, const float* norms, int64_t begin, int64_t end,
    int64_t k, uint32_t* codes, float* err) {
  constexpr int B = D <= 4 ? 4 : 2;
  const __m512 zero = _mm512_setzero_ps();
  __mmask16 any_nan = 0;
  alignas(64) float lanes[B][D][16];
  alignas(64) uint32_t best_code[B][16];
  alignas(64) float best_err[B][16];
  for (int64_t p = begin; p < end; p += 16 * B) {
    __m512 xs[B][D], best[B], x_sq[B];
    __m512i best_j[B];
#pragma GCC unroll 8
    for (int blk = 0; blk < B; ++blk) {
#pragma GCC unroll 8
      for (int i = 0; i < D; ++i) {
        for (int q = 0; q < 16; ++q) {
          const int64_t point = p + blk * 16 + q;
          lanes[blk][i][q] = point < end ? x[point * D + i] : 0.0f;
        }
        xs[blk][i] = _mm512_load_ps(lanes[blk][i]);
      }
      x_sq[blk] = zero;
#pragma GCC unroll 8
      for (int i = 0; i < D; ++i) {
        x_sq[blk] = _mm512_add_ps(x_sq[blk], _mm512_mul_ps(xs[blk][i], xs[blk][i]));
      }
      best[blk] = _mm512_set1_ps(std::numeric_limits<float>::infinity());
      best_j[blk] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < k; ++j) {
      const float* a = aug + j * D;
      __m512 av[D];
      for (int i = 0; i < D; ++i) av[i] = _mm512_set1_ps(a[i]);
      const __m512 norm = _mm512_set1_ps(norms[j]);
      const __m512i jv = _mm512_set1_epi32(int(j));
#pragma GCC unroll 8
      for (int blk = 0; blk < B; ++blk) {
        __m512 score = _mm512_fmadd_ps(xs[blk][0], av[0], zero);
#pragma GCC unroll 8
        for (int i = 1; i < D; ++i) score = _mm512_fmadd_ps(xs[blk][i], av[i], score);
        score = _mm512_add_ps(score, norm);
        const __mmask16 less = _mm512_cmp_ps_mask(score, best[blk], _CMP_LT_OQ);
        any_nan |= _mm512_cmp_ps_mask(score, score, _CMP_UNORD_Q);
        best[blk] = _mm512_min_ps(score, best[blk]);
        best_j[blk] = _mm512_mask_mov_epi32(best_j[blk], less, jv);
      }
    }
#pragma GCC unroll 8
    for (int blk = 0; blk < B; ++blk) {
      _mm512_store_si512(best_code[blk], best_j[blk]);
      _mm512_store_ps(best_err[blk], _mm512_max_ps(_mm512_add_ps(best[blk], x_sq[blk]), zero));
      for (int q = 0; q < 16; ++q) {
        const int64_t point = p + blk * 16 + q;
        if (point < end) {
          codes[point] = best_code[blk][q];
          err[point] = best_err[blk][q];
        }
      }
    }
  }
  return any_nan != 0;
}

// Whether the assignment may take its sixteen-lane kernel (tests turn it off to compare the two).
bool g_wide_assign = true;

bool wide_assign() {
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));
  return avx512 && g_wide_assign;
}

bool nearest_points_of_dim(
    int d, const float* x, const float* aug, const float* norms, int64_t begin, int64_t end,
    int64_t k, uint32_t* codes, float* err) {
  if (wide_assign()) {
    switch (d) {  // nearest_centroid admits d = 1-6 only
      case 1: return nearest_points16<1>(x, aug, norms, begin, end, k, codes, err);
      case 2: return nearest_points16<2>(x, aug, norms, begin, end, k, codes, err);
      case 3: return nearest_points16<3>(x, aug, norms, begin, end, k, codes, err);
      case 4: return nearest_points16<4>(x, aug, norms, begin, end, k, codes, err);
      case 5: return nearest_points16<5>(x, aug, norms, begin, end, k, codes, err);
      default: return nearest_points16<6>(x, aug, norms, begin, end, k, codes, err);
    }
  }
  switch (d) {
    case 1: return nearest_points<1>(x, aug, norms, begin, end, k, codes, err);
    case 2: return nearest_points<2>(x, aug, norms, begin, end, k, codes, err);
    case 3: return nearest_points<3>(x, aug, norms, begin, end, k, codes, err);
    case 4: return nearest_points<4>(x, aug, norms, begin, end, k, codes, err);
    case 5: return nearest_points<5>(x, aug, norms, begin, end, k, codes, err);
    default: return nearest_points<6>(x, aug, norms, begin, end, k, codes, err);
  }
}

// x [G, n, d], c [G or 1, k, d] -> codes [G, n] uint32, squared errors [G, n] float32.
class NearestCentroid : public CpuPrimitive {
 public:
  explicit NearestCentroid(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const mx::array &x = inputs[0], &c = inputs[1];
    const int64_t groups = x.shape(0), n = x.shape(1), k = c.shape(1);
    const int d = static_cast<int>(x.shape(2));
    const bool shared = c.shape(0) == 1;
    const float *xp = x.data<float>(), *cp = c.data<float>();
    uint32_t* codes = outputs[0].data<uint32_t>();
    float* err = outputs[1].data<float>();
    encoder.dispatch([=]() {
      // -2c and |c|^2 as kmeans.augment_codebook computes them
      const int64_t books = shared ? 1 : groups;
      std::vector<float> aug(books * k * d), norms(books * k);
      for (int64_t b = 0; b < books * k; ++b) {
        float norm = 0.0f;
        for (int i = 0; i < d; ++i) {
          const float v = cp[b * d + i];
          aug[b * d + i] = -2.0f * v;
          norm = norm + v * v;
        }
        norms[b] = norm;
      }
      // Each thread takes a contiguous run of blocks of eight points of every group.
      std::vector<char> nan(8, 0);
      const int64_t blocks = (n + 7) / 8;
      run_parts(worker_threads(groups * n * k), [&](int64_t part, int64_t parts) {
        const int64_t begin = std::min(n, blocks * part / parts * 8);
        const int64_t end = std::min(n, blocks * (part + 1) / parts * 8);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t b = shared ? 0 : g;
          nan[part] |= nearest_points_of_dim(
              d, xp + g * n * d, aug.data() + b * k * d, norms.data() + b * k, begin, end, k,
              codes + g * n, err + g * n);
        }
      });
      throw_if_any(
          nan,
          "[veloxquant.cpu_kernels] nearest_centroid: a distance is NaN (non-finite vectors or "
          "centroids)");
    });
  }

  const char* name() const override {
    return "VeloxquantCpuNearestCentroid";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// CommVQ's nearest of K*K codewords (veloxquant/methods/commvq/codebook.py): the score of code
// a*K + b is (u_a + v_b) + cross_ab, as its broadcast adds round it; the first smallest wins, as
// MLX's argmin takes it. Eight running minima (one per run of eight b's, modulo eight) keep
// the compares independent; in each lane of each the codes only grow, so each keeps its first
// minimum, and of the 64 the smallest score with the smallest code is MLX's. Rows [begin, end)
// of one group; returns whether any score was NaN.
__attribute__((target("avx2,fma"))) bool nearest_pair_rows(
    const float* u, const float* v, const float* cross, int64_t begin, int64_t end, int64_t k,
    uint32_t* codes, float* best_out) {
  constexpr int R = 8;
  const int64_t vec = k / 8 * 8;
  const float inf = std::numeric_limits<float>::infinity();
  __m256 any_nan = _mm256_setzero_ps();
  alignas(32) float lane_best[R][8];
  alignas(32) uint32_t lane_code[R][8];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t row = begin; row < end; ++row) {
    const float* ur = u + row * k;
    const float* vr = v + row * k;
    __m256 best[R];
    __m256i best_code[R];
    for (int r = 0; r < R; ++r) {
      best[r] = _mm256_set1_ps(inf);
      best_code[r] = _mm256_setzero_si256();
    }
    float tail_best = inf;
    uint32_t tail_code = 0;
    bool tail_nan = false;
    for (int64_t a = 0; a < k; ++a) {
      const __m256 ua = _mm256_set1_ps(ur[a]);
      const float* ca = cross + a * k;
      for (int64_t b = 0; b < vec; b += 8) {
        const int r = static_cast<int>((b / 8) % R);
        const __m256 score = _mm256_add_ps(
            _mm256_add_ps(ua, _mm256_loadu_ps(vr + b)), _mm256_loadu_ps(ca + b));
        const __m256 less = _mm256_cmp_ps(score, best[r], _CMP_LT_OQ);
        any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(score, score, _CMP_UNORD_Q));
        best[r] = _mm256_min_ps(score, best[r]);
        const __m256i code = _mm256_add_epi32(_mm256_set1_epi32(int(a * k + b)), lane);
        best_code[r] = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(best_code[r]), _mm256_castsi256_ps(code), less));
      }
      for (int64_t b = vec; b < k; ++b) {
        float score = ur[a] + vr[b];
        score = score + ca[b];
        tail_nan |= score != score;
        if (score < tail_best) {
          tail_best = score;
          tail_code = static_cast<uint32_t>(a * k + b);
        }
      }
    }
    float m = tail_best;
    uint32_t c = tail_code;
    if (vec) {
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(lane_best[r], best[r]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lane_code[r]), best_code[r]);
        for (int q = 0; q < 8; ++q) {
          if (lane_best[r][q] < m || (lane_best[r][q] == m && lane_code[r][q] < c)) {
            m = lane_best[r][q];
            c = lane_code[r][q];
          }
        }
      }
    }
    codes[row] = c;
    best_out[row] = m;
    if (tail_nan) any_nan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  }
  return _mm256_movemask_ps(any_nan) != 0;
}

// u, v [G, n, K], cross [G, K, K] -> codes [G, n] uint32 (a*K + b), smallest scores [G, n].
class NearestPairCodeword : public CpuPrimitive {
 public:
  explicit NearestPairCodeword(mx::Stream stream) : CpuPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const int64_t groups = inputs[0].shape(0), n = inputs[0].shape(1), k = inputs[0].shape(2);
    const float *u = inputs[0].data<float>(), *v = inputs[1].data<float>();
    const float* cross = inputs[2].data<float>();
    uint32_t* codes = outputs[0].data<uint32_t>();
    float* best = outputs[1].data<float>();
    encoder.dispatch([=]() {
      std::vector<char> nan(8, 0);
      run_parts(worker_threads(groups * n * k * k / 8), [&](int64_t part, int64_t parts) {
        const int64_t begin = n * part / parts, end = n * (part + 1) / parts;
        for (int64_t g = 0; g < groups; ++g) {
          nan[part] |= nearest_pair_rows(
              u + g * n * k, v + g * n * k, cross + g * k * k, begin, end, k, codes + g * n,
              best + g * n);
        }
      });
      throw_if_any(
          nan,
          "[veloxquant.cpu_kernels] nearest_pair_codeword: a score is NaN (non-finite vectors "
          "or codebook)");
    });
  }

  const char* name() const override {
    return "VeloxquantCpuNearestPairCodeword";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// Sum and count of the vectors assigned to each centroid, in the order of the vectors, as MLX's
// CPU scatter-add accumulates them: x [G, n, d], codes [G, n] -> sums [G, k, d], counts [G, k].
class ClusterSums : public CpuPrimitive {
 public:
  ClusterSums(mx::Stream stream, int64_t k) : CpuPrimitive(stream), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const mx::array &x = inputs[0], &codes = inputs[1];
    const int64_t groups = x.shape(0), n = x.shape(1), d = x.shape(2), k = k_;
    const float* xp = x.data<float>();
    const uint32_t* cp = codes.data<uint32_t>();
    float* sums = outputs[0].data<float>();
    float* counts = outputs[1].data<float>();
    encoder.dispatch([=]() {
      std::vector<char> bad(8, 0);
      run_parts(std::min<int64_t>(groups, worker_threads(groups * n * d)), [&](int64_t part,
                                                                            int64_t parts) {
        for (int64_t g = groups * part / parts; g < groups * (part + 1) / parts; ++g) {
          float* s = sums + g * k * d;
          float* c = counts + g * k;
          std::fill(s, s + k * d, 0.0f);
          std::fill(c, c + k, 0.0f);
          for (int64_t p = 0; p < n; ++p) {
            const uint32_t j = cp[g * n + p];
            if (j >= k) {
              bad[part] = 1;
              continue;
            }
            for (int64_t i = 0; i < d; ++i) s[j * d + i] = s[j * d + i] + xp[(g * n + p) * d + i];
            c[j] = c[j] + 1.0f;
          }
        }
      });
      throw_if_any(bad, "[veloxquant.cpu_kernels] cluster_sums: a code is >= k");
    });
  }

  const char* name() const override {
    return "VeloxquantCpuClusterSums";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return k_ == static_cast<const ClusterSums&>(other).k_;
  }

 private:
  int64_t k_;
};

// veloxquant/kmeans.py's k-means++ D² draws (`_d2_draws`), op for op as its MLX loop runs on
// the CPU: each group starts from point `first`; D² is the squared distance to the nearest point
// drawn so far, a point's ((0 + (x_0 - c_0)^2) + (x_1 - c_1)^2) + ... kept by min; each of the
// K - 1 draws takes the number of points whose inclusive cumulative D² (summed in order) is <=
// u * total, at most m - 1. Groups run side by side; a group's draws do not depend on that.
class KmeansPPDraws : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const mx::array &x = inputs[0], &first = inputs[1], &u = inputs[2];
    const int64_t groups = x.shape(0), m = x.shape(1), d = x.shape(2), draws = u.shape(0);
    const float* xp = x.data<float>();
    const uint32_t* fp = first.data<uint32_t>();
    const float* up = u.data<float>();
    uint32_t* idx = outputs[0].data<uint32_t>();
    encoder.dispatch([=]() {
      std::vector<char> bad(8, 0);
      run_parts(std::min<int64_t>(groups, worker_threads(groups * m * d * draws)),
                [&](int64_t part, int64_t parts) {
        std::vector<float> d2(m), cum(m);
        for (int64_t g = groups * part / parts; g < groups * (part + 1) / parts; ++g) {
          const float* xg = xp + g * m * d;
          uint32_t* out = idx + g * (draws + 1);
          uint32_t j = fp[g];
          if (j >= m) {
            bad[part] = 1;
            continue;
          }
          out[0] = j;
          for (int64_t p = 0; p < m; ++p) d2[p] = std::numeric_limits<float>::infinity();
          for (int64_t s = 0; s < draws; ++s) {
            const float* c = xg + j * d;
            for (int64_t p = 0; p < m; ++p) {
              float acc = 0.0f;
              for (int64_t i = 0; i < d; ++i) {
                const float diff = xg[p * d + i] - c[i];
                acc = acc + diff * diff;
              }
              d2[p] = d2[p] < acc ? d2[p] : acc;  // MLX's minimum(d2, acc)
            }
            float total = 0.0f;
            for (int64_t p = 0; p < m; ++p) cum[p] = total = total + d2[p];
            const float t = up[s * groups + g] * total;
            const int64_t below = std::upper_bound(cum.begin(), cum.end(), t) - cum.begin();
            j = static_cast<uint32_t>(std::min<int64_t>(below, m - 1));
            out[s + 1] = j;
          }
        }
      });
      throw_if_any(bad, "[veloxquant.cpu_kernels] kmeanspp_draws: a first index is >= m");
    });
  }

  const char* name() const override {
    return "VeloxquantCpuKmeansPPDraws";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// VecInfer's attention over the coded past, straight from the codes (veloxquant/methods/vecinfer/
// kernels.py `cpu_kernel_attention`; its oracle is `reference_attention`, the same algebra in MLX
// ops). Per KV head, its R query rows (the G query heads it serves, times the queries) score every
// coded token as q̃·codeword-decoded key, plus q·RoPE_t(μ) written as [a | b]·[cos | sin] of the
// token's pair angles (the caller's `veloxquant.rope.phase_coefficients` and `phase_table`), keep
// an online softmax, and sum p · the decoded value codewords. The past is cut into segments of
// CODED_SEGMENT tokens (or longer, CODED_SCRATCH_FLOATS), each attended on its own (its running
// max, sum and output) and merged in order at the end; threads take whole segments, so the bits
// do not depend on how many threads there are. Nothing of size [tokens, head_dim] is built: a block of CODED_BLOCK tokens' decoded
// rows and scores at a time, in L1.
constexpr int64_t CODED_SEGMENT = 512;
// The segments' partial outputs (segments x heads x rows x D floats) stay within this many
// floats (16 MiB): a prefill chunk's many query rows over a long past take longer segments
// (`segment_tokens`, which depends on the shapes only, so the bits still do not depend on the
// thread count).
constexpr int64_t CODED_SCRATCH_FLOATS = int64_t{1} << 22;
constexpr int64_t CODED_BLOCK = 64;

// rows [n, M·SUB] = the codewords of n tokens' M codes of `bits` bits (each token's codes a
// little-endian bit stream of row_bytes bytes, 3 bytes of padding after the last), book [K, SUB].
template <int SUB>
void decode_rows(
    const uint8_t* codes, int64_t n, int64_t row_bytes, const float* book, int64_t m, int bits,
    int sub, float* rows) {
  const int d = SUB > 0 ? SUB : sub;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = codes + i * row_bytes;
    float* out = rows + i * m * d;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t bit = j * bits;
      uint32_t word;
      std::memcpy(&word, row + (bit >> 3), sizeof(word));
      const uint32_t code = (word >> (bit & 7)) & mask;
      std::memcpy(out + j * d, book + static_cast<int64_t>(code) * d, d * sizeof(float));
    }
  }
}

void decode_rows_any(
    const uint8_t* codes, int64_t n, int64_t row_bytes, const float* book, int64_t m, int bits,
    int sub, float* rows) {
  switch (sub) {
    case 1: decode_rows<1>(codes, n, row_bytes, book, m, bits, sub, rows); break;
    case 2: decode_rows<2>(codes, n, row_bytes, book, m, bits, sub, rows); break;
    case 4: decode_rows<4>(codes, n, row_bytes, book, m, bits, sub, rows); break;
    case 8: decode_rows<8>(codes, n, row_bytes, book, m, bits, sub, rows); break;
    default: decode_rows<0>(codes, n, row_bytes, book, m, bits, sub, rows);
  }
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Tokens per segment of n_coded coded tokens, each segment's partials `per_segment` floats:
// CODED_SEGMENT, or longer (whole blocks) where the segments' partials would pass
// CODED_SCRATCH_FLOATS. From the shapes only, so the bits do not depend on the thread count.
int64_t segment_span(int64_t n_coded, int64_t per_segment) {
  const int64_t most = std::max<int64_t>(1, CODED_SCRATCH_FLOATS / std::max<int64_t>(1, per_segment));
  int64_t span = CODED_SEGMENT;
  if ((n_coded + span - 1) / span > most) {  // whole blocks, at most `most` segments
    span = (n_coded + most - 1) / most;
    span = (span + CODED_BLOCK - 1) / CODED_BLOCK * CODED_BLOCK;
  }
  return span;
}

// Each head's segments merged in order: (m, l, o) [heads, R(, D)] from the partials
// pm, pl [heads, segments, R] and po [heads, segments, R, D] of exp(score - m).
void merge_segments(
    int64_t heads, int64_t segments, int64_t R, int64_t D, const float* pm, const float* pl,
    const float* po, float* m, float* l, float* o) {
  for (int64_t bh = 0; bh < heads; ++bh) {
    for (int64_t r = 0; r < R; ++r) {
      float mx_all = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < segments; ++s) {
        mx_all = std::max(mx_all, pm[(bh * segments + s) * R + r]);
      }
      float sum = 0.0f;
      float* out = o + (bh * R + r) * D;
      std::fill(out, out + D, 0.0f);
      for (int64_t s = 0; s < segments; ++s) {
        const int64_t u = bh * segments + s;
        const float w = pm[u * R + r] == mx_all ? 1.0f : std::exp(pm[u * R + r] - mx_all);
        sum += pl[u * R + r] * w;
        const float* part_out = po + (u * R + r) * D;
        for (int64_t j = 0; j < D; ++j) out[j] += w * part_out[j];
      }
      m[bh * R + r] = mx_all;
      l[bh * R + r] = sum;
    }
  }
}

// The block's softmax step for each of its R rows: scores [R, CODED_BLOCK] of n tokens become
// exp(score - new max), l rescales by alpha (1 where the max stays).
__attribute__((target("avx2,fma"))) void block_softmax(
    float* scores, int64_t n, int64_t R, float* m, float* l, float* alpha) {
  for (int64_t r = 0; r < R; ++r) {
    float* s = scores + r * CODED_BLOCK;
    const float m_new = std::max(m[r], row_max(s, n));
    alpha[r] = m[r] == m_new ? 1.0f : std::exp(m[r] - m_new);
    l[r] = l[r] * alpha[r] + exps_and_sum(s, s, n, m_new);
    m[r] = m_new;
  }
}

struct CodedLayout {
  int64_t batch, heads, rows, dim, capacity, n_coded;
  int64_t key_bytes, value_bytes, key_codes, value_codes, key_books, value_books;
  int key_bits, key_sub, value_bits, value_sub;
  int64_t key_k, value_k;
  bool mean;

  bool operator==(const CodedLayout&) const = default;
};

// scores [R, CODED_BLOCK] of n decoded key rows [n, D]: q̃·k, plus [a | b]·[cos | sin] of the
// token's pair angles with a mean. V = D / 8 vectors a row (0: any D, one lane at a time).
template <int V>
__attribute__((target("avx2,fma"))) void block_scores(
    const float* q, const float* ab, const float* keys, const float* phases, int64_t n,
    int64_t R, int64_t D, float* scores) {
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * D;
    const float* a = ab ? ab + r * D : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const float* k = keys + i * D;
      if constexpr (V > 0) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int v = 0; v < V; ++v) {
          acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * v), _mm256_loadu_ps(k + 8 * v), acc0);
        }
        if (a) {
          const float* ph = phases + i * D;
          for (int v = 0; v < V; ++v) {
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * v), _mm256_loadu_ps(ph + 8 * v), acc1);
          }
        }
        scores[r * CODED_BLOCK + i] = hsum(_mm256_add_ps(acc0, acc1));
      } else {
        float sum = 0.0f;
        for (int64_t j = 0; j < D; ++j) sum += qr[j] * k[j];
        if (a) {
          for (int64_t j = 0; j < D; ++j) sum += a[j] * phases[i * D + j];
        }
        scores[r * CODED_BLOCK + i] = sum;
      }
    }
  }
}

// o [R, D] = o · alpha + Σ_i p[r, i] · values[i] over n decoded value rows [n, D].
template <int V>
__attribute__((target("avx2,fma"))) void block_outputs(
    const float* p, const float* alpha, const float* values, int64_t n, int64_t R, int64_t D,
    float* o) {
  for (int64_t r = 0; r < R; ++r) {
    float* out = o + r * D;
    const float* pr = p + r * CODED_BLOCK;
    if constexpr (V > 0) {
      __m256 acc[V];
      const __m256 scale = _mm256_set1_ps(alpha[r]);
      for (int v = 0; v < V; ++v) acc[v] = _mm256_mul_ps(_mm256_loadu_ps(out + 8 * v), scale);
      for (int64_t i = 0; i < n; ++i) {
        const __m256 w = _mm256_set1_ps(pr[i]);
        const float* x = values + i * D;
        for (int v = 0; v < V; ++v) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * v), acc[v]);
      }
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
    } else {
      for (int64_t j = 0; j < D; ++j) out[j] *= alpha[r];
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < D; ++j) out[j] += pr[i] * values[i * D + j];
      }
    }
  }
}

// One segment [t0, t1) of one KV head: m [R], l [R], o [R, D] of exp(score - m) for the query
// rows q [R, D], over blocks of CODED_BLOCK tokens whose key rows [n, D] `key_rows(t, n, rows)`
// writes (with ab [R, D], the rows' mean-term coefficients against the block's phases [n, D];
// none: null) and whose values are product-VQ codewords of `vb` [K, d].
template <int V, typename KeyRows>
__attribute__((target("avx2,fma"))) void attend_segment(
    int64_t R, int64_t D, int64_t t0, int64_t t1, const float* q, const float* ab,
    const float* phases, KeyRows key_rows, const uint8_t* vc, int64_t value_bytes,
    const float* vb, int64_t value_codes, int value_bits, int value_sub, float* m_out,
    float* l_out, float* o_out) {
  std::vector<float> scores(R * CODED_BLOCK), rows(CODED_BLOCK * D), alpha(R);
  std::vector<uint8_t> codes(CODED_BLOCK * value_bytes + 4);
  for (int64_t r = 0; r < R; ++r) {
    m_out[r] = -std::numeric_limits<float>::infinity();
    l_out[r] = 0.0f;
  }
  std::fill(o_out, o_out + R * D, 0.0f);
  for (int64_t t = t0; t < t1; t += CODED_BLOCK) {
    const int64_t n = std::min(CODED_BLOCK, t1 - t);
    key_rows(t, n, rows.data());
    block_scores<V>(q, ab, rows.data(), ab ? phases + t * D : nullptr, n, R, D, scores.data());
    block_softmax(scores.data(), n, R, m_out, l_out, alpha.data());
    std::memcpy(codes.data(), vc + t * value_bytes, n * value_bytes);
    decode_rows_any(codes.data(), n, value_bytes, vb, value_codes, value_bits, value_sub,
                    rows.data());
    block_outputs<V>(scores.data(), alpha.data(), rows.data(), n, R, D, o_out);
  }
}

// Every head's first n_coded coded tokens in segments (`segment_span`), each attended by
// `segment(bh, t0, t1, m, l, o)` on the worker threads (`work` sizes them), then each head's
// segments merged in order into m [heads, R], l [heads, R], o [heads, R, D].
template <typename Segment>
void attend_in_segments(
    int64_t heads, int64_t R, int64_t D, int64_t n_coded, int64_t work, Segment segment,
    float* m, float* l, float* o) {
  const int64_t span = segment_span(n_coded, heads * R * D);
  const int64_t segments = std::max<int64_t>(1, (n_coded + span - 1) / span);
  const int64_t units = heads * segments;
  std::vector<float> pm(units * R), pl(units * R), po(units * R * D);
  const int64_t parts = std::min<int64_t>(units, worker_threads(work));
  run_parts(parts, [&](int64_t part, int64_t n_parts) {
    for (int64_t u = part * units / n_parts; u < (part + 1) * units / n_parts; ++u) {
      const int64_t bh = u / segments, t0 = (u % segments) * span;
      segment(bh, t0, std::min(n_coded, t0 + span), pm.data() + u * R, pl.data() + u * R,
              po.data() + u * R * D);
    }
  });
  merge_segments(heads, segments, R, D, pm.data(), pl.data(), po.data(), m, l, o);
}

// One segment [t0, t1) of KV head (b, h): m [R], l [R], o [R, D] of exp(score - m).
template <int V>
__attribute__((target("avx2,fma"))) void coded_segment(
    const CodedLayout& L, int64_t b, int64_t h, int64_t t0, int64_t t1, const float* qt,
    const float* ab, const uint8_t* kcodes, const float* kbook, const uint8_t* vcodes,
    const float* vbook, const float* phases, float* m_out, float* l_out, float* o_out) {
  const int64_t R = L.rows, D = L.dim, bh = b * L.heads + h;
  const float* kb = kbook + (L.key_books > 1 ? h : 0) * L.key_k * L.key_sub;
  const float* vb = vbook + (L.value_books > 1 ? h : 0) * L.value_k * L.value_sub;
  const uint8_t* kc = kcodes + bh * L.capacity * L.key_bytes;
  std::vector<uint8_t> codes(CODED_BLOCK * L.key_bytes + 4);
  const auto key_rows = [&](int64_t t, int64_t n, float* rows) {
    std::memcpy(codes.data(), kc + t * L.key_bytes, n * L.key_bytes);
    decode_rows_any(codes.data(), n, L.key_bytes, kb, L.key_codes, L.key_bits, L.key_sub, rows);
  };
  attend_segment<V>(R, D, t0, t1, qt + bh * R * D, L.mean ? ab + bh * R * D : nullptr, phases,
                    key_rows, vcodes + bh * L.capacity * L.value_bytes, L.value_bytes, vb,
                    L.value_codes, L.value_bits, L.value_sub, m_out, l_out, o_out);
}

using CodedSegmentFn = void (*)(
    const CodedLayout&, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
    const uint8_t*, const float*, const uint8_t*, const float*, const float*, float*, float*,
    float*);

// The segment loop for this head_dim: unrolled for D = 32, 64, 128 and 256.
CodedSegmentFn coded_segment_for(int64_t dim) {
  switch (dim) {
    case 32: return coded_segment<4>;
    case 64: return coded_segment<8>;
    case 128: return coded_segment<16>;
    case 256: return coded_segment<32>;
    default: return coded_segment<0>;
  }
}

// Inputs qt [B, H, R, D], ab [B, H, R, D] (or [1]: no mean), key codes [B, H, capacity, key
// bytes], key book [1 or H, K, d], value codes, value book, phases [n_coded, D] (or [1]);
// outputs m [B, H, R], l [B, H, R], o [B, H, R, D] over the first n_coded coded tokens.
class VecinferCodedAttention : public CpuPrimitive {
 public:
  VecinferCodedAttention(mx::Stream stream, CodedLayout layout)
      : CpuPrimitive(stream), layout_(layout) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const CodedLayout L = layout_;
    const float *qt = inputs[0].data<float>(), *ab = inputs[1].data<float>();
    const uint8_t* kc = inputs[2].data<uint8_t>();
    const float* kb = inputs[3].data<float>();
    const uint8_t* vc = inputs[4].data<uint8_t>();
    const float *vb = inputs[5].data<float>(), *phases = inputs[6].data<float>();
    float *m = outputs[0].data<float>(), *l = outputs[1].data<float>(),
          *o = outputs[2].data<float>();
    encoder.dispatch([=]() {
      const int64_t R = L.rows, D = L.dim, heads = L.batch * L.heads;
      const CodedSegmentFn coded_segment = coded_segment_for(D);
      const auto segment = [&](int64_t bh, int64_t t0, int64_t t1, float* pm, float* pl,
                               float* po) {
        coded_segment(L, bh / L.heads, bh % L.heads, t0, t1, qt, ab, kc, kb, vc, vb, phases,
                      pm, pl, po);
      };
      attend_in_segments(heads, R, D, L.n_coded, L.n_coded * heads * R * D * 16, segment, m, l,
                         o);
    });
  }

  const char* name() const override {
    return "VeloxquantCpuVecinferCodedAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return layout_ == static_cast<const VecinferCodedAttention&>(other).layout_;
  }

 private:
  CodedLayout layout_;
};

// CommVQ: the keys of n coded tokens as rows [n, D] in pair layout (each RoPE pair's x, then
// every pair's y), rotated at their positions: pair j of token i is
// RoPE_i(s_i · scale_j · Σ_r g_rj (A_j[a_r] + i·A_j[b_r]) + μ_j), with the token's 12-bit codes
// (a_r, b_r) packed as the cache packs them (R high bytes, then the low nibbles two a byte),
// atoms [64, 2, P] and gains [R, 2, P] of its head, phases [n, D] its [cos | sin]. VP = P / 8
// vectors a half row (0: any P, one lane at a time).
struct CommvqLayout {
  int64_t batch, heads, rows, dim, capacity, n_coded, stages, key_bytes, value_bytes;
  int64_t atom_sets, gain_sets, value_books, value_codes, value_k, value_sub;
  int value_bits;
  bool mean, traditional, scaled;

  bool operator==(const CommvqLayout&) const = default;
};

inline uint32_t commvq_code(const uint8_t* row, int64_t stages, int64_t r) {
  return (static_cast<uint32_t>(row[r]) << 4) | ((row[stages + (r >> 1)] >> ((r & 1) * 4)) & 15u);
}

template <int VP>
__attribute__((target("avx2,fma"))) void commvq_key_rows(
    const CommvqLayout& L, const uint8_t* codes, const float* scales, const float* atoms,
    const float* pair_scale, const float* gains, const float* mean, const float* phases,
    int64_t n, float* rows) {
  const int64_t P = L.dim / 2, R = L.stages;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = codes + i * L.key_bytes;
    const float* ph = phases + i * L.dim;
    float* out = rows + i * L.dim;
    if constexpr (VP > 0) {
      __m256 zx[VP], zy[VP];
      for (int v = 0; v < VP; ++v) zx[v] = zy[v] = _mm256_setzero_ps();
      for (int64_t r = 0; r < R; ++r) {
        const uint32_t code = commvq_code(row, R, r);
        const float* a = atoms + (code >> 6) * 2 * P;
        const float* b = atoms + (code & 63u) * 2 * P;
        const float* g = gains + r * 2 * P;
        for (int v = 0; v < VP; ++v) {
          const __m256 ux = _mm256_sub_ps(_mm256_loadu_ps(a + 8 * v), _mm256_loadu_ps(b + P + 8 * v));
          const __m256 uy = _mm256_add_ps(_mm256_loadu_ps(a + P + 8 * v), _mm256_loadu_ps(b + 8 * v));
          const __m256 gx = _mm256_loadu_ps(g + 8 * v), gy = _mm256_loadu_ps(g + P + 8 * v);
          zx[v] = _mm256_fnmadd_ps(gy, uy, _mm256_fmadd_ps(gx, ux, zx[v]));
          zy[v] = _mm256_fmadd_ps(gy, ux, _mm256_fmadd_ps(gx, uy, zy[v]));
        }
      }
      const __m256 s = _mm256_set1_ps(scales[i]);
      for (int v = 0; v < VP; ++v) {
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(pair_scale + 8 * v), s);
        __m256 kx = _mm256_mul_ps(zx[v], sc), ky = _mm256_mul_ps(zy[v], sc);
        if (mean) {
          kx = _mm256_add_ps(kx, _mm256_loadu_ps(mean + 8 * v));
          ky = _mm256_add_ps(ky, _mm256_loadu_ps(mean + P + 8 * v));
        }
        const __m256 c = _mm256_loadu_ps(ph + 8 * v), sn = _mm256_loadu_ps(ph + P + 8 * v);
        _mm256_storeu_ps(out + 8 * v, _mm256_fmsub_ps(kx, c, _mm256_mul_ps(ky, sn)));
        _mm256_storeu_ps(out + P + 8 * v, _mm256_fmadd_ps(kx, sn, _mm256_mul_ps(ky, c)));
      }
    } else {
      for (int64_t j = 0; j < P; ++j) {
        float zx = 0.0f, zy = 0.0f;
        for (int64_t r = 0; r < R; ++r) {
          const uint32_t code = commvq_code(row, R, r);
          const float* a = atoms + (code >> 6) * 2 * P;
          const float* b = atoms + (code & 63u) * 2 * P;
          const float* g = gains + r * 2 * P;
          const float ux = a[j] - b[P + j], uy = a[P + j] + b[j];
          zx = std::fma(-g[P + j], uy, std::fma(g[j], ux, zx));
          zy = std::fma(g[P + j], ux, std::fma(g[j], uy, zy));
        }
        const float sc = pair_scale[j] * scales[i];
        float kx = zx * sc, ky = zy * sc;
        if (mean) kx += mean[j], ky += mean[P + j];
        out[j] = std::fma(kx, ph[j], -(ky * ph[P + j]));
        out[P + j] = std::fma(kx, ph[P + j], ky * ph[j]);
      }
    }
  }
}

// One segment [t0, t1) of KV head bh: m [R], l [R], o [R, D] of exp(score - m), the keys
// rebuilt a block at a time (commvq_key_rows), the values product-VQ codewords.
template <int VP>
__attribute__((target("avx2,fma"))) void commvq_segment(
    const CommvqLayout& L, int64_t bh, int64_t t0, int64_t t1, const float* q,
    const float* atoms, const float* pair_scale, const float* gains, const float* mean,
    const uint8_t* kcodes, const float* kscales, const uint8_t* vcodes, const float* vbook,
    const float* phases, float* m_out, float* l_out, float* o_out) {
  const int64_t R = L.rows, D = L.dim, h = bh % L.heads, P = D / 2;
  const float* at = atoms + (L.atom_sets > 1 ? h : 0) * 64 * D;
  const float* ps = pair_scale + (L.atom_sets > 1 ? h : 0) * P;
  const float* gn = gains + (L.gain_sets > 1 ? h : 0) * L.stages * D;
  const float* mu = L.mean ? mean + h * D : nullptr;
  const uint8_t* kc = kcodes + bh * L.capacity * L.key_bytes;
  const float* ks = kscales + bh * L.capacity;
  const auto key_rows = [&](int64_t t, int64_t n, float* rows) {
    commvq_key_rows<VP>(L, kc + t * L.key_bytes, ks + t, at, ps, gn, mu, phases + t * D, n, rows);
  };
  const float* vb = vbook + (L.value_books > 1 ? h : 0) * L.value_k * L.value_sub;
  attend_segment<2 * VP>(R, D, t0, t1, q + bh * R * D, nullptr, nullptr, key_rows,
                         vcodes + bh * L.capacity * L.value_bytes, L.value_bytes, vb,
                         L.value_codes, L.value_bits, L.value_sub, m_out, l_out, o_out);
}

using CommvqSegmentFn = void (*)(
    const CommvqLayout&, int64_t, int64_t, int64_t, const float*, const float*, const float*,
    const float*, const float*, const uint8_t*, const float*, const uint8_t*, const float*,
    const float*, float*, float*, float*);

CommvqSegmentFn commvq_segment_for(int64_t dim) {
  switch (dim) {
    case 32: return commvq_segment<2>;
    case 64: return commvq_segment<4>;
    case 128: return commvq_segment<8>;
    case 256: return commvq_segment<16>;
    default: return commvq_segment<0>;
  }
}

// Inputs: the scaled query rows q [B, H, R, D], the cache's atoms θ [S, 1, P, 64, 2] and their
// scales [S, 1, P, 1, 1] ([1]: none), gains [G, stages, P, 2], key mean [H, D] ([1]: none), all
// float32 and in the model's channel order (`traditional`: RoPE pairs (2j, 2j + 1), else
// (j, j + P)); key codes [B, H, capacity, key bytes], key scales [B, H, capacity], value
// codes, value book [1 or H, K, d], phases [n_coded, D]; outputs m [B, H, R], l [B, H, R],
// o [B, H, R, D] over the first n_coded tokens.
class CommvqCodedAttention : public CpuPrimitive {
 public:
  CommvqCodedAttention(mx::Stream stream, CommvqLayout layout)
      : CpuPrimitive(stream), layout_(layout) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs);
    const CommvqLayout L = layout_;
    const float *q_in = inputs[0].data<float>(), *theta = inputs[1].data<float>();
    const float *theta_scale = inputs[2].data<float>(), *gains_in = inputs[3].data<float>();
    const float* mean_in = inputs[4].data<float>();
    const uint8_t* kc = inputs[5].data<uint8_t>();
    const float* ks = inputs[6].data<float>();
    const uint8_t* vc = inputs[7].data<uint8_t>();
    const float *vb = inputs[8].data<float>(), *phases = inputs[9].data<float>();
    float *m = outputs[0].data<float>(), *l = outputs[1].data<float>(),
          *o = outputs[2].data<float>();
    encoder.dispatch([=]() {
      const int64_t R = L.rows, D = L.dim, P = D / 2, heads = L.batch * L.heads;
      // the cache's own arrays in the layouts the loops read (a few thousand floats): the
      // query rows and key mean with each pair's first element then every pair's second, the
      // atoms [S, 64, 2, P] and gains [G, stages, 2, P] one component's pairs contiguous
      std::vector<float> q(heads * R * D), mean(L.mean ? L.heads * D : 0);
      const auto to_pairs = [&](const float* in, float* out, int64_t rows) {
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < P; ++j) {
            out[i * D + j] = in[i * D + (L.traditional ? 2 * j : j)];
            out[i * D + P + j] = in[i * D + (L.traditional ? 2 * j + 1 : P + j)];
          }
        }
      };
      to_pairs(q_in, q.data(), heads * R);
      if (L.mean) to_pairs(mean_in, mean.data(), L.heads);
      std::vector<float> atoms(L.atom_sets * 64 * D), pair_scale(L.atom_sets * P, 1.0f);
      for (int64_t s = 0; s < L.atom_sets; ++s) {
        for (int64_t j = 0; j < P; ++j) {
          if (L.scaled) pair_scale[s * P + j] = theta_scale[s * P + j];
          for (int64_t c = 0; c < 64; ++c) {
            const float* t = theta + ((s * P + j) * 64 + c) * 2;
            atoms[(s * 64 + c) * D + j] = t[0];
            atoms[(s * 64 + c) * D + P + j] = t[1];
          }
        }
      }
      std::vector<float> gains(L.gain_sets * L.stages * D);
      for (int64_t gr = 0; gr < L.gain_sets * L.stages; ++gr) {
        for (int64_t j = 0; j < P; ++j) {
          gains[gr * D + j] = gains_in[(gr * P + j) * 2];
          gains[gr * D + P + j] = gains_in[(gr * P + j) * 2 + 1];
        }
      }
      const CommvqSegmentFn commvq_segment = commvq_segment_for(D);
      const auto segment = [&](int64_t bh, int64_t t0, int64_t t1, float* pm, float* pl,
                               float* po) {
        commvq_segment(L, bh, t0, t1, q.data(), atoms.data(), pair_scale.data(), gains.data(),
                       mean.data(), kc, ks, vc, vb, phases, pm, pl, po);
      };
      attend_in_segments(heads, R, D, L.n_coded, L.n_coded * heads * L.stages * D * 4, segment,
                         m, l, o);
    });
  }

  const char* name() const override {
    return "VeloxquantCpuCommvqCodedAttention";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return layout_ == static_cast<const CommvqCodedAttention&>(other).layout_;
  }

 private:
  CommvqLayout layout_;
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

// MLX's affine `quantized_matmul(x, w, scales, biases, transpose, group_size, bits)` for
// float32 x, scales and biases: batch axes broadcast as MLX broadcasts them.
mx::array quantized_matmul(
    const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
    bool transpose, int group_size, int bits) {
  check_float32(x, 2);
  check_float32(scales, 2);
  check_float32(biases, 2);
  if (w.dtype() != mx::uint32 || w.ndim() < 2) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] quantized_matmul takes uint32 codes");
  }
  if (!(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) ||
      !(group_size == 32 || group_size == 64 || group_size == 128)) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] quantized_matmul takes bits 2-6 or 8 and group size 32, 64 "
        "or 128");
  }
  const int64_t K = x.shape(-1), M = x.shape(-2);
  const int64_t w_cols = w.shape(-1) * 32 / bits;
  const int64_t N = transpose ? w.shape(-2) : w_cols;
  if ((transpose ? w_cols : w.shape(-2)) != K ||
      scales.shape() != biases.shape() || scales.shape(-2) != w.shape(-2) ||
      scales.shape(-1) * group_size != w_cols) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] quantized_matmul: shapes do not match");
  }
  mx::Shape x_batch(x.shape().begin(), x.shape().end() - 2);
  mx::Shape w_batch(w.shape().begin(), w.shape().end() - 2);
  mx::Shape s_batch(scales.shape().begin(), scales.shape().end() - 2);
  if (s_batch != w_batch) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] quantized_matmul: scales and biases need w's batch axes");
  }
  const mx::Shape batch = mx::broadcast_shapes(x_batch, w_batch);
  const mx::Stream s = cpu_stream();
  mx::Shape x_shape = batch;
  x_shape.push_back(M);
  x_shape.push_back(K);
  int w_entries = 1;
  for (auto d : w_batch) w_entries *= d;
  const mx::array source = mx::flatten(
      mx::broadcast_to(mx::reshape(mx::arange(w_entries, mx::int32, s), w_batch, s), batch, s),
      s);
  mx::Shape out_shape = batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  return mx::array(
      out_shape, mx::float32, std::make_shared<QuantizedMatmul>(s, transpose, group_size, bits),
      {mx::contiguous(mx::broadcast_to(x, x_shape, s), false, s), mx::contiguous(w, false, s),
       mx::contiguous(scales, false, s), mx::contiguous(biases, false, s),
       mx::contiguous(source, false, s)});
}

std::vector<mx::array> nearest_centroid(const mx::array& x, const mx::array& c) {
  check_float32(x, 3);
  check_float32(c, 3);
  if (x.ndim() != 3 || c.ndim() != 3 || c.shape(2) != x.shape(2) ||
      !(c.shape(0) == x.shape(0) || c.shape(0) == 1) || c.shape(1) < 1 || x.shape(2) < 1 ||
      x.shape(2) > 6) {
    // from d = 7 on OpenBLAS's pinned kernel sums a score in another order than this one
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] nearest_centroid takes x [G, n, d] and c [G or 1, k, d], "
        "d = 1-6");
  }
  const mx::Stream s = cpu_stream();
  const mx::Shape shape = {x.shape(0), x.shape(1)};
  return mx::array::make_arrays(
      {shape, shape}, {mx::uint32, mx::float32}, std::make_shared<NearestCentroid>(s),
      {mx::contiguous(x, false, s), mx::contiguous(c, false, s)});
}

std::vector<mx::array> nearest_pair_codeword(
    const mx::array& u, const mx::array& v, const mx::array& cross) {
  check_float32(u, 3);
  check_float32(v, 3);
  check_float32(cross, 3);
  const int64_t k = u.ndim() == 3 ? u.shape(2) : 0;
  if (u.ndim() != 3 || u.shape() != v.shape() || cross.ndim() != 3 ||
      cross.shape(0) != u.shape(0) || cross.shape(1) != k || cross.shape(2) != k || k < 1 ||
      k > 65535) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] nearest_pair_codeword takes u, v [G, n, K] and cross "
        "[G, K, K]");
  }
  const mx::Stream s = cpu_stream();
  const mx::Shape shape = {u.shape(0), u.shape(1)};
  return mx::array::make_arrays(
      {shape, shape}, {mx::uint32, mx::float32}, std::make_shared<NearestPairCodeword>(s),
      {mx::contiguous(u, false, s), mx::contiguous(v, false, s), mx::contiguous(cross, false, s)});
}

std::vector<mx::array> cluster_sums(const mx::array& x, const mx::array& codes, int64_t k) {
  check_float32(x, 3);
  if (x.ndim() != 3 || codes.dtype() != mx::uint32 || codes.ndim() != 2 ||
      codes.shape(0) != x.shape(0) || codes.shape(1) != x.shape(1) || k < 1) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] cluster_sums takes x [G, n, d], uint32 codes [G, n], k >= 1");
  }
  const mx::Stream s = cpu_stream();
  return mx::array::make_arrays(
      {{x.shape(0), static_cast<int>(k), x.shape(2)}, {x.shape(0), static_cast<int>(k)}},
      {mx::float32, mx::float32}, std::make_shared<ClusterSums>(s, k),
      {mx::contiguous(x, false, s), mx::contiguous(codes, false, s)});
}

std::vector<mx::array> kmeanspp_draws(const mx::array& x, const mx::array& first,
                                      const mx::array& u) {
  check_float32(x, 3);
  check_float32(u, 2);
  if (x.ndim() != 3 || first.dtype() != mx::uint32 || first.ndim() != 1 ||
      first.shape(0) != x.shape(0) || u.ndim() != 2 || u.shape(1) != x.shape(0) ||
      x.shape(1) < 1) {
    throw std::invalid_argument(
        "[veloxquant.cpu_kernels] kmeanspp_draws takes x [G, m, d], uint32 first [G], "
        "u [K - 1, G]");
  }
  const mx::Stream s = cpu_stream();
  return mx::array::make_arrays(
      {{x.shape(0), u.shape(0) + 1}}, {mx::uint32}, std::make_shared<KmeansPPDraws>(s),
      {mx::contiguous(x, false, s), mx::contiguous(first, false, s), mx::contiguous(u, false, s)});
}

// The op: (m, l, o) of VecinferCodedAttention, its inputs checked against one another.
std::vector<mx::array> vecinfer_coded_attention(
    const mx::array& qt, const mx::array& ab, const mx::array& key_codes,
    const mx::array& key_book, const mx::array& value_codes, const mx::array& value_book,
    const mx::array& phases, int64_t n_coded, int key_bits, int value_bits) {
  for (const auto* x : {&qt, &ab, &key_book, &value_book, &phases}) check_float32(*x, 1);
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] vecinfer_coded_attention: " + what);
  };
  if (qt.ndim() != 4 || key_codes.ndim() != 4 || value_codes.ndim() != 4 ||
      key_book.ndim() != 3 || value_book.ndim() != 3) {
    fail("takes qt [B, H, R, D], codes [B, H, capacity, bytes] and books [1 or H, K, d]");
  }
  if (key_codes.dtype() != mx::uint8 || value_codes.dtype() != mx::uint8) fail("codes are uint8");
  CodedLayout L{};
  L.batch = qt.shape(0), L.heads = qt.shape(1), L.rows = qt.shape(2), L.dim = qt.shape(3);
  L.capacity = key_codes.shape(2), L.n_coded = n_coded;
  L.key_bytes = key_codes.shape(3), L.value_bytes = value_codes.shape(3);
  L.key_books = key_book.shape(0), L.value_books = value_book.shape(0);
  L.key_bits = key_bits, L.value_bits = value_bits;
  L.key_k = key_book.shape(1), L.value_k = value_book.shape(1);
  L.key_sub = key_book.shape(2), L.value_sub = value_book.shape(2);
  L.mean = ab.ndim() == 4;
  for (int bits : {key_bits, value_bits}) {
    if (bits < 1 || bits > 16) fail("code widths are 1-16 bits");
  }
  if (L.key_k != (int64_t{1} << key_bits) || L.value_k != (int64_t{1} << value_bits)) {
    fail("a book has 2^bits codewords");
  }
  if (L.dim % L.key_sub || L.dim % L.value_sub) fail("sub-vector dims must divide D");
  L.key_codes = L.dim / L.key_sub, L.value_codes = L.dim / L.value_sub;
  const mx::Shape codes_k = {qt.shape(0), qt.shape(1), key_codes.shape(2),
                             static_cast<int>((L.key_codes * key_bits + 7) / 8)};
  const mx::Shape codes_v = {qt.shape(0), qt.shape(1), key_codes.shape(2),
                             static_cast<int>((L.value_codes * value_bits + 7) / 8)};
  if (key_codes.shape() != codes_k || value_codes.shape() != codes_v) {
    fail("code buffers must be [B, H, capacity, packed bytes] of the books' widths");
  }
  if (n_coded < 0 || n_coded > L.capacity) fail("n_coded must be within the buffers");
  for (int64_t books : {L.key_books, L.value_books}) {
    if (books != 1 && books != L.heads) fail("books are shared [1, ...] or per head [H, ...]");
  }
  if (L.mean) {
    const mx::Shape table = {static_cast<int>(n_coded), qt.shape(3)};
    if (ab.shape() != qt.shape() || phases.shape() != table) {
      fail("the mean terms are ab [B, H, R, D] and phases [n_coded, D]");
    }
  }
  const mx::Stream s = cpu_stream();
  const mx::Shape rows = {qt.shape(0), qt.shape(1), qt.shape(2)};
  return mx::array::make_arrays(
      {rows, rows, qt.shape()}, {mx::float32, mx::float32, mx::float32},
      std::make_shared<VecinferCodedAttention>(s, L),
      {mx::contiguous(qt, false, s), mx::contiguous(ab, false, s),
       mx::contiguous(key_codes, false, s), mx::contiguous(key_book, false, s),
       mx::contiguous(value_codes, false, s), mx::contiguous(value_book, false, s),
       mx::contiguous(phases, false, s)});
}

// The op: (m, l, o) of CommvqCodedAttention, its inputs checked against one another.
std::vector<mx::array> commvq_coded_attention(
    const mx::array& q, const mx::array& theta, const mx::array& theta_scale,
    const mx::array& gains, const mx::array& mean, const mx::array& key_codes,
    const mx::array& key_scales, const mx::array& value_codes, const mx::array& value_book,
    const mx::array& phases, int64_t n_coded, int value_bits, bool traditional) {
  for (const auto* x : {&q, &theta, &theta_scale, &gains, &mean, &key_scales, &value_book,
                        &phases}) {
    check_float32(*x, 1);
  }
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument("[veloxquant.cpu_kernels] commvq_coded_attention: " + what);
  };
  if (q.ndim() != 4 || theta.ndim() != 5 || gains.ndim() != 4 || key_codes.ndim() != 4 ||
      key_scales.ndim() != 3 || value_codes.ndim() != 4 || value_book.ndim() != 3 ||
      phases.ndim() != 2) {
    fail("takes q [B, H, R, D], atoms [S, 1, D/2, 64, 2], gains [G, stages, D/2, 2], codes "
         "[B, H, capacity, bytes], key scales [B, H, capacity], a value book [1 or H, K, d] "
         "and phases [n_coded, D]");
  }
  if (key_codes.dtype() != mx::uint8 || value_codes.dtype() != mx::uint8) fail("codes are uint8");
  CommvqLayout L{};
  L.batch = q.shape(0), L.heads = q.shape(1), L.rows = q.shape(2), L.dim = q.shape(3);
  L.capacity = key_codes.shape(2), L.n_coded = n_coded, L.stages = gains.shape(1);
  L.key_bytes = key_codes.shape(3), L.value_bytes = value_codes.shape(3);
  L.atom_sets = theta.shape(0), L.gain_sets = gains.shape(0), L.value_books = value_book.shape(0);
  L.value_k = value_book.shape(1), L.value_sub = value_book.shape(2), L.value_bits = value_bits;
  L.mean = mean.ndim() == 2, L.traditional = traditional, L.scaled = theta_scale.ndim() == 5;
  const int P = q.shape(3) / 2;
  if (L.dim % 2) fail("head_dim must be even (RoPE pairs)");
  if (theta.shape() != mx::Shape{theta.shape(0), 1, P, 64, 2} || gains.shape(2) != P ||
      gains.shape(3) != 2) {
    fail("atoms must be [S, 1, D/2, 64, 2] and gains [G, stages, D/2, 2]");
  }
  if (L.scaled && theta_scale.shape() != mx::Shape{theta.shape(0), 1, P, 1, 1}) {
    fail("atom scales must be [S, 1, D/2, 1, 1]");
  }
  if (L.stages < 1 || L.key_bytes != L.stages + (L.stages + 1) / 2) {
    fail("key code rows hold stages + ceil(stages / 2) bytes");
  }
  if (value_bits < 1 || value_bits > 16 || L.value_k != (int64_t{1} << value_bits)) {
    fail("the value book has 2^bits codewords of 1-16 bits");
  }
  if (L.dim % L.value_sub) fail("the value sub-vector dim must divide D");
  L.value_codes = L.dim / L.value_sub;
  const mx::Shape codes_v = {q.shape(0), q.shape(1), key_codes.shape(2),
                             static_cast<int>((L.value_codes * value_bits + 7) / 8)};
  const mx::Shape scales = {q.shape(0), q.shape(1), key_codes.shape(2)};
  if (key_codes.shape(0) != q.shape(0) || key_codes.shape(1) != q.shape(1) ||
      value_codes.shape() != codes_v || key_scales.shape() != scales) {
    fail("codes and scales must be [B, H, capacity, ...] of the queries' B and H");
  }
  if (n_coded < 0 || n_coded > L.capacity) fail("n_coded must be within the buffers");
  for (int64_t sets : {L.atom_sets, L.gain_sets, L.value_books}) {
    if (sets != 1 && sets != L.heads) fail("atoms, gains and books are [1, ...] or [H, ...]");
  }
  if (L.mean && (mean.shape(0) != L.heads || mean.shape(1) != L.dim)) fail("the mean is [H, D]");
  if (phases.shape(0) != n_coded || phases.shape(1) != L.dim) fail("phases are [n_coded, D]");
  const mx::Stream s = cpu_stream();
  const mx::Shape rows = {q.shape(0), q.shape(1), q.shape(2)};
  std::vector<mx::array> in;
  for (const auto* x : {&q, &theta, &theta_scale, &gains, &mean, &key_codes, &key_scales,
                        &value_codes, &value_book, &phases}) {
    in.push_back(mx::contiguous(*x, false, s));
  }
  return mx::array::make_arrays(
      {rows, rows, q.shape()}, {mx::float32, mx::float32, mx::float32},
      std::make_shared<CommvqCodedAttention>(s, L), in);
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
  m.def(
      "quantized_matmul", &quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
      nb::arg("biases"), nb::arg("transpose"), nb::arg("group_size"), nb::arg("bits"));
  m.def("nearest_centroid", &nearest_centroid, nb::arg("x"), nb::arg("c"));
  m.def("nearest_pair_codeword", &nearest_pair_codeword, nb::arg("u"), nb::arg("v"),
        nb::arg("cross"));
  m.def("cluster_sums", &cluster_sums, nb::arg("x"), nb::arg("codes"), nb::arg("k"));
  m.def("kmeanspp_draws", &kmeanspp_draws, nb::arg("x"), nb::arg("first"), nb::arg("u"));
  m.def("vecinfer_coded_attention", &vecinfer_coded_attention, nb::arg("qt"), nb::arg("ab"),
        nb::arg("key_codes"), nb::arg("key_book"), nb::arg("value_codes"),
        nb::arg("value_book"), nb::arg("phases"), nb::arg("n_coded"),
        nb::arg("key_bits"), nb::arg("value_bits"));
  m.def("commvq_coded_attention", &commvq_coded_attention, nb::arg("q"), nb::arg("theta"),
        nb::arg("theta_scale"), nb::arg("gains"), nb::arg("mean"), nb::arg("key_codes"),
        nb::arg("key_scales"), nb::arg("value_codes"), nb::arg("value_book"), nb::arg("phases"),
        nb::arg("n_coded"), nb::arg("value_bits"), nb::arg("traditional"));
  m.def("exp_float32", &exp_float32, nb::arg("data"));
  m.def("cpu_supported", &cpu_supported);
  m.def("set_wide_assign", [](bool on) { g_wide_assign = on; }, nb::arg("on"));
  m.def("wide_assign", &wide_assign);
}

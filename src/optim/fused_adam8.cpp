// adam8_step_ and the 8-bit state quantisation: argument checks, then the CPU loop or the CUDA launcher (the
// same element math, math/quant8_math.h).
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "../common/cpu_parallel.h"
#include "adam_cpu.h"
#include "adam_hyper.h"
#include "gpuops/fused_adam8.h"
#include "math/adam_math.h"
#include "math/quant8_math.h"
#include "optim_checks.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam8_kernels.h"
#include "pointer_lists.h"
#endif

namespace gpuops::optim {
namespace {

static_assert(kStateBlock == math::kQuantBlock);

const math::CodeBook& code_book(bool is_signed) {
  static const math::CodeBook signed_book = math::dynamic_code_book(true);
  static const math::CodeBook unsigned_book = math::dynamic_code_book(false);
  return is_signed ? signed_book : unsigned_book;
}

#ifdef GPUOPS_WITH_CUDA
/// Both code books (signed, then unsigned) as bytes on `device`, made once per device: the kernels read the
/// host's very floats and tables.
at::Tensor code_books_on(const at::Device& device) {
  static std::mutex mutex;
  static std::unordered_map<std::string, at::Tensor> made;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& books = made[device.str()];
  if (!books.defined()) {
    books = at::empty({2 * static_cast<int64_t>(sizeof(math::CodeBook))}, at::kByte);
    std::memcpy(books.data_ptr<uint8_t>(), &code_book(true), sizeof(math::CodeBook));
    std::memcpy(books.data_ptr<uint8_t>() + sizeof(math::CodeBook), &code_book(false), sizeof(math::CodeBook));
    books = books.to(device);
  }
  return books;
}
#endif

/// The elements of a dense, non-overlapping tensor in memory order (the order the blocks run over).
at::Tensor memory_order(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}, t.storage_offset()); }

void check_state(const char* op, const at::Tensor& like, const at::Tensor& codes, const at::Tensor& scales,
                 const char* name, size_t i) {
  TORCH_CHECK_VALUE(codes.defined() && codes.layout() == at::kStrided && codes.scalar_type() == at::kByte &&
                        codes.device() == like.device() && codes.sizes() == like.sizes() &&
                        codes.strides() == like.strides(),
                    op, ": ", name, "_codes[", i, "] must be uint8 with the sizes and strides of its parameter ",
                    like.sizes(), " / ", like.strides(), " on ", like.device(), ", got ",
                    codes.defined() ? codes.toString() + " " + c10::str(codes.sizes()) : "an undefined tensor");
  TORCH_CHECK_VALUE(scales.defined() && scales.layout() == at::kStrided && scales.scalar_type() == at::kFloat &&
                        scales.device() == like.device() && scales.dim() == 1 && scales.is_contiguous() &&
                        scales.numel() == state_blocks(like.numel()),
                    op, ": ", name, "_scales[", i, "] must be a contiguous 1-d float32 tensor of ",
                    state_blocks(like.numel()), " elements (one per ", kStateBlock, ") on ", like.device(), ", got ",
                    scales.defined() ? scales.toString() + " " + c10::str(scales.sizes()) : "an undefined tensor");
}

void check_all(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList m_codes,
               at::TensorList m_scales, at::TensorList v_codes, at::TensorList v_scales, at::TensorList steps,
               const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "adam8_step_";
  check_adam_options(options, op);
  TORCH_CHECK_VALUE(!options.amsgrad, op, ": amsgrad is not supported with 8-bit states (its running maximum would "
                    "need a third state); use 32-bit states for amsgrad");
  const bool master = !masters.empty();
  at::TensorList fp32 = master ? masters : params;  // what the update runs on
  if (master) {
    detail::check_step_lists(op, masters, {}, steps, grad_scale, found_inf, options.lr_tensor);
    detail::check_half_lists(op, params, grads, masters);
  } else {
    detail::check_step_lists(op, params, {{"grads", grads}}, steps, grad_scale, found_inf, options.lr_tensor);
  }
  for (const auto& [name, list] : {std::make_pair("exp_avg_codes", m_codes), std::make_pair("exp_avg_scales", m_scales),
                                   std::make_pair("exp_avg_sq_codes", v_codes),
                                   std::make_pair("exp_avg_sq_scales", v_scales)})
    TORCH_CHECK_VALUE(list.size() == fp32.size(), op, ": ", name, " has ", list.size(), " tensors but params has ",
                      fp32.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    check_state(op, fp32[i], m_codes[i], m_scales[i], "exp_avg", i);
    check_state(op, fp32[i], v_codes[i], v_scales[i], "exp_avg_sq", i);
  }
}

// The block's loops, each compiled for AVX-512, AVX2 and the baseline (the code book lookups become gathers).
__attribute__((target_clones("avx512f", "avx2", "default"))) void decode_block(
    const float* __restrict value, const uint8_t* __restrict codes, float scale, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = math::decode(value, codes[i], scale);
}

// math::magnitude_max over the block (the largest magnitude, NaN when any is), 8 lanes at a time: the same
// value whatever the order (a maximum is exact), so the CUDA kernel's tree gives it too.
__attribute__((target_clones("avx512f", "avx2", "default"))) float magnitude_max_of(const float* __restrict x,
                                                                                     int64_t n) {
  using Int8 = int __attribute__((vector_size(32)));
  math::Float8 largest{};
  Int8 nan{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    math::Float8 a = math::load8(x + i);
    a = a < 0 ? -a : a;
    nan |= a != a;
    largest = a > largest ? a : largest;
  }
  float result = 0.0f;
  bool any_nan = false;
  for (int k = 0; k < 8; ++k) {
    result = math::magnitude_max(result, largest[k]);
    any_nan = any_nan || nan[k] != 0;
  }
  for (; i < n; ++i) result = math::magnitude_max(result, std::fabs(x[i]));
  return any_nan ? NAN : result;
}

// math::encode over the block: the shared element math the CUDA kernel runs too. (A 4-wide comparison written
// here instead, and an AVX2 version with gathers, measured no better on this workplace's CPU: docs/benchmarks.md.)
__attribute__((target_clones("avx512f", "avx2", "default"))) void encode_block(
    const math::CodeBook& book, const float* __restrict x, float scale, uint8_t* __restrict codes, int64_t n) {
  for (int64_t i = 0; i < n; ++i) codes[i] = math::encode(book, x[i], scale);
}

/// One block of up to kQuantBlock elements: decode both moments, update the parameter in float32 (rounded into
/// its 16-bit copy when T is not float), take the block's new scales, re-encode.
template <typename T>
void adam8_block(float* master, T* param, const T* grad, uint8_t* m_codes, float& m_scale, uint8_t* v_codes,
                 float& v_scale, int64_t n, const math::AdamStep& s) {
  const math::CodeBook &mb = code_book(true), &vb = code_book(false);
  float m[math::kQuantBlock], v[math::kQuantBlock];
  decode_block(mb.value, m_codes, m_scale, m, n);
  decode_block(vb.value, v_codes, v_scale, v, n);
  if constexpr (std::is_same_v<T, float>) {
    detail::adam_range(master, grad, m, v, n, s);  // the 32-bit step's vectorised loop, on the decoded moments
  } else {
    float g[math::kQuantBlock];
    for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(grad[i]);
    detail::adam_range(master, g, m, v, n, s);
    for (int64_t i = 0; i < n; ++i) param[i] = static_cast<T>(master[i]);  // round to nearest even
  }
  m_scale = magnitude_max_of(m, n);
  v_scale = magnitude_max_of(v, n);
  encode_block(mb, m, m_scale, m_codes, n);
  encode_block(vb, v, v_scale, v_codes, n);
}

void adam8_cpu(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList m_codes,
               at::TensorList m_scales, at::TensorList v_codes, at::TensorList v_scales, at::TensorList steps,
               const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const bool master = !masters.empty();
  at::TensorList fp32 = master ? masters : params;
  const auto hyper = detail::to_cpu_hyper(options);
  auto constants = [&](float step, float factor) { return math::make_adam_step(hyper, step + 1.0f, factor); };
  // Pieces start at multiples of 2^15 elements of a tensor: on block boundaries.
  cpu::for_each_applied_piece(fp32, steps, grad_scale, found_inf, constants,
                              [&](size_t t, int64_t begin, int64_t end, const math::AdamStep& s) {
    uint8_t* mc = m_codes[t].data_ptr<uint8_t>();
    uint8_t* vc = v_codes[t].data_ptr<uint8_t>();
    float* ms = m_scales[t].data_ptr<float>();
    float* vs = v_scales[t].data_ptr<float>();
    float* w = fp32[t].data_ptr<float>();
    for (int64_t b = begin; b < end; b += kStateBlock) {
      const int64_t n = std::min(kStateBlock, end - b), k = b / kStateBlock;
      if (!master) {
        adam8_block<float>(w + b, nullptr, grads[t].data_ptr<float>() + b, mc + b, ms[k], vc + b, vs[k], n, s);
        continue;
      }
      AT_DISPATCH_REDUCED_FLOATING_TYPES(params[t].scalar_type(), "adam8_step_", [&] {
        adam8_block<scalar_t>(w + b, params[t].data_ptr<scalar_t>() + b, grads[t].data_ptr<scalar_t>() + b, mc + b,
                              ms[k], vc + b, vs[k], n, s);
      });
    }
  });
}

#ifdef GPUOPS_WITH_CUDA
void adam8_cuda(at::TensorList params, at::TensorList grads, at::TensorList masters, at::TensorList m_codes,
                at::TensorList m_scales, at::TensorList v_codes, at::TensorList v_scales, at::TensorList steps,
                const AdamStepOptions& options, const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf) {
  const bool master = !masters.empty();
  at::TensorList fp32 = master ? masters : params;
  c10::cuda::CUDAGuard guard(fp32[0].device());
  std::vector<void*> lists[8];
  const auto numel = detail::pointer_lists<8>(
      lists, {params, grads, fp32, m_codes, m_scales, v_codes, v_scales, steps});
  const auto dtype = !master                                    ? kernels::GradDtype::Float32
                     : params[0].scalar_type() == at::kBFloat16 ? kernels::GradDtype::BFloat16
                                                                : kernels::GradDtype::Float16;
  const at::Tensor books = code_books_on(fp32[0].device());
  kernels::launch_adam8_step(lists, numel, dtype, detail::to_hyper(options),
                             detail::step_scalars(grad_scale, found_inf, options.lr_tensor),
                             reinterpret_cast<const math::CodeBook*>(books.data_ptr<uint8_t>()),
                             c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace

void adam8_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                 at::TensorList exp_avg_codes, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_codes,
                 at::TensorList exp_avg_sq_scales, at::TensorList steps, const AdamStepOptions& options,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_all(params, grads, master_params, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales, steps,
            options, grad_scale, found_inf);
  if (params.empty()) return;
  const at::Device device = params[0].device();
  if (device.is_cpu()) {
    return adam8_cpu(params, grads, master_params, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                     exp_avg_sq_scales, steps, options, grad_scale, found_inf);
  }
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) {
    return adam8_cuda(params, grads, master_params, exp_avg_codes, exp_avg_scales, exp_avg_sq_codes,
                      exp_avg_sq_scales, steps, options, grad_scale, found_inf);
  }
#endif
  TORCH_CHECK_VALUE(false, "adam8_step_: device ", device, " is not supported");
}

// The quantisation with ATen ops on any device, the same rule as math::encode / decode: the code is the count of
// thresholds below value / scale (NaN: code 0), the value code book[code] * scale.
void quantize_state_(const at::Tensor& values, const at::Tensor& codes, const at::Tensor& scales, bool is_signed) {
  constexpr const char* op = "quantize_state_";
  TORCH_CHECK_VALUE(values.defined() && values.layout() == at::kStrided && values.scalar_type() == at::kFloat &&
                        values.is_non_overlapping_and_dense(),
                    op, ": values must be a dense, non-overlapping float32 tensor, got ",
                    values.defined() ? values.toString() : "an undefined tensor");
  check_state(op, values, codes, scales, is_signed ? "exp_avg" : "exp_avg_sq", 0);
  at::NoGradGuard no_grad;
  const int64_t n = values.numel(), blocks = state_blocks(n);
  const at::Tensor flat = memory_order(values);
  TORCH_CHECK_VALUE(is_signed || !(flat < 0).any().item<bool>(), op, ": a second-moment state must be >= 0 "
                    "everywhere; this one has negative values (not an Adam exp_avg_sq)");
  const at::Tensor padded = at::constant_pad_nd(flat, {0, blocks * kStateBlock - n}).view({blocks, kStateBlock});
  // amax ignores NaN on some paths: a block with a NaN gets NaN as its scale, as the step's maximum gives
  const at::Tensor block_max = padded.abs().amax(1);
  const at::Tensor scale = at::where(padded.isnan().any(1), at::full({}, NAN, padded.options()), block_max);
  const at::Tensor x =
      at::where(scale.eq(0).unsqueeze(1), at::zeros({}, padded.options()), padded / scale.unsqueeze(1));
  const math::CodeBook& book = code_book(is_signed);
  const at::Tensor thresholds = at::tensor(at::ArrayRef<float>(book.threshold, math::kCodes - 1), at::kFloat)
                                    .to(values.device());
  at::Tensor code = at::searchsorted(thresholds, x.reshape({-1}), /*out_int32=*/false, /*right=*/false);
  code = at::where(x.reshape({-1}).isnan(), at::zeros({}, code.options()), code);
  memory_order(codes).copy_(code.narrow(0, 0, n).to(at::kByte));
  scales.copy_(scale);
}

at::Tensor dequantize_state(const at::Tensor& codes, const at::Tensor& scales, bool is_signed) {
  TORCH_CHECK_VALUE(codes.defined() && codes.layout() == at::kStrided && codes.scalar_type() == at::kByte &&
                        codes.is_non_overlapping_and_dense(),
                    "dequantize_state: codes must be a dense, non-overlapping uint8 tensor, got ",
                    codes.defined() ? codes.toString() : "an undefined tensor");
  check_state("dequantize_state", codes, codes, scales, is_signed ? "exp_avg" : "exp_avg_sq", 0);
  at::NoGradGuard no_grad;
  const math::CodeBook& book = code_book(is_signed);
  const at::Tensor values = at::tensor(at::ArrayRef<float>(book.value, math::kCodes), at::kFloat).to(codes.device());
  const at::Tensor per_element = scales.repeat_interleave(kStateBlock).narrow(0, 0, codes.numel());
  at::Tensor out = at::empty_like(codes, codes.options().dtype(at::kFloat));
  memory_order(out).copy_(values.index_select(0, memory_order(codes).to(at::kLong)) * per_element);
  return out;
}

}  // namespace gpuops::optim

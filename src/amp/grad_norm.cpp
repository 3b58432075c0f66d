// unscaled_grad_norm_: pass 1 of the AMP step (non-finite flag + L2 norm of the unscaled gradients).
#include <cmath>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>

#include "../common/cpu_parallel.h"
#include "amp_checks.h"
#include "gpuops/amp.h"
#include "math/amp_math.h"
#include "math/float8.h"

#ifdef GPUOPS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grad_groups.h"
#include "norm_kernels.h"
#endif

namespace gpuops::amp {
namespace {

constexpr int64_t kCpuChunk = 1 << 15;

// Sum of squares of one float32 chunk. 16 fixed accumulator lanes (element i goes to lane i mod 16: the
// same order on every instruction set, so the same norm everywhere) over blocks of 1024 elements, blocks
// added in double. Written with explicit 8-wide vectors (float8.h): left to itself GCC vectorized across
// iterations with gathers and ran 4x slower than torch's norm. Non-finite values are caught with float arithmetic
// only: g - g is 0 for a finite g and NaN for inf or NaN, so a block's "poison" sum is non-zero exactly when
// the block holds one.
__attribute__((target_clones("avx512f", "avx2", "default"))) double float_chunk_sumsq(
    const float* __restrict data, int64_t n, float inv_scale, int& bad) {
  using math::Float8, math::load8;
  constexpr int64_t kBlock = 1024;
  double total = 0.0;
  int nonfinite = 0;
  for (int64_t block = 0; block < n; block += kBlock) {
    const int64_t end = std::min(n, block + kBlock);
    Float8 low = {}, high = {}, poison = {};  // lanes 0-7, lanes 8-15
    int64_t i = block;
    for (; i + 16 <= end; i += 16) {
      const Float8 a = load8(data + i), b = load8(data + i + 8);
      poison += (a - a) + (b - b);
      const Float8 ua = a * inv_scale, ub = b * inv_scale;
      low += ua * ua;
      high += ub * ub;
    }
    float lanes[16], poisoned = 0.0f;
    std::memcpy(lanes, &low, sizeof low);
    std::memcpy(lanes + 8, &high, sizeof high);
    for (; i < end; ++i) {
      const float g = data[i];
      poisoned += g - g;
      const float u = g * inv_scale;
      lanes[0] += u * u;
    }
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += lanes[k];
    for (int k = 0; k < 8; ++k) poisoned += poison[k];
    nonfinite |= poisoned != 0.0f;  // NaN != 0
    total += sum;
  }
  bad |= nonfinite;
  return total;
}

// Per-chunk partial sums in a fixed layout (chunks numbered tensor by tensor), added in order: the same norm
// whatever the thread count. One parallel region for all tensors (common/cpu_parallel.h).
at::Tensor grad_norm_cpu(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const float inv = *inv_scale.data_ptr<float>();
  int64_t chunks = 0;
  for (const auto& g : grads) chunks += (g.numel() + kCpuChunk - 1) / kCpuChunk;
  std::vector<double> partial(chunks, 0.0);
  std::vector<char> nonfinite(chunks, 0);
  cpu::for_each_piece(grads, kCpuChunk, [&](int64_t c, size_t t, int64_t begin, int64_t end) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[t].scalar_type(), "unscaled_grad_norm_", [&] {
      const scalar_t* data = grads[t].data_ptr<scalar_t>();
      if constexpr (std::is_same_v<scalar_t, float>) {
        int bad = 0;
        // (the branch is compiled for every dtype, taken for float32 only)
        partial[c] = float_chunk_sumsq(reinterpret_cast<const float*>(data) + begin, end - begin, inv, bad);
        nonfinite[c] = bad != 0;
      } else {
        double sum = 0.0;
        bool inf = false;
        for (int64_t i = begin; i < end; ++i) {
          const float u = math::unscale_element(static_cast<float>(data[i]), inv, inf);
          sum += static_cast<double>(u) * u;
        }
        partial[c] = sum;
        nonfinite[c] = inf;
      }
    });
  });
  double total = 0.0;
  bool any_inf = false;
  for (int64_t c = 0; c < chunks; ++c) {
    total += partial[c];
    any_inf = any_inf || nonfinite[c];
  }
  if (any_inf || !std::isfinite(inv)) found_inf.fill_(1.0f);  // as unscale_cpu: a non-finite factor skips the step
  return at::full({1}, static_cast<float>(std::sqrt(total)), found_inf.options());
}

#ifdef GPUOPS_WITH_CUDA
at::Tensor grad_norm_cuda(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  c10::cuda::CUDAGuard guard(found_inf.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto groups = detail::group_by_dtype(grads);
  at::Tensor sumsq = at::zeros({static_cast<int64_t>(groups.size()) + 1}, found_inf.options());
  int64_t slot = 0;
  for (const auto& [dtype, group] : groups) {
    at::Tensor partials =
        at::empty({kernels::grad_sumsq_partials(group.numel)}, found_inf.options().dtype(at::kDouble));
    kernels::launch_grad_sumsq(group.data, group.numel, detail::grad_dtype(dtype), inv_scale.data_ptr<float>(),
                               partials.data_ptr<double>(), sumsq.data_ptr<float>() + slot++,
                               found_inf.data_ptr<float>(), stream);
  }
  return sumsq.sum().sqrt().reshape({1});
}
#endif

}  // namespace

at::Tensor unscaled_grad_norm_(at::TensorList grads, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  TORCH_CHECK_VALUE(found_inf.defined(), "unscaled_grad_norm_: found_inf is undefined");
  const at::Device device = found_inf.device();
  detail::check_scalar_state(found_inf, "found_inf", at::kFloat, device);
  detail::check_scalar_state(inv_scale, "inv_scale", at::kFloat, device);
  detail::check_grads("unscaled_grad_norm_", grads, device);
  if (device.is_cpu()) return grad_norm_cpu(grads, inv_scale, found_inf);
#ifdef GPUOPS_WITH_CUDA
  if (device.is_cuda()) return grad_norm_cuda(grads, inv_scale, found_inf);
#endif
  TORCH_CHECK_VALUE(false, "unscaled_grad_norm_: device ", device, " is not supported");
}

}  // namespace gpuops::amp

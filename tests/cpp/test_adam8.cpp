// The 8-bit Adam engine from C++ (gpuops/fused_adam8.h): the quantisation against float64, one step against
// Adam's arithmetic in float64 from the same decoded moments, a skipped step. tests/python/test_adam8.py holds
// the rest (the optimizer classes, state_dict, adversarial blocks).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "gpuops/fused_adam8.h"
#include "parity_bound.h"

namespace {

using gpuops::optim::kStateBlock;

struct State {
  at::Tensor codes, scales;
};

State quantized(const at::Tensor& values, bool is_signed) {
  State s{at::empty_like(values, values.options().dtype(at::kByte)),
          at::empty({gpuops::optim::state_blocks(values.numel())})};
  gpuops::optim::quantize_state_(values, s.codes, s.scales, is_signed);
  return s;
}

at::Tensor decoded(const State& s, bool is_signed) {
  return gpuops::optim::dequantize_state(s.codes, s.scales, is_signed).to(at::kDouble);
}

/// Each block's scale, per element (float64).
at::Tensor block_scales(const at::Tensor& values) {
  const int64_t n = values.numel(), blocks = gpuops::optim::state_blocks(n);
  const at::Tensor padded = at::constant_pad_nd(values.to(at::kDouble).abs(), {0, blocks * kStateBlock - n});
  return std::get<0>(padded.view({blocks, kStateBlock}).max(1)).repeat_interleave(kStateBlock).narrow(0, 0, n);
}

TEST(Adam8, QuantisationIsWithinTheCodeBooksHalfGapOfEachBlocksScale) {
  for (bool is_signed : {true, false}) {
    at::Tensor values = at::randn({3 * kStateBlock + 41}) * at::exp(at::empty({3 * kStateBlock + 41}).uniform_(-20, 0));
    if (!is_signed) values = values.abs();
    const State s = quantized(values, is_signed);
    const at::Tensor scale = block_scales(values);
    EXPECT_TRUE(at::equal(s.scales.to(at::kDouble).repeat_interleave(kStateBlock).narrow(0, 0, values.numel()), scale));
    // 0.9 / 128 (signed) or 0.9 / 256 (unsigned) of the scale: half the code book's widest gap, plus rounding.
    const double half_gap = is_signed ? 0.9 / 128 : 0.9 / 256;
    const double worst = ((decoded(s, is_signed) - values.to(at::kDouble)).abs() / scale).max().item<double>();
    EXPECT_LE(worst, half_gap + 1e-6) << (is_signed ? "signed" : "unsigned");
  }
}

TEST(Adam8, OneStepMatchesAdamWInFloat64FromTheDecodedMoments) {
  const int64_t n = 5 * kStateBlock + 3;
  at::Tensor param = at::randn({n}), grad = at::randn({n});
  const State m = quantized(at::randn({n}) * 0.1, true), v = quantized(at::rand({n}) * 0.01, false);
  // float64 and float32 references: torch's single-tensor AdamW arithmetic, step 3, from the decoded moments
  const auto reference = [&](at::ScalarType dtype) {
    const double lr = 1e-2, wd = 0.0625, b1 = 0.9, b2 = 0.999, t = 3;
    at::Tensor p = param.to(dtype) * (1 - lr * wd), g = grad.to(dtype);
    at::Tensor m1 = decoded(m, true).to(dtype), v1 = decoded(v, false).to(dtype);
    m1 = m1 + (1 - b1) * (g - m1);
    v1 = v1 * b2 + (1 - b2) * g * g;
    return p - lr / (1 - std::pow(b1, t)) * m1 / (v1.sqrt() / std::sqrt(1 - std::pow(b2, t)) + 1e-8);
  };
  const at::Tensor want64 = reference(at::kDouble), want32 = reference(at::kFloat);
  at::Tensor step = at::full({}, 2.0f);
  gpuops::optim::AdamStepOptions options;
  options.lr = 1e-2;
  options.weight_decay = 0.0625;
  gpuops::optim::adam8_step_({param}, {grad}, {}, {m.codes}, {m.scales}, {v.codes}, {v.scales}, {step}, options,
                             std::nullopt, std::nullopt);
  EXPECT_EQ(step.item<float>(), 3.0f);
  const auto p = gpuops_test::parity({param}, {want64}, {want32});
  EXPECT_TRUE(p.holds()) << p.worst << " > " << p.bound();
}

TEST(Adam8, ASkippedStepChangesNothingAndBadListsAreNamed) {
  const int64_t n = 2 * kStateBlock;
  at::Tensor param = at::randn({n});
  const State m = quantized(at::randn({n}), true), v = quantized(at::rand({n}), false);
  const std::vector<at::Tensor> before{param.clone(), m.codes.clone(), m.scales.clone(), v.codes.clone(),
                                       v.scales.clone()};
  at::Tensor step = at::zeros({});
  gpuops::optim::adam8_step_({param}, {at::randn({n})}, {}, {m.codes}, {m.scales}, {v.codes}, {v.scales}, {step}, {},
                             at::full({1}, 1024.0f), at::ones({1}));
  const std::vector<at::Tensor> after{param, m.codes, m.scales, v.codes, v.scales};
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i])) << i;
  EXPECT_EQ(step.item<float>(), 0.0f);
  gpuops::optim::AdamStepOptions amsgrad;
  amsgrad.amsgrad = true;
  try {
    gpuops::optim::adam8_step_({param}, {param.clone()}, {}, {m.codes}, {m.scales}, {v.codes}, {v.scales}, {step},
                               amsgrad, std::nullopt, std::nullopt);
    ADD_FAILURE() << "amsgrad was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad is not supported with 8-bit states"), std::string::npos);
  }
}

}  // namespace

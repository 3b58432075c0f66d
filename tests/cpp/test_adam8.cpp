// The 8-bit Adam engine from C++ (gpuops/fused_adam8.h): the quantisation against float64, one step against
// Adam's arithmetic in float64 from the same decoded moments, a skipped step; and AdamW(state_bits 8): its
// steps are the engine's, its archive round-trips, a 32-bit archive loads into it. tests/python/test_adam8.py
// holds the rest (the Python classes, state_dict, adversarial blocks).
#include <gtest/gtest.h>

#include <sstream>

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include "gpuops/fused_adam8.h"
#include "gpuops/optimizers.h"
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

const gpuops::optim::AdamWParamState& state_of(const gpuops::optim::AdamW& opt, const at::Tensor& param) {
  return static_cast<const gpuops::optim::AdamWParamState&>(*opt.state().at(param.unsafeGetTensorImpl()));
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

TEST(Adam8, AdamWWithStateBits8StepsAsTheEngineAndItsArchiveRoundTrips) {
  // A 64x128 weight (8-bit moments) and a 128-element bias (float32 ones, under kMin8BitNumel).
  const auto make = [] {
    return std::vector<at::Tensor>{at::randn({128, 64}).requires_grad_(true), at::randn({128}).requires_grad_(true)};
  };
  auto params = make();
  std::vector<at::Tensor> engine{params[0].detach().clone()};
  const State m0 = quantized(at::zeros({128, 64}), true), v0 = quantized(at::zeros({128, 64}), false);
  State m{m0.codes.clone(), m0.scales.clone()}, v{v0.codes.clone(), v0.scales.clone()};
  at::Tensor engine_step = at::zeros({});
  gpuops::optim::AdamW opt(params, gpuops::optim::AdamWOptions(1e-2).state_bits(8));
  gpuops::optim::AdamStepOptions options;
  options.lr = 1e-2;
  options.weight_decay = 1e-2;
  for (int step = 0; step < 3; ++step) {
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes());
    opt.step();
    gpuops::optim::adam8_step_(engine, {params[0].grad()}, {}, {m.codes}, {m.scales}, {v.codes}, {v.scales},
                               {engine_step}, options, std::nullopt, std::nullopt);
  }
  EXPECT_TRUE(at::equal(params[0], engine[0]));
  const auto& weight = state_of(opt, params[0]);
  const auto& bias = state_of(opt, params[1]);
  EXPECT_TRUE(at::equal(weight.exp_avg_codes(), m.codes) && at::equal(weight.exp_avg_sq_scales(), v.scales));
  EXPECT_FALSE(weight.exp_avg().defined());
  EXPECT_TRUE(bias.exp_avg().defined() && !bias.exp_avg_codes().defined());
  // The archive: another optimizer over copies loads it, and the next step gives the same bits.
  std::stringstream archive;
  torch::save(opt, archive);
  std::vector<at::Tensor> copies{params[0].detach().clone().requires_grad_(true),
                                 params[1].detach().clone().requires_grad_(true)};
  gpuops::optim::AdamW again(copies, gpuops::optim::AdamWOptions(1e-2).state_bits(8));
  torch::load(again, archive);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = at::randn(params[i].sizes());
    copies[i].mutable_grad() = params[i].grad().clone();
  }
  opt.step();
  again.step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], copies[i])) << i;
  // A corrupt archive (negative scales) is refused naming the tensor, and the optimizer keeps its state.
  weight.exp_avg_scales().neg_().sub_(1);
  std::stringstream corrupt;
  torch::save(opt, corrupt);
  const at::Tensor before = state_of(again, copies[0]).exp_avg_scales().clone();
  try {
    torch::load(again, corrupt);
    ADD_FAILURE() << "negative scales were loaded";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'exp_avg_scales' has negative scales"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(state_of(again, copies[0]).exp_avg_scales(), before));
}

TEST(Adam8, AFloat32ArchiveLoadsIntoStateBits8EncodedAndBadOptionsAreNamed) {
  std::vector<at::Tensor> params{at::randn({4096}).requires_grad_(true)};
  gpuops::optim::AdamW plain(params, gpuops::optim::AdamWOptions(1e-2));
  params[0].mutable_grad() = at::randn({4096});
  plain.step();
  std::stringstream archive;
  torch::save(plain, archive);
  gpuops::optim::AdamW eight(params, gpuops::optim::AdamWOptions(1e-2).state_bits(8));
  torch::load(eight, archive);  // the archive's options hold state_bits 32: set 8 again, as a user would
  static_cast<gpuops::optim::AdamWOptions&>(eight.param_groups()[0].options()).state_bits(8);
  const auto& loaded = state_of(eight, params[0]);
  params[0].mutable_grad() = at::zeros({4096});
  const at::Tensor exp_avg = loaded.exp_avg().clone();
  eight.step();
  const auto& after = state_of(eight, params[0]);
  // encoded from the loaded float32 moment, then one step with a zero gradient: m = 0.9 m
  EXPECT_TRUE(after.exp_avg_codes().defined() && !after.exp_avg().defined());
  const at::Tensor decoded = gpuops::optim::dequantize_state(after.exp_avg_codes(), after.exp_avg_scales(), true);
  EXPECT_LE((decoded - 0.9 * exp_avg).abs().max().item<float>(), 0.9 / 128 * exp_avg.abs().max().item<float>() * 2.01);
  for (int64_t bits : {7, 16, 0}) {
    try {
      gpuops::optim::AdamW bad(params, gpuops::optim::AdamWOptions().state_bits(bits));
      ADD_FAILURE() << "state_bits " << bits << " was accepted";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("state_bits must be 32 (float32 moments) or 8"), std::string::npos);
    }
  }
  try {
    gpuops::optim::Adam bad(params, gpuops::optim::AdamOptions().amsgrad(true).state_bits(8));
    ADD_FAILURE() << "amsgrad with 8 bits was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad=true is not supported with state_bits=8"), std::string::npos);
  }
}

}  // namespace

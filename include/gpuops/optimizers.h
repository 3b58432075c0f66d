#pragma once
// gpuops::optim::AdamW and SGD for LibTorch C++: subclasses of torch::optim::Optimizer (param groups,
// per-group options, zero_grad, torch::save/load, torch's LR schedulers), whose step is one fused pass per
// group and device (fused_adam.h, fused_sgd.h). A GradScaler hands them its scale and overflow flag through
// step_scaled(): they divide the gradients as they read them and skip themselves on overflow, on the
// device, without a host sync.

#include <cstdint>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "gpuops/fused_adam.h"

namespace gpuops::optim {

/// The learning rate of a capturable group, kept on the parameters' device: made at the group's first step,
/// written by set_lr (which torch's LR schedulers call), read by the step on the device. A step captured in
/// a CUDA graph then follows the schedule.
class DeviceLr {
 public:
  /// The float32 tensor on `device` holding `lr`: made on first use, refilled if lr was changed without
  /// set (options are const during a step).
  const at::Tensor& on(const at::Device& device, double lr) const;
  /// Writes lr into the tensor, if there is one (an asynchronous fill on a GPU).
  void set(double lr);

 private:
  mutable at::Tensor tensor_;
  mutable double value_ = 0.0;  ///< what tensor_ holds
};

/// What the fused optimizers share: the AMP hand-off and the per-group gathering of parameters.
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;

  /// torch's step: evaluates the closure (if any, with grad enabled), then steps every group.
  at::Tensor step(LossClosure closure = nullptr) override;

  /// The AMP step (float32 parameters, or float16/bfloat16 ones on fp32 master copies): gradients are divided by grad_scale (float32[1]) as they are read, and nothing changes
  /// where found_inf (float32[1]) is non-zero, not even the step counters. No host sync. Either may be
  /// empty. Every group is checked before any is stepped, so a bad gradient changes nothing.
  void step_scaled(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

  /// For sharded optimizers (ZeroOptimizer): a GradScaler calls prepare_gradients() before it reads the
  /// gradients of param_groups() (a sharded optimizer reduces them there), and combines its overflow flag and
  /// gradient norm over ranks with global_found_inf / global_grad_norm. Here: nothing, and the values as given.
  virtual void prepare_gradients() {}
  virtual at::Tensor global_found_inf(const at::Tensor& found_inf) { return found_inf; }
  virtual at::Tensor global_grad_norm(const at::Tensor& norm) { return norm; }
  /// The divisor GradScaler::set_grad_divisor folds into the unscale: a sharded optimizer averages its
  /// gradients over ranks, so the global mean needs the mean of the ranks' divisors (e.g. sample counts of
  /// windows that differ across ranks). Here: the divisor as given.
  virtual at::Tensor global_divisor(const at::Tensor& divisor) { return divisor; }

 protected:
  /// The class name, for error messages.
  virtual const char* name() const = 0;
  /// Throws c10::ValueError naming the option of param_groups()[index] that is out of range.
  virtual void check_options(size_t index) const = 0;
  /// The fp32 master a 16-bit parameter steps on: `master` itself, or a fresh copy of the parameter when
  /// there is none or something else wrote the parameter since the last step (load, an EMA swap, an
  /// in-place edit: its version moved; our step does not move it) and `master` no longer rounds to it.
  /// Stepping a stale master would silently undo that write. Values are compared (a host sync on a GPU)
  /// only after such a write.
  at::Tensor synced_master(const at::Tensor& param, const at::Tensor& master);
  /// Throws c10::ValueError when a parameter is listed twice (in one group or in two): it would be stepped
  /// twice. The constructors call it, and every step (add_param_group may have added one since).
  void check_unique_params() const;
  /// After loading state: every master is checked against its parameter at the next step.
  void forget_master_versions() { master_versions_.clear(); }
  /// save(): the optimizer's name beside torch's archive layout, which AdamW and Adam share (their weight decay
  /// differs in meaning); load(): c10::ValueError for an archive another kind wrote (one without the name,
  /// torch's own, loads).
  void write_kind(torch::serialize::OutputArchive& archive) const;
  void check_kind(torch::serialize::InputArchive& archive) const;
  /// The options of param_groups()[index] as `Options`; c10::ValueError when the group was added with another
  /// optimizer's options (a cast would read garbage).
  template <typename Options>
  const Options& group_options(size_t index) const {
    const auto* options = dynamic_cast<const Options*>(&param_groups_[index].options());
    TORCH_CHECK_VALUE(options != nullptr, name(), ": param_groups[", index, "] has the options of another optimizer; "
                      "give it ", name(), "'s options, or none (the defaults)");
    return *options;
  }
  /// A range of a parameter's elements (of its flat view) that one fused call steps, on the step counter
  /// `step` (a one-element float32 tensor the call reads and advances).
  struct StepPart {
    int64_t offset = 0;
    int64_t numel = 0;
    at::Tensor step;
  };
  /// The parts of `param` to step now; `step` is its state's counter. Here: the whole parameter on `step`.
  /// ZeroOptimizer: the parameters of its flat shard that have a gradient, each run of them on a copy of its
  /// own counter (torch's rule: a parameter without a gradient is not stepped).
  virtual std::vector<StepPart> step_parts(const at::Tensor& param, const at::Tensor& step) const {
    return {{0, param.numel(), step}};
  }
  /// Whether `param` of a state_bits=8 group keeps 8-bit moments: here when it has kMin8BitNumel elements or
  /// more. ZeroOptimizer: when its flat buffer is one laid out in whole blocks (ZeroShards::blocked).
  virtual bool takes_8bit_states(const at::Tensor& param) const;
  /// A new state's step counter for `param`: a 0-dim float32 zero on its device. ZeroOptimizer: one per parameter
  /// of the flat buffer.
  virtual at::Tensor fresh_step(const at::Tensor& param) const;
  /// `t` (laid out as the parameter of `part`) cut to the part: itself when the part is all of it.
  static at::Tensor part_of(const at::Tensor& t, const StepPart& part);
  /// Steps the parameters of param_groups()[index] that have a gradient (all on one device, checked).
  virtual void step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) = 0;

 private:
  /// Parameters the fused step cannot read linearly, as torch's optimizers step them: one that is not a dense
  /// block (a strided view) steps on a dense copy of its data (set_data: the parameter, and so its state, keep
  /// their identity), written back after the step; a gradient laid out otherwise is copied into that layout.
  class Staging {
   public:
    void stage(at::Tensor& param);
    /// Puts every parameter's data and gradient back; `write_back`: the stepped values into the parameter.
    void restore(bool write_back);

   private:
    struct Staged {
      at::Tensor param, original, grad, dense;
    };
    std::vector<Staged> staged_;
  };

  std::unordered_map<const c10::TensorImpl*, uint32_t> master_versions_;  ///< param version at its last step
};

/// Options of gpuops::optim::AdamW, named and defaulted as torch::optim::AdamWOptions (+ maximize).
struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): torch's options convert from lr
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  /// Read lr on the device (DeviceLr) so that a step captured in a CUDA graph follows an LR scheduler.
  /// Change lr through set_lr then, as the schedulers do: lr(x) alone does not reach a captured graph.
  TORCH_ARG(bool, capturable) = false;
  /// 32: float32 moments; 8: block-wise 8-bit moments for float32/16-bit parameters of kMin8BitNumel elements
  /// or more (gpuops/fused_adam8.h; not with amsgrad, and not yet with ZeroOptimizer).
  TORCH_ARG(int64_t, state_bits) = 32;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override {
    this->lr(lr);
    device_lr.set(lr);
  }
  DeviceLr device_lr;  ///< used when capturable
};

/// Options of gpuops::optim::Adam, named and defaulted as torch::optim::AdamOptions (+ maximize): the
/// weight decay is L2 (added to the gradient), not decoupled, and 0 by default.
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  /// As AdamWOptions::capturable.
  TORCH_ARG(bool, capturable) = false;
  /// 32: float32 moments; 8: block-wise 8-bit moments for float32/16-bit parameters of kMin8BitNumel elements
  /// or more (gpuops/fused_adam8.h; not with amsgrad, and not yet with ZeroOptimizer).
  TORCH_ARG(int64_t, state_bits) = 32;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override {
    this->lr(lr);
    device_lr.set(lr);
  }
  DeviceLr device_lr;  ///< used when capturable
};

/// Per-parameter state: the step counter lives on the parameter's device (float32 scalar, advanced only by
/// applied steps), as in torch's fused/capturable AdamW. A float16/bfloat16 parameter also has an fp32
/// master_param, and its moments are fp32.
struct AdamWParamState : public torch::optim::OptimizerCloneableParamState<AdamWParamState> {
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, master_param);
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);
  /// With state_bits 8, in place of exp_avg and exp_avg_sq: uint8 codes laid out as the parameter (or its
  /// master) and float32 scales, one per kStateBlock elements (gpuops/fused_adam8.h).
  TORCH_ARG(at::Tensor, exp_avg_codes);
  TORCH_ARG(at::Tensor, exp_avg_scales);
  TORCH_ARG(at::Tensor, exp_avg_sq_codes);
  TORCH_ARG(at::Tensor, exp_avg_sq_scales);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};
using AdamParamState = AdamWParamState;  ///< Adam keeps the same tensors

/// What Adam and AdamW share: the fused step (fp32 parameters, or float16/bfloat16 ones on an fp32
/// master copy, rounded back), one call per group and parameter dtype.
class AdamBase : public FusedOptimizer {
 public:
  using FusedOptimizer::FusedOptimizer;

 protected:
  /// The fused step's options for param_groups()[index] (decoupled or L2 weight decay; a capturable group's
  /// learning rate on `device`).
  virtual AdamStepOptions step_options(size_t index, c10::Device device) const = 0;
  /// The group's state_bits (32 or 8).
  virtual int64_t state_bits(size_t index) const = 0;
  void step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) override;
};

/// AdamW (decoupled weight decay, optional amsgrad), fused.
class AdamW : public AdamBase {
 public:
  using Options = AdamWOptions;
  using ParamState = AdamWParamState;
  /// c10::ValueError naming the option out of range (check_adam_options) or a parameter given twice.
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamWOptions defaults = {});
  explicit AdamW(std::vector<at::Tensor> params, AdamWOptions defaults = {});

  void save(torch::serialize::OutputArchive& archive) const override;
  /// Loads an archive of ours or of torch::optim::AdamW, or changes nothing: the group count and sizes,
  /// every option and every state tensor's shape are checked before the state and options are swapped in.
  /// c10::ValueError for an archive of another optimizer or model, or for a file that is no optimizer archive.
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  const char* name() const override;
  void check_options(size_t index) const override;
  AdamStepOptions step_options(size_t index, c10::Device device) const override;
  int64_t state_bits(size_t index) const override;
};

/// Adam (L2 weight decay added to the gradient, optional amsgrad), fused: torch::optim::Adam's update.
class Adam : public AdamBase {
 public:
  using Options = AdamOptions;
  using ParamState = AdamParamState;
  /// c10::ValueError naming the option out of range (check_adam_options) or a parameter given twice.
  explicit Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamOptions defaults = {});
  explicit Adam(std::vector<at::Tensor> params, AdamOptions defaults = {});

  void save(torch::serialize::OutputArchive& archive) const override;
  /// As AdamW::load; takes archives of ours and of torch::optim::Adam.
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  const char* name() const override;
  void check_options(size_t index) const override;
  AdamStepOptions step_options(size_t index, c10::Device device) const override;
  int64_t state_bits(size_t index) const override;
};

/// Options of gpuops::optim::SGD, named and defaulted as torch::optim::SGDOptions (+ maximize).
struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  /// As AdamWOptions::capturable.
  TORCH_ARG(bool, capturable) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override {
    this->lr(lr);
    device_lr.set(lr);
  }
  DeviceLr device_lr;  ///< used when capturable
};

/// Per-parameter state: torch's momentum_buffer plus a device step counter (0: the buffer starts from the
/// next applied gradient, as torch's does); a float16/bfloat16 parameter also has an fp32 master_param and
/// an fp32 momentum buffer.
struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// SGD with momentum, dampening, Nesterov and weight decay, fused. Float32 parameters (any layout), or
/// float16/bfloat16 ones stepped on an fp32 master copy and rounded back.
class SGD : public FusedOptimizer {
 public:
  using Options = SGDOptions;
  using ParamState = SGDParamState;
  /// c10::ValueError naming the option out of range (check_sgd_options) or a parameter given twice.
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, SGDOptions defaults);
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults);

  void save(torch::serialize::OutputArchive& archive) const override;
  /// As AdamW::load; takes archives of ours and of torch::optim::SGD (whose momentum buffers are continued).
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  const char* name() const override;
  void check_options(size_t index) const override;
  void step_group(size_t index, std::vector<at::Tensor>& params, const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) override;
};

}  // namespace gpuops::optim

// The option checks of the fused optimizers, the GradScaler and the GradAccumulator, for their Python
// classes: the very C++ functions the C++ classes call, so both languages accept the same values and say
// the same thing. This file only converts Python values, naming the argument when one is not a number.
#include <pybind11/stl.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>              // torch.Tensor <-> at::Tensor

#include "bindings.h"
#include "py_args.h"
#include "gpuops/fused_adam.h"
#include "gpuops/fused_adam8.h"
#include "gpuops/fused_sgd.h"
#include "gpuops/grad_accumulator.h"
#include "gpuops/grad_scaler.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

/// A count or divisor: a tensor as it is, a number as a float64 CPU scalar (checked before any rounding).
at::Tensor count_tensor(const std::string& where, const std::string& name, const py::handle& value) {
  if (THPVariable_Check(value.ptr())) return THPVariable_Unpack(value.ptr());
  return at::scalar_tensor(real_arg(where, name, value), at::kDouble);
}

amp::GradScalerOptions scaler_options(const std::string& where, const py::dict& o) {
  amp::GradScalerOptions options;
  options.init_scale = real_arg(where, "init_scale", o["init_scale"]);
  options.growth_factor = real_arg(where, "growth_factor", o["growth_factor"]);
  options.backoff_factor = real_arg(where, "backoff_factor", o["backoff_factor"]);
  options.growth_interval = int_arg(where, "growth_interval", o["growth_interval"]);
  options.hysteresis = int_arg(where, "hysteresis", o["hysteresis"]);
  options.min_scale = real_arg(where, "min_scale", o["min_scale"]);
  options.max_scale = o["max_scale"].is_none() ? 0.0 : real_arg(where, "max_scale", o["max_scale"]);
  return options;
}

py::dict scaler_dict(const amp::GradScalerOptions& o) {
  py::dict d;
  d["init_scale"] = o.init_scale;
  d["growth_factor"] = o.growth_factor;
  d["backoff_factor"] = o.backoff_factor;
  d["growth_interval"] = o.growth_interval;
  d["hysteresis"] = o.hysteresis;
  d["min_scale"] = o.min_scale;
  d["max_scale"] = o.max_scale;
  return d;
}

}  // namespace

void bind_optim_checks(py::module_& m) {
  m.attr("STATE_BLOCK") = optim::kStateBlock;  // 8-bit optimizer states (gpuops/fused_adam8.h)
  m.attr("MIN_8BIT_NUMEL") = optim::kMin8BitNumel;
  m.attr("STATE_FORMAT") = optim::kStateFormat;
  m.def(
      "check_adam_options",
      [](const std::string& where, const py::object& lr, const py::object& betas, const py::object& eps,
         const py::object& weight_decay) {
        if (!py::isinstance<py::sequence>(betas) || py::isinstance<py::str>(betas) || py::len(betas) != 2)
          throw py::type_error(where + ": betas must be a pair of numbers, got " + text_of(betas));
        optim::AdamStepOptions o;
        o.lr = real_arg(where, "lr", lr);
        o.beta1 = real_arg(where, "betas[0]", betas[py::int_(0)]);
        o.beta2 = real_arg(where, "betas[1]", betas[py::int_(1)]);
        o.eps = real_arg(where, "eps", eps);
        o.weight_decay = real_arg(where, "weight_decay", weight_decay);
        optim::check_adam_options(o, where);
      },
      py::arg("where"), py::arg("lr"), py::arg("betas"), py::arg("eps"), py::arg("weight_decay"),
      "gpuops::optim::check_adam_options: ValueError naming the option out of range");
  m.def(
      "check_sgd_options",
      [](const std::string& where, const py::object& lr, const py::object& momentum, const py::object& dampening,
         const py::object& weight_decay, const py::object& nesterov) {
        optim::SgdStepOptions o;
        o.lr = real_arg(where, "lr", lr);
        o.momentum = real_arg(where, "momentum", momentum);
        o.dampening = real_arg(where, "dampening", dampening);
        o.weight_decay = real_arg(where, "weight_decay", weight_decay);
        o.nesterov = PyObject_IsTrue(nesterov.ptr()) == 1;
        optim::check_sgd_options(o, where);
      },
      py::arg("where"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
      py::arg("nesterov"), "gpuops::optim::check_sgd_options: ValueError naming the option out of range");
  m.def(
      "check_grad_scaler_options",
      [](const std::string& where, const py::dict& options) {
        amp::check_grad_scaler_options(scaler_options(where, options), where);
      },
      py::arg("where"), py::arg("options"),
      "gpuops::amp::check_grad_scaler_options on a dict of GradScaler's options (max_scale None: none)");
  m.def(
      "read_grad_scaler_state",
      [](const py::dict& state, const py::dict& current) {
        const std::string where = "GradScaler.load_state_dict";
        amp::GradScalerState values;
        for (const auto& [key, value] : state) {
          if (!py::isinstance<py::str>(key)) continue;  // (torch's keys are strings; others are not ours)
          values[key.cast<std::string>()] = real_arg(where, key.cast<std::string>(), value);
        }
        const auto [options, counters] = amp::read_grad_scaler_state(values, scaler_options(where, current));
        py::dict result = scaler_dict(options);
        result["_growth_tracker"] = counters.growth_tracker;
        result["_hysteresis_left"] = counters.hysteresis_left;
        result["_skipped_steps"] = counters.skipped_steps;
        return result;
      },
      py::arg("state"), py::arg("current"),
      "gpuops::amp::read_grad_scaler_state: the checked options (init_scale: the saved scale) and counters");
  m.def(
      "check_positive_count",
      [](const py::object& value, const std::string& where, const std::string& name, const py::object& device) {
        const std::optional<c10::Device> on =
            device.is_none() ? std::nullopt : std::optional<c10::Device>(c10::Device(py::str(device).cast<std::string>()));
        amp::check_positive_count(count_tensor(where, name, value), where, name.c_str(), on);
      },
      py::arg("value"), py::arg("where"), py::arg("name"), py::arg("device") = py::none(),
      "gpuops::amp::check_positive_count on a number or a tensor");
  m.def(
      "check_grad_accumulator_options",
      [](const py::object& window, const py::object& max_norm) {
        GradAccumulatorOptions o;
        o.window = int_arg("GradAccumulator", "window", window);
        if (!max_norm.is_none()) o.max_norm = real_arg("GradAccumulator", "max_norm", max_norm);
        check_grad_accumulator_options(o);
      },
      py::arg("window"), py::arg("max_norm"));
  m.def(
      "check_micro_batch",
      [](const py::object& loss_sum, const py::object& count) {
        const std::string where = "GradAccumulator.backward";
        check_micro_batch(tensor_arg(where, "loss_sum", loss_sum), count_tensor(where, "count", count));
      },
      py::arg("loss_sum"), py::arg("count"));
}

}  // namespace gpuops::python

#pragma once
// Loading the optimizers from torch::save archives: the layout torch::optim::serialize writes (ours and
// torch::optim's AdamW/SGD), read whole and checked before anything of the optimizer changes.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include "option_checks.h"

namespace gpuops::optim::detail {

/// `capturable` came after the first saved optimizers: an archive without it means false.
template <typename Options>
void read_capturable(torch::serialize::InputArchive& archive, Options& options) {
  c10::IValue value;
  options.capturable(archive.try_read("capturable", value) && value.toBool());
}

/// An archive's options or one parameter's state, with the name of what it describes, for messages.
struct Entry {
  std::string where;  // e.g. "AdamW.load: param_groups[0] options"
  torch::serialize::InputArchive archive;

  std::optional<c10::IValue> get(const char* key) {
    c10::IValue value;
    if (!archive.try_read(key, value)) return std::nullopt;
    return value;
  }
  /// A key every archive of this optimizer has: missing means the archive is another optimizer's.
  c10::IValue required(const char* key, const char* optimizer) {
    auto value = get(key);
    TORCH_CHECK_VALUE(value, where, " have no '", key, "': the archive was not saved by ", optimizer,
                      " (gpuops::optim or torch::optim)");
    return *value;
  }
  double number(const c10::IValue& v, const char* key) {
    TORCH_CHECK_VALUE(v.isDouble() || v.isInt(), where, ": '", key, "' must be a number, got ", v.tagKind());
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  }
  bool flag(const std::optional<c10::IValue>& v, const char* key) {
    if (!v) return false;  // keys added after the first archives (maximize, capturable) default to false
    TORCH_CHECK_VALUE(v->isBool(), where, ": '", key, "' must be a bool, got ", v->tagKind());
    return v->toBool();
  }
  /// A float32 state tensor laid out as `param` (the fused steps go over both blocks alike) on its device;
  /// nullopt when absent.
  std::optional<at::Tensor> tensor_like(const char* key, const at::Tensor& param) {
    auto v = get(key);
    if (!v) return std::nullopt;
    TORCH_CHECK_VALUE(v->isTensor() && v->toTensor().is_floating_point(), where, ": '", key,
                      "' must be a floating tensor, got ", v->isTensor() ? v->toTensor().toString() : v->tagKind());
    const at::Tensor& t = v->toTensor();
    TORCH_CHECK_VALUE(t.sizes() == param.sizes(), where, ": '", key, "' has shape ", t.sizes(),
                      " but its parameter has shape ", param.sizes(), "; the archive belongs to another model");
    return at::empty_like(param, param.options().dtype(at::kFloat)).copy_(t);
  }
  /// The step counter: our float32 tensor or torch::optim's int64, as a float32 scalar on `param`'s device.
  std::optional<at::Tensor> step(const at::Tensor& param) {
    auto v = get("step");
    if (!v) return std::nullopt;
    double value = 0;
    if (v->isTensor() && v->toTensor().numel() == 1) {
      value = v->toTensor().item<double>();
    } else {
      value = number(*v, "step");
    }
    TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0, where, ": 'step' must be a finite number >= 0, got ",
                      gpuops::detail::py_repr(value));
    return at::full({}, value, param.options().dtype(at::kFloat));
  }
};

/// The whole archive: the state of each saved parameter key, and each group's parameter keys and options.
struct Archive {
  std::map<std::string, torch::serialize::InputArchive> state;
  std::vector<std::pair<std::vector<std::string>, torch::serialize::InputArchive>> groups;
};

/// Reads the layout of torch::optim::serialize; a file that is not such an archive is a c10::ValueError
/// naming `who`, not a raw serialization error.
inline Archive read_layout(torch::serialize::InputArchive& archive, const std::string& who) {
  Archive result;
  try {
    c10::IValue version;
    TORCH_CHECK_VALUE(archive.try_read("pytorch_version", version) && version.isString() &&
                          version.toStringRef() == "1.5.0",
                      who, ": the archive is not an optimizer's (no pytorch_version \"1.5.0\" key, as torch::save of "
                      "an optimizer writes)");
    torch::serialize::InputArchive state, groups;
    TORCH_CHECK_VALUE(archive.try_read("state", state) && archive.try_read("param_groups", groups), who,
                      ": the archive has no 'state' and 'param_groups': it is not an optimizer's");
    for (const std::string& key : state.keys()) {
      torch::serialize::InputArchive entry;
      TORCH_CHECK_VALUE(state.try_read(key, entry), who, ": state entry '", key, "' is not a parameter's state");
      result.state.emplace(key, std::move(entry));
    }
    at::Tensor size;
    groups.read("param_groups/size", size);
    for (int64_t i = 0; i < size.item<int64_t>(); ++i) {
      torch::serialize::InputArchive group, options;
      groups.read("param_groups/" + std::to_string(i), group);
      at::Tensor count;
      group.read("params/size", count);
      std::vector<std::string> keys;
      for (int64_t j = 0; j < count.item<int64_t>(); ++j) {
        c10::IValue key;
        group.read("params/" + std::to_string(j), key);
        keys.push_back(key.toStringRef());
      }
      group.read("options", options);
      result.groups.emplace_back(std::move(keys), std::move(options));
    }
  } catch (const c10::ValueError&) {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, who, ": the archive is not a readable optimizer archive: ", e.what_without_backtrace());
  }
  return result;
}

/// Loads an archive into `optimizer` or changes nothing: every group's options are read with
/// read_options(Entry&) -> Options (which checks them) and every parameter's state with
/// read_state(Entry&, const at::Tensor& param) -> std::unique_ptr<State>, before the state and the options
/// are swapped in. The options' DeviceLr stays the group's (a captured graph keeps reading it) and takes the
/// loaded lr.
template <typename Options, typename ReadOptions, typename ReadState>
void load_checked(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& input, const std::string& who,
                  ReadOptions read_options, ReadState read_state) {
  Archive archive = read_layout(input, who);
  auto& groups = optimizer.param_groups();
  TORCH_CHECK_VALUE(archive.groups.size() == groups.size(), who, ": loaded state dict has a different number of "
                    "parameter groups (", archive.groups.size(), ") than the optimizer (", groups.size(), ")");
  std::map<std::string, at::Tensor> param_of_key;
  std::vector<std::unique_ptr<Options>> options;
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& [keys, group_options] = archive.groups[i];
    const auto& params = groups[i].params();
    TORCH_CHECK_VALUE(keys.size() == params.size(), who, ": loaded state dict contains a parameter group that "
                      "doesn't match the size of optimizer's group: param_groups[", i, "] has ", keys.size(),
                      " parameters in the archive and ", params.size(), " in the optimizer");
    for (size_t j = 0; j < keys.size(); ++j) param_of_key[keys[j]] = params[j];
    Entry entry{who + ": param_groups[" + std::to_string(i) + "] options", std::move(group_options)};
    options.push_back(std::make_unique<Options>(read_options(entry)));
  }
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> state;
  for (auto& [key, saved] : archive.state) {
    const auto param = param_of_key.find(key);
    TORCH_CHECK_VALUE(param != param_of_key.end(), who, ": the archive has state for a parameter (key ", key,
                      ") that is in none of its param_groups");
    Entry entry{who + ": the state of the parameter of shape " + c10::str(param->second.sizes()), std::move(saved)};
    c10::NoGradGuard no_grad;
    state[param->second.unsafeGetTensorImpl()] = read_state(entry, param->second);
  }
  // Nothing below throws: the swap.
  optimizer.state() = std::move(state);
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& current = static_cast<Options&>(groups[i].options());
    DeviceLr device_lr = current.device_lr;
    current = *options[i];
    current.device_lr = device_lr;
    current.device_lr.set(current.lr());
  }
}

}  // namespace gpuops::optim::detail

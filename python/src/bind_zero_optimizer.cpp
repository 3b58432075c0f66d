// gpuops._C.ZeroOptimizer (zero_optimizer.h): the C++ sharded optimizers (ZeroOptimizer<AdamW|Adam|SGD>)
// through their common interface, ShardedOptimizer; gpuops.ZeroOptimizer (python/gpuops/zero.py) only adds
// torch.optim's attributes around it. Also the sharded training-state protocol (sharded_state.h) for
// gpuops.TrainingState. Collective calls release the GIL.
#include <type_traits>
#include <functional>
#include <map>
#include <optional>
#include <sstream>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>  // torch::PyWarningHandler
#include <torch/csrc/utils/pybind.h>  // torch.Tensor <-> at::Tensor
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "bindings.h"
#include "fail_together.h"
#include "py_args.h"
#include "gpuops/sharded_state.h"
#include "gpuops/zero_optimizer.h"

namespace py = pybind11;

namespace gpuops::python {

namespace {

using optim::ShardedOptimizer;

std::optional<at::Tensor> optional_tensor(const std::string& where, const std::string& name, const py::handle& v) {
  if (v.is_none()) return std::nullopt;
  return tensor_arg(where, name, v);
}

// Runs a collective without the GIL; its TORCH_WARNs (ZeroShards::check_gradients) become Python UserWarnings.
template <class Fn>
void warning_call(Fn&& fn) {
  torch::PyWarningHandler warnings;
  try {
    py::gil_scoped_release release;
    fn();
  } catch (...) {
    warnings.set_in_exception();
    throw;
  }
}

bool bool_arg(const std::string& where, const std::string& name, const py::handle& v) {
  if (!PyBool_Check(v.ptr())) throw py::type_error(where + ": " + name + " must be a bool, got " + text_of(v));
  return v.cast<bool>();
}

// The keyword options of one optimizer kind, each converted with a message naming it; unknown ones refused.
struct Keywords {
  std::string where;
  py::dict given;
  std::vector<std::string> used;

  py::handle get(const char* name) {
    used.emplace_back(name);
    return given.contains(name) ? given[name] : py::handle();
  }
  template <typename Set>
  void real(const char* name, Set set) {
    if (auto v = get(name)) set(real_arg(where, name, v));
  }
  template <typename Set>
  void flag(const char* name, Set set) {
    if (auto v = get(name)) set(bool_arg(where, name, v));
  }
  void finish(const std::string& kind) {
    for (const auto& [key, value] : given) {
      const auto name = key.cast<std::string>();
      // torch.optim's implementation switches: every choice runs our fused step (capturable is refused).
      if ((name == "foreach" || name == "fused" || name == "differentiable") &&
          (value.is_none() || (PyBool_Check(value.ptr()) && !value.cast<bool>())))
        continue;
      if (std::find(used.begin(), used.end(), name) == used.end())
        throw py::type_error(where + ": unexpected option '" + name + "' for " + kind + " (accepted: " +
                             [&] {
                               std::string all;
                               for (const auto& u : used) all += (all.empty() ? "" : ", ") + u;
                               return all;
                             }() +
                             ")");
    }
  }
  template <typename Options>
  void adam(Options& o) {
    real("lr", [&](double v) { o.lr(v); });
    if (auto betas = get("betas")) {
      if (py::isinstance<py::str>(betas) || !py::isinstance<py::sequence>(betas) || py::len(betas) != 2)
        throw py::type_error(where + ": betas must be a pair of numbers, got " + text_of(betas));
      const auto pair = py::reinterpret_borrow<py::sequence>(betas);
      o.betas({real_arg(where, "betas", pair[0]), real_arg(where, "betas", pair[1])});
    }
    real("eps", [&](double v) { o.eps(v); });
    real("weight_decay", [&](double v) { o.weight_decay(v); });
    flag("amsgrad", [&](bool v) { o.amsgrad(v); });
    flag("maximize", [&](bool v) { o.maximize(v); });
    flag("capturable", [&](bool v) { o.capturable(v); });
    if (auto bits = get("state_bits")) {  // (the optimizer's checks name the values it accepts)
      if (!py::isinstance<py::int_>(bits) || PyBool_Check(bits.ptr()))
        throw py::type_error(where + ": state_bits must be an int, got " + text_of(bits));
      o.state_bits(bits.cast<int64_t>());
    }
  }
  // SGD's options but capturable (read at construction only).
  void sgd(optim::SGDOptions& o) {
    real("lr", [&](double v) { o.lr(v); });
    real("momentum", [&](double v) { o.momentum(v); });
    real("dampening", [&](double v) { o.dampening(v); });
    real("weight_decay", [&](double v) { o.weight_decay(v); });
    flag("nesterov", [&](bool v) { o.nesterov(v); });
    flag("maximize", [&](bool v) { o.maximize(v); });
  }
};

using Construct = std::function<std::unique_ptr<ShardedOptimizer>()>;

// Reads the options of `kind` (every Python argument is read here, before the construction's agreement) and
// returns what constructs the optimizer.
Construct parse(const std::string& kind, std::vector<at::Tensor> params, const dist::Communicator& comm,
                const optim::ZeroOptions& zero, Keywords& k) {
  if (kind == "adamw") {
    optim::AdamWOptions o;
    k.adam(o);
    k.finish("AdamW");
    return [=] { return std::make_unique<optim::ZeroOptimizer<optim::AdamW>>(params, comm, zero, o); };
  }
  if (kind == "adam") {
    optim::AdamOptions o;
    k.adam(o);
    k.finish("Adam");
    return [=] { return std::make_unique<optim::ZeroOptimizer<optim::Adam>>(params, comm, zero, o); };
  }
  if (kind == "sgd") {
    auto lr = k.get("lr");
    if (!lr) throw py::type_error(k.where + ": SGD needs lr (torch.optim.SGD's default 1e-3 is not assumed)");
    optim::SGDOptions o(real_arg(k.where, "lr", lr));
    k.sgd(o);
    k.flag("capturable", [&](bool v) { o.capturable(v); });
    k.finish("SGD");
    return [=] { return std::make_unique<optim::ZeroOptimizer<optim::SGD>>(params, comm, zero, o); };
  }
  throw py::value_error(k.where + ": optimizer must be 'adamw', 'adam' or 'sgd', got '" + kind + "'");
}

// The group's options as torch.optim names them (what a consolidated state_dict's param_groups hold).
py::dict options_of(const torch::optim::OptimizerOptions& options) {
  py::dict d;
  const auto adam = [&d](const auto& o) {
    d["lr"] = o.lr();
    d["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
    d["eps"] = o.eps();
    d["weight_decay"] = o.weight_decay();
    d["amsgrad"] = o.amsgrad();
    d["maximize"] = o.maximize();
    d["state_bits"] = o.state_bits();
  };
  if (const auto* o = dynamic_cast<const optim::AdamWOptions*>(&options)) adam(*o);
  if (const auto* o = dynamic_cast<const optim::AdamOptions*>(&options)) adam(*o);
  if (const auto* o = dynamic_cast<const optim::SGDOptions*>(&options)) {
    d["lr"] = o->lr();
    d["momentum"] = o->momentum();
    d["dampening"] = o->dampening();
    d["weight_decay"] = o->weight_decay();
    d["nesterov"] = o->nesterov();
    d["maximize"] = o->maximize();
  }
  return d;
}

// The group's options as given by Python (torch's LR schedulers write lr, OneCycleLR/CyclicLR also betas or
// momentum): the current options with these keywords applied, checked by Base over a probe tensor, swapped in.
template <class Options, class Base>
void replace_options(ShardedOptimizer& z, Keywords& k, const std::function<void(Options&)>& parse) {
  Options o = static_cast<const Options&>(z.optimizer().param_groups()[0].options());
  parse(o);
  k.finish(z.kind());
  Base probe({at::zeros({1}).requires_grad_(true)}, o);  // c10::ValueError naming the option
  if constexpr (!std::is_same_v<Options, optim::SGDOptions>)  // (8 -> 32 decodes the moments at the next step)
    TORCH_CHECK_VALUE(o.state_bits() != 8 || z.shards().blocks().block > 0, k.where, ": state_bits=8 needs the "
                      "buffers laid out in whole blocks at construction: construct the ZeroOptimizer with "
                      "state_bits=8 (a state moves over through consolidate_state_dict and load_state_dict)");
  z.optimizer().param_groups()[0].set_options(std::make_unique<Options>(o));
}

void set_options(ShardedOptimizer& z, const py::dict& given) {
  Keywords k{std::string("gpuops.ZeroOptimizer.param_groups[0]"), given, {}};
  const std::string kind = z.kind();
  if (kind == "AdamW") replace_options<optim::AdamWOptions, optim::AdamW>(z, k, [&](auto& o) { k.adam(o); });
  if (kind == "Adam") replace_options<optim::AdamOptions, optim::Adam>(z, k, [&](auto& o) { k.adam(o); });
  if (kind == "SGD") replace_options<optim::SGDOptions, optim::SGD>(z, k, [&](auto& o) { k.sgd(o); });
}

py::list to_python(const std::vector<optim::NamedTensors>& states) {
  py::list out;
  for (const auto& state : states) {
    py::dict d;
    for (const auto& [name, t] : state) d[py::str(name)] = t;
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_zero_optimizer(py::module_& m) {
  py::class_<ShardedOptimizer>(m, "ZeroOptimizer")
      .def(py::init([](const py::object& params, dist::Communicator& communicator, const py::object& stage,
                       const std::string& optimizer, const py::dict& options, const py::object& reduce_in_backward,
                       const py::object& bucket_bytes, const std::vector<std::string>& param_names,
                       const py::object& overlap_param_gather, const std::vector<int64_t>& units,
                       const py::object& prefetch, const py::object& reshard_after_forward,
                       const std::string& device, const py::object& check_unit_order, const std::string& offload) {
             const std::string where = "gpuops.ZeroOptimizer";
             Construct construct;
             try {
               auto tensors = tensor_list_arg(where, "params", params);
               const int64_t s = int_arg(where, "stage", stage);
               if (s < 1 || s > 3)
                 throw py::value_error(where + ": stage must be 1 (optimizer state sharded), 2 (optimizer state "
                                       "and gradients sharded) or 3 (parameters too), got " + text_of(stage));
               optim::ZeroOptions zero;
               zero.stage = static_cast<int>(s);
               zero.reduce_in_backward = bool_arg(where, "reduce_in_backward", reduce_in_backward);
               zero.bucket_bytes = int_arg(where, "bucket_bytes", bucket_bytes);
               zero.param_names = param_names;
               zero.overlap_param_gather = bool_arg(where, "overlap_param_gather", overlap_param_gather);
               zero.units = units;
               zero.prefetch = int_arg(where, "prefetch", prefetch);
               zero.reshard_after_forward = bool_arg(where, "reshard_after_forward", reshard_after_forward);
               zero.check_unit_order = bool_arg(where, "check_unit_order", check_unit_order);
               if (offload != "none" && offload != "cpu")
                 throw py::value_error(where + ": offload must be None or 'cpu', got '" + offload + "'");
               zero.offload = offload == "cpu" ? optim::ZeroOptions::Offload::Cpu : optim::ZeroOptions::Offload::Device;
               if (!device.empty()) {
                 try {
                   zero.device = c10::Device(device);
                 } catch (const c10::Error&) {
                   throw py::value_error(where + ": device must name a device ('cuda', 'cuda:1', 'cpu'), got '" +
                                         device + "'");
                 }
               }
               if (zero.bucket_bytes < 1)
                 throw py::value_error(where + ": bucket_bytes must be >= 1, got " + text_of(bucket_bytes));
               Keywords k{where, options, {}};
               construct = parse(optimizer, std::move(tensors), communicator, zero, k);
             } catch (...) {
               fail_together(communicator, "ZeroOptimizer");
             }
             py::gil_scoped_release release;  // collective: the construction's agreement
             return construct();
           }),
           py::arg("params"), py::arg("communicator"), py::arg("stage"), py::arg("optimizer"), py::arg("options"),
           py::arg("reduce_in_backward") = false, py::arg("bucket_bytes") = optim::ZeroOptions().bucket_bytes,
           py::arg("param_names") = std::vector<std::string>{}, py::arg("overlap_param_gather") = false,
           py::arg("units") = std::vector<int64_t>{}, py::arg("prefetch") = 1, py::arg("reshard_after_forward") = true,
           py::arg("device") = std::string(), py::arg("check_unit_order") = true, py::arg("offload") = "none")
      // stage 3: the module hooks of gpuops.ZeroOptimizer call these around each unit (collective: gathers)
      .def("unit_count", [](const ShardedOptimizer& z) { return z.shards().unit_count(); })
      .def("unit_pre_forward", [](ShardedOptimizer& z, size_t u) { z.shards().unit_pre_forward(u); },
           py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("unit_post_forward", [](ShardedOptimizer& z, size_t u) { z.shards().unit_post_forward(u); },
           py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("unit_pre_backward", [](ShardedOptimizer& z, size_t u) { z.shards().unit_pre_backward(u); },
           py::arg("unit"), py::call_guard<py::gil_scoped_release>())
      .def("gathered_bytes", [](const ShardedOptimizer& z) { return z.shards().gathered_bytes(); })
      .def("full_parameters", [](ShardedOptimizer& z, int to) { return z.shards().full_parameters(to); },
           py::arg("to") = 0, py::call_guard<py::gil_scoped_release>())
      .def("load_full_parameters",
           [](ShardedOptimizer& z, const std::vector<at::Tensor>& values) { z.shards().load_full_parameters(values); },
           py::arg("values"), py::call_guard<py::gil_scoped_release>())  // collective: its agreement
      .def(
          "step",
          [](ShardedOptimizer& z, const py::object& grad_scale, const py::object& found_inf) {
            const std::string where = "ZeroOptimizer.step";
            auto gs = optional_tensor(where, "grad_scale", grad_scale);
            auto fi = optional_tensor(where, "found_inf", found_inf);
            warning_call([&] {
              z.optimizer().prepare_gradients();
              z.optimizer().step_scaled(gs, fi);
            });
          },
          py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none())
      .def("zero_grad", [](ShardedOptimizer& z, bool set_to_none) { z.zero_grad(set_to_none); },
           py::arg("set_to_none") = true)
      .def("prepare_gradients", [](ShardedOptimizer& z) { warning_call([&] { z.optimizer().prepare_gradients(); }); })
      .def("refuse_step_with_foreign_scaler",
           [](ShardedOptimizer& z) { warning_call([&] { z.shards().refuse_step_with_foreign_scaler(); }); })
      .def("global_found_inf", [](ShardedOptimizer& z, const at::Tensor& f) { return z.optimizer().global_found_inf(f); },
           py::call_guard<py::gil_scoped_release>())
      .def("global_grad_norm", [](ShardedOptimizer& z, const at::Tensor& n) { return z.optimizer().global_grad_norm(n); },
           py::call_guard<py::gil_scoped_release>())
      .def("global_divisor", [](ShardedOptimizer& z, const at::Tensor& d) { return z.optimizer().global_divisor(d); },
           py::call_guard<py::gil_scoped_release>())
      .def("shard_params", [](ShardedOptimizer& z) { return z.shards().shard_params(); })
      .def(
          "wait_for_parameters",
          [](const ShardedOptimizer& z, const py::object& params) {
            if (params.is_none()) {
              py::gil_scoped_release release;
              z.wait_for_parameters();
              return;
            }
            auto tensors = tensor_list_arg("ZeroOptimizer.wait_for_parameters", "params", params);
            py::gil_scoped_release release;
            z.wait_for_parameters(tensors);
          },
          py::arg("params") = py::none())
      .def_property(
          "lr", [](ShardedOptimizer& z) { return z.optimizer().param_groups()[0].options().get_lr(); },
          [](ShardedOptimizer& z, const py::object& lr) {
            z.optimizer().param_groups()[0].options().set_lr(real_arg("ZeroOptimizer.lr", "lr", lr));
          })
      .def("set_options", &set_options, py::arg("options"))
      .def_property_readonly("kind", &ShardedOptimizer::kind)
      .def_property_readonly("options",
                             [](ShardedOptimizer& z) { return options_of(z.optimizer().param_groups()[0].options()); })
      .def_property_readonly("stage", [](ShardedOptimizer& z) { return z.shards().stage(); })
      .def_property_readonly("rank", [](ShardedOptimizer& z) { return z.shards().communicator().rank(); })
      .def_property_readonly("world_size", [](ShardedOptimizer& z) { return z.shards().communicator().size(); })
      .def_property_readonly("param_count", [](ShardedOptimizer& z) { return z.shards().param_count(); })
      .def("state_bytes", &ShardedOptimizer::state_bytes)
      .def("offload_timeline",
           [](const ShardedOptimizer& z) {
             py::list events;
             for (const auto& e : z.shards().offload_timeline())
               events.append(py::make_tuple(e.what, e.bucket, e.begin_s, e.end_s));
             return events;
           })
      .def("gradient_bytes", &ShardedOptimizer::gradient_bytes)
      .def("flat_numels",
           [](ShardedOptimizer& z) {
             std::vector<int64_t> n;
             for (size_t k = 0; k < z.shards().bucket_count(); ++k) n.push_back(z.shards().bucket(k).data.numel());
             return n;
           })
      .def("save_shard", &ShardedOptimizer::save_shard, py::arg("path"), py::call_guard<py::gil_scoped_release>())
      // This rank's shard in memory (save_shard's content) and back: what find_max_batch_size(restore=) puts
      // back. load_bytes is collective (its agreement: every rank loads its bytes of the same snapshot).
      .def("save_bytes",
           [](ShardedOptimizer& z) {
             std::ostringstream bytes;
             {
               py::gil_scoped_release release;
               torch::serialize::OutputArchive archive;
               dynamic_cast<torch::optim::Optimizer&>(z).save(archive);
               archive.save_to(bytes);
             }
             return py::bytes(bytes.str());
           })
      .def("load_bytes",
           [](ShardedOptimizer& z, const py::bytes& saved) {
             const std::string bytes = saved;
             py::gil_scoped_release release;
             torch::serialize::InputArchive archive;
             archive.load_from(bytes.data(), bytes.size());
             dynamic_cast<torch::optim::Optimizer&>(z).load(archive);
           },
           py::arg("saved"))
      .def("load_shards", &ShardedOptimizer::load_shards, py::arg("files"), py::arg("allow_reshard") = false,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "consolidate_state",
          [](ShardedOptimizer& z, const py::object& to) {
            int64_t rank = 0;
            try {
              rank = int_arg("ZeroOptimizer.consolidate_state_dict", "to", to);
            } catch (...) {
              fail_together(z.shards().communicator(), "ZeroOptimizer.consolidate_state_dict");
            }
            std::vector<optim::NamedTensors> states;
            {
              py::gil_scoped_release release;
              states = z.consolidate_state(static_cast<int>(std::clamp<int64_t>(rank, -1, 1 << 30)));
            }
            return to_python(states);
          },
          py::arg("to"))
      .def(
          "load_full_state",
          [](ShardedOptimizer& z, const std::vector<std::map<std::string, at::Tensor>>& per_param) {
            py::gil_scoped_release release;
            z.load_full_state(per_param);
          },
          py::arg("per_param"));

  // The writers get every rank's own part as a list of bytes (RankParts).
  using Fields = std::vector<std::pair<std::string, std::string>>;
  const auto as_list = [](const RankParts& parts) {  // (with the GIL held)
    py::list list;
    for (const auto& p : parts) list.append(py::bytes(p));
    return list;
  };
  m.def(
      "save_sharded_state",
      [as_list](const StateStore& store, int64_t step, const std::string& writer, ShardedOptimizer& optimizer,
                const py::function& write_main, const std::string& local_error, const Fields& fields,
                const py::bytes& own) {
        const RankPart part{fields, std::string(own)};
        py::gil_scoped_release release;  // write_main takes the GIL back to run
        const auto write = [&](const std::string& path, const RankParts& parts) {
          py::gil_scoped_acquire gil;
          write_main(path, as_list(parts));
        };
        return save_sharded_state(&store, step, writer, optimizer, write, local_error, part);
      },
      py::arg("store"), py::arg("step"), py::arg("writer"), py::arg("optimizer"), py::arg("write_main"),
      py::arg("local_error") = "", py::arg("fields") = Fields{}, py::arg("own") = py::bytes());
  m.def(
      "save_by_rank_zero",
      [as_list](dist::Communicator& comm, int64_t step, const std::string& local_error, const py::function& write,
                const Fields& fields, const py::bytes& own) {
        const RankPart part{fields, std::string(own)};
        py::gil_scoped_release release;  // write takes the GIL back to run
        return save_by_rank_zero(comm, step, local_error, [&](const RankParts& parts) {
          py::gil_scoped_acquire gil;
          return write(as_list(parts)).cast<std::string>();
        }, part);
      },
      py::arg("communicator"), py::arg("step"), py::arg("local_error"), py::arg("write"), py::arg("fields") = Fields{},
      py::arg("own") = py::bytes());
  m.def("shard_files_of", &shard_files_of, py::arg("state"));
  m.def("read_full_parameters", &optim::read_full_parameters, py::arg("files"),
        py::call_guard<py::gil_scoped_release>());
  m.def("state_identity", &state_identity, py::arg("state").none(true));
  m.def("agree_on_state", &agree_on_state, py::arg("communicator"), py::arg("identity"), py::arg("local_error"),
        py::arg("fields") = Fields{}, py::call_guard<py::gil_scoped_release>());
  m.def("agree_loaded", &agree_loaded, py::arg("communicator"), py::arg("local_error"),
        py::call_guard<py::gil_scoped_release>());
  m.def("load_sharded_state", &load_sharded_state, py::arg("optimizer"), py::arg("files"), py::arg("allow_reshard"),
        py::arg("local_error"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace gpuops::python

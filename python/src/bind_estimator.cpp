// The estimator and the command line, for gpuops.estimate() and the `gpuops` console script. Arguments
// arrive as Python objects and are converted here, each with an error naming it (pybind11's own
// overload error lists the whole signature instead).
#include <climits>
#include <sstream>
#include <system_error>

#include <pybind11/stl.h>

#include "bindings.h"
#include "gpuops/cli.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"
#include "gpuops/plot_svg.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

using namespace gpuops::estimator;

// "float 2.5": the type, and the value where its repr is short (a config object's would fill the screen).
std::string describe(py::handle value) {
  const std::string type = py::str(py::type::of(value).attr("__name__")).cast<std::string>();
  const std::string repr = printable(py::repr(value).cast<std::string>());
  return repr.size() <= 60 ? type + " " + repr : type;
}

// A Python int (or an object with __index__, as numpy's integers), not a bool, float or str.
int64_t int_arg(py::handle value, const char* name) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr()))
    throw py::type_error(fmt::format("{} must be an int, got {}", name, describe(value)));
  const py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0)
    throw ArgumentError(fmt::format("{} {} is out of range; accepted: an int from -2**63 to 2**63 - 1", name,
                                    printable(py::repr(value).cast<std::string>())));
  return v;
}

// A str; bytes that are not UTF-8 (surrogate escapes) are kept as bytes, as the command line gets them.
std::string str_arg(py::handle value, const char* name, const char* example) {
  if (!PyUnicode_Check(value.ptr()))
    throw py::type_error(fmt::format("{} must be a str such as '{}', got {}", name, example, describe(value)));
  const py::bytes encoded = py::reinterpret_steal<py::bytes>(
      PyUnicode_AsEncodedString(value.ptr(), "utf-8", "surrogateescape"));
  if (!encoded) throw py::error_already_set();
  return encoded.cast<std::string>();
}

// A sequence of str, or one str as a comma list ("q,v"), as --lora-targets takes it.
std::vector<std::string> targets_arg(py::handle value) {
  const char* name = "lora_targets";
  std::vector<std::string> out;
  if (PyUnicode_Check(value.ptr())) {
    std::string text = str_arg(value, name, "q,v");
    for (size_t start = 0;;) {
      const size_t comma = text.find(',', start);
      out.push_back(text.substr(start, comma - start));
      if (comma == std::string::npos) return out;
      start = comma + 1;
    }
  }
  if (!PySequence_Check(value.ptr()) || PyBytes_Check(value.ptr()))
    throw py::type_error(fmt::format("{} must be a sequence of str such as ('q', 'v'), got {}", name, describe(value)));
  for (py::handle item : py::reinterpret_borrow<py::sequence>(value)) out.push_back(str_arg(item, name, "q"));
  return out;
}

// A parameter count: an int, or a str such as "7B" (a float is read as its decimal text: 7e9, not nan).
// The spec is named by the text given, as on the command line, so that errors quote it.
ModelSpec params_arg(py::handle value) {
  std::string text;
  if (PyUnicode_Check(value.ptr())) text = str_arg(value, "params", "7B");
  else if (PyFloat_Check(value.ptr())) text = py::repr(value).cast<std::string>();
  if (!text.empty() || PyUnicode_Check(value.ptr())) return params_only_model(parse_param_count(text), text);
  const int64_t count = int_arg(value, "params");
  GPUOPS_CHECK_ARG(count >= 1, "params {} is not a parameter count; accepted: an int >= 1 or a str such as '7B'",
                   count);
  return params_only_model(count, std::to_string(count));
}

// A config.json path as bytes (os.fsencode in estimator.py), so that any file name reaches open().
std::string path_arg(py::handle value) {
  if (!PyBytes_Check(value.ptr()))
    throw py::type_error(fmt::format("config must be a path or a dict, got {}", describe(value)));
  return value.cast<std::string>();
}

DeviceProfile device_arg(py::handle value) {
  const std::string device = str_arg(value, "device", "cuda");
  if (device == "cuda") return cuda_device();
  if (device == "cpu") return cpu_device();
  throw ArgumentError(fmt::format("device '{}' is not accepted; accepted: cuda, cpu", device));
}

// A bool (True or False), not an int or a str.
bool bool_arg(py::handle value, const char* name) {
  if (!PyBool_Check(value.ptr()))
    throw py::type_error(fmt::format("{} must be a bool (True or False), got {}", name, describe(value)));
  return value.ptr() == Py_True;
}

// Optimizer placement and sharding (docs/estimator.md, "Optimizers, offload and sharding"); keywords left
// out keep the C++ defaults. sharding="fsdp2", "gpuops" or "fsdp1" with zero_stage 0 means stage 3, as on the
// command line.
void read_state_options(const py::dict& a, TrainingSetup& s) {
  if (a.contains("sharding")) s.sharding = parse_sharding(str_arg(a["sharding"], "sharding", "fsdp2"));
  if (s.sharding != ShardingLayout::Flat && s.zero_stage == 0) s.zero_stage = 3;  // fsdp2, gpuops, fsdp1
  if (a.contains("zero_prefetch")) s.zero_prefetch = int_arg(a["zero_prefetch"], "zero_prefetch");
  if (a.contains("ds_reduce_bucket")) {  // an int, or "auto"
    const py::handle v = a["ds_reduce_bucket"];
    s.ds_reduce_bucket = PyUnicode_Check(v.ptr()) ? parse_ds_reduce_bucket(str_arg(v, "ds_reduce_bucket", "auto"))
                                                  : int_arg(v, "ds_reduce_bucket");
    if (!PyUnicode_Check(v.ptr()) && s.ds_reduce_bucket < 0)  // "auto" is the string only
      throw ArgumentError(fmt::format("ds_reduce_bucket {} is not accepted; accepted: 'auto', or 0 to 2**40 elements",
                                      s.ds_reduce_bucket));
  }
  if (a.contains("reshard_after_forward"))
    s.reshard_after_forward = bool_arg(a["reshard_after_forward"], "reshard_after_forward");
  if (a.contains("reduce_dtype")) s.reduce_dtype = parse_reduce_dtype(str_arg(a["reduce_dtype"], "reduce_dtype", "fp32"));
  if (a.contains("offload_optimizer")) s.offload_optimizer = bool_arg(a["offload_optimizer"], "offload_optimizer");
  if (a.contains("fsdp_orig_params")) s.fsdp_orig_params = bool_arg(a["fsdp_orig_params"], "fsdp_orig_params");
  if (a.contains("quantize_lm_head")) s.lora.quantize_lm_head = bool_arg(a["quantize_lm_head"], "quantize_lm_head");
  if (a.contains("bnb_version")) s.lora.bnb_version = parse_bnb_version(str_arg(a["bnb_version"], "bnb_version", "0.42.0"));
}

// A Python float or int (not a bool); nan and inf are left to validate(), which names the argument.
double float_arg(py::handle value, const char* name) {
  if (PyBool_Check(value.ptr()) || !(PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr())))
    throw py::type_error(fmt::format("{} must be a float such as 0.05, got {}", name, describe(value)));
  const double v = PyFloat_AsDouble(value.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgumentError(fmt::format("{} {} is out of range; accepted: a probability 0 <= p < 1", name,
                                    printable(py::repr(value).cast<std::string>())));
  }
  return v;
}

// The CUDA software from the keywords cuda, module_loading, allocator, context_bytes and device_profile (those of
// `gpuops estimate`); absent keywords keep the defaults.
CudaRuntime runtime_arg(const py::dict& a) {
  CudaRuntime rt;
  if (a.contains("cuda")) {
    const int64_t cuda = int_arg(a["cuda"], "cuda");
    GPUOPS_CHECK_ARG(cuda >= 11 && cuda <= 13, "cuda {} is not accepted; accepted: 11, 12, 13", cuda);
    rt.cuda_major = static_cast<int>(cuda);
  }
  if (a.contains("module_loading")) {
    const std::string loading = str_arg(a["module_loading"], "module_loading", "lazy");
    GPUOPS_CHECK_ARG(loading == "lazy" || loading == "eager",
                     "module_loading '{}' is not accepted; accepted: lazy, eager", loading);
    rt.lazy_loading = loading == "lazy";
  }
  if (a.contains("allocator")) {
    const std::string allocator = str_arg(a["allocator"], "allocator", "default");
    GPUOPS_CHECK_ARG(allocator == "default" || allocator == "expandable",
                     "allocator '{}' is not accepted; accepted: default, expandable", allocator);
    rt.allocator = allocator == "expandable" ? AllocatorMode::ExpandableSegments : AllocatorMode::Default;
  }
  if (a.contains("context_bytes") && !a["context_bytes"].is_none()) {
    rt.context_bytes = int_arg(a["context_bytes"], "context_bytes");
    GPUOPS_CHECK_ARG(rt.context_bytes >= 0 && rt.context_bytes <= (int64_t{1} << 40),
                     "context_bytes {} is not accepted; accepted: None or 0 to 2**40", rt.context_bytes);
  }
  if (a.contains("device_profile") && !a["device_profile"].is_none()) {
    py::handle path = a["device_profile"];
    if (!PyBytes_Check(path.ptr()))  // estimator.py passes os.fsencode(path)
      throw py::type_error(fmt::format("device_profile must be a path or None, got {}", describe(path)));
    rt.measured = read_device_profile(path.cast<std::string>(), "device_profile");
  }
  return rt;
}

// The device profile: "cpu", or "cuda" with the CUDA software of runtime_arg on the catalog GPU `gpu`
// (None: an H100).
DeviceProfile profile_arg(py::handle device, const py::dict& a) {
  const DeviceProfile base = device_arg(device);
  if (base.is_cpu()) return base;
  const CudaRuntime rt = runtime_arg(a);
  if (a.contains("gpu") && !a["gpu"].is_none()) return device_of(find_gpu(str_arg(a["gpu"], "gpu", "H100-80GB")), rt);
  return cuda_device(90, rt);
}

// The setup, with the C++ parsers, so that names and their errors are the CLI's own.
TrainingSetup make_setup(const py::dict& a) {
  TrainingSetup s;
  s.precision = parse_precision(str_arg(a["precision"], "precision", "bf16-mixed"));
  s.amp = parse_amp_layout(str_arg(a["amp"], "amp", "autocast"));
  s.optimizer = parse_optimizer(str_arg(a["optimizer"], "optimizer", "adamw"));
  s.optimizer_impl = parse_optimizer_impl(str_arg(a["optimizer_impl"], "optimizer_impl", "default"));
  const int64_t zero = int_arg(a["zero_stage"], "zero_stage");
  GPUOPS_CHECK_ARG(zero >= 0 && zero <= 3, "zero_stage {} is not accepted; accepted: 0, 1, 2, 3", zero);
  s.zero_stage = static_cast<int>(zero);
  s.num_gpus = int_arg(a["num_gpus"], "num_gpus");
  parse_checkpointing(str_arg(a["checkpointing"], "checkpointing", "none"), s);
  s.attention = parse_attention(str_arg(a["attention"], "attention", "sdpa"));
  s.lora.rank = int_arg(a["lora_rank"], "lora_rank");
  s.lora.targets = targets_arg(a["lora_targets"]);
  s.lora.base = parse_base_dtype(str_arg(a["base_dtype"], "base_dtype", "bf16"));
  s.micro_batch = int_arg(a["micro_batch"], "micro_batch");
  s.seq_len = int_arg(a["seq_len"], "seq_len");
  s.grad_accum = int_arg(a["grad_accum"], "grad_accum");
  if (a.contains("zero_grad")) s.grads_set_to_none = parse_zero_grad(str_arg(a["zero_grad"], "zero_grad", "none"));
  if (a.contains("zero_reduce"))
    s.zero_reduce_at_step = parse_zero_reduce(str_arg(a["zero_reduce"], "zero_reduce", "step"));
  if (a.contains("zero_bucket_bytes")) s.zero_bucket_bytes = int_arg(a["zero_bucket_bytes"], "zero_bucket_bytes");
  if (a.contains("loss")) parse_loss(str_arg(a["loss"], "loss", "chunked:8"), s);
  if (a.contains("lora_dropout")) s.lora_dropout = float_arg(a["lora_dropout"], "lora_dropout");
  if (a.contains("compile")) s.compile = bool_arg(a["compile"], "compile");
  if (a.contains("held_logits")) s.held_logits = parse_held_logits(str_arg(a["held_logits"], "held_logits", "model"));
  if (a.contains("model_code")) s.model_code = parse_model_code(str_arg(a["model_code"], "model_code", "litgpt"));
  read_state_options(a, s);
  return s;
}

// ArgumentError messages echo user text; Python needs them as valid UTF-8 (else the ValueError itself
// would fail to build).
void translate_argument_errors() {
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, printable(e.what()).c_str());
    }
  });
}

// Pictures and advice (docs/estimator.md, "Pictures and advice"): the C++ engine of `gpuops estimate --plot`
// and `--advise`, so that Python writes the same SVG and gives the same advice.

// A catalog GPU named by keyword `name` (None: no GPU when `optional`).
const GpuModel* gpu_arg(py::handle value, const char* name, bool optional) {
  if (optional && value.is_none()) return nullptr;
  const std::string text = str_arg(value, name, "H100-80GB");
  try {
    return &find_gpu(text);
  } catch (const ArgumentError& e) {
    throw ArgumentError(fmt::format("{}: {}", name, e.what()));
  }
}

// The setup fields an Advice may change, as estimate()'s keywords (the rest is what the caller gave).
py::dict advised_keywords(const TrainingSetup& s) {
  py::dict d;
  d["optimizer"] = std::string(to_string(s.optimizer));
  d["optimizer_impl"] = std::string(to_string(s.optimizer_impl));
  d["zero_stage"] = s.zero_stage;
  d["checkpointing"] = checkpointing_to_string(s);
  d["attention"] = std::string(to_string(s.attention));
  d["lora_rank"] = s.lora.rank;
  d["lora_targets"] = s.lora.targets;
  d["base_dtype"] = std::string(to_string(s.lora.base));
  d["micro_batch"] = s.micro_batch;
  d["grad_accum"] = s.grad_accum;
  d["zero_grad"] = s.grads_set_to_none ? "none" : "zeros";
  d["zero_reduce"] = s.zero_reduce_at_step ? "step" : "backward";
  d["zero_bucket_bytes"] = s.zero_bucket_bytes;
  d["loss"] = loss_to_string(s);
  d["held_logits"] = std::string(to_string(s.held_logits));
  d["model_code"] = std::string(to_string(s.model_code));
  d["compile"] = s.compile;
  d["offload_optimizer"] = s.offload_optimizer;
  d["fsdp_orig_params"] = s.fsdp_orig_params;
  d["amp"] = std::string(to_string(s.amp));
  d["lora_dropout"] = s.lora_dropout;
  return d;
}

py::dict advice_dict(const Advice& a, const GpuModel& gpu) {
  py::dict d;
  d["description"] = a.description;
  d["options"] = a.options;
  d["changes"] = a.changes;
  d["keeps_numerics"] = a.keeps_numerics;
  d["cost"] = std::string(to_string(a.cost));
  d["saved_bytes"] = a.saved_bytes;
  d["fits"] = a.fits;
  d["total_bytes"] = a.breakdown.total();
  d["total_high_bytes"] = a.breakdown.total_high();
  d["headroom_bytes"] = gpu.memory_bytes - a.breakdown.total_high();
  d["items"] = a.breakdown.items();
  d["off_device"] = py::dict(py::arg("host_memory") = a.breakdown.host_memory,
                             py::arg("band_below") = a.breakdown.band_below,
                             py::arg("band_above") = a.breakdown.band_above);
  d["peak_phase"] = std::string(to_string(a.breakdown.peak_phase));
  d["setup"] = advised_keywords(a.setup);
  return d;
}

// write_file_atomically with its failure as OSError(errno, message, path).
void write_file(py::bytes path, const std::string& text) {
  const std::string p = path;
  if (!is_svg_name(p))
    throw ArgumentError(fmt::format("path '{}': the picture is SVG; give a name ending in .svg (no PNG or other "
                                    "format is written)", printable(p)));
  try {
    write_file_atomically(p, text);
  } catch (const std::system_error& e) {
    PyErr_SetObject(PyExc_OSError, py::make_tuple(e.code().value(), printable(e.what()), path).ptr());
    throw py::error_already_set();
  }
}

}  // namespace

void bind_estimator(py::module_& m) {
  translate_argument_errors();
  py::class_<ModelSpec>(m, "ModelSpec", "An architecture the estimator understands.")
      .def_readonly("name", &ModelSpec::name)
      .def_readonly("hidden_size", &ModelSpec::hidden_size)
      .def_readonly("num_layers", &ModelSpec::num_layers)
      .def_readonly("vocab_size", &ModelSpec::vocab_size)
      // Model families: config text may hold any bytes, so the strings are made printable (\xNN).
      .def_property_readonly("model_type", [](const ModelSpec& s) { return printable(s.model_type); })
      .def_property_readonly("family", [](const ModelSpec& s) { return std::string(to_string(s.family)); })
      .def_readonly("fixed_bytes", &ModelSpec::fixed_bytes)
      .def_readonly("num_experts", &ModelSpec::num_experts)
      .def_readonly("experts_per_token", &ModelSpec::experts_per_token)
      .def_property_readonly("assumptions", [](const ModelSpec& s) {
        std::vector<std::string> out;
        for (const auto& a : s.assumptions) out.push_back(printable(a));
        return out;
      })
      .def_property_readonly("parameter_count", [](const ModelSpec& s) { return parameter_count(s); })
      .def("training_flops_per_token", [](const ModelSpec& s, int64_t seq_len) {
        return training_flops_per_token(s, seq_len);
      }, py::arg("seq_len"))
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(name='" + printable(s.name) + "', parameters=" + std::to_string(parameter_count(s)) + ")";
      });
  m.def("model_by_name", [](py::object name) { return model_by_name(str_arg(name, "model", "llama-2-7b")); },
        py::arg("name"), "A preset, or a Hugging Face Hub id whose config.json is in the local Hub cache.");
  m.def("default_seq_len", &default_seq_len, py::arg("model"),
        "The sequence length `gpuops estimate` uses without --seq: 2048, or a learned position table's length.");
  m.def("model_from_config_json", &model_from_hf_config, py::arg("json_text"), py::arg("name"));
  m.def("model_from_config_file", [](py::object path) { return model_from_hf_config_file(path_arg(path)); },
        py::arg("path"));
  m.def("model_from_params", [](py::object count) { return params_arg(count); }, py::arg("count"));
  m.def(
      "model_from_module",
      [](int64_t trainable, int64_t fixed_bytes, const std::string& name) {
        GPUOPS_CHECK_ARG(trainable >= 1, "trainable {} is not accepted; accepted: >= 1 parameters", trainable);
        GPUOPS_CHECK_ARG(fixed_bytes >= 0, "fixed_bytes {} is not accepted; accepted: >= 0", fixed_bytes);
        ModelSpec s = params_only_model(trainable, name);
        s.fixed_bytes = fixed_bytes;
        return s;
      },
      py::arg("trainable"), py::arg("fixed_bytes"), py::arg("name"),
      "A module with no architecture the estimator reads: its trainable parameter count and the bytes of its "
      "frozen parameters, buffers and integer tensors.");
  m.def("preset_names", &preset_names);

  m.def(
      "estimate_memory",
      [](const ModelSpec& model, py::object device, py::kwargs setup) {
        const DeviceProfile profile = profile_arg(device, setup);
        const MemoryBreakdown peak = estimate_memory(model, make_setup(setup), profile);
        py::dict off_device;  // what items() leaves out: host memory and the band of the device figure
        off_device["host_memory"] = peak.host_memory;
        off_device["band_below"] = peak.band_below;
        off_device["band_above"] = peak.band_above;
        return py::make_tuple(peak.items(), std::string(to_string(peak.peak_phase)), off_device);
      },
      py::arg("model"), py::arg("device"),
      "Peak of one step; the setup as keywords precision, amp, optimizer, optimizer_impl, zero_stage, num_gpus, "
      "checkpointing, attention, lora_rank, lora_targets, base_dtype, micro_batch, seq_len, grad_accum, zero_reduce, zero_bucket_bytes, sharding, "
      "reshard_after_forward, zero_prefetch, ds_reduce_bucket, reduce_dtype, offload_optimizer, fsdp_orig_params, quantize_lm_head, bnb_version, "
      "held_logits, model_code.");

  m.def(
      "fit_table_json",
      [](const ModelSpec& model, bool recommend, py::kwargs setup) {
        return fit_table_json(model, make_setup(setup), runtime_arg(setup), recommend);
      },
      py::arg("model"), py::arg("recommend"),
      "The GPU table of `gpuops estimate --json` (its \"gpus\" array, as JSON text); the setup as estimate_memory's "
      "keywords.");

  m.def("find_gpu_name", [](py::object name) { return gpu_arg(name, "gpu", false)->name; }, py::arg("name"),
        "The catalog name of a GPU (ignoring case, spaces, '-' and '_'); ValueError listing the names otherwise.");

  m.attr("CUDA_CONTEXT_BYTES") = cuda_device().cuda_context_bytes;  // what the estimator assumes

  // The caching allocator model alone, over a trace, so that a GPU run can compare it with torch's own
  // (bench/estimator_validation/calibrate_device.py).
  m.def(
      "replay_caching_allocator",
      [](const std::vector<int64_t>& trace, bool expandable) {
        constexpr int64_t kMaxOps = int64_t{1} << 20, kMaxSize = int64_t{1} << 40;  // sums stay far from 2**63
        GPUOPS_CHECK_ARG(static_cast<int64_t>(trace.size()) <= kMaxOps, "trace has {} operations; accepted: at most "
                         "{}", trace.size(), kMaxOps);
        CachingAllocatorModel model(expandable ? AllocatorMode::ExpandableSegments : AllocatorMode::Default);
        std::vector<int64_t> handles;
        std::vector<bool> freed;
        for (const int64_t op : trace) {
          GPUOPS_CHECK_ARG(op <= kMaxSize, "trace: {} is not accepted; accepted: a size in bytes of at most 2**40 "
                           "(1 TiB), or -(k + 1) to free the k-th allocation", op);
          if (op > 0) {
            handles.push_back(model.malloc(op));
            freed.push_back(false);
            continue;
          }
          const int64_t k = -(op + 1);  // op = -(k + 1) frees the k-th allocation
          GPUOPS_CHECK_ARG(op < 0 && k < static_cast<int64_t>(handles.size()) && !freed[k],
                           "trace: {} is not accepted; accepted: a size in bytes (> 0), or -(k + 1) to free the k-th "
                           "allocation (0-based) once, after it was made ({} made so far)", op, handles.size());
          model.free(handles[k]);
          freed[k] = true;
        }
        py::dict peaks;
        peaks["peak_allocated"] = model.peak_allocated();
        peaks["peak_reserved"] = model.peak_reserved();
        peaks["peak_requested"] = model.peak_requested();
        return peaks;
      },
      py::arg("trace"), py::arg("expandable") = false,
      "Peaks of the caching allocator model (c10's rules) over a trace: sizes to allocate, -(k + 1) to free the "
      "k-th allocation.");

  // Pictures and advice.
  m.def(
      "estimate_svg",
      [](const ModelSpec& model, py::object device, py::object gpu, py::kwargs setup) {
        const GpuModel* line = gpu_arg(gpu, "gpu", true);
        DeviceProfile profile = device_arg(device);
        const CudaRuntime rt = runtime_arg(setup);
        if (!profile.is_cpu()) profile = line ? device_of(*line, rt) : cuda_device(90, rt);  // as `gpuops estimate`
        return estimate_svg(model, make_setup(setup), profile, line);
      },
      py::arg("model"), py::arg("device"), py::arg("gpu"),
      "The SVG text of `gpuops estimate --plot`; the setup as estimate_memory's keywords.");
  m.def(
      "advise",
      [](const ModelSpec& model, py::object gpu, py::kwargs setup) {
        const GpuModel& g = *gpu_arg(gpu, "gpu", false);
        const TrainingSetup s = make_setup(setup);
        const CudaRuntime rt = runtime_arg(setup);
        const MemoryBreakdown given = estimate_memory(model, s, device_of(g, rt));
        py::dict as_given;
        as_given["gpu"] = g.name;
        as_given["memory_bytes"] = g.memory_bytes;
        as_given["total_bytes"] = given.total();
        as_given["total_high_bytes"] = given.total_high();
        as_given["fits"] = fits_on(given, g);
        as_given["headroom_bytes"] = g.memory_bytes - given.total_high();
        py::list advice;
        for (const Advice& a : advise(model, s, g, rt)) advice.append(advice_dict(a, g));
        return py::make_tuple(as_given, advice);
      },
      py::arg("model"), py::arg("gpu"),
      "`gpuops estimate --advise`: ({gpu, memory_bytes, total_bytes, fits, headroom_bytes} of the setup as given, "
      "[advice dicts]); the setup as estimate_memory's keywords.");
  m.def("write_file_atomically", &write_file, py::arg("path"), py::arg("text"),
        "Writes text (UTF-8) through a temporary file in the same folder renamed over path; OSError on failure.");
  m.def(
      "run_cli",
      [](const std::vector<std::string>& args) {  // str or bytes (os.fsencode'd argv) items
        std::ostringstream out, err;
        const int code = run_cli(args, out, err);
        return py::make_tuple(code, py::bytes(out.str()), py::bytes(err.str()));
      },
      py::arg("args"),
      "Runs the `gpuops` command line in-process: (exit status, stdout bytes, stderr bytes), as the native "
      "binary would write them.");
}

}  // namespace gpuops::python

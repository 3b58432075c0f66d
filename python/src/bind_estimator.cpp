// The estimator and the command line, for gpuops.estimate() and the `gpuops` console script. Arguments
// arrive as Python objects and are converted here, each with an error naming it (pybind11's own
// overload error lists the whole signature instead).
#include <climits>
#include <sstream>

#include <pybind11/stl.h>

#include "bindings.h"
#include "gpuops/cli.h"
#include "gpuops/errors.h"
#include "gpuops/estimator.h"

namespace py = pybind11;

namespace gpuops::python {
namespace {

using namespace gpuops::estimator;

std::string describe(py::handle value) {
  return fmt::format("{} {}", py::str(py::type::of(value).attr("__name__")).cast<std::string>(),
                     printable(py::repr(value).cast<std::string>()));
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

}  // namespace

void bind_estimator(py::module_& m) {
  translate_argument_errors();
  py::class_<ModelSpec>(m, "ModelSpec", "An architecture the estimator understands.")
      .def_readonly("name", &ModelSpec::name)
      .def_readonly("hidden_size", &ModelSpec::hidden_size)
      .def_readonly("num_layers", &ModelSpec::num_layers)
      .def_readonly("vocab_size", &ModelSpec::vocab_size)
      .def_property_readonly("parameter_count", [](const ModelSpec& s) { return parameter_count(s); })
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(name='" + printable(s.name) + "', parameters=" + std::to_string(parameter_count(s)) + ")";
      });
  m.def("model_from_preset", [](py::object name) { return preset(str_arg(name, "model", "llama-2-7b")); },
        py::arg("name"));
  m.def("model_from_config_json", &model_from_hf_config, py::arg("json_text"), py::arg("name"));
  m.def("model_from_config_file", [](py::object path) { return model_from_hf_config_file(path_arg(path)); },
        py::arg("path"));
  m.def("model_from_params", [](py::object count) { return params_arg(count); }, py::arg("count"));
  m.def("preset_names", &preset_names);

  m.def(
      "estimate_memory",
      [](const ModelSpec& model, py::object device, py::kwargs setup) {
        const DeviceProfile profile = device_arg(device);
        const MemoryBreakdown peak = estimate_memory(model, make_setup(setup), profile);
        return py::make_tuple(peak.items(), std::string(to_string(peak.peak_phase)));
      },
      py::arg("model"), py::arg("device"),
      "Peak of one step; the setup as keywords precision, amp, optimizer, optimizer_impl, zero_stage, num_gpus, "
      "checkpointing, attention, lora_rank, lora_targets, base_dtype, micro_batch, seq_len, grad_accum.");

  m.attr("CUDA_CONTEXT_BYTES") = cuda_device().cuda_context_bytes;  // what the estimator assumes
  m.def("gpu_catalog", [] {
    std::vector<py::dict> rows;
    for (const auto& gpu : gpu_catalog()) {
      py::dict row;
      row["name"] = gpu.name;
      row["memory_bytes"] = gpu.memory_bytes;
      row["bandwidth_gb_s"] = gpu.bandwidth_gb_s;
      row["bf16_tflops"] = gpu.bf16_tflops;
      row["spot_price_usd_per_hour"] = gpu.spot_price_usd_per_hour;
      rows.push_back(std::move(row));
    }
    return rows;
  });

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

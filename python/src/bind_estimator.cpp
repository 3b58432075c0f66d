// The estimator and the command line, for gpuops.estimate() and the `gpuops` console script.
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

// Builds the setup with the C++ parsers, so that names and their errors are the CLI's own.
TrainingSetup make_setup(const std::string& precision, const std::string& amp, const std::string& optimizer,
                         const std::string& optimizer_impl, int zero_stage,
                         int64_t num_gpus, const std::string& checkpointing, const std::string& attention,
                         int64_t lora_rank, const std::vector<std::string>& lora_targets,
                         const std::string& base_dtype, int64_t micro_batch, int64_t seq_len, int64_t grad_accum) {
  TrainingSetup setup;
  setup.precision = parse_precision(precision);
  setup.amp = parse_amp_layout(amp);
  setup.optimizer = parse_optimizer(optimizer);
  setup.optimizer_impl = parse_optimizer_impl(optimizer_impl);
  setup.zero_stage = zero_stage;
  setup.num_gpus = num_gpus;
  parse_checkpointing(checkpointing, setup);
  setup.attention = parse_attention(attention);
  setup.lora.rank = lora_rank;
  setup.lora.targets = lora_targets;
  setup.lora.base = parse_base_dtype(base_dtype);
  setup.micro_batch = micro_batch;
  setup.seq_len = seq_len;
  setup.grad_accum = grad_accum;
  return setup;
}

DeviceProfile parse_device_profile(const std::string& device) {
  if (device == "cuda") return cuda_device();
  if (device == "cpu") return cpu_device();
  throw gpuops::ArgumentError("estimate: device must be 'cuda' or 'cpu', got '" + device + "'");
}

}  // namespace

void bind_estimator(py::module_& m) {
  py::class_<ModelSpec>(m, "ModelSpec", "An architecture the estimator understands.")
      .def_readonly("name", &ModelSpec::name)
      .def_readonly("hidden_size", &ModelSpec::hidden_size)
      .def_readonly("num_layers", &ModelSpec::num_layers)
      .def_readonly("vocab_size", &ModelSpec::vocab_size)
      .def_property_readonly("parameter_count", [](const ModelSpec& s) { return parameter_count(s); })
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec(name='" + s.name + "', parameters=" + std::to_string(parameter_count(s)) + ")";
      });
  m.def("model_from_preset", [](const std::string& name) { return preset(name); }, py::arg("name"));
  m.def("model_from_config_json", &model_from_hf_config, py::arg("json_text"), py::arg("name"));
  m.def("model_from_config_file", &model_from_hf_config_file, py::arg("path"));
  m.def("model_from_params", [](const std::string& count) { return params_only_model(parse_param_count(count)); },
        py::arg("count"));
  m.def("preset_names", &preset_names);

  m.def(
      "estimate_memory",
      [](const ModelSpec& model, const std::string& device, const std::string& precision, const std::string& amp,
         const std::string& optimizer, const std::string& optimizer_impl, int zero_stage, int64_t num_gpus,
         const std::string& checkpointing, const std::string& attention,
         int64_t lora_rank, const std::vector<std::string>& lora_targets, const std::string& base_dtype,
         int64_t micro_batch, int64_t seq_len, int64_t grad_accum) {
        const auto setup = make_setup(precision, amp, optimizer, optimizer_impl, zero_stage, num_gpus, checkpointing,
                                      attention, lora_rank, lora_targets, base_dtype, micro_batch, seq_len, grad_accum);
        const MemoryBreakdown peak = estimate_memory(model, setup, parse_device_profile(device));
        return py::make_tuple(peak.items(), std::string(to_string(peak.peak_phase)));
      },
      py::arg("model"), py::arg("device"), py::arg("precision"), py::arg("amp"), py::arg("optimizer"),
      py::arg("optimizer_impl"), py::arg("zero_stage"),
      py::arg("num_gpus"), py::arg("checkpointing"), py::arg("attention"), py::arg("lora_rank"),
      py::arg("lora_targets"), py::arg("base_dtype"), py::arg("micro_batch"), py::arg("seq_len"),
      py::arg("grad_accum"));

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
      [](const std::vector<std::string>& args) {
        std::ostringstream out, err;
        const int code = run_cli(args, out, err);
        return py::make_tuple(code, out.str(), err.str());
      },
      py::arg("args"),
      "Runs the `gpuops` command line in-process: (exit status, stdout text, stderr text).");
}

}  // namespace gpuops::python

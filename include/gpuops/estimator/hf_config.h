#pragma once
// Reads a Hugging Face config.json into a ModelSpec (nlohmann-json).

#include <string>
#include <string_view>

#include "gpuops/estimator/model_spec.h"

namespace gpuops::estimator {

/// Builds a spec from config.json text. model_type: gpt2; bert; any decoder-only model by its standard fields,
/// with what llama, mistral, qwen2, gemma, gemma2, phi3, mixtral, qwen2_moe, deepseek_v2 and deepseek_v3
/// hard-code; an unknown model_type is read as a Llama-style decoder and says so in spec.assumptions
/// (docs/estimator.md "Model families"). Encoder-decoder and other encoder-only types are refused. `name`
/// labels the spec and the error messages (usually the file path).
ModelSpec model_from_hf_config(std::string_view json_text, std::string name);

/// Reads and parses a config.json file; ArgumentError naming the file (and key) if it cannot.
ModelSpec model_from_hf_config_file(const std::string& path);

/// The local Hugging Face Hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
/// else ~/.cache/huggingface/hub (huggingface_hub's own rule).
std::string hub_cache_dir();
/// The cached config.json of Hub id `repo_id` ("org/name"): the snapshot refs/main names, else the newest; ""
/// when the cache has none or the id is not a Hub id. Reads the disk only, never the network.
std::string hub_cache_config(std::string_view repo_id);
/// A model by name, as `gpuops estimate --model` and gpuops.estimate(model) take it: a preset, else a Hub id
/// whose config.json is in the local cache (named by the id; the file it came from in spec.assumptions).
/// ArgumentError listing the presets and the cache looked in otherwise.
ModelSpec model_by_name(std::string_view name);

}  // namespace gpuops::estimator

// A model by name: a preset, or a Hugging Face Hub id read from the local Hub cache (no network), as accelerate's
// `estimate-memory` takes a model id.
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuops/errors.h"
#include "gpuops/estimator/hf_config.h"
#include "gpuops/estimator/presets.h"
#include "gpuops/estimator/printable.h"
#include "text_file.h"

namespace gpuops::estimator {
namespace {

namespace fs = std::filesystem;

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// "org/name" or "name" of letters, digits, '-', '_' and '.', neither part "." or "..": Hub's rule, and never a
// path that leaves the cache.
bool is_repo_id(std::string_view id) {
  const size_t slash = id.find('/');
  const auto part_ok = [](std::string_view p) {
    if (p.empty() || p.size() > 96 || p == "." || p == "..") return false;
    for (const char c : p)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
    return true;
  };
  if (slash == std::string_view::npos) return part_ok(id);
  return part_ok(id.substr(0, slash)) && part_ok(id.substr(slash + 1));
}

// The first line of a small regular file; "" for anything else: a FIFO (it hung the CLI), a link to a device
// (/dev/zero was read for 4.2 GB), a missing or oversized file. A ref holds a 40-character commit hash.
std::string first_line(const fs::path& file) {
  try {
    const std::string text = read_text_file(file.string(), {"refs/main", "Hub cache ref", "", 4096});
    return text.substr(0, text.find('\n'));
  } catch (const ArgumentError&) {
    return "";
  }
}

}  // namespace

std::string hub_cache_dir() {
  if (!env("HF_HUB_CACHE").empty()) return env("HF_HUB_CACHE");
  if (!env("HF_HOME").empty()) return env("HF_HOME") + "/hub";
  if (!env("XDG_CACHE_HOME").empty()) return env("XDG_CACHE_HOME") + "/huggingface/hub";
  return env("HOME") + "/.cache/huggingface/hub";
}

std::string hub_cache_config(std::string_view repo_id) {
  if (!is_repo_id(repo_id)) return "";
  std::string folder = "models--" + std::string(repo_id);
  for (size_t at = folder.find('/'); at != std::string::npos; at = folder.find('/')) folder.replace(at, 1, "--");
  const fs::path repo = fs::path(hub_cache_dir()) / folder;
  std::error_code ec;
  // The revision refs/main names (what from_pretrained loads by default), else the newest snapshot.
  const std::string main = first_line(repo / "refs" / "main");
  if (is_repo_id(main) && main.find('/') == std::string::npos) {
    const fs::path config = repo / "snapshots" / main / "config.json";
    if (fs::is_regular_file(config, ec)) return config.string();
  }
  fs::path newest;
  fs::file_time_type newest_time{};
  for (const auto& snapshot : fs::directory_iterator(repo / "snapshots", ec)) {
    const fs::path config = snapshot.path() / "config.json";
    if (!fs::is_regular_file(config, ec)) continue;
    const auto when = fs::last_write_time(config, ec);
    if (!ec && (newest.empty() || when > newest_time)) {
      newest = config;
      newest_time = when;
    }
  }
  return newest.string();
}

ModelSpec model_by_name(std::string_view name) {
  const std::vector<std::string> presets = preset_names();
  try {
    return preset(name);
  } catch (const ArgumentError&) {
    const std::string config = hub_cache_config(name);
    if (config.empty())
      throw ArgumentError(fmt::format(
          "model '{}' is not a preset ({}) nor a Hugging Face Hub id with a config.json in the local Hub cache ({}; "
          "nothing is downloaded); give the config.json itself with --config / config=", printable(name),
          fmt::join(presets, ", "), printable(hub_cache_dir())));
    ModelSpec spec = model_from_hf_config_file(config);
    spec.name = std::string(name);
    spec.assumptions.push_back(fmt::format("read from the local Hugging Face Hub cache: {}", config));
    return spec;
  }
}

}  // namespace gpuops::estimator

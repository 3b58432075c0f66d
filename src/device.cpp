// device_info(): the CUDA device chosen by LOCAL_RANK (or asked for), else the CPU.
#include "gpuops/device.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>

#ifdef GPUOPS_WITH_CUDA
#include "cuda_device.h"
#endif

namespace gpuops {
namespace {

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::optional<std::string>(value) : std::nullopt;
}

// The value after "<key>" and its colon in a /proc text file, or "" when absent.
std::string proc_field(const char* path, const std::string& key) {
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    if (line.compare(0, key.size(), key) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

}  // namespace

int64_t available_host_memory_bytes() {
  const std::string available_kib = proc_field("/proc/meminfo", "MemAvailable");  // "123456 kB"
  return available_kib.empty() ? static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE)
                               : std::atoll(available_kib.c_str()) * 1024;
}

int64_t host_memory_headroom_bytes() {
  int64_t headroom = available_host_memory_bytes();
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  int64_t current = 0;
  if (max_file >> max_text && max_text != "max" && current_file >> current)
    headroom = std::min<int64_t>(headroom, std::atoll(max_text.c_str()) - current);
  for (const auto& [resource, used_field] : {std::pair{RLIMIT_AS, "VmSize"}, std::pair{RLIMIT_DATA, "VmData"}}) {
    rlimit limit{};
    if (getrlimit(resource, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) continue;
    const int64_t used = std::atoll(proc_field("/proc/self/status", used_field).c_str()) * 1024;  // "123 kB"
    headroom = std::min<int64_t>(headroom, static_cast<int64_t>(limit.rlim_cur) - used);
  }
  return std::max<int64_t>(headroom, 0);
}

namespace {

DeviceInfo cpu_info() {
  DeviceInfo info;
  info.type = "cpu";
  info.name = proc_field("/proc/cpuinfo", "model name");
  if (info.name.empty()) info.name = "cpu";
  info.total_memory_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  info.free_memory_bytes = available_host_memory_bytes();
  info.multiprocessors = static_cast<int>(std::thread::hardware_concurrency());
  return info;
}

int visible_cuda_devices() {
#ifdef GPUOPS_WITH_CUDA
  return kernels::cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace

std::optional<int> parse_local_rank(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  char* end = nullptr;
  const long rank = std::strtol(text->c_str(), &end, 10);
  TORCH_CHECK_VALUE(!text->empty() && *end == '\0' && rank >= 0 && rank <= INT32_MAX,
                    "LOCAL_RANK must be a non-negative integer, got '", *text, "'");
  return static_cast<int>(rank);
}

int device_index_for_local_rank(const std::optional<std::string>& local_rank, int device_count) {
  TORCH_CHECK_VALUE(device_count >= 0, "device_index_for_local_rank: device_count must be >= 0, got ", device_count);
  const auto rank = parse_local_rank(local_rank);
  if (!rank || device_count == 1) return 0;
  TORCH_CHECK_VALUE(*rank < device_count, "LOCAL_RANK=", *rank, " has no CUDA device: this process sees ",
                    device_count, " (indices 0..", device_count - 1, "; check CUDA_VISIBLE_DEVICES)");
  return *rank;
}

DeviceInfo device_info(std::optional<int> index) {
  const int count = visible_cuda_devices();
  const auto local_rank_text = env("LOCAL_RANK");
  DeviceInfo info;
  if (count == 0) {
    TORCH_CHECK_VALUE(!index || *index == 0, "device_info: index must be 0 when no CUDA device is visible, got ",
                      *index);
    info = cpu_info();
  } else {
    TORCH_CHECK_VALUE(!index || (*index >= 0 && *index < count), "device_info: index must be in [0, ", count,
                      "), got ", index.value_or(0));
    const int chosen = index ? *index : device_index_for_local_rank(local_rank_text, count);
#ifdef GPUOPS_WITH_CUDA
    const auto props = kernels::cuda_device_props(chosen);
    info.type = "cuda";
    info.index = chosen;
    info.name = props.name;
    info.total_memory_bytes = props.total_memory_bytes;
    info.free_memory_bytes = props.free_memory_bytes;
    info.multiprocessors = props.multiprocessors;
    info.compute_major = props.compute_major;
    info.compute_minor = props.compute_minor;
#endif
  }
  info.visible_device_count = count;
  info.cuda_visible_devices = env("CUDA_VISIBLE_DEVICES").value_or("");
  info.local_rank = parse_local_rank(local_rank_text);
  return info;
}

}  // namespace gpuops

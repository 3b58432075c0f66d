#pragma once
// The device layer: which accelerator this process uses and what it has.
#include <cstdint>
#include <optional>
#include <string>

namespace gpuops {

/// What device_info() reports; for the CPU, memory is the machine's and compute capability is 0.0.
struct DeviceInfo {
  std::string type;              ///< "cuda" or "cpu"
  int index = 0;                 ///< CUDA ordinal within the visible devices; 0 for the CPU
  std::string name;              ///< e.g. "NVIDIA H100 80GB HBM3", or the CPU model name
  int64_t total_memory_bytes = 0;
  int64_t free_memory_bytes = 0;
  int multiprocessors = 0;       ///< streaming multiprocessors, or logical CPU cores
  int compute_major = 0;
  int compute_minor = 0;
  int visible_device_count = 0;  ///< CUDA devices this process sees
  std::string cuda_visible_devices;  ///< the CUDA_VISIBLE_DEVICES value, "" when unset
  std::optional<int> local_rank;     ///< LOCAL_RANK, when set (torchrun, SLURM, job schedulers)
};

/// The device this process should use: CUDA device `index` if given, else the one LOCAL_RANK
/// selects, else device 0; the CPU when no CUDA device is visible (or the build has no CUDA).
DeviceInfo device_info(std::optional<int> index = std::nullopt);

/// The host memory available now (Linux's MemAvailable; the physical memory where it is unknown).
int64_t available_host_memory_bytes();

/// The host memory this process may still take: the least of available_host_memory_bytes(), its cgroup's
/// memory.max minus memory.current (cgroup v2: a container's limit, which MemAvailable does not see) and the
/// room left under ulimit -v and -d (RLIMIT_AS, RLIMIT_DATA). The CUDA driver's pinned allocations are not
/// charged to ulimit -l (RLIMIT_MEMLOCK), so it plays no part.
int64_t host_memory_headroom_bytes();

/// Parses a LOCAL_RANK value (nullopt: unset); throws c10::ValueError when it is malformed.
std::optional<int> parse_local_rank(const std::optional<std::string>& text);

/// Picks the CUDA ordinal for a LOCAL_RANK value (nullopt: unset) among `device_count` visible
/// devices. A scheduler that pins one GPU per process (one visible device) gets 0 for any rank.
/// Throws c10::ValueError for a malformed LOCAL_RANK or one with no device.
int device_index_for_local_rank(const std::optional<std::string>& local_rank, int device_count);

}  // namespace gpuops

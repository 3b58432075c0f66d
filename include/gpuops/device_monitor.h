#pragma once
// gpuops::telemetry::DeviceMonitor (issue 34, item 4): the figures GPU monitors show (nvidia-smi, DCGM, an NVML
// exporter): utilisation, memory used, temperature, power draw, SM clock and energy, read through NVML loaded at
// run time (dlopen of libnvidia-ml.so.1: no link dependency; absent on machines without a driver) on a thread of
// its own, never on the training step's path. MetricsRecorder adds them to every record (RecorderOptions::gpu).

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace gpuops::telemetry {

/// The samples since the last take(): means of the rates, maxima of the levels, the energy used between the
/// first and last sample. NaN where NVML did not answer (a GPU without the counter) or there was no sample.
struct DeviceFigures {
  double util_pct = 0;          ///< GPU utilisation (the share of time a kernel ran), mean, %
  double memory_used_bytes = 0; ///< device memory in use (every process: nvidia-smi's figure), maximum
  double temperature_c = 0;     ///< GPU temperature, maximum, degrees C
  double power_w = 0;           ///< power draw, mean, W
  double sm_clock_mhz = 0;      ///< SM clock, mean, MHz
  double energy_j = 0;          ///< energy since the last take() (NVML's total energy counter), J
  int64_t samples = 0;
};

class DeviceMonitor {
 public:
  /// Loads NVML (the library GPUOPS_NVML_LIBRARY names, else libnvidia-ml.so.1), finds the GPU `gpu` (a PCI
  /// bus id such as "00000000:3B:00.0", what torch.cuda.get_device_properties gives, or an NVML index "0") and
  /// samples it every `interval_s` seconds (> 0, <= 3600; c10::ValueError otherwise) from a thread of its own.
  /// Without NVML or that GPU it does nothing: available() is false and reason() says why.
  DeviceMonitor(std::string gpu, double interval_s);
  ~DeviceMonitor();
  DeviceMonitor(const DeviceMonitor&) = delete;
  DeviceMonitor& operator=(const DeviceMonitor&) = delete;

  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }
  /// The figures of the samples since the last call (one more sample is taken now, so that a call right after
  /// construction has one).
  DeviceFigures take();

 private:
  struct Nvml;
  struct Totals;
  void sample();  ///< one reading into totals_ (under mutex_)
  void run();

  std::unique_ptr<Nvml> nvml_;
  std::unique_ptr<Totals> totals_;
  bool available_ = false;
  std::string reason_;
  double interval_s_;
  std::mutex mutex_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace gpuops::telemetry

#pragma once
// TensorBoard's events as bytes to append to an event file (private to src/telemetry). Torch-free on purpose:
// libtorch's include folder holds its own, older protobuf headers, so the protobuf code (tensorboard_event.proto
// compiled by protoc, tensorboard_encoding.cpp) is compiled without torch's include path.
#include <cstdint>
#include <string>
#include <vector>

namespace gpuops::telemetry::detail::tensorboard {

struct Scalar {
  std::string tag;
  float value = 0;  // TensorBoard's scalars are float32
};

/// Each function returns one event framed as a TFRecord: its length (8 bytes, little-endian), the length's
/// masked CRC-32C, the serialized event, its masked CRC-32C.

/// The first event of a file: its version, "brain.Event:2".
std::string file_version_record(double wall_time);
/// A SessionLog START at `step`: TensorBoard drops the events of steps >= step written before it (a restart).
std::string run_start_record(double wall_time, int64_t step);
/// Scalars at `step`, one Summary.
std::string scalars_record(double wall_time, int64_t step, const std::vector<Scalar>& scalars);

/// TFRecord's checksum of `bytes`: CRC-32C (Castagnoli) masked as TFRecord stores it (for the tests).
uint32_t masked_crc32c(const std::string& bytes);

}  // namespace gpuops::telemetry::detail::tensorboard

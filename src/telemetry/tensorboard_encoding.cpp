// The events are messages of TensorBoard's schema (tensorboard_event.proto, compiled by protoc for
// protobuf-lite), framed as TFRecords whose checksums are CRC-32C (Boost.CRC).
#include "tensorboard_encoding.h"

#include <boost/crc.hpp>

#include "tensorboard_event.pb.h"

namespace gpuops::telemetry::detail::tensorboard {
namespace {

template <typename T>
std::string little_endian(T value) {
  std::string out(sizeof(T), '\0');
  for (size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

std::string tf_record(const Event& event) {
  const std::string bytes = event.SerializeAsString();
  const std::string length = little_endian<uint64_t>(bytes.size());
  return length + little_endian(masked_crc32c(length)) + bytes + little_endian(masked_crc32c(bytes));
}

Event event_at(double wall_time, int64_t step) {
  Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  return event;
}

}  // namespace

uint32_t masked_crc32c(const std::string& bytes) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;  // CRC-32C
  crc.process_bytes(bytes.data(), bytes.size());
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;  // TFRecord's mask: rotated right by 15, plus a constant
}

std::string file_version_record(double wall_time) {
  Event event = event_at(wall_time, 0);
  event.set_file_version("brain.Event:2");
  return tf_record(event);
}

std::string run_start_record(double wall_time, int64_t step) {
  Event event = event_at(wall_time, step);
  event.mutable_session_log()->set_status(SessionLog::START);
  return tf_record(event);
}

std::string scalars_record(double wall_time, int64_t step, const std::vector<Scalar>& scalars) {
  Event event = event_at(wall_time, step);
  Summary* summary = event.mutable_summary();
  for (const Scalar& scalar : scalars) {
    SummaryValue* value = summary->add_value();
    value->set_tag(scalar.tag);
    value->set_simple_value(scalar.value);
  }
  return tf_record(event);
}

}  // namespace gpuops::telemetry::detail::tensorboard

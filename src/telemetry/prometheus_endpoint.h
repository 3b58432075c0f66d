#pragma once
// A Prometheus text-format endpoint (GET /metrics) for the recorder's latest record, served from a thread of its
// own (off the training thread) by a small poll loop bounded in connections, request size and time per
// connection; docs/telemetry.md, "Prometheus".
#include <cstdint>
#include <memory>
#include <string>

#include "gpuops/telemetry.h"

namespace gpuops::telemetry::detail {

struct PrometheusLabels {
  std::string job;
  int64_t rank = 0, world_size = 1;
};

/// The text exposition format (version 0.0.4) of `record`: one gauge per reported figure, named gpuops_<figure>
/// (a figure in seconds, <name>_s, as gpuops_<name>_seconds; "time" as gpuops_last_step_timestamp_seconds), the
/// step, and each group's learning rate; figures not reported are left out.
std::string prometheus_text(const Record& record, const PrometheusLabels& labels);

/// True: every build serves Prometheus (kept for callers that asked when it needed cpp-httplib).
bool prometheus_built();

class PrometheusEndpoint {
 public:
  /// Binds `address`:`port` (port 0: a free one; port() tells which) and serves from a thread of its own;
  /// ValueError naming the address and port when it cannot bind (in use, or not an address of this host).
  PrometheusEndpoint(const std::string& address, int64_t port, PrometheusLabels labels);
  ~PrometheusEndpoint();  ///< stops serving and joins the thread, at once whatever the clients do
  PrometheusEndpoint(const PrometheusEndpoint&) = delete;
  PrometheusEndpoint& operator=(const PrometheusEndpoint&) = delete;
  int64_t port() const;
  /// What the next scrape returns.
  void publish(const Record& record);

 private:
  struct Server;
  std::unique_ptr<Server> server_;
};

}  // namespace gpuops::telemetry::detail

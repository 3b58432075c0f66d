// The Prometheus endpoint (see prometheus_endpoint.h). The text format: https://prometheus.io/docs/instrumenting/
// exposition_formats/. Without cpp-httplib (GPUOPS_WITH_PROMETHEUS undefined) the text is still made, and asking
// for an endpoint is refused naming the missing library.
#include "prometheus_endpoint.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#ifdef GPUOPS_WITH_PROMETHEUS
#include <httplib.h>
#include <sys/socket.h>
#endif

namespace gpuops::telemetry::detail {
namespace {

// A label value with \, " and newlines escaped.
std::string escaped(const std::string& value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  }
  return out;
}

bool ends_with(const std::string& text, const std::string& end) {
  return text.size() >= end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

// A figure's metric name: gpuops_<figure>, a duration in seconds spelled out as Prometheus' base unit
// (step_time_s: gpuops_step_time_seconds; rates such as tokens_per_s stay), the record's time as the last-step
// timestamp.
std::string metric_name(const std::string& figure) {
  if (figure == "time") return "gpuops_last_step_timestamp_seconds";
  const bool seconds = ends_with(figure, "_s") && !ends_with(figure, "_per_s");
  return "gpuops_" + (seconds ? figure.substr(0, figure.size() - 2) + "_seconds" : figure);
}

void gauge(std::string& out, const std::string& name, const std::string& labels, double value) {
  fmt::format_to(std::back_inserter(out), "# TYPE {} gauge\n{}{{{}}} {}\n", name, name, labels, value);
}

}  // namespace

std::string prometheus_text(const Record& record, const PrometheusLabels& labels) {
  const std::string common =
      fmt::format("job=\"{}\",rank=\"{}\",world_size=\"{}\"", escaped(labels.job), labels.rank, labels.world_size);
  std::string out;
  gauge(out, "gpuops_step", common, static_cast<double>(record.step));
  for (const auto& [name, value] : record.figures) {
    if (!std::isfinite(value)) continue;  // not reported
    gauge(out, metric_name(name), common, value);
  }
  if (!record.lrs.empty()) out += "# TYPE gpuops_lr gauge\n";
  for (size_t g = 0; g < record.lrs.size(); ++g)
    if (std::isfinite(record.lrs[g])) fmt::format_to(std::back_inserter(out), "gpuops_lr{{{},group=\"{}\"}} {}\n",
                                                     common, g, record.lrs[g]);
  return out;
}

#ifdef GPUOPS_WITH_PROMETHEUS

bool prometheus_built() { return true; }

struct PrometheusEndpoint::Server {
  httplib::Server http;
  std::thread thread;
  std::mutex mutex;
  std::string text;  // the latest record's exposition
  PrometheusLabels labels;
  int64_t port = 0;
};

PrometheusEndpoint::PrometheusEndpoint(const std::string& address, int64_t port, PrometheusLabels labels)
    : server_(std::make_unique<Server>()) {
  TORCH_CHECK_VALUE(port >= 0 && port <= 65535, "MetricsRecorder: prometheus_port ", port,
                    " is not accepted; accepted: 0 (a free port) to 65535, or -1 for no endpoint");
  Server& s = *server_;
  s.labels = std::move(labels);
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which lets a second server share a port in use.
  s.http.set_socket_options([](socket_t sock) {  // (cpp-httplib declares socket_t globally)
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  s.http.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
    std::lock_guard<std::mutex> lock(server_->mutex);
    response.set_content(server_->text, "text/plain; version=0.0.4; charset=utf-8");
  });
  const bool bound = port == 0 ? (s.port = s.http.bind_to_any_port(address)) > 0
                               : (s.port = port, s.http.bind_to_port(address, static_cast<int>(port)));
  TORCH_CHECK_VALUE(bound, "MetricsRecorder: prometheus endpoint ", address, ":", port,
                    " cannot be bound (the port is in use, or the address is not one of this host's); accepted: a "
                    "free port on an address of this host (default 127.0.0.1)");
  s.thread = std::thread([&http = s.http] { http.listen_after_bind(); });
  // Serving before the constructor returns: a stop() that came before the listening loop began would not end it.
  while (!s.http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

PrometheusEndpoint::~PrometheusEndpoint() {
  server_->http.stop();
  if (server_->thread.joinable()) server_->thread.join();
}

int64_t PrometheusEndpoint::port() const { return server_->port; }

void PrometheusEndpoint::publish(const Record& record) {
  std::string text = prometheus_text(record, server_->labels);
  std::lock_guard<std::mutex> lock(server_->mutex);
  server_->text = std::move(text);
}

#else

bool prometheus_built() { return false; }

struct PrometheusEndpoint::Server {};

PrometheusEndpoint::PrometheusEndpoint(const std::string&, int64_t, PrometheusLabels) {
  TORCH_CHECK_VALUE(false, "MetricsRecorder: prometheus_port asks for a Prometheus endpoint, but this build of gpuops "
                    "has none (built without cpp-httplib: Debian's libcpp-httplib-dev); accepted: prometheus_port -1");
}
PrometheusEndpoint::~PrometheusEndpoint() = default;
int64_t PrometheusEndpoint::port() const { return -1; }
void PrometheusEndpoint::publish(const Record&) {}

#endif

}  // namespace gpuops::telemetry::detail

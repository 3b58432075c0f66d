// The Prometheus endpoint (see prometheus_endpoint.h). The text format: https://prometheus.io/docs/instrumenting/
// exposition_formats/. Without cpp-httplib (GPUOPS_WITH_PROMETHEUS undefined) the text is still made, and asking
// for an endpoint is refused naming the missing library.
#include "prometheus_endpoint.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#ifdef GPUOPS_WITH_PROMETHEUS
#include <httplib.h>
#include <pthread.h>
#include <sys/socket.h>

#include <csignal>
#include <cstdio>
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

// A figure's metric name: gpuops_<figure>, a duration in seconds spelled out as Prometheus' base unit
// (step_time_s: gpuops_step_time_seconds, step_time_s_max_rank: gpuops_step_time_seconds_max_rank; rates such as
// tokens_per_s stay), the record's time as the last-step timestamp.
std::string metric_name(const std::string& figure) {
  if (figure == "time") return "gpuops_last_step_timestamp_seconds";
  std::string out = "gpuops", previous;
  size_t start = 0;
  while (start <= figure.size()) {
    const size_t end = std::min(figure.find('_', start), figure.size());
    const std::string token = figure.substr(start, end - start);
    out += "_" + (token == "s" && previous != "per" ? std::string("seconds") : token);
    previous = token;
    start = end + 1;
  }
  return out;
}

// Per-record deltas that Prometheus gets as process totals instead (counters: a scrape between two records
// would otherwise miss a save).
bool exported_as_total(const std::string& figure) { return figure.rfind("checkpoint_", 0) == 0; }

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
    if (!std::isfinite(value) || exported_as_total(name)) continue;  // not reported; or a total below
    gauge(out, metric_name(name), common, value);
  }
  const CheckpointSaves saves = checkpoint_saves();  // since the process began
  for (const auto& [name, value] : {std::pair{"gpuops_checkpoint_saves_total", static_cast<double>(saves.count)},
                                    {"gpuops_checkpoint_save_seconds_total", saves.seconds},
                                    {"gpuops_checkpoint_bytes_total", static_cast<double>(saves.bytes)}})
    fmt::format_to(std::back_inserter(out), "# TYPE {} counter\n{}{{{}}} {}\n", name, name, common, value);
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
  // Two worker threads (a scrape is small; httplib's default is one per core, per rank) and no keep-alive, so that
  // stop() does not wait out an idle scraper's connection.
  s.http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  s.http.set_keep_alive_max_count(1);
  s.http.Get("/metrics", [this](const httplib::Request&, httplib::Response& response) {
    std::lock_guard<std::mutex> lock(server_->mutex);
    response.set_content(server_->text, "text/plain; version=0.0.4; charset=utf-8");
  });
  const bool bound = port == 0 ? (s.port = s.http.bind_to_any_port(address)) > 0
                               : (s.port = port, s.http.bind_to_port(address, static_cast<int>(port)));
  TORCH_CHECK_VALUE(bound, "MetricsRecorder: prometheus endpoint ", address, ":", port,
                    " cannot be bound (the port is in use, or the address is not one of this host's); accepted: a "
                    "free port on an address of this host (default 127.0.0.1)");
  s.thread = std::thread([&http = s.http] {
    // A scraper that hangs up mid-response must not end the process: the Debian build of cpp-httplib sends
    // without MSG_NOSIGNAL, so SIGPIPE is blocked on this thread and on the workers it starts (they inherit it).
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    try {
      http.listen_after_bind();
    } catch (const std::exception& e) {  // never into std::terminate: the training goes on without the endpoint
      std::fprintf(stderr, "gpuops MetricsRecorder: the Prometheus endpoint stopped: %s\n", e.what());
    }
  });
  // Serving before the constructor returns: a stop() that came before the listening loop began would not end it.
  for (int waited_ms = 0; !s.http.is_running(); ++waited_ms) {
    if (waited_ms == 10000) {
      s.http.stop();
      s.thread.join();
      TORCH_CHECK(false, "MetricsRecorder: the Prometheus endpoint on ", address, ":", s.port,
                  " did not start serving within 10 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
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

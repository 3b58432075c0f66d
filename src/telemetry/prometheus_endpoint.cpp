// The Prometheus endpoint (see prometheus_endpoint.h). The text format: https://prometheus.io/docs/instrumenting/
// exposition_formats/. The server is a poll loop of our own, bounded in every way a client could push
// (docs/architecture.md, "Telemetry", says why not cpp-httplib).
#include "prometheus_endpoint.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

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

bool prometheus_built() { return true; }

namespace {

// What the endpoint allows, so that no client (a scraper gone wrong, or any local process) can cost the
// training process more than a few sockets and kilobytes, or hold its close():
constexpr size_t kMaxConnections = 16;       // at once; more wait in the kernel's backlog, then are refused
constexpr int kBacklog = 16;
constexpr size_t kMaxRequestBytes = 8192;    // the request line and headers; a body is never read
constexpr auto kConnectionTime = std::chrono::seconds(5);  // from accept to the last byte sent, whatever the pace

struct Connection {
  int fd = -1;
  std::chrono::steady_clock::time_point deadline;
  std::string request, response;
  size_t sent = 0;
};

// The response to a request's head (request line and headers, up to the blank line): GET and HEAD of
// /metrics, 404 for another path, 405 for another method; the connection closes after it (no keep-alive).
std::string respond(const std::string& head, const std::string& text) {
  const size_t line_end = head.find("\r\n");
  const std::string line = head.substr(0, line_end);
  const size_t space = line.find(' '), space2 = line.find(' ', space + 1);
  const std::string method = line.substr(0, space);
  const std::string target = space == std::string::npos ? "" : line.substr(space + 1, space2 - space - 1);
  const std::string path = target.substr(0, target.find('?'));
  const auto reply = [](const char* status, const std::string& type, const std::string& body, bool with_body,
                        const char* extra = "") {
    return fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n{}",
                       status, type, body.size(), extra, with_body ? body : "");
  };
  if (method != "GET" && method != "HEAD")
    return reply("405 Method Not Allowed", "text/plain", "GET or HEAD /metrics\n", true, "Allow: GET, HEAD\r\n");
  if (path != "/metrics") return reply("404 Not Found", "text/plain", "GET /metrics\n", method == "GET");
  return reply("200 OK", "text/plain; version=0.0.4; charset=utf-8", text, method == "GET");
}

void close_quietly(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace

struct PrometheusEndpoint::Server {
  int listener = -1;
  int wake[2] = {-1, -1};  // a pipe: a byte written ends the loop at once
  std::thread thread;
  std::mutex mutex;
  std::string text;  // the latest record's exposition
  PrometheusLabels labels;
  int64_t port = 0;

  ~Server() {
    close_quietly(listener);
    close_quietly(wake[0]);
    close_quietly(wake[1]);
  }

  void serve();
};

// One thread, one poll loop over the listener, the wake pipe and at most kMaxConnections connections, each with
// its own deadline: a slow or idle client costs one slot for kConnectionTime, never a thread or unbounded memory.
void PrometheusEndpoint::Server::serve() {
  std::vector<Connection> connections;
  struct CloseAll {  // whatever ends the loop
    std::vector<Connection>& connections;
    ~CloseAll() {
      for (const Connection& c : connections) close_quietly(c.fd);
    }
  } close_all{connections};
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    for (Connection& c : connections)
      if (now >= c.deadline) c.fd = (close_quietly(c.fd), -1);
    connections.erase(std::remove_if(connections.begin(), connections.end(), [](const Connection& c) { return c.fd < 0; }),
                      connections.end());
    std::vector<pollfd> polled = {{wake[0], POLLIN, 0}};
    if (connections.size() < kMaxConnections) polled.push_back({listener, POLLIN, 0});
    auto next = now + std::chrono::seconds(1);
    for (const Connection& c : connections) {
      polled.push_back({c.fd, static_cast<short>(c.response.empty() ? POLLIN : POLLOUT), 0});
      next = std::min(next, c.deadline);
    }
    const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    if (::poll(polled.data(), polled.size(), static_cast<int>(wait_ms)) < 0 && errno != EINTR) return;
    if (polled[0].revents != 0) return;  // close()
    for (size_t i = 1; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      if (polled[i].fd == listener) {
        const int fd = ::accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) connections.push_back({fd, std::chrono::steady_clock::now() + kConnectionTime, {}, {}, 0});
        continue;
      }
      auto c = std::find_if(connections.begin(), connections.end(), [&](const Connection& x) { return x.fd == polled[i].fd; });
      if (c == connections.end()) continue;
      if (c->response.empty()) {  // reading the head
        char buffer[2048];
        const ssize_t n = ::recv(c->fd, buffer, sizeof buffer, 0);
        if (n <= 0) {
          if (n == 0 || (errno != EAGAIN && errno != EINTR)) c->fd = (close_quietly(c->fd), -1);
          continue;
        }
        c->request.append(buffer, static_cast<size_t>(n));
        const size_t end = c->request.find("\r\n\r\n");
        if (end != std::string::npos) {
          std::lock_guard<std::mutex> lock(mutex);
          c->response = respond(c->request.substr(0, end), text);
        } else if (c->request.size() > kMaxRequestBytes) {
          c->response = "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        }
        if (!c->response.empty()) c->request.clear();
      } else {  // writing the response; MSG_NOSIGNAL: a client that hung up is no SIGPIPE
        const ssize_t n = ::send(c->fd, c->response.data() + c->sent, c->response.size() - c->sent,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) c->sent += static_cast<size_t>(n);
        if ((n < 0 && errno != EAGAIN && errno != EINTR) || c->sent == c->response.size())
          c->fd = (close_quietly(c->fd), -1);
      }
    }
  }
}

PrometheusEndpoint::PrometheusEndpoint(const std::string& address, int64_t port, PrometheusLabels labels)
    : server_(std::make_unique<Server>()) {
  TORCH_CHECK_VALUE(port >= 0 && port <= 65535, "MetricsRecorder: prometheus_port ", port,
                    " is not accepted; accepted: 0 (a free port) to 65535, or -1 for no endpoint");
  Server& s = *server_;
  s.labels = std::move(labels);
  const auto refuse = [&](const std::string& why) {
    TORCH_CHECK_VALUE(false, "MetricsRecorder: prometheus endpoint ", address, ":", port, " cannot be bound (", why,
                      "); accepted: a free port on an address of this host (default 127.0.0.1)");
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found); rc != 0) refuse(gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
  s.listener = ::socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.listener < 0) refuse(std::strerror(errno));
  // SO_REUSEADDR only (a restarted job rebinds its port at once); never SO_REUSEPORT, which would let a second
  // server share a port in use silently.
  int yes = 1;
  ::setsockopt(s.listener, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  if (::bind(s.listener, found->ai_addr, found->ai_addrlen) != 0 || ::listen(s.listener, kBacklog) != 0)
    refuse(errno == EADDRINUSE ? "the port is in use" : std::strerror(errno));
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(s.listener, reinterpret_cast<sockaddr*>(&bound), &length);
  s.port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  TORCH_CHECK(::pipe2(s.wake, O_CLOEXEC | O_NONBLOCK) == 0, "MetricsRecorder: cannot make the endpoint's pipe: ",
              std::strerror(errno));
  s.thread = std::thread([&s] {
    try {
      s.serve();
    } catch (const std::exception& e) {  // never into std::terminate: the training goes on without the endpoint
      std::fprintf(stderr, "gpuops MetricsRecorder: the Prometheus endpoint stopped: %s\n", e.what());
    }
  });
}

PrometheusEndpoint::~PrometheusEndpoint() {
  const char stop = 1;
  [[maybe_unused]] const ssize_t woken = ::write(server_->wake[1], &stop, 1);  // the loop returns at once
  if (server_->thread.joinable()) server_->thread.join();
}

int64_t PrometheusEndpoint::port() const { return server_->port; }

void PrometheusEndpoint::publish(const Record& record) {
  std::string text = prometheus_text(record, server_->labels);
  std::lock_guard<std::mutex> lock(server_->mutex);
  server_->text = std::move(text);
}

}  // namespace gpuops::telemetry::detail

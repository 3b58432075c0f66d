#include "text_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "../common/file_checks.h"
#include "gpuops/errors.h"

namespace gpuops::estimator {

std::string read_text_file(const std::string& path, const TextFileKind& k) {
  // Refused before it is opened for reading: a NUL byte (C would open another file), a FIFO (it blocks forever),
  // a directory (it reads as nothing), a device (endless bytes).
  const std::string problem = detail::readable_file_problem(path);
  const size_t nul = path.find('\0');
  const std::string shown = nul == std::string::npos ? path : path.substr(0, nul) + "\\0...";
  GPUOPS_CHECK_ARG(problem != "is a directory", "{} '{}' is a directory; give the path of its {} file", k.label, shown,
                   k.kind);
  GPUOPS_CHECK_ARG(problem.empty(), "{} '{}' {}; {}", k.label, shown, problem, k.hint);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  GPUOPS_CHECK_ARG(fd >= 0, "{} '{}' cannot be read ({}); {}", k.label, path, std::strerror(errno), k.hint);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  GPUOPS_CHECK_ARG(::fstat(fd, &st) == 0, "{} '{}' cannot be read ({}); {}", k.label, path, std::strerror(errno),
                   k.hint);
  GPUOPS_CHECK_ARG(st.st_size <= k.max_bytes, "{} '{}' is {} bytes; accepted: a {} of at most {} bytes", k.label, path,
                   static_cast<int64_t>(st.st_size), k.kind, k.max_bytes);
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    GPUOPS_CHECK_ARG(n >= 0, "{} '{}' cannot be read ({}); {}", k.label, path, std::strerror(errno), k.hint);
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    GPUOPS_CHECK_ARG(static_cast<int64_t>(text.size()) <= k.max_bytes,
                     "{} '{}' is larger than {} bytes; accepted: a {} of at most that", k.label, path, k.max_bytes,
                     k.kind);
  }
  return text;
}

}  // namespace gpuops::estimator

#include "file_checks.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace gpuops::detail {

std::string path_problem(const std::string& path) {
  return path.find('\0') == std::string::npos ? "" : "holds a NUL byte";
}

std::string readable_file_problem(const std::string& path) {
  if (std::string p = path_problem(path); !p.empty()) return p;
  // Opened without blocking: a FIFO would block the open (or the read) forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::string("cannot be read (") + std::strerror(errno) + ")";
  struct stat st {};
  const int stat_result = ::fstat(fd, &st);
  const int stat_errno = errno;
  ::close(fd);
  if (stat_result != 0) return std::string("cannot be read (") + std::strerror(stat_errno) + ")";
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (!S_ISREG(st.st_mode)) return "is not a regular file (a FIFO, socket or device)";
  return "";
}

}  // namespace gpuops::detail

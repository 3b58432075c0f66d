#include "archive_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

namespace gpuops::detail {

void save_archive(torch::serialize::OutputArchive& archive, const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", path, ": ", std::strerror(errno));
  int error = 0;
  try {
    archive.save_to([&](const void* data, size_t n) -> size_t {
      const char* bytes = static_cast<const char*>(data);
      for (size_t done = 0; error == 0 && done < n;) {
        const ssize_t written = ::write(fd, bytes + done, n - done);
        if (written < 0 && errno == EINTR) continue;
        if (written <= 0) error = written < 0 ? errno : ENOSPC;
        else done += static_cast<size_t>(written);
      }
      return n;  // never a short count: torch's writer would throw, then throw again while unwinding
    });
  } catch (...) {  // the archive itself failed (not the disk): nothing half-written stays
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error != 0) {
    ::unlink(path.c_str());
    TORCH_CHECK(false, "cannot write ", path, ": ", std::strerror(error));
  }
}

}  // namespace gpuops::detail

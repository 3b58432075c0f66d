// posix_files.h: POSIX durability (fsync + rename) and OpenSSL's SHA-256.
#include "posix_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>

#include <openssl/evp.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace gpuops::detail {

std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string join_path(const std::string& directory, const std::string& name) {
  return directory.empty() || directory.back() == '/' ? directory + name : directory + "/" + name;
}

void make_directories(const std::string& path) {
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST)
      TORCH_CHECK_VALUE(false, "cannot create the folder '", prefix, "': ", std::strerror(errno));
    if (end == std::string::npos) break;
  }
  struct stat info {};
  TORCH_CHECK_VALUE(::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode), "'", path, "' is not a folder");
}

std::vector<std::string> list_folder(const std::string& path) {
  std::vector<std::string> names;
  std::unique_ptr<DIR, int (*)(DIR*)> folder(::opendir(path.c_str()), ::closedir);
  if (!folder) return names;
  while (const dirent* entry = ::readdir(folder.get())) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  return names;
}

int64_t file_size(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 ? static_cast<int64_t>(info.st_size) : -1;
}

void remove_file(const std::string& path) { ::unlink(path.c_str()); }

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "cannot open ", path, " to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of ", path, " failed: ", std::strerror(error));
}

void commit_file(const std::string& tmp_path, const std::string& path) {
  TORCH_CHECK(::rename(tmp_path.c_str(), path.c_str()) == 0, "cannot rename ", tmp_path, " to ", path, ": ",
              std::strerror(errno));
  fsync_path(parent_of(path));
}

namespace {
// This host and this process, as temporary names carry them: two writers never pick the same name (two hosts
// on a shared filesystem, two containers whose processes have the same PID), and a sweep can tell a dead
// writer's leftovers from a live writer's save in progress.
uint32_t fnv32(const std::string& bytes) {
  uint32_t h = 2166136261u;
  for (const unsigned char c : bytes) h = (h ^ c) * 16777619u;
  return h;
}
std::string host_id() {
  static const std::string id = [] {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return fmt::format("{:08x}", fnv32(name));
  }();
  return id;
}
std::string process_nonce() {
  static const std::string nonce = fmt::format("{:08x}", std::random_device{}());
  return nonce;
}
constexpr const char* kTagVersion = "v2-";
}  // namespace

std::string temporary_tag() {
  static std::atomic<int64_t> counter{0};
  return fmt::format("{}{}-{}-{}-{}", kTagVersion, host_id(), ::getpid(), process_nonce(), counter++);
}

bool temporary_is_stale(const std::string& path, const std::string& name, int64_t max_age_s) {
  const auto at = name.find(".tmp-");
  if (at == std::string::npos) return false;
  std::string rest = name.substr(at + 5);
  if (rest.rfind(kTagVersion, 0) == 0) {
    rest = rest.substr(std::string(kTagVersion).size());
    char host[9] = {}, nonce[9] = {};
    long pid = 0;
    if (std::sscanf(rest.c_str(), "%8[0-9a-f]-%ld-%8[0-9a-f]-", host, &pid, nonce) == 3 && host_id() == host &&
        pid > 0) {
      if (pid == ::getpid()) return process_nonce() != nonce;  // ours: in progress; an earlier process's: left over
      return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;  // its writer is gone
    }
  }
  // Another host's (or an older gpuops'): left over once nothing touched it for max_age_s.
  struct stat info {};
  return ::lstat(path.c_str(), &info) == 0 && std::time(nullptr) - info.st_mtime > max_age_s;
}

std::string temporary_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return join_path(parent_of(path), "." + name + ".tmp-" + temporary_tag());
}

void write_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = temporary_name(path);
  try {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
    size_t written = 0;
    int error = 0;
    while (written < data.size() && error == 0) {
      const ssize_t n = ::write(fd, data.data() + written, data.size() - written);
      if (n < 0 && errno != EINTR) error = errno;
      if (n > 0) written += static_cast<size_t>(n);
    }
    if (error == 0 && ::fsync(fd) != 0) error = errno;
    if (::close(fd) != 0 && error == 0) error = errno;
    TORCH_CHECK(error == 0, "cannot write ", tmp, ": ", std::strerror(error));
    commit_file(tmp, path);
  } catch (...) {
    remove_file(tmp);  // a failed write leaves nothing behind
    throw;
  }
}

PathKind path_kind(const std::string& path) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) return {};
  PathKind kind;
  kind.exists = true;
  kind.regular = S_ISREG(info.st_mode);
  kind.folder = S_ISDIR(info.st_mode);
  kind.bytes = static_cast<int64_t>(info.st_size);
  return kind;
}

std::string read_small_file(const std::string& path, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot read ", path, ": ", std::strerror(errno));
  std::string data;
  struct stat info {};
  const bool regular = ::fstat(fd, &info) == 0 && S_ISREG(info.st_mode);
  if (regular && info.st_size <= max_bytes) {
    data.resize(static_cast<size_t>(info.st_size));
    size_t got = 0;
    while (got < data.size()) {
      const ssize_t n = ::read(fd, data.data() + got, data.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    data.resize(got);
  }
  ::close(fd);
  TORCH_CHECK(regular, path, " is not a regular file");
  TORCH_CHECK(info.st_size <= max_bytes, path, " has ", info.st_size, " bytes, more than the ", max_bytes, " expected");
  return data;
}

void remove_folder(const std::string& path) {
  for (const std::string& name : list_folder(path)) ::unlink(join_path(path, name).c_str());
  ::rmdir(path.c_str());
}

std::string sha256_of_file(const std::string& path) {
  // No links, and a FIFO or device must not block or stream forever: open without following or waiting,
  // then insist on a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot read ", path, ": ", std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* f) {
    ::close(*f);
    delete f;
  });
  struct stat info {};
  TORCH_CHECK(::fstat(fd, &info) == 0 && S_ISREG(info.st_mode), path, " is not a regular file");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  TORCH_CHECK(context && EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) == 1, "SHA-256 unavailable");
  std::string block(1 << 20, '\0');
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "cannot read ", path, ": ", std::strerror(errno));
    if (n == 0) break;
    EVP_DigestUpdate(context.get(), block.data(), static_cast<size_t>(n));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(context.get(), digest, &length);
  std::string hex;
  char byte[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(byte, sizeof byte, "%02x", digest[i]);
    hex += byte;
  }
  return hex;
}

}  // namespace gpuops::detail

// posix_files.h: POSIX durability (fsync + rename) and OpenSSL's SHA-256.
#include "posix_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include <openssl/evp.h>

#include <c10/util/Exception.h>

namespace gpuops::detail {
namespace {

std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

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

std::string temporary_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  return join_path(parent_of(path), "." + name + ".tmp-" + std::to_string(::getpid()));
}

void write_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = temporary_name(path);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    TORCH_CHECK(out.good(), "cannot write ", tmp);
  }
  fsync_path(tmp);
  commit_file(tmp, path);
}

std::string sha256_of_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot read ", path);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  TORCH_CHECK(context && EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) == 1, "SHA-256 unavailable");
  std::string block(1 << 20, '\0');
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    EVP_DigestUpdate(context.get(), block.data(), static_cast<size_t>(in.gcount()));
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

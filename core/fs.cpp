#include "core/fs.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace lar {

static std::string errno_str() { return std::strerror(errno); }

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some filesystems refuse directory fds
  ::fsync(fd);
  ::close(fd);
}

void atomic_write(const fs::path& path, std::string_view content) {
  fs::path dir = path.parent_path();
  if (!dir.empty()) fs::create_directories(dir);
  std::string tmpl = (dir / ("." + path.filename().string() + ".tmpXXXXXX")).string();
  int fd = ::mkstemp(tmpl.data());
  if (fd < 0) throw RuntimeError("cannot create a temporary file beside " + path.string() + ": " + errno_str());
  size_t off = 0;
  while (off < content.size()) {
    ssize_t n = ::write(fd, content.data() + off, content.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::string e = errno_str();
      ::close(fd);
      ::unlink(tmpl.c_str());
      throw RuntimeError("cannot write " + path.string() + ": " + e);
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    std::string e = errno_str();
    ::unlink(tmpl.c_str());
    throw RuntimeError("cannot flush " + path.string() + ": " + e);
  }
  ::chmod(tmpl.c_str(), 0644);
  if (::rename(tmpl.c_str(), path.c_str()) != 0) {
    std::string e = errno_str();
    ::unlink(tmpl.c_str());
    throw RuntimeError("cannot rename into " + path.string() + ": " + e);
  }
  fsync_dir(dir);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RuntimeError("cannot read " + path.string() + ": " + errno_str());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace lar

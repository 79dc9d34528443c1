#include "dist/id_exchange.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

#include "core/error.hpp"
#include "core/fs.hpp"

namespace lar::dist {

namespace fs = std::filesystem;

namespace {
std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", s);
  return b;
}
}  // namespace

fs::path id_file_path(const fs::path& run_dir, const std::string& token) {
  return run_dir / "dist" / ("nccl-id." + token);
}

void publish_id(const fs::path& file, const std::string& bytes) {
  fs::create_directories(file.parent_path());
  atomic_write(file, bytes);
}

std::string wait_for_id(const fs::path& file, std::size_t size, double timeout_s, double poll_s) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::error_code ec;
    if (fs::exists(file, ec)) {
      std::string bytes = read_file(file);
      if (bytes.size() != size)
        throw RuntimeError(file.string() + ": holds " + std::to_string(bytes.size()) + " bytes, an NCCL id has " +
                           std::to_string(size));
      return bytes;
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited >= timeout_s)
      throw RuntimeError("no NCCL id from rank 0 after " + seconds(timeout_s) + " s (" +
                         file.string() + "): is rank 0 running on the same run directory in the same launch?");
    std::this_thread::sleep_for(std::chrono::duration<double>(poll_s));
  }
}

}  // namespace lar::dist

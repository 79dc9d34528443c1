#pragma once
// The NCCL unique id (128 opaque bytes) travels from rank 0 to the others through a file
// in the run directory, which every rank sees (one host, or a shared filesystem under
// Slurm): rank 0 writes it atomically (temp file + rename, so a reader never sees half of
// it), the others poll for it with a timeout. The file name carries the launch's token so
// that an id left behind by an earlier launch is never read. docs/distributed.md also
// describes the TCP alternative (no shared filesystem).
#include <filesystem>
#include <string>

namespace lar::dist {

// <run_dir>/dist/nccl-id.<token>
std::filesystem::path id_file_path(const std::filesystem::path& run_dir, const std::string& token);

// Rank 0: write `bytes` to `file` atomically (creating its folder).
void publish_id(const std::filesystem::path& file, const std::string& bytes);

// The other ranks: wait until `file` exists and read it. Throws lar::RuntimeError naming
// the file when it has not appeared after timeout_s, or holds other than `size` bytes.
std::string wait_for_id(const std::filesystem::path& file, std::size_t size, double timeout_s,
                        double poll_s = 0.05);

}  // namespace lar::dist

#pragma once
#include <filesystem>
#include <string>
#include <string_view>

namespace lar {
namespace fs = std::filesystem;

// Write `content` to `path` atomically: temp file in the same folder, fsync, rename,
// fsync the folder. A reader sees the old file or the new one, never a torn one.
void atomic_write(const fs::path& path, std::string_view content);

// The whole file; throws RuntimeError naming the path when it cannot be read.
std::string read_file(const fs::path& path);

// fsync a folder so that a rename inside it survives a crash.
void fsync_dir(const fs::path& dir);
}  // namespace lar

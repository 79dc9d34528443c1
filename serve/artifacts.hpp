#pragma once
// Run artifacts (config.json, status.json, metrics.jsonl, log.txt, …) served only from
// inside a registered run directory. A request names a path relative to the run
// directory; it is rejected before touching the disk when it is absolute or has '.',
// '..' or empty components (400), and after canonicalisation (symlinks resolved) when it
// lands outside the directory (403). Files are bounded in size (413).
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace lar::serve {

namespace fs = std::filesystem;

inline constexpr std::uintmax_t kMaxArtifactBytes = 64ull << 20;

struct Artifact {
  fs::path path;             // canonical, inside the run directory
  std::uintmax_t bytes = 0;
  std::string content_type;  // text/plain for text formats (never text/html), else octet-stream
  bool attachment = false;   // binary files download instead of displaying
};

// Throws HttpError (400/403/404/413) as described above.
Artifact resolve_artifact(const fs::path& run_dir, const std::string& relative);

struct ArtifactEntry {
  std::string relative;  // "metrics.jsonl", "checkpoints/step_00000100.ckpt"
  std::uintmax_t bytes = 0;
};

// Regular files at the top of the run directory and in its checkpoints/ folder (at most
// `max_entries`, sorted); [] when the directory is gone.
std::vector<ArtifactEntry> list_artifacts(const fs::path& run_dir, size_t max_entries = 200);

}  // namespace lar::serve

#include "serve/artifacts.hpp"

#include <algorithm>
#include <system_error>

#include "serve/http_error.hpp"

namespace lar::serve {

namespace {

std::string content_type_of(const fs::path& p, bool& attachment) {
  static const std::vector<std::string> text = {".json", ".jsonl", ".txt", ".log", ".tsv", ".csv", ".yaml", ".yml",
                                                ".sbatch", ".md", ""};
  const std::string ext = p.extension().string();
  attachment = std::find(text.begin(), text.end(), ext) == text.end();
  // Text is always text/plain: a log line holding markup must not become a page.
  return attachment ? "application/octet-stream" : "text/plain; charset=utf-8";
}

bool inside(const fs::path& root, const fs::path& p) {
  auto [r, q] = std::mismatch(root.begin(), root.end(), p.begin(), p.end());
  return r == root.end() && q != p.end();
}

}  // namespace

Artifact resolve_artifact(const fs::path& run_dir, const std::string& rel) {
  if (rel.empty() || rel.size() > 512 || rel.find('\0') != std::string::npos || rel.find('\\') != std::string::npos)
    throw HttpError(400, "bad artifact path");
  const fs::path rp(rel);
  if (rp.is_absolute()) throw HttpError(400, "bad artifact path: absolute");
  for (const auto& part : rp)
    if (part.empty() || part == "." || part == "..") throw HttpError(400, "bad artifact path: '.', '..' or empty component");
  std::error_code ec;
  const fs::path root = fs::canonical(run_dir, ec);
  if (ec || run_dir.empty()) throw HttpError(404, "the run directory is not on this machine");
  const fs::path target = fs::canonical(root / rp, ec);
  if (ec) throw HttpError(404, "no such artifact");
  // A symlink inside the run directory may point anywhere: check where it landed.
  if (!inside(root, target)) throw HttpError(403, "artifact outside the run directory");
  if (!fs::is_regular_file(target, ec)) throw HttpError(404, "not a file");
  Artifact a;
  a.path = target;
  a.bytes = fs::file_size(target, ec);
  if (ec) throw HttpError(404, "cannot read artifact");
  if (a.bytes > kMaxArtifactBytes) throw HttpError(413, "artifact larger than 64 MiB");
  a.content_type = content_type_of(target, a.attachment);
  return a;
}

std::vector<ArtifactEntry> list_artifacts(const fs::path& run_dir, size_t max_entries) {
  std::vector<ArtifactEntry> out;
  std::error_code ec;
  if (run_dir.empty() || !fs::is_directory(run_dir, ec)) return out;
  auto scan = [&](const fs::path& dir, const std::string& prefix) {
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end && out.size() < max_entries; it.increment(ec)) {
      std::error_code e2;
      if (it->is_regular_file(e2)) out.push_back({prefix + it->path().filename().string(), it->file_size(e2)});
    }
  };
  scan(run_dir, "");
  if (fs::is_directory(run_dir / "checkpoints", ec)) scan(run_dir / "checkpoints", "checkpoints/");
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.relative < b.relative; });
  return out;
}

}  // namespace lar::serve

#include "registry/report/bundle.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "registry/registry.hpp"
#include "registry/report/process.hpp"

namespace lar::report {

namespace {

// A scratch folder removed when it goes out of scope.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    path = fs::temp_directory_path() / ("lar-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(now));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// Copy a run folder, leaving out its checkpoints (the bulk of it, and machine-local).
void copy_run(const fs::path& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) {
    const std::string name = e.path().filename().string();
    if (name == "checkpoints") continue;
    if (e.is_directory()) fs::copy(e.path(), to / name, fs::copy_options::recursive);
    else if (e.is_regular_file()) fs::copy_file(e.path(), to / name);
  }
}

bool is_run_dir(const fs::path& p) { return fs::is_directory(p) && fs::is_regular_file(p / "config.json"); }

void check_tar(const ProcessResult& r, const std::string& what) {
  if (r.rc == 127) throw RuntimeError(what + ": the tar command is not installed (apt-get install tar)");
  if (r.rc != 0) throw RuntimeError(what + " failed (tar exit " + std::to_string(r.rc) + "): " + r.output);
}

}  // namespace

BundleSummary export_bundle(const std::string& experiment, const fs::path& runs_root, const fs::path& file,
                            const json& meta) {
  BundleSummary s;
  s.experiment = experiment;
  const fs::path src = runs_root / experiment;
  if (!fs::is_directory(src)) throw UserError("no run folders for experiment '" + experiment + "' under " + runs_root.string());
  TempDir tmp("bundle");
  const fs::path stage = tmp.path / "stage";
  const fs::path runs = stage / "runs" / experiment;
  std::vector<fs::path> cells;
  for (const auto& e : fs::directory_iterator(src))
    if (is_run_dir(e.path())) cells.push_back(e.path());
  std::sort(cells.begin(), cells.end());
  if (cells.empty()) throw UserError("experiment '" + experiment + "' has no run folders under " + src.string());
  for (const auto& c : cells) {
    copy_run(c, runs / c.filename());
    s.cells.push_back(c.filename().string());
  }
  {
    auto reg = registry::Registry::open(stage / "lar.db");
    reg.sync(stage / "runs");
  }
  json manifest = meta.is_object() ? meta : json::object();
  manifest["format"] = "lar-bundle";
  manifest["version"] = 1;
  manifest["experiment"] = experiment;
  manifest["runs"] = s.cells;
  manifest["created_at"] = static_cast<double>(std::chrono::duration_cast<std::chrono::seconds>(
                                                   std::chrono::system_clock::now().time_since_epoch())
                                                   .count());
  atomic_write(stage / "bundle.json", manifest.dump(2) + "\n");
  // Leave no SQLite side files behind (the registry is closed above).
  for (const char* side : {"lar.db-wal", "lar.db-shm", "lar.db-journal"}) fs::remove(stage / side);

  const fs::path out = fs::absolute(file);
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  const fs::path part = out.string() + ".part";
  check_tar(run_program({"tar", "-czf", part.string(), "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "-C",
                         stage.string(), "bundle.json", "lar.db", "runs"}),
            "writing " + out.string());
  fs::rename(part, out);
  s.bytes = static_cast<long>(fs::file_size(out));
  return s;
}

BundleSummary import_bundle(const fs::path& file, const fs::path& runs_root, const fs::path& db, bool replace) {
  if (!fs::is_regular_file(file)) throw UserError("no such bundle '" + file.string() + "'");
  // Every member must stay inside the extraction folder.
  const ProcessResult list = run_program({"tar", "-tzf", file.string()});
  if (list.rc == 127) check_tar(list, "reading " + file.string());
  if (list.rc != 0) throw UserError(file.string() + ": not a .tar.gz bundle (" + list.output.substr(0, 200) + ")");
  size_t start = 0;
  bool has_manifest = false;
  while (start < list.output.size()) {
    size_t end = list.output.find('\n', start);
    if (end == std::string::npos) end = list.output.size();
    const std::string name = list.output.substr(start, end - start);
    start = end + 1;
    if (name.empty()) continue;
    if (name[0] == '/' || name == ".." || name.rfind("../", 0) == 0 || name.find("/../") != std::string::npos ||
        (name.size() >= 3 && name.compare(name.size() - 3, 3, "/..") == 0))
      throw UserError(file.string() + ": refusing a member outside the bundle: '" + name + "'");
    has_manifest |= name == "bundle.json" || name == "./bundle.json";
  }
  if (!has_manifest) throw UserError(file.string() + ": not a lar bundle (no bundle.json)");
  TempDir tmp("import");
  check_tar(run_program({"tar", "-xzf", file.string(), "--no-same-owner", "--no-same-permissions", "-C", tmp.path.string()}),
            "unpacking " + file.string());
  json manifest;
  try {
    manifest = json::parse(read_file(tmp.path / "bundle.json"));
  } catch (const json::exception& e) {
    throw UserError(file.string() + ": bundle.json is not JSON: " + e.what());
  }
  if (manifest.value("format", std::string()) != "lar-bundle")
    throw UserError(file.string() + ": bundle.json is not a lar bundle manifest");
  if (manifest.value("version", 0) != 1)
    throw UserError(file.string() + ": bundle version " + manifest.value("version", json()).dump() + " (this lar reads 1)");
  BundleSummary s;
  s.experiment = manifest.value("experiment", std::string());
  if (s.experiment.empty() || s.experiment.find('/') != std::string::npos || s.experiment[0] == '.')
    throw UserError(file.string() + ": bad experiment name in bundle.json");
  const fs::path src = tmp.path / "runs" / s.experiment;
  if (!fs::is_directory(src)) throw UserError(file.string() + ": no runs/" + s.experiment + "/ in the bundle");
  std::vector<fs::path> cells;
  for (const auto& e : fs::directory_iterator(src))
    if (is_run_dir(e.path())) cells.push_back(e.path());
  std::sort(cells.begin(), cells.end());
  for (const auto& c : cells) {
    const fs::path dest = runs_root / s.experiment / c.filename();
    if (fs::exists(dest)) {
      if (!replace) {
        s.kept.push_back(c.filename().string());
        continue;
      }
      fs::remove_all(dest);
    }
    fs::create_directories(dest.parent_path());
    fs::copy(c, dest, fs::copy_options::recursive);
    s.cells.push_back(c.filename().string());
  }
  auto reg = registry::Registry::open(db);
  reg.sync(runs_root);
  return s;
}

}  // namespace lar::report

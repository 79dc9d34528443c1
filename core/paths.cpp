#include "core/paths.hpp"

#include "core/env.hpp"

namespace lar {

static std::filesystem::path env_or(const char* name, const std::filesystem::path& dflt) {
  const auto v = env_string(name);
  return v ? std::filesystem::path(*v) : dflt;
}

std::filesystem::path lar_home() { return env_or("LAR_HOME", "."); }
std::filesystem::path default_db_path() { return env_or("LAR_DB", lar_home() / "lar.db"); }
std::filesystem::path runs_root() { return lar_home() / "runs"; }
std::filesystem::path data_root() { return env_or("LAR_DATA", lar_home() / "data"); }
std::filesystem::path run_dir_for(const std::string& experiment, const std::string& cell_id) {
  return runs_root() / experiment / cell_id;
}

}  // namespace lar

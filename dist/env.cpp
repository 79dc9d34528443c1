#include "dist/env.hpp"

#include <cctype>
#include <cstdlib>

#include "core/env.hpp"
#include "core/error.hpp"

namespace lar::dist {

namespace {

int parse_int(const char* name, const char* value) {
  std::string v = value ? value : "";
  std::size_t pos = 0;
  long n = 0;
  try {
    n = std::stol(v, &pos);
  } catch (...) {
    pos = 0;
  }
  if (v.empty() || pos != v.size() || n < 0 || n > 1000000)
    throw UserError(std::string(name) + "='" + v + "': expected a non-negative integer");
  return static_cast<int>(n);
}

// Token characters that are safe in a file name.
std::string clean_token(const std::string& t) {
  std::string out;
  for (char c : t) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_') ? c : '_';
  return out;
}

}  // namespace

DistEnv dist_env(const EnvLookup& get) {
  DistEnv e;
  auto has = [&](const char* n) { const char* v = get(n); return v && *v; };
  const char *rank_var = nullptr, *world_var = nullptr, *local_var = nullptr;
  if (has("LAR_WORLD_SIZE")) {
    e.source = "lar";
    rank_var = "LAR_RANK", world_var = "LAR_WORLD_SIZE", local_var = "LAR_LOCAL_RANK";
    if (!has("LAR_RANK")) throw UserError("LAR_WORLD_SIZE is set but LAR_RANK is not");
    e.token = has("LAR_DIST_TOKEN") ? get("LAR_DIST_TOKEN") : "lar";
  } else if (has("SLURM_NTASKS") && (has("SLURM_STEP_ID") || has("SLURM_STEPID"))) {
    e.source = "slurm";
    rank_var = "SLURM_PROCID", world_var = "SLURM_NTASKS", local_var = "SLURM_LOCALID";
    if (!has("SLURM_PROCID")) throw UserError("SLURM_NTASKS is set but SLURM_PROCID is not");
    const char* step = has("SLURM_STEP_ID") ? get("SLURM_STEP_ID") : get("SLURM_STEPID");
    e.token = std::string("slurm-") + (has("SLURM_JOB_ID") ? get("SLURM_JOB_ID") : "job") + "." + step;
    if (has("SLURM_RESTART_COUNT")) e.token += std::string(".r") + get("SLURM_RESTART_COUNT");
  } else {
    return e;
  }
  e.world = parse_int(world_var, get(world_var));
  e.rank = parse_int(rank_var, get(rank_var));
  e.local_rank = has(local_var) ? parse_int(local_var, get(local_var)) : e.rank;
  if (e.world < 1) throw UserError(std::string(world_var) + "=0: the world has at least one rank");
  if (e.rank >= e.world)
    throw UserError(std::string(rank_var) + "=" + std::to_string(e.rank) + " is not below " + world_var + "=" +
                    std::to_string(e.world));
  e.token = clean_token(e.token);
  return e;
}

DistEnv dist_env() {
  return dist_env([](const char* n) { return static_cast<const char*>(std::getenv(n)); });
}

double dist_timeout_s() { return env_number("LAR_DIST_TIMEOUT", 40, "seconds"); }

}  // namespace lar::dist

#pragma once
// A Cell is one run of an experiment matrix: the unit the runner launches and the
// registry records. Produced by experiments/ (expand), consumed by runner/ and cli/.
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/json.hpp"
#include "experiments/claims.hpp"

namespace lar::experiments {

struct Cell {
  std::string experiment;   // spec name
  std::string id;           // human id from axis values, e.g. "gdn.muon.hybrid.lr3e-4.s0"
  std::string hash;         // SHA-256 (64 hex) of canonical_dump(config)
  std::vector<std::pair<std::string, json>> axes;  // axis name → value, in axis order
  json config;              // fully resolved run config (with schema defaults)
  std::string role = "main";            // main | exploratory
  std::optional<std::string> baseline;  // id of the matched-baseline cell, if any
  json reference;           // published values for this cell ({"metric": value, ...}) or null

  std::string short_hash() const { return hash.substr(0, 12); }
  // The content of the run directory's config.json (docs/protocol.md).
  json run_config_json() const;
};

struct Plan {
  std::string experiment;
  std::string scale;                   // "" when the spec has no scales
  std::filesystem::path spec_path;
  std::vector<Cell> cells;
  std::vector<std::string> warnings;   // e.g. an exclude that matched nothing (file:line:col)
  std::vector<std::string> notes;      // true of this machine, not of the spec (data not prepared here yet)
  json meta;                           // spec-level extras: description, reference source/metrics
  std::vector<Claim> claims;           // the paper's conclusions, audited by registry/report
};

}  // namespace lar::experiments

namespace lar::experiments {
// Parse, validate and expand a spec file at a scale ("" = the spec's default_scale).
// Throws lar::UserError naming file:line:col on any problem; writes nothing.
Plan load_plan(const std::filesystem::path& spec, const std::string& scale);

struct LoadOptions {
  // false: Cell::config stays null (ids, axes, hashes, roles, baselines and reference
  // values are still exact). For tools that only list cells of very large matrices
  // (`lar plan`, `lar-bench plan`): a resolved config costs ~8 KB and ~100 allocations.
  bool configs = true;
  // false: skip the trainer's rules on every cell (trainer/config_check.hpp); only for
  // measuring expansion alone (`lar-bench plan`).
  bool check = true;
  // true: an lm cell whose prepared data is not on this machine is an error (a local
  // launch); false: a warning (planning, dry runs, a cluster's file system).
  bool require_data = false;
};
Plan load_plan(const std::filesystem::path& spec, const std::string& scale, const LoadOptions& options);
}  // namespace lar::experiments

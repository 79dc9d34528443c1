#pragma once
// Where `lar eval` results go (docs/eval.md): scalars into the run's status.json summary
// (so `lar show` lists them and paper-table columns read them by name), one line per
// evaluation into metrics.jsonl (so `lar metrics RUN --name …` has them, at the checkpoint
// step), provenance (file, SHA-256, options) under summary.eval_files, and the registry
// row of the run refreshed when a registry exists.
#include <filesystem>
#include <string>

#include "core/json.hpp"

namespace lar::eval {

struct EvalRecord {
  std::string name;            // task name, or "long_context", "niah", "speed"
  json metrics;                // flat {"<metric key>": number}
  json provenance;             // {"file", "sha256", "kind", …}
};

// The run must not be running (UserError otherwise: the trainer rewrites status.json).
void check_not_running(const std::filesystem::path& run_dir);

// Adds `rec` to the run directory (atomic status.json rewrite, one metrics line).
void record(const std::filesystem::path& run_dir, long checkpoint_step, const EvalRecord& rec);

// `lar sync` of this one run into the registry at `db` (when the file exists). Returns
// false when there is no registry to update.
bool sync_registry(const std::filesystem::path& db, const std::filesystem::path& run_dir);

}  // namespace lar::eval

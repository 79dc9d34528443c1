#pragma once
// Results bundles: one experiment's run folders without their checkpoints, plus a registry
// of exactly those runs, in one .tar.gz (written and read with the `tar` command). What a
// reproduction on a borrowed machine sends home; `import_bundle` puts it back under
// runs/ and ingests it into the local registry.
//
//   bundle.json                 {"format": "lar-bundle", "version": 1, "experiment", "runs": [cell…], …}
//   lar.db                      a registry of the bundled runs (lar runs --db …/lar.db)
//   runs/<experiment>/<cell>/   config.json, status.json, metrics.jsonl, log.txt, … (no checkpoints/)
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.hpp"

namespace lar::report {

namespace fs = std::filesystem;

struct BundleSummary {
  std::string experiment;
  std::vector<std::string> cells;    // bundled (export) or imported (import)
  std::vector<std::string> kept;     // import: cells that exist here already and were kept
  long bytes = 0;                    // export: size of the file
};

// Bundle runs_root/<experiment>/* into `file`. `meta` is merged into bundle.json (table,
// scale, seeds, commit…). Throws UserError when the experiment has no run folders here,
// RuntimeError when tar fails. Writes the file atomically (a temp name, then rename).
BundleSummary export_bundle(const std::string& experiment, const fs::path& runs_root, const fs::path& file,
                            const json& meta = json::object());

// Unpack `file` (checked: a lar bundle, no absolute paths or '..'), copy its run folders
// under runs_root (a folder that exists is kept unless `replace`), sync the registry at db.
BundleSummary import_bundle(const fs::path& file, const fs::path& runs_root, const fs::path& db, bool replace = false);

}  // namespace lar::report

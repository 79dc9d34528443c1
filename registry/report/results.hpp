#pragma once
// The results folder of one reproduced table (`lar reproduce … --report DIR`):
//   README.md        our table beside the paper's (with epochs of the corpus per row), the
//                    claims and their verdicts, links to the rest
//   audit.md/.json   the full audit (which runs count and why, agreement, claims)
//   table.csv        the table for other tools
//   <figure>.svg     the paper's figures drawn from this table's runs (`lar export figure`)
//   provenance.md/.json  the machine and commit the report was made at; per run: host,
//                    backend, steps, tokens, epochs, wall time, attempts
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "registry/report/adapter.hpp"

namespace lar::report {

namespace fs = std::filesystem;

struct ResultsOptions {
  std::string table;       // "laa/table2" (what `lar export figure` is asked for)
  std::string scale;
  int seeds = 0;
  fs::path lar_exe;        // the lar binary that draws the figures; empty: no figures
  std::string command;     // the command line that made the runs, for the README
};

struct ResultsSummary {
  std::vector<fs::path> files;        // written, in order
  std::vector<std::string> warnings;  // a figure that could not be drawn, …
};

// Per-run facts for the provenance (from the registry record and its run folder).
json run_provenance(const registry::RunRecord& rec, const ReportRun* run);

// This machine and source tree: host, GPUs (nvidia-smi), CPU model, lar commit.
json machine_provenance();

ResultsSummary write_results(const PaperReport& p, registry::Registry* reg, const fs::path& dir, const ResultsOptions& o);

}  // namespace lar::report

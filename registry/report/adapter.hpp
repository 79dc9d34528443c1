#pragma once
// The thin layer between the report's plain structs and the real modules: paper specs on
// disk (experiments::load_plan), runs in the SQLite registry (registry::RunRecord).
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "experiments/cell.hpp"
#include "registry/registry.hpp"
#include "registry/report/report.hpp"

namespace lar::report {

namespace fs = std::filesystem;

// Where the paper specs live: $LAR_PAPERS, else experiments/papers next to the binary's
// source tree (../experiments/papers or ../../experiments/papers from the binary), else the
// source tree this binary was built from. Throws RuntimeError when none exists.
fs::path papers_root();

// "laa/table2" → <papers_root>/laa/table2.yaml (a path to a .yaml file is taken as is).
// Throws UserError naming the available tables when it does not exist.
fs::path resolve_paper_spec(const std::string& paper_table);

// Every "<paper>/<table>" under the papers root (common.yaml and notes.yaml are not specs).
std::vector<std::string> list_paper_tables();

// load_plan plus what a reproduction needs:
//  - published values: smaller scales keep the paper's matrix but change numeric axis
//    values (sequence lengths, budgets, widths), so a reference row written for the paper
//    scale matches no cell there; such cells take the reference of the cell at the same
//    position of the paper-scale plan (same categorical axis values);
//  - seeds > 0: every row runs seeds 0..seeds-1 (ids, configs, hashes and baselines follow).
experiments::Plan load_paper_plan(const fs::path& spec, const std::string& scale, int seeds = 0);

// Replace each row's seed list by 0..n-1 (exposed for tests).
experiments::Plan with_seeds(const experiments::Plan& plan, int n);

// The paper's inconsistencies for one table, from <paper dir>/notes.yaml ([] when absent).
std::vector<KnownIssue> load_known_issues(const fs::path& spec);

// Tokens a run config trains: its steps (the trainer's rule: ceil(budget.tokens /
// (batch_size · seq_len)) when budget.tokens > 0, else budget.steps) × batch_size × seq_len.
double planned_tokens(const json& config);

// Train tokens of the LM corpus a config reads (manifest.json's train.tokens; data.path ""
// is the embedded Brown corpus under $LAR_DATA); nullopt for synthetic tasks or data that
// is not prepared here. Cached per folder.
std::optional<double> corpus_train_tokens(const json& config);

ReportCell to_report_cell(const experiments::Cell& c);
// checkpoint_step: the step the final metrics belong to (see make_table_input).
ReportRun to_report_run(const registry::RunRecord& r, std::optional<long> checkpoint_step);

// The cells of the plan joined with every registry run of the experiment. The final
// checkpoint step of a run is summary.checkpoint_step when the trainer records it, else
// the newest checkpoint the registry indexed, else the newest evaluation.
TableInput make_table_input(const experiments::Plan& plan, const fs::path& spec, registry::Registry* reg);

// Same, reading the registry at `db` when it exists (no runs otherwise).
TableInput make_table_input(const experiments::Plan& plan, const fs::path& spec, const fs::path& db);

// The whole pipeline for `lar table` / `lar audit` / `lar export`: resolve the paper
// table, plan it at `scale`, join the registry at `db`, audit.
struct PaperReport {
  fs::path spec;
  experiments::Plan plan;
  TableInput input;
  Report report;
};
PaperReport paper_report(const std::string& paper_table, const std::string& scale, int seeds, const fs::path& db);

}  // namespace lar::report

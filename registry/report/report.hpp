#pragma once
// Audited paper tables. A TableInput is a paper spec's cells (from experiments::load_plan)
// plus the registry's runs of that experiment, as plain structs (adapter.hpp builds them
// from the real modules; tests build them by hand). build_report() decides, for every run,
// whether it counts and why not; aggregates the included runs per table row (all seeds of
// one cell); computes relative throughput, deltas against matched baselines with their
// statistics, and the agreement with the published values.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/json.hpp"
#include "experiments/claims.hpp"
#include "registry/report/claims.hpp"
#include "registry/report/stats.hpp"

namespace lar::report {

// One cell of the paper matrix (mirror of experiments::Cell).
struct ReportCell {
  std::string id;    // e.g. "gdn.muon.hybrid.s0"
  std::string hash;  // config hash (full or a prefix)
  std::vector<std::pair<std::string, json>> axes;
  json config;       // fully resolved run config
  std::string role = "main";
  std::optional<std::string> baseline;  // id of the matched-baseline cell
  json reference;    // published values {"metric": value} or null
  std::optional<double> epochs;  // planned passes over the corpus's train split (LM data)
};

// One recorded run (mirror of the registry's RunRecord, only what the audit needs).
struct ReportRun {
  std::string run_id;
  std::string cell_id;
  std::string hash;            // hash of the config the run trained with
  std::string status;          // pending|running|completed|failed|diverged|preempted|cancelled|timeout
  std::string reason;          // status reason (why it failed / diverged)
  std::string role = "main";
  long step = 0;               // last completed step
  long total_steps = 0;        // planned steps
  std::optional<long> checkpoint_step;  // step the final metrics were measured at (final checkpoint)
  json config;                 // resolved run config
  json summary = json::object();  // final_loss, saturation_loss, tokens_per_s, iter_time_s, …
  double updated_at = 0;       // newest wins among duplicates
  std::optional<double> epochs;  // tokens trained / the corpus's train tokens (LM data)
};

struct KnownIssue {
  std::string where;  // "Table 6", "text p.8"
  std::string text;
};

struct TableInput {
  std::string experiment;
  std::string scale;
  std::string title;        // "LAA Table 2"
  std::string description;
  json source = json::object();  // {paper, arxiv, table, page}
  std::vector<std::string> metrics;  // published columns, in order
  std::vector<ReportCell> cells;     // in plan order
  std::vector<ReportRun> runs;       // every run of the experiment the registry knows
  std::vector<KnownIssue> known_issues;
  std::vector<experiments::Claim> claims;  // the spec's claims, audited into Report::claims
};

// Why a run does not count. Codes are stable (JSON output, tests).
namespace reason {
inline constexpr const char* not_completed = "schedule_not_completed";
inline constexpr const char* diverged = "diverged";
inline constexpr const char* not_final = "not_final_checkpoint";
inline constexpr const char* missing_field = "required_field_missing";
inline constexpr const char* config_differs = "config_differs_from_cell";
inline constexpr const char* superseded = "superseded";
inline constexpr const char* not_in_plan = "not_in_plan";
}  // namespace reason

struct RunVerdict {
  std::string run_id;
  std::string cell_id;
  bool included = false;
  std::string code;    // one of reason::*, "" when included
  std::string reason;  // human sentence
};

struct MetricValue {
  std::vector<double> values;     // one per seed (included runs), in seed order
  std::vector<std::string> run_ids;
  std::vector<std::string> cell_ids;  // the cell of each value (seed alignment)
  SampleStats stats;
  bool proxy = false;             // our value stands in for a different published quantity
  std::string proxy_note;
};

struct Delta {
  bool matched = true;
  std::string mismatch;           // "optimizer.lr: 0.001 vs 0.0003" when not matched
  std::optional<double> ours;     // mean(row) − mean(baseline row)
  std::optional<double> se;       // when both sides have ≥ 2 seeds
  std::optional<WelchResult> test;
  std::optional<double> published;
  int n = 0, n_baseline = 0;
};

struct Row {
  std::string id;                 // cell id without the seed
  std::vector<std::pair<std::string, json>> axes;  // without the seed axis
  std::string role = "main";
  std::vector<std::string> cell_ids;  // one per seed
  std::optional<std::string> baseline_row;
  std::map<std::string, MetricValue> ours;
  std::map<std::string, double> published;
  std::map<std::string, Delta> deltas;  // only for rows with a baseline
  std::string status;              // ok | fail | missing | exploratory
  std::vector<std::string> notes;  // single seed, proxies, missing seeds, unmatched baseline…
  // Passes over the corpus's train split: the most of the included runs, else the plan's.
  std::optional<double> epochs;
  bool epochs_planned = false;     // from the budget (no included run yet)
};

struct MetricAgreement {
  std::string metric;
  int n = 0;                        // rows with both values
  std::optional<double> spearman;
  std::optional<double> kendall;    // τ-b
};

struct SignAgreement {
  std::string metric;
  int n = 0;       // rows with both deltas
  int agree = 0;
};

struct Report {
  std::string experiment, scale, title, description;
  json source;
  std::vector<std::string> metrics;
  std::vector<Row> rows;
  std::vector<RunVerdict> runs;
  std::vector<MetricAgreement> agreement;
  std::vector<SignAgreement> signs;
  std::vector<KnownIssue> known_issues;
  std::vector<ClaimResult> claims;
  std::optional<std::string> throughput_reference;  // row id normalised to 100
  std::map<std::string, int> decimals;              // printing precision per metric
  bool has_deltas() const;
  // Main rows without a complete result: failed (no included run for a seed although its runs
  // ended, or an unmatched baseline), missing (no run yet) or incomplete (runs still unfinished).
  std::vector<std::string> failed_main_rows() const;
  std::vector<std::string> main_rows_with_status(const std::string& status) const;
};

Report build_report(const TableInput& in);

// --- building blocks, exposed for tests and figures -----------------------------------

// The run's config paths that differ from `other`'s, as "path: a vs b" (sorted by path),
// ignoring keys that do not change the math (threads, backend, checkpoint.*, log.*).
std::vector<std::string> config_differences(const json& a, const json& b,
                                            const std::vector<std::string>& ignore_paths = {});

// Verdict for one run against its cell (nullptr: the run's cell is not in the plan).
RunVerdict judge_run(const ReportRun& run, const ReportCell* cell, const std::vector<std::string>& metrics);

// Our value of a metric for one run; nullopt when the run does not record it.
// `proxy` is set when the value stands in for the published quantity (e.g. validation
// perplexity on our corpus for a WikiText perplexity column).
std::optional<double> run_metric(const ReportRun& run, const std::string& metric, bool* proxy = nullptr,
                                 std::string* proxy_note = nullptr);

// Cell id without its seed component ("gdn.muon.pure.s1" → "gdn.muon.pure").
std::string row_id_of(const ReportCell& cell);

}  // namespace lar::report

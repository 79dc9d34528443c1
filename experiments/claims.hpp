#pragma once
// A paper's conclusions as data: the `claims:` block of a spec (docs/reproduce.md, "Claims").
// A claim names rows of the table by axis values (selectors) and says how they compare on
// one metric; the audit (registry/report/claims.hpp) tests it over the matched rows.
#include <string>
#include <utility>
#include <vector>

#include "core/json.hpp"

namespace lar::experiments {

struct Plan;
struct YNode;

// Axis name → value, as in the spec's matrix ("optimizer: normuon"); a row matches when
// every listed axis has that value.
using Selector = std::vector<std::pair<std::string, json>>;

struct Claim {
  // better:      rows matching `sides[0]` beat their matched rows matching `sides[1]`;
  // no_gain:     rows matching `sides[0]` are not reliably better than `sides[1]`;
  // order:       sides[0] beats sides[1] beats sides[2] … (better first), per matched tuple;
  // lowest / highest: the row matching `sides[0]` has the lowest / highest value of the
  //              metric among the rows matching `among` (all main rows when empty);
  // grows_least: the rows matching `sides[0]` grow least in the metric from the smallest
  //              to the largest value of the axis `along`, among the groups of rows that
  //              differ only in `along`.
  enum class Kind { better, no_gain, order, lowest, highest, grows_least };
  std::string name;
  Kind kind = Kind::better;
  std::vector<Selector> sides;
  Selector among;     // lowest / highest / grows_least: the rows that compete
  Selector where;     // every kind: only rows matching this take part
  std::string along;  // grows_least
  std::string metric;
  bool lower_is_better = true;
  double alpha = 0.05;  // significance level of the verdict
  std::string source;   // where the paper states it ("Table 2, p. 12")
  std::string loc;      // file:line:col of the claim, for messages
};

const char* to_string(Claim::Kind k);

// Parse and validate the `claims:` node against an expanded plan: axis names and values
// must be the plan's (at its scale), the metric one of `metrics` (reference.metrics).
// Throws lar::UserError naming file:line:col.
std::vector<Claim> parse_claims(const YNode& node, const Plan& plan, const std::vector<std::string>& metrics);

// Whether a metric is better when lower, from its name (loss, perplexity, time, memory,
// growth); nullopt-like false with *known = false when the name does not say.
bool lower_is_better_default(const std::string& metric, bool* known);

}  // namespace lar::experiments

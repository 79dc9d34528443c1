#pragma once
// The audit of a spec's claims (experiments/claims.hpp) over an audited Report: for each
// claim, the matched rows (pairs that differ only in the claim's axes, or the competing
// rows of a "lowest" claim), our mean Δ over seeds with its standard error, Welch's p,
// a seeded bootstrap interval when every row has ≥ 3 seeds, the sign agreement across
// pairs, the same reading of the published values, and a verdict.
#include <optional>
#include <string>
#include <vector>

#include "experiments/claims.hpp"
#include "registry/report/stats.hpp"

namespace lar::report {

struct Report;

// Verdict words (stable: JSON output, tests, docs/results).
namespace verdict {
inline constexpr const char* holds = "holds";
inline constexpr const char* fails = "fails";
inline constexpr const char* inconclusive = "inconclusive";
inline constexpr const char* no_data = "not enough data";
}  // namespace verdict

// One compared pair: a row of the better side against its matched row (for `order`, one
// link of a tuple; for lowest/highest/grows_least, the target against the runner-up).
struct ClaimPair {
  std::string a, b;           // row ids (grows_least: group ids)
  int link = 0;               // order: index of the link (sides[link] vs sides[link+1])
  std::vector<double> a_values, b_values;  // per seed
  std::optional<double> delta;            // mean(a) − mean(b), metric units
  std::optional<WelchResult> test;        // both sides ≥ 2 seeds
  std::optional<Interval> ci;             // both sides ≥ 3 seeds
  std::optional<double> published_delta;
  bool agrees = false;                    // delta points the claimed way
};

// Statistics over a set of pairs (a whole better/no_gain claim, or one link of an order).
struct PairSummary {
  int expected = 0;                // matched pairs in the plan
  int measured = 0;                // pairs with our values on both sides
  int agree = 0;
  std::optional<double> mean_delta;
  std::optional<double> se;        // seed noise of the mean Δ (Welch), else the spread across pairs
  bool se_across_pairs = false;
  std::optional<double> p;         // Welch over seeds of the mean Δ (every side ≥ 2 seeds)
  std::optional<double> df;
  double sign_p = 1;               // exact sign test over the measured pairs
  std::optional<Interval> ci;      // bootstrap of the mean Δ (every side ≥ 3 seeds)
  int published = 0, published_agree = 0;
  std::optional<double> published_mean_delta;
  std::string verdict, why;
};

struct ClaimResult {
  experiments::Claim claim;
  std::vector<ClaimPair> pairs;
  std::vector<PairSummary> links;  // better/no_gain: one; order: one per link; others: one
  // lowest / highest / grows_least
  std::optional<std::string> best;            // our best row (group), by mean
  std::optional<std::string> published_best;
  std::optional<double> p_best;               // bootstrap: how often the target is best
  std::vector<std::pair<std::string, double>> ranking;  // ours, best first (group id, mean)
  std::string verdict, why;
  // The published values read the same way: true/false, nullopt when they cannot tell.
  std::optional<bool> paper_consistent;
  std::string paper_reading;
};

std::vector<ClaimResult> audit_claims(const Report& rep, const std::vector<experiments::Claim>& claims);

// The bootstrap's resample count (fixed, so the intervals are reproducible).
inline constexpr int kBootstrapResamples = 2000;

}  // namespace lar::report

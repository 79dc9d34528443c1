#include "registry/report/claims.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "registry/report/report.hpp"

namespace lar::report {

namespace {

using experiments::Claim;
using experiments::Selector;

bool same_value(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

std::string text_of(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

bool row_matches(const Row& r, const Selector& s) {
  for (const auto& [axis, want] : s) {
    bool ok = false;
    for (const auto& [a, v] : r.axes)
      if (a == axis && same_value(v, want)) ok = true;
    if (!ok) return false;
  }
  return true;
}

std::vector<double> ours(const Row& r, const std::string& metric) {
  auto it = r.ours.find(metric);
  return it == r.ours.end() ? std::vector<double>{} : it->second.values;
}

std::optional<double> published(const Row& r, const std::string& metric) {
  auto it = r.published.find(metric);
  return it == r.published.end() ? std::nullopt : std::optional<double>(it->second);
}

double mean(const std::vector<double>& v) { return sample_stats(v).mean; }

// FNV-1a: a fixed bootstrap seed per claim, so that intervals are reproducible.
uint64_t seed_of(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string num(double v) { return fmt::format("{:.4g}", v); }

// Rows that take part: main rows matching `where`.
std::vector<const Row*> candidates(const Report& rep, const Claim& c) {
  std::vector<const Row*> out;
  for (const auto& r : rep.rows)
    if (r.role == "main" && row_matches(r, c.where)) out.push_back(&r);
  return out;
}

// The axes a pairing ignores besides the claim's own: those constant within every side
// (e.g. LAA Table 2's lr, which follows the optimizer through `by:`), so that rows differing
// in them are still the matched pair the matrix intends.
std::set<std::string> implied_axes(const std::vector<std::vector<const Row*>>& sides, const std::set<std::string>& claim_axes) {
  std::set<std::string> all;
  for (const auto& side : sides)
    for (const Row* r : side)
      for (const auto& [a, v] : r->axes) all.insert(a);
  std::set<std::string> out;
  for (const auto& a : all) {
    if (claim_axes.count(a)) continue;
    bool constant = true;
    for (const auto& side : sides) {
      std::optional<json> seen;
      for (const Row* r : side)
        for (const auto& [x, v] : r->axes)
          if (x == a) {
            if (seen && !same_value(*seen, v)) constant = false;
            seen = v;
          }
    }
    if (constant) out.insert(a);
  }
  return out;
}

std::string key_of(const Row& r, const std::set<std::string>& skip) {
  std::string k;
  for (const auto& [a, v] : r.axes)
    if (!skip.count(a)) k += a + "=" + text_of(v) + ";";
  return k;
}

// Matched tuples: one row per side, equal on every axis but the claim's and the implied.
std::vector<std::vector<const Row*>> match_tuples(const std::vector<const Row*>& rows, const std::vector<Selector>& sides) {
  std::vector<std::vector<const Row*>> by_side(sides.size());
  std::set<std::string> claim_axes;
  for (size_t i = 0; i < sides.size(); ++i) {
    for (const auto& [a, v] : sides[i]) claim_axes.insert(a);
    for (const Row* r : rows)
      if (row_matches(*r, sides[i])) by_side[i].push_back(r);
  }
  std::set<std::string> skip = implied_axes(by_side, claim_axes);
  skip.insert(claim_axes.begin(), claim_axes.end());
  std::vector<std::vector<const Row*>> tuples;
  for (const Row* first : by_side[0]) {
    // The cartesian product over the later sides of the rows with the same key.
    std::vector<std::vector<const Row*>> partial = {{first}};
    const std::string key = key_of(*first, skip);
    for (size_t i = 1; i < sides.size(); ++i) {
      std::vector<std::vector<const Row*>> next;
      for (const auto& t : partial)
        for (const Row* r : by_side[i])
          if (key_of(*r, skip) == key && std::find(t.begin(), t.end(), r) == t.end()) {
            auto u = t;
            u.push_back(r);
            next.push_back(std::move(u));
          }
      partial = std::move(next);
    }
    tuples.insert(tuples.end(), partial.begin(), partial.end());
  }
  return tuples;
}

bool better_way(double delta, bool lower) { return lower ? delta < 0 : delta > 0; }

ClaimPair make_pair(const std::string& a, const std::string& b, std::vector<double> av, std::vector<double> bv,
                    std::optional<double> pa, std::optional<double> pb, bool lower, uint64_t seed) {
  ClaimPair p;
  p.a = a;
  p.b = b;
  p.a_values = std::move(av);
  p.b_values = std::move(bv);
  if (!p.a_values.empty() && !p.b_values.empty()) {
    p.delta = mean(p.a_values) - mean(p.b_values);
    p.agrees = better_way(*p.delta, lower);
    p.test = welch_t_test(p.a_values, p.b_values);
    if (p.a_values.size() >= 3 && p.b_values.size() >= 3)
      p.ci = bootstrap_interval({p.a_values, p.b_values}, [](const Groups& g) { return mean(g[0]) - mean(g[1]); },
                                kBootstrapResamples, seed);
  }
  if (pa && pb) p.published_delta = *pa - *pb;
  return p;
}

std::string pvalue(double p) { return p < 1e-4 ? fmt::format("{:.1e}", p) : fmt::format("{:.3g}", p); }

// The pairwise statistics and the verdict of a better (or no_gain) reading of `pairs`.
PairSummary summarize(const std::vector<ClaimPair>& pairs, const Claim& c, bool no_gain, uint64_t seed) {
  PairSummary s;
  s.expected = static_cast<int>(pairs.size());
  std::vector<double> deltas;
  std::vector<std::pair<double, std::vector<double>>> terms;
  Groups groups;
  bool all_three = true;
  for (const auto& p : pairs) {
    if (p.published_delta) {
      ++s.published;
      s.published_agree += better_way(*p.published_delta, c.lower_is_better);
    }
    if (!p.delta) continue;
    ++s.measured;
    s.agree += p.agrees;
    deltas.push_back(*p.delta);
    groups.push_back(p.a_values);
    groups.push_back(p.b_values);
    all_three &= p.a_values.size() >= 3 && p.b_values.size() >= 3;
  }
  if (s.published > 0) {
    double sum = 0;
    for (const auto& p : pairs)
      if (p.published_delta) sum += *p.published_delta;
    s.published_mean_delta = sum / s.published;
  }
  if (s.measured == 0) {
    s.verdict = verdict::no_data;
    s.why = "no matched pair has included runs on both sides yet (0 of " + std::to_string(s.expected) + ")";
    return s;
  }
  const double P = s.measured;
  for (size_t i = 0; i < groups.size(); i += 2) {
    terms.emplace_back(1 / P, groups[i]);
    terms.emplace_back(-1 / P, groups[i + 1]);
  }
  s.mean_delta = mean(deltas);
  if (auto w = welch_linear(terms)) {
    s.se = w->se;
    s.p = w->p;
    s.df = w->df;
  } else if (deltas.size() >= 2) {
    s.se = sample_stats(deltas).std / std::sqrt(P);
    s.se_across_pairs = true;
  }
  s.sign_p = sign_test_p(s.agree, s.measured);
  if (all_three)
    s.ci = bootstrap_interval(
        groups,
        [](const Groups& g) {
          double sum = 0;
          for (size_t i = 0; i < g.size(); i += 2) sum += mean(g[i]) - mean(g[i + 1]);
          return sum / static_cast<double>(g.size() / 2);
        },
        kBootstrapResamples, seed);

  // Significance over seeds when every side has ≥ 2 (Welch), else across pairs (sign test).
  const bool welch = s.p.has_value();
  const double p = welch ? *s.p : s.sign_p;
  const bool favourable = welch ? better_way(*s.mean_delta, c.lower_is_better) : 2 * s.agree > s.measured;
  const bool ci_agrees = !s.ci || (c.lower_is_better ? s.ci->hi < 0 : s.ci->lo > 0);
  const bool significant = p < c.alpha && (favourable ? ci_agrees : true);
  const std::string pairs_txt = std::to_string(s.agree) + " of " + std::to_string(s.measured) + " pairs";
  const std::string test_txt = welch ? "Welch p = " + pvalue(p) + " over seeds" : "sign test p = " + pvalue(p) + " (1 seed)";
  const std::string missing =
      s.measured < s.expected ? "; " + std::to_string(s.expected - s.measured) + " pair(s) not measured yet" : "";
  if (!no_gain) {
    if (significant && favourable && s.agree == s.measured) {
      s.verdict = verdict::holds;
      s.why = pairs_txt + " agree, " + test_txt + missing;
    } else if (significant && !favourable) {
      s.verdict = verdict::fails;
      s.why = "the opposite holds: " + pairs_txt + " agree, " + test_txt + missing;
    } else {
      s.verdict = verdict::inconclusive;
      s.why = pairs_txt + " agree, " + test_txt + (significant ? " but not every pair agrees" : ", not significant at α = " + num(c.alpha)) + missing;
    }
  } else {
    if (significant && favourable) {
      s.verdict = verdict::fails;
      s.why = "a reliable gain: " + pairs_txt + " improve, " + test_txt + missing;
    } else if (!welch && s.agree == s.measured) {
      s.verdict = verdict::inconclusive;
      s.why = "every pair improves (" + pairs_txt + "), too few for the sign test to tell (" + test_txt + ")" + missing;
    } else {
      s.verdict = verdict::holds;
      s.why = "no reliable gain: " + pairs_txt + " improve, " + test_txt + missing;
    }
  }
  return s;
}

struct Entry {
  std::string id;
  std::vector<double> values;
  std::optional<double> published;
  bool target = false;
};

// lowest / highest / grows_least: is a target entry the best one?
void rank_entries(ClaimResult& res, const std::vector<Entry>& all, bool lower, uint64_t seed) {
  const Claim& c = res.claim;
  PairSummary s;
  std::vector<const Entry*> measured;
  for (const auto& e : all)
    if (!e.values.empty()) measured.push_back(&e);
  std::sort(measured.begin(), measured.end(), [&](const Entry* a, const Entry* b) {
    return lower ? mean(a->values) < mean(b->values) : mean(a->values) > mean(b->values);
  });
  for (const Entry* e : measured) res.ranking.emplace_back(e->id, mean(e->values));
  // The paper's reading.
  std::vector<const Entry*> pub;
  for (const auto& e : all)
    if (e.published) pub.push_back(&e);
  if (pub.size() >= 2) {
    const Entry* best = *std::min_element(pub.begin(), pub.end(), [&](const Entry* a, const Entry* b) {
      return lower ? *a->published < *b->published : *a->published > *b->published;
    });
    res.published_best = best->id;
    res.paper_consistent = best->target;
    res.paper_reading = "paper: best is " + best->id + " (" + num(*best->published) + ")";
  } else {
    res.paper_reading = "paper: too few published values to rank";
  }
  const bool has_target = std::any_of(measured.begin(), measured.end(), [](const Entry* e) { return e->target; });
  if (!has_target || measured.size() < 2) {
    s.verdict = verdict::no_data;
    s.why = !has_target ? "the named row has no included run yet" : "fewer than two rows measured";
    res.links.push_back(s);
    return;
  }
  const Entry* best = measured.front();
  const Entry* best_target = *std::find_if(measured.begin(), measured.end(), [](const Entry* e) { return e->target; });
  const Entry* rival = nullptr;
  if (best->target) {
    auto it = std::find_if(measured.begin(), measured.end(), [](const Entry* e) { return !e->target; });
    if (it != measured.end()) rival = *it;
  } else {
    rival = best;
  }
  res.best = best->id;
  if (!rival) {
    s.verdict = verdict::no_data;
    s.why = "only the named rows are measured";
    res.links.push_back(s);
    return;
  }
  res.pairs.push_back(make_pair(best_target->id, rival->id, best_target->values, rival->values, best_target->published,
                                rival->published, lower, seed));
  const ClaimPair& p = res.pairs.back();
  s.expected = s.measured = 1;
  s.agree = p.agrees;
  s.mean_delta = p.delta;
  if (p.test) {
    s.se = p.test->se;
    s.p = p.test->p;
    s.df = p.test->df;
  }
  s.ci = p.ci;
  const bool all_three = std::all_of(measured.begin(), measured.end(), [](const Entry* e) { return e->values.size() >= 3; });
  if (all_three) {
    Groups g;
    std::vector<bool> is_target;
    for (const Entry* e : measured) {
      g.push_back(e->values);
      is_target.push_back(e->target);
    }
    std::vector<double> draws;
    bootstrap_interval(
        g,
        [&](const Groups& x) {
          size_t bi = 0;
          for (size_t i = 1; i < x.size(); ++i)
            if (lower ? mean(x[i]) < mean(x[bi]) : mean(x[i]) > mean(x[bi])) bi = i;
          return is_target[bi] ? 1.0 : 0.0;
        },
        kBootstrapResamples, seed ^ 0x9e3779b97f4a7c15ull, 0.95, &draws);
    res.p_best = mean(draws);
  }
  const std::string lead = best->target ? best->id + " is best, ahead of " + rival->id : rival->id + " beats " + best_target->id;
  const std::string margin = " by " + num(std::fabs(*p.delta));
  if (p.test) {
    const bool sig = p.test->p < c.alpha;
    s.verdict = sig ? (best->target ? verdict::holds : verdict::fails) : verdict::inconclusive;
    s.why = lead + margin + " (Welch p = " + pvalue(p.test->p) + (sig ? "" : ", not significant") + ")";
  } else {
    s.verdict = best->target ? verdict::holds : verdict::fails;
    s.why = lead + margin + " (single seed: rank only, no significance)";
  }
  res.links.push_back(s);
}

std::string group_id(const Row& r, const std::string& along) {
  std::string id;
  for (const auto& [a, v] : r.axes)
    if (a != along) id += (id.empty() ? "" : ".") + text_of(v);
  return id.empty() ? "(all)" : id;
}

// Values of a row by seed position (the index of the cell in the row), for growth ratios.
std::map<size_t, double> by_seed(const Row& r, const std::string& metric) {
  std::map<size_t, double> out;
  auto it = r.ours.find(metric);
  if (it == r.ours.end()) return out;
  const MetricValue& mv = it->second;
  for (size_t i = 0; i < mv.values.size() && i < mv.cell_ids.size(); ++i) {
    auto pos = std::find(r.cell_ids.begin(), r.cell_ids.end(), mv.cell_ids[i]);
    if (pos != r.cell_ids.end()) out[static_cast<size_t>(pos - r.cell_ids.begin())] = mv.values[i];
  }
  return out;
}

std::optional<double> along_value(const Row& r, const std::string& along) {
  for (const auto& [a, v] : r.axes)
    if (a == along && v.is_number()) return v.get<double>();
  return std::nullopt;
}

ClaimResult audit_one(const Report& rep, const Claim& c) {
  ClaimResult res;
  res.claim = c;
  const uint64_t seed = seed_of(rep.experiment + "/" + c.name);
  const auto rows = candidates(rep, c);
  switch (c.kind) {
    case Claim::Kind::better:
    case Claim::Kind::no_gain:
    case Claim::Kind::order: {
      const auto tuples = match_tuples(rows, c.sides);
      const size_t links = c.sides.size() - 1;
      std::vector<std::vector<ClaimPair>> by_link(links);
      for (const auto& t : tuples)
        for (size_t l = 0; l < links; ++l) {
          ClaimPair p = make_pair(t[l]->id, t[l + 1]->id, ours(*t[l], c.metric), ours(*t[l + 1], c.metric),
                                  published(*t[l], c.metric), published(*t[l + 1], c.metric), c.lower_is_better,
                                  seed + 1000 + l);
          p.link = static_cast<int>(l);
          by_link[l].push_back(p);
          res.pairs.push_back(std::move(p));
        }
      for (size_t l = 0; l < links; ++l)
        res.links.push_back(summarize(by_link[l], c, c.kind == Claim::Kind::no_gain, seed + 1000 + l));
      if (tuples.empty()) {
        res.verdict = verdict::no_data;
        res.why = "no matched rows in this table";
        break;
      }
      if (c.kind != Claim::Kind::order) {
        res.verdict = res.links[0].verdict;
        res.why = res.links[0].why;
      } else {
        auto any = [&](const char* v) {
          return std::any_of(res.links.begin(), res.links.end(), [&](const PairSummary& s) { return s.verdict == v; });
        };
        res.verdict = any(verdict::fails) ? verdict::fails
                      : any(verdict::no_data) ? verdict::no_data
                      : std::all_of(res.links.begin(), res.links.end(),
                                    [](const PairSummary& s) { return s.verdict == verdict::holds; })
                          ? verdict::holds
                          : verdict::inconclusive;
        int ordered = 0, complete = 0;
        for (size_t t = 0; t < tuples.size(); ++t) {
          bool all = true, measured = true;
          for (size_t l = 0; l < links; ++l) {
            const ClaimPair& p = by_link[l][t];
            measured &= p.delta.has_value();
            all &= p.agrees;
          }
          complete += measured;
          ordered += measured && all;
        }
        res.why = std::to_string(ordered) + " of " + std::to_string(complete) + " measured tuples fully ordered";
        for (size_t l = 0; l < links; ++l) res.why += "; link " + std::to_string(l + 1) + ": " + res.links[l].verdict;
      }
      // The paper's reading: every published pair the claimed way (no_gain: mixed signs).
      const PairSummary& first = res.links[0];
      int pub = 0, pub_agree = 0;
      for (const auto& s : res.links) {
        pub += s.published;
        pub_agree += s.published_agree;
      }
      if (pub > 0) {
        if (c.kind == Claim::Kind::no_gain) {
          if (pub_agree < pub) res.paper_consistent = true;
        } else {
          res.paper_consistent = pub_agree == pub;
        }
        res.paper_reading = "paper: " + std::to_string(pub_agree) + " of " + std::to_string(pub) + " published " +
                            (c.kind == Claim::Kind::order ? "links" : "pairs") +
                            (c.kind == Claim::Kind::no_gain ? " improve" : " the claimed way") +
                            (first.published_mean_delta && c.kind != Claim::Kind::order
                                 ? ", mean Δ " + fmt::format("{:+.4g}", *first.published_mean_delta)
                                 : "");
      } else {
        res.paper_reading = "paper: no published pair";
      }
      break;
    }
    case Claim::Kind::lowest:
    case Claim::Kind::highest: {
      std::vector<Entry> entries;
      for (const Row* r : rows)
        if (row_matches(*r, c.among))
          entries.push_back({r->id, ours(*r, c.metric), published(*r, c.metric), row_matches(*r, c.sides[0])});
      rank_entries(res, entries, c.kind == Claim::Kind::lowest, seed);
      res.verdict = res.links[0].verdict;
      res.why = res.links[0].why;
      break;
    }
    case Claim::Kind::grows_least: {
      // Groups of rows that differ only in `along`; growth from its smallest to its largest value.
      std::map<std::string, std::vector<const Row*>> groups;
      std::vector<std::string> order;
      for (const Row* r : rows) {
        if (!row_matches(*r, c.among) || !along_value(*r, c.along)) continue;
        const std::string g = group_id(*r, c.along);
        if (!groups.count(g)) order.push_back(g);
        groups[g].push_back(r);
      }
      std::vector<Entry> entries;
      for (const auto& g : order) {
        auto& rs = groups[g];
        if (rs.size() < 2) continue;
        std::sort(rs.begin(), rs.end(), [&](const Row* a, const Row* b) { return *along_value(*a, c.along) < *along_value(*b, c.along); });
        const Row& lo = *rs.front();
        const Row& hi = *rs.back();
        Entry e;
        e.id = g;
        e.target = row_matches(hi, c.sides[0]);
        const auto vlo = by_seed(lo, c.metric), vhi = by_seed(hi, c.metric);
        for (const auto& [seed_pos, v] : vhi)
          if (auto it = vlo.find(seed_pos); it != vlo.end() && it->second > 0) e.values.push_back(100 * (v / it->second - 1));
        auto plo = published(lo, c.metric), phi = published(hi, c.metric);
        if (plo && phi && *plo > 0) e.published = 100 * (*phi / *plo - 1);
        // Papers that plot iteration times often print only the growth (LAA Fig. 6).
        else if (c.metric.rfind("sec_per_iter", 0) == 0) e.published = published(hi, "iter_time_growth_pct");
        entries.push_back(std::move(e));
      }
      rank_entries(res, entries, /*lower=*/true, seed);
      res.verdict = res.links[0].verdict;
      res.why = res.links[0].why + " (growth in % of " + c.metric + " from the smallest to the largest " + c.along + ")";
      break;
    }
  }
  return res;
}

}  // namespace

std::vector<ClaimResult> audit_claims(const Report& rep, const std::vector<experiments::Claim>& claims) {
  std::vector<ClaimResult> out;
  for (const auto& c : claims) out.push_back(audit_one(rep, c));
  return out;
}

}  // namespace lar::report

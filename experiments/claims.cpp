#include "experiments/claims.hpp"

#include <algorithm>
#include <set>

#include "core/error.hpp"
#include "experiments/cell.hpp"
#include "experiments/yaml_tree.hpp"

namespace lar::experiments {

namespace {

[[noreturn]] void fail(const SourceLoc& loc, const std::string& msg) { throw UserError(loc, msg); }

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

std::string text_of(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// Numbers compare by value (1 and 1.0 are one axis value), everything else exactly.
bool same_value(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

const std::vector<std::string> kKinds = {"better", "no_gain", "order", "lowest", "highest", "grows_least"};
const std::vector<std::string> kKeys = {"name",   "better", "than",  "no_gain", "order",     "lowest", "highest",
                                        "grows_least", "along", "among", "where", "metric", "direction",
                                        "alpha",  "source"};

// The values each axis takes in the plan (seed excluded: claims compare rows, which are
// averaged over seeds), in first-seen order.
struct AxisValues {
  std::vector<std::string> names;
  std::vector<std::vector<json>> values;
  int find(const std::string& n) const {
    auto it = std::find(names.begin(), names.end(), n);
    return it == names.end() ? -1 : static_cast<int>(it - names.begin());
  }
};

AxisValues axis_values(const Plan& plan) {
  AxisValues av;
  for (const auto& c : plan.cells)
    for (const auto& [a, v] : c.axes) {
      if (a == "seed") continue;
      int i = av.find(a);
      if (i < 0) {
        av.names.push_back(a);
        av.values.emplace_back();
        i = static_cast<int>(av.names.size()) - 1;
      }
      auto& vs = av.values[i];
      if (std::none_of(vs.begin(), vs.end(), [&](const json& x) { return same_value(x, v); })) vs.push_back(v);
    }
  return av;
}

bool cell_matches(const Cell& c, const Selector& s) {
  for (const auto& [axis, want] : s) {
    bool ok = false;
    for (const auto& [a, v] : c.axes)
      if (a == axis && same_value(v, want)) ok = true;
    if (!ok) return false;
  }
  return true;
}

class ClaimParser {
 public:
  ClaimParser(const Plan& plan, const std::vector<std::string>& metrics)
      : plan_(plan), metrics_(metrics), axes_(axis_values(plan)) {}

  std::vector<Claim> parse(const YNode& node) {
    if (node.is_null()) return {};
    if (!node.is_seq()) fail(node.loc, "claims: expected a list, got " + node.describe());
    std::vector<Claim> out;
    std::set<std::string> names;
    for (size_t i = 0; i < node.items.size(); ++i) {
      Claim c = parse_one(*node.items[i], "claims[" + std::to_string(i) + "]");
      if (!names.insert(c.name).second) fail(node.items[i]->get("name")->loc, "claims: the name '" + c.name + "' is used twice");
      out.push_back(std::move(c));
    }
    return out;
  }

 private:
  Claim parse_one(const YNode& n, const std::string& what) {
    if (!n.is_map()) fail(n.loc, what + ": expected a map, got " + n.describe());
    for (const auto& [k, v] : n.entries)
      if (std::find(kKeys.begin(), kKeys.end(), k->text) == kKeys.end()) {
        std::string msg = what + ": unknown key '" + k->text + "'";
        std::string hint = did_you_mean(k->text, kKeys);
        fail(k->loc, msg + (hint.empty() ? "" : " (" + hint + ")"));
      }
    Claim c;
    c.loc = n.loc.str();
    const YNode* name = n.get("name");
    if (!name) fail(n.loc, what + ": missing 'name' (what the paper concludes, in words)");
    c.name = string_of(*name, what + ".name");
    if (c.name.empty()) fail(name->loc, what + ".name: empty");
    const std::string w = what + " ('" + c.name + "')";

    std::vector<std::string> kinds;
    for (const auto& k : kKinds)
      if (n.get(k)) kinds.push_back(k);
    if (kinds.empty()) fail(n.loc, w + ": say what is claimed with one of " + join(kKinds));
    if (kinds.size() > 1) fail(n.entry(kinds[1])->first->loc, w + ": one claim per entry (both '" + kinds[0] + "' and '" + kinds[1] + "')");
    const std::string kind = kinds.front();
    const YNode& body = *n.get(kind);
    c.kind = kind == "better"   ? Claim::Kind::better
             : kind == "no_gain" ? Claim::Kind::no_gain
             : kind == "order"   ? Claim::Kind::order
             : kind == "lowest"  ? Claim::Kind::lowest
             : kind == "highest" ? Claim::Kind::highest
                                 : Claim::Kind::grows_least;

    if (const YNode* wh = n.get("where")) c.where = selector(*wh, w + ".where");
    const bool pairwise = c.kind == Claim::Kind::better || c.kind == Claim::Kind::no_gain;
    const YNode* than = n.get("than");
    if (pairwise) {
      if (!than) fail(n.loc, w + ": '" + kind + "' needs 'than' (the rows it is compared with)");
      c.sides.push_back(selector(body, w + "." + kind));
      c.sides.push_back(selector(*than, w + ".than"));
      check_distinct(c.sides[0], c.sides[1], n.entry("than")->first->loc, w);
    } else if (than) {
      fail(n.entry("than")->first->loc, w + ": 'than' belongs to 'better' and 'no_gain' claims");
    }
    if (c.kind == Claim::Kind::order) {
      if (!body.is_seq() || body.items.size() < 2)
        fail(body.loc, w + ".order: expected a list of at least two selectors (best first), got " + body.describe());
      for (size_t i = 0; i < body.items.size(); ++i) {
        c.sides.push_back(selector(*body.items[i], w + ".order[" + std::to_string(i) + "]"));
        for (size_t j = 0; j < i; ++j) check_distinct(c.sides[j], c.sides[i], body.items[i]->loc, w);
      }
    }
    const bool single = c.kind == Claim::Kind::lowest || c.kind == Claim::Kind::highest || c.kind == Claim::Kind::grows_least;
    if (single) c.sides.push_back(selector(body, w + "." + kind));
    if (const YNode* am = n.get("among")) {
      if (!single) fail(n.entry("among")->first->loc, w + ": 'among' belongs to lowest, highest and grows_least claims");
      c.among = selector(*am, w + ".among");
    }
    const YNode* along = n.get("along");
    if (c.kind == Claim::Kind::grows_least) {
      if (!along) fail(n.loc, w + ": 'grows_least' needs 'along' (the axis the metric grows along, e.g. seq_len)");
      c.along = string_of(*along, w + ".along");
      const int a = axes_.find(c.along);
      if (a < 0) fail(along->loc, unknown_axis(w + ".along", c.along));
      const auto& vs = axes_.values[a];
      if (vs.size() < 2 || std::any_of(vs.begin(), vs.end(), [](const json& v) { return !v.is_number(); }))
        fail(along->loc, w + ".along: axis '" + c.along + "' needs at least two numeric values");
      for (const auto& [axis, v] : c.sides[0])
        if (axis == c.along) fail(body.loc, w + ".grows_least: names the 'along' axis '" + c.along + "'; name the rows that grow");
    } else if (along) {
      fail(n.entry("along")->first->loc, w + ": 'along' belongs to grows_least claims");
    }

    const YNode* metric = n.get("metric");
    if (!metric) fail(n.loc, w + ": missing 'metric' (one of " + join(metrics_) + ")");
    c.metric = string_of(*metric, w + ".metric");
    if (std::find(metrics_.begin(), metrics_.end(), c.metric) == metrics_.end()) {
      std::string hint = did_you_mean(c.metric, metrics_);
      fail(metric->loc, w + ".metric: '" + c.metric + "' is not a metric of this table (reference.metrics: " +
                            (metrics_.empty() ? std::string("none") : join(metrics_)) + ")" +
                            (hint.empty() ? "" : "; " + hint));
    }
    bool known = false;
    c.lower_is_better = lower_is_better_default(c.metric, &known);
    if (const YNode* d = n.get("direction")) {
      const std::string dir = string_of(*d, w + ".direction");
      if (dir != "lower" && dir != "higher") fail(d->loc, w + ".direction: expected lower or higher, got '" + dir + "'");
      c.lower_is_better = dir == "lower";
    } else if (!known) {
      fail(metric->loc, w + ": cannot tell whether lower or higher " + c.metric + " is better; add direction: lower|higher");
    }
    if (const YNode* a = n.get("alpha")) {
      const json v = a->to_json();
      if (!v.is_number() || !(v.get<double>() > 0 && v.get<double>() < 1))
        fail(a->loc, w + ".alpha: expected a number between 0 and 1, got " + a->describe());
      c.alpha = v.get<double>();
    }
    if (const YNode* s = n.get("source")) c.source = string_of(*s, w + ".source");

    // Every named row set must exist at this scale.
    for (size_t i = 0; i < c.sides.size(); ++i) {
      Selector s = c.sides[i];
      s.insert(s.end(), c.where.begin(), c.where.end());
      if (std::none_of(plan_.cells.begin(), plan_.cells.end(), [&](const Cell& cell) { return cell_matches(cell, s); }))
        fail(n.loc, w + ": no cell has " + describe(s) + (plan_.scale.empty() ? "" : " at scale " + plan_.scale));
    }
    return c;
  }

  std::string string_of(const YNode& n, const std::string& what) {
    if (!n.is_scalar() || !n.to_json().is_string()) fail(n.loc, what + ": expected a string, got " + n.describe());
    return n.text;
  }

  std::string unknown_axis(const std::string& what, const std::string& axis) {
    std::string hint = did_you_mean(axis, axes_.names);
    return what + ": '" + axis + "' is not an axis of the matrix (axes: " + join(axes_.names) + ")" +
           (hint.empty() ? "" : "; " + hint);
  }

  Selector selector(const YNode& n, const std::string& what) {
    if (!n.is_map()) fail(n.loc, what + ": expected a map of axis values, e.g. {optimizer: normuon}, got " + n.describe());
    if (n.entries.empty()) fail(n.loc, what + ": empty (name at least one axis value)");
    Selector s;
    for (const auto& [k, v] : n.entries) {
      if (k->text == "seed") fail(k->loc, what + ": 'seed' cannot select rows (a row is all seeds of one cell)");
      const int a = axes_.find(k->text);
      if (a < 0) fail(k->loc, unknown_axis(what, k->text));
      const json val = v->to_json();
      const auto& vs = axes_.values[a];
      if (std::none_of(vs.begin(), vs.end(), [&](const json& x) { return same_value(x, val); })) {
        std::vector<std::string> texts;
        for (const auto& x : vs) texts.push_back(text_of(x));
        std::string hint = val.is_string() ? did_you_mean(val.get<std::string>(), texts) : "";
        fail(v->loc, what + "." + k->text + ": " + v->describe() + " is not a value of axis '" + k->text + "'" +
                         (plan_.scale.empty() ? "" : " at scale " + plan_.scale) + " (values: " + join(texts) + ")" +
                         (hint.empty() ? "" : "; " + hint));
      }
      s.emplace_back(k->text, val);
    }
    return s;
  }

  // Two sides of a comparison must differ in a common axis, or a row could be on both.
  static void check_distinct(const Selector& a, const Selector& b, const SourceLoc& loc, const std::string& w) {
    for (const auto& [x, vx] : a)
      for (const auto& [y, vy] : b)
        if (x == y && !same_value(vx, vy)) return;
    fail(loc, w + ": " + describe(a) + " and " + describe(b) + " must give different values to a common axis");
  }

  static std::string describe(const Selector& s) {
    std::string out = "{";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + s[i].first + ": " + text_of(s[i].second);
    return out + "}";
  }

  const Plan& plan_;
  const std::vector<std::string>& metrics_;
  AxisValues axes_;
};

}  // namespace

const char* to_string(Claim::Kind k) {
  switch (k) {
    case Claim::Kind::better: return "better";
    case Claim::Kind::no_gain: return "no_gain";
    case Claim::Kind::order: return "order";
    case Claim::Kind::lowest: return "lowest";
    case Claim::Kind::highest: return "highest";
    case Claim::Kind::grows_least: return "grows_least";
  }
  return "?";
}

bool lower_is_better_default(const std::string& metric, bool* known) {
  auto has = [&](const char* s) { return metric.find(s) != std::string::npos; };
  *known = true;
  if (has("loss") || has("ppl") || has("perplexity") || has("sec_per_iter") || has("time") || has("mem") || has("growth"))
    return true;
  if (has("acc") || has("throughput") || has("tok_s") || has("tokens_per_s") || has("avg") || has("score")) return false;
  *known = false;
  return true;
}

std::vector<Claim> parse_claims(const YNode& node, const Plan& plan, const std::vector<std::string>& metrics) {
  return ClaimParser(plan, metrics).parse(node);
}

}  // namespace lar::experiments

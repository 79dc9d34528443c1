#include "registry/views.hpp"

#include <cmath>
#include <sstream>

#include "core/error.hpp"
#include "registry/text_table.hpp"

namespace lar::registry {

static json num_or_null(double v) { return std::isfinite(v) ? json(v) : json(); }

json to_json(const StatusEvent& e) {
  return {{"state", to_string(e.state)}, {"at", e.at}, {"step", e.step}, {"reason", e.reason}, {"attempt", e.attempt}};
}

json to_json(const RunRecord& r) {
  json hist = json::array();
  for (const auto& e : r.history) hist.push_back(to_json(e));
  json j = {{"run_id", r.run_id},   {"experiment", r.experiment}, {"cell_id", r.cell_id},
            {"hash", r.hash},       {"axes", r.axes},             {"role", r.role},
            {"baseline", r.baseline.empty() ? json() : json(r.baseline)},
            {"status", to_string(r.status)}, {"step", r.step},   {"total_steps", r.total_steps},
            {"reason", r.reason},   {"summary", r.summary},       {"attempts", r.attempts},
            {"host", r.host},       {"run_dir", r.run_dir},       {"updated_at", r.updated_at},
            {"history", hist}};
  if (!r.config.is_null()) j["config"] = r.config;
  return j;
}

json to_json(const MetricPoint& p) {
  return {{"step", p.step}, {"tokens", num_or_null(p.tokens)}, {"value", num_or_null(p.value)},
          {"wall_time", num_or_null(p.wall_time)}};
}

static void flatten_into(const json& j, const std::string& prefix, std::map<std::string, json>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten_into(*it, prefix.empty() ? it.key() : prefix + "." + it.key(), out);
  } else {
    out[prefix] = j;
  }
}

std::map<std::string, json> flatten(const json& j) {
  std::map<std::string, json> out;
  if (j.is_object()) flatten_into(j, "", out);
  return out;
}

std::string cell_text(const json& v) {
  if (v.is_null()) return "-";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return v.dump();
  if (v.is_number()) return fmt_num(v.get<double>(), 6);
  return v.dump();
}

std::vector<RunState> parse_states(const std::vector<std::string>& words) {
  static const std::vector<std::string> names = {"pending", "running", "completed", "failed",
                                                 "diverged", "preempted", "cancelled", "timeout"};
  std::vector<RunState> out;
  for (const auto& w : words) {
    std::stringstream ss(w);
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item.empty()) continue;
      auto s = run_state_from_string(item);
      if (!s) {
        std::string hint = did_you_mean(item, names);
        throw UserError("unknown status '" + item + "' (" + (hint.empty() ? "" : hint + " ") +
                        "one of: pending, running, completed, failed, diverged, preempted, cancelled, timeout)");
      }
      out.push_back(*s);
    }
  }
  return out;
}

OutputFormat parse_format(const std::string& s, const std::vector<std::string>& allowed) {
  bool ok = false;
  std::string list;
  for (const auto& a : allowed) {
    ok = ok || a == s;
    list += (list.empty() ? "" : "|") + a;
  }
  if (!ok) throw UserError("unknown --format '" + s + "' (expected " + list + ")");
  if (s == "csv") return OutputFormat::csv;
  if (s == "json") return OutputFormat::json;
  return OutputFormat::table;
}

}  // namespace lar::registry

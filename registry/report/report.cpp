#include "registry/report/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "core/config_schema.hpp"
#include "registry/report/timing.hpp"

namespace lar::report {

namespace {

// Keys that change how a run executes but not what it computes.
const std::vector<std::string> kOperationalKeys = {"threads", "backend", "deterministic", "checkpoint",
                                                   "log"};

bool ignored(const std::string& path, const std::vector<std::string>& ignore) {
  auto under = [&](const std::string& p) {
    return path == p || (path.size() > p.size() && path.compare(0, p.size(), p) == 0 && path[p.size()] == '.');
  };
  return std::any_of(kOperationalKeys.begin(), kOperationalKeys.end(), under) ||
         std::any_of(ignore.begin(), ignore.end(), under);
}

void flatten(const json& j, const std::string& prefix, std::map<std::string, json>& out) {
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  out[prefix] = j;
}

// Numbers compare by value (1 and 1.0 are the same config), everything else exactly.
bool same_value(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

std::string show(const json& v) { return v.is_null() ? "(absent)" : v.is_string() ? v.get<std::string>() : v.dump(); }

const json* find_path(const json& j, const std::string& dotted) {
  const json* cur = &j;
  size_t start = 0;
  while (true) {
    size_t dot = dotted.find('.', start);
    std::string key = dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!cur->is_object() || !cur->contains(key)) return nullptr;
    cur = &(*cur)[key];
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

int decimals_of(double v) {
  std::string s = json(v).dump();
  if (s.find_first_of("eE") != std::string::npos) return 4;
  auto dot = s.find('.');
  return dot == std::string::npos ? 0 : static_cast<int>(s.size() - dot - 1);
}

bool is_number_at(const json& j, const char* key) { return j.is_object() && j.contains(key) && j[key].is_number(); }

std::string fmt_epochs(double e) {
  char buf[32];
  std::snprintf(buf, sizeof buf, e < 10 ? "%.2f" : "%.1f", e);
  return buf;
}

}  // namespace

std::vector<std::string> config_differences(const json& a, const json& b, const std::vector<std::string>& ignore_paths) {
  std::map<std::string, json> fa, fb;
  flatten(a, "", fa);
  flatten(b, "", fb);
  std::set<std::string> keys;
  for (const auto& [k, v] : fa) keys.insert(k);
  for (const auto& [k, v] : fb) keys.insert(k);
  std::vector<std::string> out;
  for (const auto& k : keys) {
    if (ignored(k, ignore_paths)) continue;
    const json va = fa.count(k) ? fa[k] : json(), vb = fb.count(k) ? fb[k] : json();
    if (!same_value(va, vb)) out.push_back(k + ": " + show(va) + " vs " + show(vb));
  }
  return out;
}

std::optional<double> run_metric(const ReportRun& run, const std::string& metric, bool* proxy, std::string* proxy_note) {
  if (proxy) *proxy = false;
  const json& s = run.summary;
  if (is_number_at(s, metric.c_str())) return s[metric].get<double>();
  // A published percentage of a recorded fraction (`lar eval` records fractions):
  // hellaswag_acc_norm_pct → 100 · summary[hellaswag_acc_norm], mkniah_acc_pct@4K → 100 ·
  // summary[mkniah_acc@4096].
  if (auto p = metric.find("_pct"); p != std::string::npos && (p + 4 == metric.size() || metric[p + 4] == '@')) {
    std::string base = metric.substr(0, p), len = p + 4 < metric.size() ? metric.substr(p + 5) : "";
    if (!len.empty() && (len.back() == 'K' || len.back() == 'k') && len.size() > 1 &&
        len.find_first_not_of("0123456789") == len.size() - 1)
      len = std::to_string(std::stol(len.substr(0, len.size() - 1)) * 1024);
    if (!len.empty()) base += "@" + len;
    if (is_number_at(s, base.c_str())) return 100.0 * s[base].get<double>();
  }
  // Published perplexities on benchmark corpora: our validation perplexity stands in.
  const bool ppl = metric.size() > 4 && metric.compare(metric.size() - 4, 4, "_ppl") == 0;
  if (ppl && is_number_at(s, "final_loss")) {
    if (proxy) *proxy = true;
    if (proxy_note) *proxy_note = metric + ": our validation perplexity exp(final_loss) stands in";
    return std::exp(s["final_loss"].get<double>());
  }
  // Seconds per iteration under the paper's name for it.
  if (metric.rfind("sec_per_iter", 0) == 0 && is_number_at(s, "iter_time_s")) return s["iter_time_s"].get<double>();
  if (metric == "peak_mem_gb" && is_number_at(s, "peak_mem_mb")) return s["peak_mem_mb"].get<double>() / 1024.0;
  if (metric == "tok_s" && is_number_at(s, "tokens_per_s")) return s["tokens_per_s"].get<double>();
  // Model TFLOP/s per GPU (LAA Table 8): the config's training FLOPs a token × tokens/s.
  if (metric == "tflops_per_gpu" && is_number_at(s, "tokens_per_s") && run.config.is_object()) {
    const double world = is_number_at(s, "world_size") ? s["world_size"].get<double>() : 1.0;
    return model_flops_per_token(run.config) * s["tokens_per_s"].get<double>() / world / 1e12;
  }
  // Retrieval accuracy in percent: acc_pct@4K → 100 · summary["acc@4096"].
  if (metric.rfind("acc_pct", 0) == 0) {
    std::string key = "acc";
    if (auto at = metric.find('@'); at != std::string::npos) {
      std::string len = metric.substr(at + 1);
      if (metric.compare(0, at, "acc_pct") != 0) return std::nullopt;  // acc_pct_<task>@L: another task
      long mult = 1;
      if (!len.empty() && (len.back() == 'K' || len.back() == 'k')) {
        mult = 1024;
        len.pop_back();
      }
      try {
        key += "@" + std::to_string(std::stol(len) * mult);
      } catch (const std::exception&) {
        return std::nullopt;
      }
    } else if (metric != "acc_pct") {
      return std::nullopt;
    }
    if (is_number_at(s, key.c_str())) return 100.0 * s[key].get<double>();
  }
  return std::nullopt;
}

std::string row_id_of(const ReportCell& cell) {
  for (const auto& [axis, value] : cell.axes) {
    if (axis != "seed") continue;
    const std::string token = "s" + (value.is_string() ? value.get<std::string>() : value.dump());
    const std::string& id = cell.id;
    if (id.size() > token.size() && id.compare(id.size() - token.size() - 1, std::string::npos, "." + token) == 0)
      return id.substr(0, id.size() - token.size() - 1);
    if (auto pos = id.find("." + token + "."); pos != std::string::npos)
      return id.substr(0, pos) + id.substr(pos + token.size() + 1);
    if (id.rfind(token + ".", 0) == 0) return id.substr(token.size() + 1);
  }
  return cell.id;
}

RunVerdict judge_run(const ReportRun& run, const ReportCell* cell, const std::vector<std::string>& metrics) {
  RunVerdict v{run.run_id, run.cell_id, false, "", ""};
  auto exclude = [&](const char* code, std::string why) {
    v.code = code;
    v.reason = std::move(why);
    return v;
  };
  if (!cell) return exclude(reason::not_in_plan, "cell '" + run.cell_id + "' is not part of this table at this scale");

  const std::string at = " at step " + std::to_string(run.step) + "/" + std::to_string(run.total_steps);
  if (run.status == "diverged")
    return exclude(reason::diverged, "diverged" + at + (run.reason.empty() ? "" : " (" + run.reason + ")"));
  if (run.status != "completed")
    return exclude(reason::not_completed, "schedule not completed: " + (run.status.empty() ? "unknown" : run.status) +
                                              at + (run.reason.empty() ? "" : " (" + run.reason + ")"));

  // LAA Appendix B: a main result records architecture, stack, size, token budget,
  // optimizer, learning rate, metric and checkpoint.
  if (!run.config.is_object() || run.config.empty()) return exclude(reason::missing_field, "required field missing: config");
  struct Field { const char* name; std::vector<const char*> paths; };
  const std::vector<Field> fields = {
      {"architecture", {"model.architecture"}}, {"stack", {"model.stack"}},
      {"size", {"model.n_layers", "model.d_model"}}, {"optimizer", {"optimizer.name"}},
      {"learning rate", {"optimizer.lr"}}};
  for (const auto& f : fields)
    for (const char* p : f.paths)
      if (!find_path(run.config, p) || find_path(run.config, p)->is_null())
        return exclude(reason::missing_field, std::string("required field missing: ") + f.name + " (" + p + ")");
  const json* steps = find_path(run.config, "budget.steps");
  const json* tokens = find_path(run.config, "budget.tokens");
  const bool has_budget = (steps && steps->is_number() && steps->get<double>() > 0) ||
                          (tokens && tokens->is_number() && tokens->get<double>() > 0);
  if (!has_budget) return exclude(reason::missing_field, "required field missing: token budget (budget.steps / budget.tokens)");
  bool any_metric = metrics.empty();
  for (const auto& m : metrics) {
    if (m == "rel_throughput_pct" ? is_number_at(run.summary, "tokens_per_s") : run_metric(run, m).has_value())
      any_metric = true;
  }
  if (!any_metric) {
    std::string all;
    for (const auto& m : metrics) all += (all.empty() ? "" : ", ") + m;
    return exclude(reason::missing_field, "required field missing: metric (none of " + all + " in the summary)");
  }
  if (!run.checkpoint_step) return exclude(reason::missing_field, "required field missing: checkpoint (no final checkpoint step recorded)");

  if (*run.checkpoint_step != run.total_steps || run.step != run.total_steps)
    return exclude(reason::not_final, "not the final checkpoint: metrics at step " + std::to_string(*run.checkpoint_step) +
                                          ", schedule ends at step " + std::to_string(run.total_steps));

  if (cell->config.is_object() && !cell->config.empty()) {
    // Both with today's defaults: a key the schema gained after the run, at its default,
    // is no difference.
    auto diffs = config_differences(with_defaults(run.config), with_defaults(cell->config));
    if (!diffs.empty()) {
      std::string why = "config differs from the spec's cell: " + diffs.front();
      if (diffs.size() > 1) why += " (+" + std::to_string(diffs.size() - 1) + " more)";
      return exclude(reason::config_differs, why);
    }
  }
  v.included = true;
  return v;
}

bool Report::has_deltas() const {
  return std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.baseline_row.has_value(); });
}

std::vector<std::string> Report::failed_main_rows() const {
  std::vector<std::string> out;
  for (const auto& r : rows)
    if (r.role == "main" && (r.status == "fail" || r.status == "missing" || r.status == "incomplete"))
      out.push_back(r.id);
  return out;
}

std::vector<std::string> Report::main_rows_with_status(const std::string& status) const {
  std::vector<std::string> out;
  for (const auto& r : rows)
    if (r.role == "main" && r.status == status) out.push_back(r.id);
  return out;
}

Report build_report(const TableInput& in) {
  Report rep;
  rep.experiment = in.experiment;
  rep.scale = in.scale;
  rep.title = in.title;
  rep.description = in.description;
  rep.source = in.source;
  rep.metrics = in.metrics;
  rep.known_issues = in.known_issues;

  std::map<std::string, const ReportCell*> cell_by_id;
  for (const auto& c : in.cells) cell_by_id[c.id] = &c;

  // 1. Judge every run; among a cell's included runs the newest counts.
  std::map<std::string, const ReportRun*> chosen;  // cell id → run
  std::vector<size_t> order(in.runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return in.runs[a].updated_at > in.runs[b].updated_at;  // newest first
  });
  std::vector<RunVerdict> verdicts(in.runs.size());
  for (size_t i : order) {
    const ReportRun& run = in.runs[i];
    auto it = cell_by_id.find(run.cell_id);
    RunVerdict v = judge_run(run, it == cell_by_id.end() ? nullptr : it->second, in.metrics);
    if (v.included) {
      if (auto c = chosen.find(run.cell_id); c != chosen.end()) {
        v.included = false;
        v.code = reason::superseded;
        v.reason = "superseded by the newer run " + c->second->run_id + " of the same cell";
      } else {
        chosen[run.cell_id] = &run;
      }
    }
    verdicts[i] = v;
  }
  rep.runs = verdicts;

  // 2. Rows: the cells of one row differ only in their seed.
  std::map<std::string, size_t> row_index;
  for (const auto& c : in.cells) {
    const std::string rid = row_id_of(c);
    auto [it, fresh] = row_index.try_emplace(rid, rep.rows.size());
    if (fresh) {
      Row r;
      r.id = rid;
      for (const auto& a : c.axes)
        if (a.first != "seed") r.axes.push_back(a);
      r.role = c.role;
      if (c.reference.is_object())
        for (const auto& [k, v] : c.reference.items())
          if (v.is_number()) r.published[k] = v.get<double>();
      rep.rows.push_back(std::move(r));
    }
    Row& r = rep.rows[it->second];
    r.cell_ids.push_back(c.id);
    if (c.baseline && !r.baseline_row) {
      auto b = cell_by_id.find(*c.baseline);
      r.baseline_row = b == cell_by_id.end() ? *c.baseline : row_id_of(*b->second);
    }
  }
  auto row_by_id = [&](const std::string& id) -> Row* {
    auto it = row_index.find(id);
    return it == row_index.end() ? nullptr : &rep.rows[it->second];
  };

  // 3. Throughput reference: the row the paper normalises to 100.
  std::optional<double> ref_tps;
  const bool want_rel = std::find(in.metrics.begin(), in.metrics.end(), "rel_throughput_pct") != in.metrics.end();
  if (want_rel) {
    for (const auto& r : rep.rows) {
      auto p = r.published.find("rel_throughput_pct");
      if (p != r.published.end() && p->second == 100.0) {
        rep.throughput_reference = r.id;
        std::vector<double> tps;
        for (const auto& cid : r.cell_ids)
          if (auto c = chosen.find(cid); c != chosen.end() && is_number_at(c->second->summary, "tokens_per_s"))
            tps.push_back(c->second->summary["tokens_per_s"].get<double>());
        if (!tps.empty()) ref_tps = sample_stats(tps).mean;
        break;
      }
    }
  }

  // 4. Our values per row and metric.
  for (auto& r : rep.rows) {
    int n_included = 0;
    for (const auto& cid : r.cell_ids) {
      auto c = chosen.find(cid);
      if (c == chosen.end()) continue;
      ++n_included;
      for (const auto& m : in.metrics) {
        MetricValue& mv = r.ours[m];
        std::optional<double> val;
        if (m == "rel_throughput_pct") {
          if (ref_tps && *ref_tps > 0 && is_number_at(c->second->summary, "tokens_per_s"))
            val = 100.0 * c->second->summary["tokens_per_s"].get<double>() / *ref_tps;
        } else {
          bool proxy = false;
          std::string note;
          val = run_metric(*c->second, m, &proxy, &note);
          if (proxy) {
            mv.proxy = true;
            mv.proxy_note = note;
          }
        }
        if (val && std::isfinite(*val)) {
          mv.values.push_back(*val);
          mv.run_ids.push_back(c->second->run_id);
          mv.cell_ids.push_back(cid);
        }
      }
    }
    for (auto& [m, mv] : r.ours) mv.stats = sample_stats(mv.values);
    for (const auto& cid : r.cell_ids)
      if (auto c = chosen.find(cid); c != chosen.end() && c->second->epochs)
        r.epochs = std::max(r.epochs.value_or(0.0), *c->second->epochs);
    if (!r.epochs)
      for (const auto& cid : r.cell_ids)
        if (const ReportCell* cell = cell_by_id[cid]; cell && cell->epochs) {
          r.epochs = std::max(r.epochs.value_or(0.0), *cell->epochs);
          r.epochs_planned = true;
        }
    if (r.epochs && *r.epochs > 1)
      r.notes.push_back(fmt_epochs(*r.epochs) + " epochs of the corpus" + (r.epochs_planned ? " (planned)" : "") +
                        ": the data repeats, so the loss is partly memorisation");
    for (const auto& cid : r.cell_ids)
      if (!chosen.count(cid)) r.notes.push_back("cell " + cid + ": no included run");
    if (n_included == 1) r.notes.push_back("single seed: no significance claim");
    for (const auto& [m, mv] : r.ours)
      if (mv.proxy) r.notes.push_back("proxy — " + mv.proxy_note);
    if (want_rel && !ref_tps && n_included > 0)
      r.notes.push_back("rel_throughput_pct: the reference row " +
                        (rep.throughput_reference ? *rep.throughput_reference : std::string("(none)")) +
                        " has no included run");
  }

  // 4b. Growth of the iteration time over the shortest sequence length of the same
  // configuration (LAA Fig. 6: +192 % from 4K to 32K for softmax).
  if (std::find(in.metrics.begin(), in.metrics.end(), "iter_time_growth_pct") != in.metrics.end()) {
    auto seq_len_of = [](const Row& r) -> std::optional<double> {
      for (const auto& [a, v] : r.axes)
        if ((a == "seq_len" || a == "data.seq_len") && v.is_number()) return v.get<double>();
      return std::nullopt;
    };
    auto others = [](const Row& r) {
      json o = json::object();
      for (const auto& [a, v] : r.axes)
        if (a != "seq_len" && a != "data.seq_len") o[a] = v;
      return o;
    };
    for (auto& r : rep.rows) {
      auto len = seq_len_of(r);
      if (!len) continue;
      const Row* shortest = nullptr;
      for (const auto& o : rep.rows) {
        auto ol = seq_len_of(o);
        if (ol && others(o) == others(r) && (!shortest || *ol < *seq_len_of(*shortest))) shortest = &o;
      }
      std::vector<double> base_times;
      for (const auto& cid : shortest->cell_ids)
        if (auto c = chosen.find(cid); c != chosen.end())
          if (auto t = run_metric(*c->second, "sec_per_iter")) base_times.push_back(*t);
      if (base_times.empty()) continue;
      const double t0 = sample_stats(base_times).mean;
      MetricValue& mv = r.ours["iter_time_growth_pct"];
      mv.values.clear();
      mv.run_ids.clear();
      mv.cell_ids.clear();
      for (const auto& cid : r.cell_ids)
        if (auto c = chosen.find(cid); c != chosen.end())
          if (auto t = run_metric(*c->second, "sec_per_iter"); t && t0 > 0) {
            mv.values.push_back(100.0 * (*t / t0 - 1.0));
            mv.run_ids.push_back(c->second->run_id);
            mv.cell_ids.push_back(cid);
          }
      mv.stats = sample_stats(mv.values);
    }
  }

  // 5. Deltas against the matched baseline row.
  for (auto& r : rep.rows) {
    if (!r.baseline_row) continue;
    Row* b = row_by_id(*r.baseline_row);
    if (!b) {
      r.notes.push_back("baseline " + *r.baseline_row + " is not a cell of this table");
      continue;
    }
    // Matched = configs equal except on the axes the baseline mapping replaces.
    std::string mismatch;
    for (const auto& cid : r.cell_ids) {
      const ReportCell* c = cell_by_id[cid];
      if (!c->baseline || !cell_by_id.count(*c->baseline)) continue;
      const ReportCell* bc = cell_by_id[*c->baseline];
      std::vector<std::string> allowed;
      for (const auto& [axis, value] : c->axes)
        for (const auto& [baxis, bvalue] : bc->axes)
          if (axis == baxis && !same_value(value, bvalue)) allowed.push_back(resolve_axis(axis));
      auto rc = chosen.find(c->id), rb = chosen.find(bc->id);
      std::vector<std::string> diffs;
      if (rc != chosen.end() && rb != chosen.end()) {
        diffs = config_differences(rc->second->config, rb->second->config, allowed);
        const json &sa = rc->second->summary, &sb = rb->second->summary;
        // Equal configs can still read different data (data.path re-prepared, another
        // tokenizer): the trainer records the slice and tokenizer of every run.
        for (const auto& [key, what] : {std::pair{"data_slice", "data slice"}, std::pair{"tokenizer", "tokenizer"}})
          if (diffs.empty() && sa.contains(key) && sb.contains(key) && sa[key] != sb[key])
            diffs.push_back(std::string(what) + " (summary." + key + "): run " + rc->second->run_id + " trained on " +
                            show(sa[key]) + ", run " + rb->second->run_id + " on " + show(sb[key]));
      } else {
        diffs = config_differences(c->config, bc->config, allowed);
      }
      if (!diffs.empty()) {
        mismatch = diffs.front();
        break;
      }
    }
    for (const auto& m : in.metrics) {
      // Throughput is normalised to one row already; a delta of it says nothing new.
      if (m == "rel_throughput_pct") continue;
      Delta d;
      d.matched = mismatch.empty();
      d.mismatch = mismatch;
      const auto& mine = r.ours[m].values;
      const auto& theirs = b->ours[m].values;
      d.n = static_cast<int>(mine.size());
      d.n_baseline = static_cast<int>(theirs.size());
      if (d.matched && !mine.empty() && !theirs.empty()) {
        d.ours = sample_stats(mine).mean - sample_stats(theirs).mean;
        if (auto t = welch_t_test(mine, theirs)) {
          d.test = t;
          d.se = t->se;
        }
      }
      auto pa = r.published.find(m), pb = b->published.find(m);
      if (pa != r.published.end() && pb != b->published.end()) d.published = pa->second - pb->second;
      r.deltas[m] = d;
    }
    if (!mismatch.empty()) r.notes.push_back("delta not reported: baseline " + b->id + " differs in " + mismatch);
    else {
      auto included = [&](const Row& row) {
        return static_cast<int>(std::count_if(row.cell_ids.begin(), row.cell_ids.end(),
                                              [&](const std::string& id) { return chosen.count(id) > 0; }));
      };
      const int n = included(r), nb = included(*b);
      if (n > 0 && nb > 0 && (n < 2 || nb < 2))
        r.notes.push_back("too few seeds for a significance test (n = " + std::to_string(n) + " vs " +
                          std::to_string(nb) + "; Welch's t needs ≥ 2 per side)");
    }
  }

  // 6. Row status.
  // A row whose runs are all either included or still unfinished (training, or cut before the
  // end of their schedule: a table in progress) is incomplete, not failed.
  auto unfinished = [](const std::string& status) {
    return status != "completed" && status != "diverged" && status != "failed";
  };
  for (auto& r : rep.rows) {
    int included = 0, seen = 0;
    bool only_unfinished = true;  // every cell without an included run has only unfinished runs
    for (const auto& cid : r.cell_ids) {
      if (chosen.count(cid)) ++included;
      for (const auto& run : in.runs)
        if (run.cell_id == cid) {
          ++seen;
          if (!chosen.count(cid) && !unfinished(run.status)) only_unfinished = false;
        }
    }
    const bool unmatched = std::any_of(r.deltas.begin(), r.deltas.end(), [](const auto& d) { return !d.second.matched; });
    if (r.role != "main") {
      r.status = "exploratory";
      r.notes.insert(r.notes.begin(), "exploratory: indicative only, not a main result (LAA App. B)");
    } else if (seen == 0) {
      r.status = "missing";
    } else if (included < static_cast<int>(r.cell_ids.size()) && only_unfinished && !unmatched) {
      r.status = "incomplete";
    } else if (included < static_cast<int>(r.cell_ids.size()) || unmatched) {
      r.status = "fail";
    } else {
      r.status = "ok";
    }
  }

  // 7. Agreement with the paper across main rows.
  for (const auto& m : in.metrics) {
    std::vector<double> ours, theirs;
    for (const auto& r : rep.rows) {
      if (r.role != "main") continue;
      auto o = r.ours.find(m);
      auto p = r.published.find(m);
      if (o == r.ours.end() || o->second.stats.n == 0 || p == r.published.end()) continue;
      ours.push_back(o->second.stats.mean);
      theirs.push_back(p->second);
    }
    MetricAgreement a;
    a.metric = m;
    a.n = static_cast<int>(ours.size());
    if (a.n >= 2) {
      a.spearman = spearman(ours, theirs);
      a.kendall = kendall_tau_b(ours, theirs);
    }
    rep.agreement.push_back(a);

    SignAgreement s;
    s.metric = m;
    for (const auto& r : rep.rows) {
      if (r.role != "main") continue;
      auto d = r.deltas.find(m);
      if (d == r.deltas.end() || !d->second.ours || !d->second.published) continue;
      ++s.n;
      auto sign = [](double x) { return (x > 0) - (x < 0); };
      if (sign(*d->second.ours) == sign(*d->second.published)) ++s.agree;
    }
    if (rep.has_deltas() && m != "rel_throughput_pct") rep.signs.push_back(s);
  }

  // 8. Printing precision: as many decimals as the paper prints.
  for (const auto& m : in.metrics) {
    int dec = -1;
    for (const auto& r : rep.rows)
      if (auto p = r.published.find(m); p != r.published.end()) dec = std::max(dec, decimals_of(p->second));
    rep.decimals[m] = dec < 0 ? (m == "rel_throughput_pct" ? 1 : 4) : std::clamp(dec, 1, 4);
  }

  // 9. The spec's claims over the rows.
  rep.claims = audit_claims(rep, in.claims);
  return rep;
}

}  // namespace lar::report

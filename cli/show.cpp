// `lar show RUN` — one run: identity, status and its history, config, summary, last
// metrics, checkpoints.
#include <fmt/format.h>

#include <iostream>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/registry.hpp"
#include "registry/text_table.hpp"
#include "registry/views.hpp"

namespace {

struct ShowOptions {
  std::string db;
  std::string run;
  std::string format = "text";
};

int run_show(const ShowOptions& o) {
  using namespace lar;
  using namespace lar::registry;
  if (o.format != "text" && o.format != "json")
    throw UserError("unknown --format '" + o.format + "' (expected text|json)");
  auto reg = Registry::open(o.db.empty() ? default_db_path() : std::filesystem::path(o.db), true);
  RunRecord r = reg.require_run(o.run);
  auto last = reg.last_metrics(r.run_id);
  auto ckpts = reg.checkpoints(r.run_id);

  if (o.format == "json") {
    json j = to_json(r);
    json lm = json::object();
    for (const auto& [name, p] : last) lm[name] = to_json(p);
    j["last_metrics"] = lm;
    json ck = json::array();
    for (const auto& c : ckpts) ck.push_back({{"step", c.step}, {"path", c.path}, {"bytes", c.bytes}});
    j["checkpoints"] = ck;
    std::cout << j.dump(2) << "\n";
    return 0;
  }

  auto& out = std::cout;
  out << fmt::format("run         {}\n", r.run_id);
  out << fmt::format("experiment  {}   cell {}   role {}{}\n", r.experiment, r.cell_id, r.role,
                     r.baseline.empty() ? "" : "   baseline " + r.baseline);
  out << fmt::format("hash        {}\n", r.hash.empty() ? "-" : r.hash);
  out << fmt::format("status      {}  step {}/{}  attempt {}{}\n", to_string(r.status), r.step, r.total_steps,
                     r.attempts, r.reason.empty() ? "" : "  reason: " + r.reason);
  out << fmt::format("updated     {}{}\n", fmt_time(r.updated_at), r.host.empty() ? "" : "  on " + r.host);
  out << fmt::format("run dir     {}\n", r.run_dir.empty() ? "-" : r.run_dir);
  if (!r.axes.empty()) {
    std::string axes;
    for (auto it = r.axes.begin(); it != r.axes.end(); ++it)
      axes += (axes.empty() ? "" : "  ") + it.key() + "=" + cell_text(*it);
    out << "axes        " << axes << "\n";
  }

  if (!r.history.empty()) {
    TextTable t;
    t.headers = {"at", "state", "step", "attempt", "reason"};
    t.right_align = {false, false, true, true, false};
    for (const auto& e : r.history)
      t.rows.push_back({fmt_time(e.at), to_string(e.state), std::to_string(e.step), std::to_string(e.attempt),
                        e.reason});
    out << "\nstatus history\n" << t.to_table();
  }
  if (!r.summary.empty()) {
    out << "\nsummary\n";
    for (const auto& [k, v] : flatten(r.summary)) out << fmt::format("  {} = {}\n", k, cell_text(v));
  }
  if (!last.empty()) {
    TextTable t;
    t.headers = {"metric", "step", "value", "tokens"};
    t.right_align = {false, true, true, true};
    for (const auto& [name, p] : last)
      t.rows.push_back({name, std::to_string(p.step), fmt_num(p.value, 6), fmt_num(p.tokens, 6)});
    out << "\nlast metrics\n" << t.to_table();
  }
  if (!ckpts.empty())
    out << fmt::format("\ncheckpoints {} (latest step {}: {})\n", ckpts.size(), ckpts.back().step, ckpts.back().path);
  auto cfg = flatten(r.config);
  if (!cfg.empty()) {
    out << "\nconfig\n";
    for (const auto& [k, v] : cfg) out << fmt::format("  {} = {}\n", k, cell_text(v));
  }
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "show", "Show one run: config, status history, summary, last metrics", 42,
    [](CLI::App& app) -> lar::cli::Runner {
      auto o = std::make_shared<ShowOptions>();
      app.add_option("run", o->run, "Run id (experiment/cell), a unique prefix, a cell id or a hash prefix")
          ->required();
      app.add_option("--db", o->db, "Registry database (default: $LAR_DB or $LAR_HOME/lar.db)");
      app.add_option("-f,--format", o->format, "text | json");
      return [o] { return run_show(*o); };
    }};

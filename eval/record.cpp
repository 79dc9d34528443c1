#include "eval/record.hpp"

#include "core/error.hpp"
#include "core/run_dir.hpp"
#include "registry/registry.hpp"

namespace lar::eval {

namespace fs = std::filesystem;

void check_not_running(const fs::path& run_dir) {
  auto st = RunDir(run_dir).read_status();
  if (st && st->state == RunState::running)
    throw UserError(run_dir.string() + ": the run is still training (status running); evaluate it once it stops");
}

void record(const fs::path& run_dir, long checkpoint_step, const EvalRecord& rec) {
  RunDir rd(run_dir);
  RunStatus st;
  if (auto s = rd.read_status()) st = *s;
  if (!st.summary.is_object()) st.summary = json::object();
  json line = {{"step", checkpoint_step}, {"wall_time", unix_now()}};
  for (const auto& [k, v] : rec.metrics.items()) {
    st.summary[k] = v;
    if (v.is_number()) line[k] = v;
  }
  json prov = rec.provenance;
  prov["checkpoint_step"] = checkpoint_step;
  prov["at"] = unix_now();
  st.summary["eval_files"][rec.name] = prov;
  st.updated_at = unix_now();
  rd.write_status(st);
  MetricsWriter(rd.metrics_path()).append(line);
}

bool sync_registry(const fs::path& db, const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::exists(db, ec)) return false;
  auto reg = registry::Registry::open(db);
  reg.sync_run(run_dir);
  return true;
}

}  // namespace lar::eval

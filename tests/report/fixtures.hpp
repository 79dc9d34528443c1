#pragma once
// Hand-built TableInputs for the report tests: a tiny "table" of two architectures with
// a published final loss, and a routing table with baselines.
#include <string>

#include "core/config_schema.hpp"
#include "registry/report/report.hpp"

namespace lar::report::testing {

inline json config_for(const std::string& arch, const std::string& routing, int seed, double lr = 1e-3) {
  json c = {{"model", {{"architecture", arch}, {"stack", "pure"}, {"routing", routing}, {"n_layers", 2}, {"d_model", 64}}},
            {"optimizer", {{"name", "adamw"}, {"lr", lr}}},
            {"budget", {{"steps", 100}}},
            {"seed", seed}};
  return with_defaults(c);
}

inline ReportCell cell(const std::string& arch, const std::string& routing, int seed, json reference = json()) {
  ReportCell c;
  c.id = arch + "." + routing + ".s" + std::to_string(seed);
  c.hash = "h-" + c.id;
  c.axes = {{"architecture", arch}, {"routing", routing}, {"seed", seed}};
  c.config = config_for(arch, routing, seed);
  c.reference = std::move(reference);
  if (routing != "none") c.baseline = arch + ".none.s" + std::to_string(seed);
  return c;
}

inline ReportRun completed_run(const ReportCell& c, double final_loss, double tps = 1000, double t = 1) {
  ReportRun r;
  r.run_id = "exp/" + c.id;
  r.cell_id = c.id;
  r.hash = c.hash;
  r.status = "completed";
  r.step = 100;
  r.total_steps = 100;
  r.checkpoint_step = 100;
  r.config = c.config;
  r.summary = {{"final_loss", final_loss}, {"saturation_loss", final_loss + 0.1}, {"tokens_per_s", tps}};
  r.updated_at = t;
  return r;
}

}  // namespace lar::report::testing

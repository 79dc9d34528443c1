#include "runner/registry_hooks.hpp"

#include <memory>

#include "core/paths.hpp"
#include "registry/registry.hpp"

namespace lar::runner {

LaunchHooks registry_hooks(const std::filesystem::path& db_path,
                           std::function<void(const std::string&)> warn) {
  // Opened lazily by before_start (a dry run never opens it) and shared by the hooks.
  auto reg = std::make_shared<std::unique_ptr<registry::Registry>>();
  auto guarded = [warn](const std::string& what, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      if (warn) warn("registry: " + what + " failed: " + e.what() + " (the run dirs are intact; run `lar sync`)");
    }
  };
  LaunchHooks h;
  h.before_start = [=](const experiments::Plan& plan) {
    guarded("registering the cells", [&] {
      *reg = std::make_unique<registry::Registry>(registry::Registry::open(db_path));
      std::vector<registry::PlannedCell> cells;
      for (const auto& c : plan.cells) {
        registry::PlannedCell p;
        p.experiment = c.experiment.empty() ? plan.experiment : c.experiment;
        p.cell_id = c.id;
        p.hash = c.hash;
        for (const auto& [k, v] : c.axes) p.axes[k] = v;
        p.role = c.role;
        p.baseline = c.baseline.value_or("");
        p.config = c.config;
        p.run_dir = run_dir_for(plan.experiment, c.id);
        cells.push_back(std::move(p));
      }
      (*reg)->register_cells(cells);
    });
  };
  h.after_cell = [=](const CellOutcome& o) {
    if (!*reg) return;
    guarded("syncing " + o.cell_id, [&] { (*reg)->sync_run(o.run_dir); });
  };
  h.at_end = [=](const LaunchSummary& s) {
    if (!*reg) return;
    guarded("the final sync", [&] {
      for (const auto& c : s.cells)
        if (std::filesystem::exists(c.run_dir / "config.json")) (*reg)->sync_run(c.run_dir);
    });
  };
  return h;
}

}  // namespace lar::runner

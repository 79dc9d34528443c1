// `lar bundle export|import` — one experiment's run folders without checkpoints, plus a
// registry of them, in one .tar.gz: what a reproduction on a borrowed machine sends home.
#include <iostream>
#include <memory>

#include "cli/command.hpp"
#include "core/error.hpp"
#include "core/paths.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/bundle.hpp"

namespace {

struct BundleArgs {
  std::string what;  // experiment name or paper table
  std::string file;
  std::string scale;
  bool replace = false;
};

// "laa/table2" names a paper table: its experiment is the spec's name.
std::string experiment_of(const BundleArgs& a) {
  using namespace lar;
  if (a.what.find('/') == std::string::npos && !a.what.ends_with(".yaml")) return a.what;
  return report::load_paper_plan(report::resolve_paper_spec(a.what), a.scale).experiment;
}

int run_export(const BundleArgs& a) {
  using namespace lar;
  const std::string exp = experiment_of(a);
  auto s = report::export_bundle(exp, runs_root(), a.file, {{"source", a.what}});
  std::cout << "wrote " << a.file << ": " << s.cells.size() << " runs of " << exp << " without checkpoints, "
            << s.bytes / 1024 << " KiB\n";
  return 0;
}

int run_import(const BundleArgs& a) {
  using namespace lar;
  auto s = report::import_bundle(a.file, runs_root(), default_db_path(), a.replace);
  std::cout << "imported " << s.cells.size() << " runs of " << s.experiment << " into " << (runs_root() / s.experiment).string()
            << " and the registry " << default_db_path().string() << "\n";
  if (!s.kept.empty()) {
    std::cout << s.kept.size() << " run folder(s) exist here already and were kept (--replace overwrites them):";
    for (const auto& k : s.kept) std::cout << " " << k;
    std::cout << "\n";
  }
  return 0;
}

}  // namespace

static lar::cli::CommandRegistration reg{
    "bundle", "Results bundles: runs without checkpoints + their registry in one .tar.gz", 63,
    [](CLI::App& app) -> lar::cli::Runner {
      auto a = std::make_shared<BundleArgs>();
      auto mode = std::make_shared<std::string>();
      app.require_subcommand(1);
      CLI::App* ex = app.add_subcommand("export", "Write one experiment's runs (no checkpoints) to a .tar.gz");
      ex->add_option("experiment", a->what, "experiment name (laa-table2) or paper table (laa/table2)")->required();
      ex->add_option("-o,--out", a->file, "bundle file to write, e.g. laa-table2.tar.gz")->required();
      ex->add_option("--scale", a->scale, "scale, when naming a paper table (the experiment name is the same at every scale)");
      ex->callback([mode] { *mode = "export"; });
      CLI::App* im = app.add_subcommand("import", "Unpack a bundle under runs/ and ingest it into the registry");
      im->add_option("file", a->file, "bundle written by `lar bundle export` or `lar reproduce --bundle`")->required();
      im->add_flag("--replace", a->replace, "overwrite run folders that exist here already (default: keep them)");
      im->callback([mode] { *mode = "import"; });
      app.footer("A bundle holds bundle.json (experiment, runs, the machine and command), lar.db (a\n"
                 "registry of the bundled runs) and runs/<experiment>/<cell>/ without checkpoints/.\n"
                 "Written and read with the tar command. See docs/reproduce.md.");
      return [a, mode] { return *mode == "import" ? run_import(*a) : run_export(*a); };
    }};

#include "registry/report/results.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "registry/report/figure.hpp"
#include "registry/report/process.hpp"
#include "registry/report/render.hpp"

namespace lar::report {

namespace {

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && s[i] == ' ') ++i;
  return s.substr(i);
}

std::string last_line_with(const fs::path& file, const std::string& needle) {
  std::ifstream f(file);
  std::string line, found;
  while (std::getline(f, line))
    if (line.find(needle) != std::string::npos) found = line;
  return found;
}

// The last complete line of metrics.jsonl (a torn last line is skipped).
json last_metrics(const fs::path& file) {
  std::ifstream f(file);
  std::string line;
  json last;
  while (std::getline(f, line)) {
    try {
      last = json::parse(line);
    } catch (const json::exception&) {
    }
  }
  return last;
}

std::string iso_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string num_or_dash(const json& j, const char* key, const char* fmtspec) {
  if (!j.contains(key) || !j[key].is_number()) return "—";
  return fmt::format(fmt::runtime(fmtspec), j[key].get<double>());
}

void write(const fs::path& p, const std::string& text, ResultsSummary& s) {
  atomic_write(p, text);
  s.files.push_back(p);
}

}  // namespace

json machine_provenance() {
  json m = json::object();
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) == 0) m["host"] = host;
  m["date"] = iso_now();
  const ProcessResult gpus = run_program({"nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"});
  json list = json::array();
  if (gpus.rc == 0) {
    std::istringstream in(gpus.output);
    std::string line;
    while (std::getline(in, line))
      if (!trim(line).empty()) list.push_back(trim(line));
  }
  m["gpus"] = list;
  std::string cpu = last_line_with("/proc/cpuinfo", "model name");
  if (auto colon = cpu.find(':'); colon != std::string::npos) m["cpu"] = trim(cpu.substr(colon + 1));
  m["cores"] = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  // The source tree the paper specs (and, normally, this binary) come from.
  try {
    const std::string root = papers_root().string();
    const ProcessResult head = run_program({"git", "-C", root, "rev-parse", "HEAD"});
    if (head.rc == 0) {
      m["commit"] = trim(head.output);
      const ProcessResult dirty = run_program({"git", "-C", root, "status", "--porcelain", "--untracked-files=no"});
      m["dirty"] = dirty.rc == 0 && !trim(dirty.output).empty();
    }
  } catch (const std::exception&) {
  }
  return m;
}

json run_provenance(const registry::RunRecord& rec, const ReportRun* run) {
  json j = {{"run_id", rec.run_id}, {"cell", rec.cell_id}, {"status", to_string(rec.status)}, {"host", rec.host},
            {"attempts", rec.attempts}, {"step", rec.step}, {"total_steps", rec.total_steps}, {"hash", rec.hash}};
  const json& s = rec.summary.is_object() ? rec.summary : json::object();
  for (const char* k : {"params", "tokens", "tokens_per_s", "iter_time_s", "final_loss", "gpu_peak_mem_mb", "peak_mem_mb"})
    if (s.contains(k)) j[k] = s[k];
  if (run && run->epochs) j["epochs"] = *run->epochs;
  if (!rec.run_dir.empty()) {
    const fs::path dir = rec.run_dir;
    const json last = last_metrics(dir / "metrics.jsonl");
    if (last.is_object() && last.contains("wall_time")) j["wall_time_s"] = last["wall_time"];
    // "start: N parameters, S steps, backend cuda" — the backend the trainer picked.
    std::string line = last_line_with(dir / "log.txt", "backend ");
    if (auto at = line.find("backend "); at != std::string::npos) {
      std::string b = line.substr(at + 8);
      b = b.substr(0, b.find_first_of(", )"));
      j["backend"] = b;
    }
  }
  if (rec.config.is_object()) {
    j["precision"] = rec.config.value("precision", json());
    j["deterministic"] = rec.config.value("deterministic", json());
  }
  return j;
}

ResultsSummary write_results(const PaperReport& p, registry::Registry* reg, const fs::path& dir, const ResultsOptions& o) {
  ResultsSummary s;
  fs::create_directories(dir);
  const Report& r = p.report;

  // Figures first, so that the README can link the ones that exist.
  std::vector<std::string> figures;
  if (!o.lar_exe.empty())
    for (const auto& def : figure_catalogue()) {
      if (def.table != o.table) continue;
      std::string name = def.name;
      std::replace(name.begin(), name.end(), '/', '_');
      const fs::path out = dir / (name + ".svg");
      std::vector<std::string> argv = {o.lar_exe.string(), "export", "figure", def.name, "--format", "svg", "-o", out.string()};
      if (!r.scale.empty()) argv.insert(argv.end(), {"--scale", r.scale});
      if (o.seeds > 0) argv.insert(argv.end(), {"--seeds", std::to_string(o.seeds)});
      const ProcessResult res = run_program(argv);
      if (res.rc == 0 && fs::exists(out)) {
        figures.push_back(out.filename().string());
        s.files.push_back(out);
      } else {
        s.warnings.push_back("figure " + def.name + " not drawn (lar export figure exit " + std::to_string(res.rc) + "): " +
                             trim(res.output).substr(0, 300));
      }
    }

  // Provenance.
  json prov = {{"machine", machine_provenance()}, {"table", o.table}, {"experiment", r.experiment}, {"scale", r.scale},
               {"seeds", o.seeds}, {"command", o.command}, {"runs", json::array()}};
  std::map<std::string, const ReportRun*> run_by_id;
  for (const auto& run : p.input.runs) run_by_id[run.run_id] = &run;
  std::map<std::string, bool> included;
  for (const auto& v : r.runs) included[v.run_id] = v.included;
  double wall_total = 0;
  if (reg) {
    registry::RunFilter f;
    f.experiment = r.experiment;
    for (const auto& rec : reg->runs(f)) {
      auto it = run_by_id.find(rec.run_id);
      json j = run_provenance(rec, it == run_by_id.end() ? nullptr : it->second);
      j["included"] = included.count(rec.run_id) ? json(included[rec.run_id]) : json(false);
      if (j.contains("wall_time_s") && j["wall_time_s"].is_number()) wall_total += j["wall_time_s"].get<double>();
      prov["runs"].push_back(j);
    }
  }
  write(dir / "provenance.json", prov.dump(2) + "\n", s);
  {
    const json& m = prov["machine"];
    std::ostringstream md;
    md << "# Provenance: " << (r.title.empty() ? r.experiment : r.title) << "\n\n";
    md << "- report written " << m.value("date", "") << " on " << m.value("host", "?");
    if (!m["gpus"].empty()) {
      md << ", GPUs:";
      for (const auto& g : m["gpus"]) md << " " << g.get<std::string>() << ";";
    }
    if (m.contains("cpu")) md << " CPU " << m["cpu"].get<std::string>() << " (" << m.value("cores", 0) << " cores)";
    md << "\n- lar commit " << m.value("commit", std::string("unknown")) << (m.value("dirty", false) ? " (with local changes)" : "")
       << "\n- experiment " << r.experiment << ", scale " << (r.scale.empty() ? "(none)" : r.scale)
       << (o.seeds > 0 ? ", seeds 0.." + std::to_string(o.seeds - 1) : ", the spec's seeds") << "\n";
    if (!o.command.empty()) md << "- command: `" << o.command << "`\n";
    md << "- " << prov["runs"].size() << " runs, " << fmt::format("{:.1f}", wall_total / 60)
       << " min of trainer wall time in all (cells ran side by side, so the elapsed time is shorter)\n\n";
    md << "| run | status | counts | host | backend | steps | tokens | epochs | wall s | tok/s | attempts |\n"
       << "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& j : prov["runs"]) {
      md << "| " << j["run_id"].get<std::string>() << " | " << j["status"].get<std::string>() << " | "
         << (j.value("included", false) ? "yes" : "no") << " | " << j.value("host", "") << " | "
         << j.value("backend", std::string("—")) << " | " << j["step"].get<long>() << "/" << j["total_steps"].get<long>()
         << " | " << num_or_dash(j, "tokens", "{:.0f}") << " | " << num_or_dash(j, "epochs", "{:.2f}") << " | "
         << num_or_dash(j, "wall_time_s", "{:.1f}") << " | " << num_or_dash(j, "tokens_per_s", "{:.0f}") << " | "
         << j.value("attempts", 0) << " |\n";
    }
    write(dir / "provenance.md", md.str(), s);
  }

  // The audit and the table.
  write(dir / "audit.md", audit_markdown(r), s);
  write(dir / "audit.json", audit_json(r).dump(2) + "\n", s);
  write(dir / "table.csv", table_csv(r), s);

  std::ostringstream md;
  md << "# " << (r.title.empty() ? r.experiment : r.title) << " at scale " << (r.scale.empty() ? "(none)" : r.scale)
     << "\n\n";
  if (!r.description.empty()) md << r.description << ".\n\n";
  if (!o.command.empty()) md << "Made by `" << o.command << "`; see [provenance.md](provenance.md) for the machine, commit and every run.\n\n";
  md << table_markdown(r) << "\n";
  if (!r.claims.empty()) md << claims_markdown(r) << "\n";
  else md << "This spec declares no claims.\n\n";
  for (const auto& a : r.agreement)
    if (a.n > 0)
      md << "- " << a.metric << " against the paper over " << a.n << " main rows: Spearman ρ = "
         << (a.spearman ? fmt::format("{:.3f}", *a.spearman) : std::string("n/a")) << ", Kendall τ-b = "
         << (a.kendall ? fmt::format("{:.3f}", *a.kendall) : std::string("n/a")) << "\n";
  md << "\nFiles: [audit.md](audit.md) (which runs count and why), [audit.json](audit.json), [table.csv](table.csv), "
        "[provenance.md](provenance.md)";
  for (const auto& f : figures) md << ", [" << f << "](" << f << ")";
  md << ".\n";
  for (const auto& f : figures) md << "\n![" << f << "](" << f << ")\n";
  if (!s.warnings.empty()) {
    md << "\nNot written:\n";
    for (const auto& w : s.warnings) md << "- " << w << "\n";
  }
  write(dir / "README.md", md.str(), s);
  return s;
}

}  // namespace lar::report

#include "registry/report/figure.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace lar::report {

namespace {

// gnuplot double-quoted string: escape backslash and quote.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string num(double v) { return fmt::format("{:.17g}", v); }

// XML comments must not contain "--".
std::string comment_safe(std::string s) {
  for (size_t p; (p = s.find("--")) != std::string::npos;) s.replace(p, 2, "- -");
  return s;
}

const char* kLarDataTag = "lar-figure-data";

std::string axis_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

std::vector<std::string> Figure::runs() const {
  std::set<std::string> ids;
  for (const auto& s : series) ids.insert(s.run_ids.begin(), s.run_ids.end());
  return {ids.begin(), ids.end()};
}

std::string gnuplot_script(const Figure& fig, const std::string& format, const std::filesystem::path& out) {
  std::ostringstream os;
  if (format == "svg") os << "set terminal svg size 900,560 dynamic font 'sans,11' background rgb 'white'\n";
  else if (format == "png") os << "set terminal pngcairo size 1200,750 font 'sans,11'\n";
  else if (format == "pdf") os << "set terminal pdfcairo size 7.5in,4.7in font 'sans,9'\n";
  else throw UserError("unknown figure format '" + format + "' (choices: svg, png, pdf)");
  os << "set output " << quoted(out.string()) << "\n";
  os << "set title " << quoted(fig.title) << " noenhanced\n";
  os << "set xlabel " << quoted(fig.xlabel) << " noenhanced\n";
  os << "set ylabel " << quoted(fig.ylabel) << " noenhanced\n";
  if (fig.logx) os << "set logscale x\n";
  os << "set grid\nset key outside right top noenhanced\n";
  // Caption: the runs this figure was drawn from (wrapped, at most 6 lines).
  const auto runs = fig.runs();
  std::vector<std::string> lines;
  std::string line = fmt::format("{} runs:", runs.size());
  for (const auto& id : runs) {
    if (line.size() + id.size() > 150) {
      lines.push_back(line);
      line = " ";
    }
    line += " " + id;
  }
  lines.push_back(line);
  if (lines.size() > 6) {
    lines.resize(6);
    lines.back() += " … (all printed by lar export)";
  }
  os << "set bmargin " << 4 + lines.size() << "\n";
  for (size_t i = 0; i < lines.size(); ++i)
    os << "set label " << i + 1 << " " << quoted(lines[i]) << " at screen 0.01, screen " << 0.012 + 0.028 * (lines.size() - 1 - i)
       << " font ',7' noenhanced\n";
  // Data inline, one datablock per series.
  for (size_t i = 0; i < fig.series.size(); ++i) {
    os << "$s" << i << " << EOD\n";
    for (const auto& p : fig.series[i].points) os << num(p.x) << " " << num(p.y) << "\n";
    os << "EOD\n";
  }
  std::vector<std::string> plots;
  for (size_t i = 0; i < fig.series.size(); ++i) {
    const auto& s = fig.series[i];
    if (s.points.empty()) continue;
    std::string style = s.published ? "linespoints dashtype 2 pointtype 6" : "linespoints pointtype 7";
    if (!s.lines) style = s.published ? "points pointtype 6 pointsize 1.3" : "points pointtype 7 pointsize 1.3";
    else if (s.points.size() > 40) style = s.published ? "lines dashtype 2" : "lines";  // curves: markers would blot
    plots.push_back(fmt::format("$s{} using 1:2 with {} linewidth 1.5 title {}", i, style, quoted(s.label)));
  }
  if (plots.empty()) {
    os << "set label 100 'no data' at graph 0.5, graph 0.5 center\nset xrange [0:1]\nset yrange [0:1]\nplot NaN notitle\n";
  } else {
    os << "plot ";
    for (size_t i = 0; i < plots.size(); ++i) os << (i ? ", \\\n     " : "") << plots[i];
    os << "\n";
  }
  os << "unset output\n";
  return os.str();
}

void render_figure(const Figure& fig, const std::string& format, const std::filesystem::path& out) {
  const std::string script = gnuplot_script(fig, format, out);
  std::error_code ec;
  std::filesystem::remove(out, ec);
  FILE* gp = ::popen("gnuplot 2>&1", "w");
  if (!gp) throw RuntimeError("cannot start gnuplot (install the Debian package gnuplot-nox)");
  std::fwrite(script.data(), 1, script.size(), gp);
  const int rc = ::pclose(gp);
  if (rc != 0) throw RuntimeError("gnuplot failed (exit status " + std::to_string(rc) + ") drawing " + fig.name);
  std::string why;
  if (!figure_file_ok(out, format, &why)) throw RuntimeError("gnuplot wrote no valid " + format + " to " + out.string() + ": " + why);
  if (format != "svg") return;
  // Put the provenance into the SVG itself: run ids and the exact data points.
  std::ifstream in(out, std::ios::binary);
  std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ostringstream c;
  c << "<!-- " << kLarDataTag << "\n";
  c << comment_safe(fmt::format("figure {}; runs: ", fig.name));
  for (const auto& id : fig.runs()) c << comment_safe(id) << " ";
  c << "\n";
  for (const auto& s : fig.series) {
    c << "series\t" << comment_safe(s.label) << "\n";
    for (const auto& p : s.points) c << num(p.x) << "\t" << num(p.y) << "\n";
  }
  c << "-->\n";
  auto pos = svg.find("<svg");
  if (pos == std::string::npos) throw RuntimeError("gnuplot's SVG has no <svg> element: " + out.string());
  svg.insert(pos, c.str());
  std::ofstream o(out, std::ios::binary | std::ios::trunc);
  o << svg;
  if (!o) throw RuntimeError("cannot write " + out.string());
}

bool figure_file_ok(const std::filesystem::path& file, const std::string& format, std::string* why) {
  auto fail = [&](const std::string& w) {
    if (why) *why = w;
    return false;
  };
  std::ifstream in(file, std::ios::binary);
  if (!in) return fail("file missing");
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (head.empty()) return fail("file is empty");
  if (format == "png") return head.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0 ? true : fail("no PNG signature");
  if (format == "pdf") {
    if (head.compare(0, 5, "%PDF-") != 0) return fail("no %PDF- header");
    std::ifstream all(file, std::ios::binary);
    std::string body((std::istreambuf_iterator<char>(all)), std::istreambuf_iterator<char>());
    return body.find("%%EOF") != std::string::npos ? true : fail("no %%EOF trailer");
  }
  if (format == "svg") {
    if (head.find("<?xml") == std::string::npos && head.find("<svg") == std::string::npos) return fail("not XML");
    std::ifstream all(file, std::ios::binary);
    std::string body((std::istreambuf_iterator<char>(all)), std::istreambuf_iterator<char>());
    if (body.find("<svg") == std::string::npos) return fail("no <svg> root element");
    if (body.find("</svg>") == std::string::npos) return fail("the <svg> element is not closed");
    return true;
  }
  return fail("unknown format " + format);
}

std::vector<Series> svg_embedded_data(const std::filesystem::path& svg) {
  std::ifstream in(svg, std::ios::binary);
  std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Series> out;
  auto start = body.find(std::string("<!-- ") + kLarDataTag);
  if (start == std::string::npos) return out;
  auto end = body.find("-->", start);
  std::istringstream ss(body.substr(start, end - start));
  std::string line;
  std::getline(ss, line);  // tag
  std::getline(ss, line);  // figure/runs
  while (std::getline(ss, line)) {
    if (line.rfind("series\t", 0) == 0) {
      out.push_back({line.substr(7), {}, {}, false, true});
      continue;
    }
    if (out.empty() || line.empty()) continue;
    std::istringstream ls(line);
    Point p;
    if (ls >> p.x >> p.y) out.back().points.push_back(p);
  }
  return out;
}

Figure metric_vs_axis(const Report& rep, const std::string& x_axis, const std::string& y_metric,
                      const std::vector<std::string>& series_axes) {
  Figure fig;
  fig.xlabel = x_axis;
  fig.ylabel = y_metric;
  std::map<std::string, size_t> index;  // series key → position (ours); paper series follow
  std::vector<Series> ours, paper;
  for (const auto& row : rep.rows) {
    std::optional<double> x;
    std::string key;
    for (const auto& [a, v] : row.axes) {
      if (a == x_axis && v.is_number()) x = v.get<double>();
      if (std::find(series_axes.begin(), series_axes.end(), a) != series_axes.end())
        key += (key.empty() ? "" : "/") + axis_text(v);
    }
    if (!x) continue;
    if (key.empty()) key = "all";
    auto [it, fresh] = index.try_emplace(key, ours.size());
    if (fresh) {
      ours.push_back({key, {}, {}, false, true});
      paper.push_back({key + " (paper)", {}, {}, true, true});
    }
    if (auto o = row.ours.find(y_metric); o != row.ours.end() && o->second.stats.n > 0) {
      ours[it->second].points.push_back({*x, o->second.stats.mean});
      auto& ids = ours[it->second].run_ids;
      ids.insert(ids.end(), o->second.run_ids.begin(), o->second.run_ids.end());
    }
    if (auto p = row.published.find(y_metric); p != row.published.end()) paper[it->second].points.push_back({*x, p->second});
  }
  auto by_x = [](const Point& a, const Point& b) { return a.x < b.x; };
  for (auto& s : ours) std::stable_sort(s.points.begin(), s.points.end(), by_x);
  for (auto& s : paper) std::stable_sort(s.points.begin(), s.points.end(), by_x);
  fig.series = ours;
  for (auto& s : paper)
    if (!s.points.empty()) fig.series.push_back(s);
  return fig;
}

Figure metrics_at_lengths(const Report& rep, const std::string& y_prefix) {
  Figure fig;
  fig.xlabel = "context length";
  fig.ylabel = y_prefix;
  std::vector<std::pair<std::string, double>> cols;  // metric, its length
  for (const auto& m : rep.metrics) {
    if (m.rfind(y_prefix + "@", 0) != 0) continue;
    try {
      size_t used = 0;
      const std::string len = m.substr(y_prefix.size() + 1);
      const double L = std::stod(len, &used);
      if (used == len.size()) cols.push_back({m, L});
    } catch (const std::exception&) {
    }
  }
  for (const auto& row : rep.rows) {
    Series ours{row.id, {}, {}, false, true}, paper{row.id + " (paper)", {}, {}, true, true};
    for (const auto& [m, L] : cols) {
      if (auto o = row.ours.find(m); o != row.ours.end() && o->second.stats.n > 0) {
        ours.points.push_back({L, o->second.stats.mean});
        ours.run_ids.insert(ours.run_ids.end(), o->second.run_ids.begin(), o->second.run_ids.end());
      }
      if (auto p = row.published.find(m); p != row.published.end()) paper.points.push_back({L, p->second});
    }
    if (!ours.points.empty()) fig.series.push_back(ours);
    if (!paper.points.empty()) fig.series.push_back(paper);
  }
  return fig;
}

Figure metric_vs_metric(const Report& rep, const std::string& x_metric, const std::string& y_metric) {
  Figure fig;
  fig.xlabel = x_metric;
  fig.ylabel = y_metric;
  // A scatter: each point is one table row, not a path.
  Series ours{"ours", {}, {}, false, false}, paper{"paper", {}, {}, true, false};
  std::vector<std::pair<Point, std::string>> ours_pts, paper_pts;
  for (const auto& row : rep.rows) {
    auto ox = row.ours.find(x_metric), oy = row.ours.find(y_metric);
    if (ox != row.ours.end() && oy != row.ours.end() && ox->second.stats.n > 0 && oy->second.stats.n > 0) {
      ours.points.push_back({ox->second.stats.mean, oy->second.stats.mean});
      ours.run_ids.insert(ours.run_ids.end(), oy->second.run_ids.begin(), oy->second.run_ids.end());
    }
    auto px = row.published.find(x_metric), py = row.published.find(y_metric);
    if (px != row.published.end() && py != row.published.end()) paper.points.push_back({px->second, py->second});
  }
  auto by_x = [](const Point& a, const Point& b) { return a.x < b.x; };
  std::stable_sort(ours.points.begin(), ours.points.end(), by_x);
  std::stable_sort(paper.points.begin(), paper.points.end(), by_x);
  fig.series = {ours};
  if (!paper.points.empty()) fig.series.push_back(paper);
  return fig;
}

Figure curves_figure(const std::string& name, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Curve>& curves) {
  Figure fig;
  fig.name = name;
  fig.title = title;
  fig.xlabel = xlabel;
  fig.ylabel = ylabel;
  for (const auto& c : curves) fig.series.push_back({c.label, c.points, {c.run_id}, false, true});
  return fig;
}

const std::vector<FigureDef>& figure_catalogue() {
  static const std::vector<FigureDef> defs = {
      // The paper plots validation loss; lar evaluates at the phase ends only (eval.every
      // 0), so the curves are the training loss logged every step.
      {"laa/fig3", "laa/table2", "curves", "tokens", "loss", {},
       "LAA Fig. 3: training loss vs tokens (Table 2 runs)"},
      {"laa/fig4", "laa/lr_sweep", "curves", "step", "loss", {},
       "LAA Fig. 4: training loss of the learning-rate sweep"},
      {"laa/fig5", "laa/lr_sweep", "metric_vs_axis", "lr", "final_loss", {"architecture", "optimizer"},
       "LAA Fig. 5: final loss vs learning rate"},
      {"laa/fig6", "laa/fig6", "metric_vs_axis", "seq_len", "sec_per_iter", {"architecture", "stack"},
       "LAA Fig. 6: seconds per training iteration vs sequence length"},
      {"laa/frontier", "laa/table2", "metric_vs_metric", "rel_throughput_pct", "final_loss", {},
       "LAA Table 2: loss–throughput frontier"},
      // ppl@L of `lar eval --lengths` (token-weighted, non-overlapping windows), one line per cell.
      {"ccq/fig3_4", "ccq/fig3_4", "metrics_at_lengths", "", "ppl", {},
       "CCQ Figs. 3-4: token perplexity vs context length"},
  };
  return defs;
}

const FigureDef& find_figure(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& d : figure_catalogue()) {
    if (d.name == name) return d;
    names.push_back(d.name);
  }
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  std::string msg = "unknown figure '" + name + "' (choices: " + all + ")";
  std::string hint = did_you_mean(name, names);
  if (!hint.empty()) msg += "; " + hint;
  throw UserError(msg);
}

}  // namespace lar::report

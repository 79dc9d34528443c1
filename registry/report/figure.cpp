#include "registry/report/figure.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <unistd.h>

#include "core/error.hpp"

namespace lar::report {

namespace {

// gnuplot double-quoted string: escape backslash and quote.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
      continue;
    }
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

// One page size per format, the same aspect ratio and the same font-to-height ratio, so
// the three look alike; 6.5 in wide (a paper's text width) with 8 pt type in the PDF.
struct Page {
  double w_in, h_in;
};

Page page_of(const Figure& fig) {
  if (fig.panels.empty()) return {6.5, 4.0};
  const int cols = std::max(1, fig.cols);
  const int rows = static_cast<int>((fig.panels.size() + cols - 1) / cols);
  const double w = cols >= 4 ? 10.0 : 6.5;
  return {w, std::min(9.0, 0.9 + rows * (w / cols) * 0.85)};
}

// Points of type per nominal point: each terminal's own unit (SVG px at 96/in, the PNG's
// pixels at 200 dpi as pngcairo scales them, PDF points).
double font_unit(const std::string& format) {
  if (format == "svg") return 96.0 / 72;
  if (format == "png") return 200.0 / 72 * 0.5;  // pngcairo draws a "point" 1.5 px at 200 dpi
  return 1.0;
}

// A round tick step giving about `target` ticks over [lo, hi] (1, 2, 5 × 10^k).
double nice_step(double lo, double hi, int target) {
  const double raw = (hi - lo) / target;
  if (!(raw > 0) || !std::isfinite(raw)) return 0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

// Text is plain (the terminals run noenhanced): '_' in a metric name stays '_'.
std::string terminal(const std::string& format, Page pg) {
  const double font_pt = 8.5;
  if (format == "svg")  // 96 px per inch
    return fmt::format("set terminal svg size {},{} dynamic noenhanced font 'DejaVu Sans,{:.1f}' linewidth 1.1 background rgb 'white'\n",
                       std::lround(pg.w_in * 96), std::lround(pg.h_in * 96), font_pt * 96 / 72);
  if (format == "png")  // 200 dpi: sharp in print, small enough to mail
    return fmt::format("set terminal pngcairo size {},{} noenhanced font 'DejaVu Sans,{:.1f}' linewidth {:.2f} background rgb 'white'\n",
                       std::lround(pg.w_in * 200), std::lround(pg.h_in * 200), font_pt * font_unit("png"), 200.0 / 72 * 0.75);
  if (format == "pdf")
    return fmt::format("set terminal pdfcairo size {}in,{}in noenhanced font 'DejaVu Sans,{:.1f}' linewidth 1.0 pointscale 0.4\n", pg.w_in, pg.h_in,
                       font_pt);
  throw UserError("unknown figure format '" + format + "' (choices: svg, png, pdf)");
}

// gnuplot dash patterns of Style::dash, short enough to show in a legend sample.
std::string dash_pattern(int dash) {
  switch (dash) {
    case 2: return "(14,8)";
    case 3: return "(2,5)";
    case 4: return "(16,6,3,6)";
    default: return "solid";
  }
}

std::string rgb(const std::string& c) { return "rgb " + quoted(c); }

// Caption lines: the runs a figure was drawn from (wrapped, at most `max_lines`).
std::vector<std::string> caption_lines(const std::vector<std::string>& runs, size_t width, size_t max_lines) {
  std::vector<std::string> lines;
  std::string line = fmt::format("{} runs:", runs.size());
  for (const auto& id : runs) {
    if (line.size() + id.size() > width) {
      lines.push_back(line);
      line = " ";
    }
    line += " " + id;
  }
  lines.push_back(line);
  if (lines.size() > max_lines) {
    lines.resize(max_lines);
    lines.back() += " … (all printed by lar export)";
  }
  return lines;
}

// Training curves fall steeply at first and then separate by little: the y range starts
// at 15 % of the x range (as the papers' loss figures), so the later part, where the
// series differ, fills the plot.
std::string curve_yrange(const Figure& fig) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0;
  bool curves = false;
  for (const auto& s : fig.series) {
    if (!s.band || s.points.size() < 20) continue;
    curves = true;
    x0 = std::min(x0, s.points.front().x), x1 = std::max(x1, s.points.back().x);
  }
  if (!curves || fig.logy || !(x1 > x0)) return "set yrange [*:*]";
  const double cut = x0 + 0.15 * (x1 - x0);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto& s : fig.series)
    for (const auto* pts : {&s.points, &s.raw})
      for (const auto& p : *pts)
        if (p.x >= cut && std::isfinite(p.y)) lo = std::min(lo, p.y - p.err), hi = std::max(hi, p.y + p.err);
  if (!(hi > lo)) return "set yrange [*:*]";
  const double pad = 0.05 * (hi - lo);
  return "set yrange [" + num(lo - pad) + ":" + num(hi + pad) + "]";
}

// The plot commands of one panel (or of a single figure). `block` numbers the datablocks
// across panels; `key` false hides the legend.
void plot_panel(std::ostringstream& os, const Figure& fig, int& block, bool key, double font_scale, bool small) {
  os << "set title " << quoted(fig.note.empty() ? fig.title : fig.title + "\n" + fig.note) << "\n";
  os << "set xlabel " << quoted(fig.xlabel) << "\nset ylabel " << quoted(fig.ylabel) << "\n";
  os << "unset logscale\n";
  // Log axes end at the data, not at the next power of the base.
  if (fig.logx) os << "set logscale x " << fig.log_base_x << "\n";
  if (fig.logy) os << "set logscale y\n";
  os << "set format x " << quoted(fig.xformat.empty() ? "% h" : fig.xformat) << "\nset format y '% h'\n";
  // Small panels: about four y ticks (gnuplot picks by range, not by the panel's size).
  os << "set ytics autofreq\n";
  if (small && !fig.logy) {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (const auto& s : fig.series)
      for (const auto& p : s.points)
        if (std::isfinite(p.y)) lo = std::min(lo, p.y - p.err), hi = std::max(hi, p.y + p.err);
    if (fig.bars) lo = std::min(lo, 0.0);
    if (const double step = nice_step(lo, hi, 4); step > 0) os << "set ytics " << num(step) << "\n";
  }
  if (!fig.xtics.empty()) {
    os << "set xtics (";
    for (size_t i = 0; i < fig.xtics.size(); ++i)
      os << (i ? ", " : "") << quoted(fig.xtics[i].second) << " " << num(fig.xtics[i].first);
    os << ")\n";
  } else {
    os << "set xtics autofreq\n";
    // Small panels: about three x ticks, so long labels ("140k") do not run together.
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (const auto& s : fig.series)
      for (const auto& p : s.points)
        if (std::isfinite(p.x)) lo = std::min(lo, p.x), hi = std::max(hi, p.x);
    if (small && !fig.logx)
      if (const double step = nice_step(lo, hi, 3); step > 0) os << "set xtics " << num(step) << "\n";
  }
  os << "unset arrow\nunset label\nunset object\n";
  if (key) os << "set key " << (fig.bars ? "inside top center horizontal" : "outside right top vertical") << " Left reverse samplen 4.5 spacing 1.05 width 1.5 font ',"
               << fmt::format("{:.1f}", 7.5 * font_scale) << "'\n";
  else os << "set key off\n";
  // Scatter plots: room around the outermost points and their labels.
  if (!fig.labels.empty() && !fig.bars) os << "set offsets graph 0.06, graph 0.16, graph 0.06, graph 0.06\n";
  else if (fig.logx) os << "set offsets graph 0.04, graph 0.04, 0, 0\n";
  else os << "set offsets 0, 0, 0, 0\n";
  if (fig.bars) {
    // Headroom above the tallest bar for its value and the legend.
    double hi = 0;
    for (const auto& s : fig.series)
      for (const auto& p : s.points)
        if (std::isfinite(p.y)) hi = std::max(hi, p.y + p.err);
    os << "set boxwidth 0.36\nset xrange [-0.6:" << num(static_cast<double>(fig.xtics.size()) - 0.4) << "]\nset yrange [0:"
       << (hi > 0 ? num(hi * 1.32) : std::string("*")) << "]\n";
  } else {
    os << "set xrange [*:*]\n" << curve_yrange(fig) << "\n";
    // The x axis ends at the data (with the offsets), not at the next tick or power.
    os << "set autoscale xfix\n";
  }
  for (size_t i = 0; i < fig.links.size(); ++i) {
    const auto& l = fig.links[i];
    os << fmt::format("set arrow {} from {},{} to {},{} nohead lc {} lw 0.9 dt {} back\n", i + 1, num(l.from.x), num(l.from.y),
                      num(l.to.x), num(l.to.y), rgb(l.colour), dash_pattern(l.dash));
  }
  for (size_t i = 0; i < fig.labels.size(); ++i) {
    const auto& t = fig.labels[i];
    os << fmt::format("set label {} {} at {},{} offset char 0.7,0.45 font ',{:.1f}' tc {} front\n", i + 10, quoted(t.text),
                      num(t.at.x), num(t.at.y), 6.5 * font_scale, rgb(t.colour));
  }
  // Datablocks: the line, the raw curve, the band / error bars, the best point.
  std::vector<std::string> back, mid, front, rings;
  bool best_titled = false;
  for (const auto& s : fig.series) {
    const int b = block++;
    os << "$d" << b << " << EOD\n";
    for (const auto& p : s.points) os << num(p.x) << " " << num(p.y) << " " << num(p.err) << "\n";
    os << "EOD\n";
    if (s.points.empty()) continue;
    const Style& st = s.style;
    const double lw = st.width * (s.emphasis ? 1.8 : 1.0);
    const std::string title = s.label.empty() || !s.keyed ? "notitle" : "title " + quoted(s.label);
    if (!s.raw.empty()) {
      os << "$r" << b << " << EOD\n";
      for (const auto& p : s.raw) os << num(p.x) << " " << num(p.y) << "\n";
      os << "EOD\n";
      back.push_back(fmt::format("$r{} using 1:2 with lines lc {} lw 0.7 dt 1 notitle", b, rgb(tint(st.colour, 0.62))));
    }
    const bool has_err = std::any_of(s.points.begin(), s.points.end(), [](const Point& p) { return p.err > 0; });
    if (fig.bars) {
      const std::string fill = s.published ? fmt::format("fs transparent solid 0.22 border lc {}", rgb(st.colour))
                                           : fmt::format("fs solid 0.9 border lc {}", rgb(shade(st.colour, 0.3)));
      front.push_back(fmt::format("$d{} using 1:2 with boxes lc {} lw 1.2 {} {}", b, rgb(st.colour), fill, title));
      if (has_err) front.push_back(fmt::format("$d{} using 1:2:3 with yerrorbars lc rgb '#222222' pt 0 lw 1 notitle", b));
      continue;
    }
    if (has_err && s.band)
      mid.push_back(fmt::format("$d{} using 1:($2-$3):($2+$3) with filledcurves lc {} fs transparent solid 0.2 noborder notitle", b,
                                rgb(st.colour)));
    else if (has_err)
      mid.push_back(fmt::format("$d{} using 1:2:3 with yerrorbars lc {} pt 0 lw 1 notitle", b, rgb(st.colour)));
    const int marker = s.published ? st.open_marker : st.marker;
    const double ps = s.published ? 1.25 : 1.0;
    if (st.marker < 0) {  // a plain line (a front, a guide)
      back.push_back(fmt::format("$d{} using 1:2 with lines lw {:.2f} dt {} lc {} {}", b, lw, dash_pattern(st.dash), rgb(st.colour), title));
    } else if (!s.lines || (s.published && s.points.size() == 1)) {
      // On the frontier, a one-point linespoints: the legend's sample then shows the segment
      // style (the optimiser) beside the marker.
      const bool sample = !s.published && s.keyed && !fig.links.empty() && s.points.size() == 1;
      front.push_back(fmt::format("$d{} using 1:2 with {} pt {} ps {} lw 1.5 dt {} lc {} {}", b, sample ? "linespoints" : "points",
                                  marker, ps * 1.5, dash_pattern(st.dash), rgb(st.colour), title));
    } else {
      const int dash = s.published ? 3 : st.dash;
      // Markers every few points on long curves: they name the stack without blotting.
      const size_t n = s.points.size();
      const int interval = n > 12 ? static_cast<int>((n + 6) / 7) : 1;
      front.push_back(fmt::format("$d{} using 1:2 with linespoints pt {} ps {} pi {} lw {:.2f} dt {} lc {} {}", b, marker,
                                  ps * (n > 12 ? 0.95 : 1.35),
                                  interval, lw, dash_pattern(dash), rgb(st.colour), title));
    }
    if (s.best) {
      os << "$b" << b << " << EOD\n" << num(s.best->x) << " " << num(s.best->y) << "\nEOD\n";
      rings.push_back(fmt::format("$b{} using 1:2 with points pt 6 ps 2.6 lw 1.6 lc rgb '#111111' {}", b,
                                  best_titled ? "notitle" : "title 'best learning rate'"));
      best_titled = true;
    }
  }
  std::vector<std::string> plots = back;
  plots.insert(plots.end(), mid.begin(), mid.end());
  plots.insert(plots.end(), front.begin(), front.end());
  plots.insert(plots.end(), rings.begin(), rings.end());
  if (plots.empty()) {
    os << "set label 100 'no data yet' at graph 0.5, graph 0.5 center\nset xrange [0:1]\nset yrange [0:1]\nplot NaN notitle\n";
    return;
  }
  os << "plot ";
  for (size_t i = 0; i < plots.size(); ++i) os << (i ? ", \\\n     " : "") << plots[i];
  os << "\n";
}

}  // namespace

std::vector<std::string> Figure::runs() const {
  std::set<std::string> ids;
  for (const auto& s : series) ids.insert(s.run_ids.begin(), s.run_ids.end());
  for (const auto& p : panels)
    for (const auto& id : p.runs()) ids.insert(id);
  return {ids.begin(), ids.end()};
}

Series make_series(std::string label, std::vector<Point> points, std::vector<std::string> run_ids, bool published, bool lines,
                   Facets facets) {
  Series s;
  s.label = std::move(label);
  s.points = std::move(points);
  s.run_ids = std::move(run_ids);
  s.published = published;
  s.lines = lines;
  s.facets = std::move(facets);
  return s;
}

void apply_grammar(Figure& fig) {
  for (auto& p : fig.panels) {
    if (p.colour_by.empty()) p.colour_by = fig.colour_by;
    apply_grammar(p);
  }
  // Facets of our series decide what varies; the paper's series reuse the style of ours.
  std::vector<Facets> facets;
  for (const auto& s : fig.series)
    if (!s.published && !s.keep_style) facets.push_back(s.facets);
  if (facets.empty())
    for (const auto& s : fig.series)
      if (!s.keep_style) facets.push_back(s.facets);
  const auto styles = styles_for(facets, fig.colour_by);
  const auto legends = legends_for(facets, fig.colour_by.empty());
  auto find = [&](const Facets& f) -> std::optional<size_t> {
    for (size_t i = 0; i < facets.size(); ++i)
      if (facets[i] == f) return i;
    return std::nullopt;
  };
  for (auto& s : fig.series) {
    if (s.keep_style) continue;
    auto i = find(s.facets);
    if (!i) {
      const auto one = styles_for({s.facets}, fig.colour_by);
      s.style = one.front();
      if (s.label.empty()) s.label = legends_for({s.facets}, fig.colour_by.empty()).front() + (s.published ? " (paper)" : "");
      continue;
    }
    s.style = styles[*i];
    if (s.label.empty()) s.label = legends[*i] + (s.published ? " (paper)" : "");
  }
}

std::vector<Point> ema(const std::vector<Point>& pts, double a) {
  if (!(a > 0) || pts.empty()) return pts;
  std::vector<Point> out = pts;
  double m = pts.front().y;
  for (size_t i = 0; i < pts.size(); ++i) {
    if (std::isfinite(pts[i].y)) m = a * m + (1 - a) * pts[i].y;
    out[i].y = std::isfinite(pts[i].y) ? m : pts[i].y;
  }
  return out;
}

std::vector<Point> mean_curve(const std::vector<std::vector<Point>>& curves) {
  if (curves.empty()) return {};
  if (curves.size() == 1) return curves.front();
  std::vector<std::map<double, double>> by_x(curves.size());
  for (size_t c = 0; c < curves.size(); ++c)
    for (const auto& p : curves[c]) by_x[c][p.x] = p.y;
  std::vector<Point> out;
  for (const auto& p : curves.front()) {
    std::vector<double> ys;
    for (const auto& m : by_x)
      if (auto it = m.find(p.x); it != m.end()) ys.push_back(it->second);
    if (ys.size() != curves.size()) continue;
    const SampleStats st = sample_stats(ys);
    out.push_back({p.x, st.mean, st.std});
  }
  return out;
}

std::vector<Point> pareto_front(std::vector<Point> pts) {
  std::sort(pts.begin(), pts.end(), [](const Point& a, const Point& b) { return a.x > b.x || (a.x == b.x && a.y < b.y); });
  std::vector<Point> front;
  double best = std::numeric_limits<double>::infinity();
  for (const auto& p : pts)
    if (p.y < best) {
      front.push_back(p);
      best = p.y;
    }
  std::reverse(front.begin(), front.end());
  return front;
}

std::string gnuplot_script(const Figure& fig, const std::string& format, const std::filesystem::path& out) {
  std::ostringstream os;
  const Page pg = page_of(fig);
  os << terminal(format, pg);
  const double unit = font_unit(format);
  os << "set output " << quoted(out.string()) << "\n";
  os << "set encoding utf8\nset grid lc rgb '#dddddd' lw 0.6\nset border lw 0.8\nset tics nomirror out scale 0.6\nset mxtics default\n"
        "set style fill solid 1.0\nset errorbars small\n";
  const auto runs = fig.runs();
  const size_t width = static_cast<size_t>(pg.w_in * 19);  // characters of 6 pt type a line
  const auto lines = caption_lines(runs, width, 4);
  const double line_h = 0.11 / pg.h_in;  // caption line height, screen fraction (6.5 pt type)
  int block = 0;
  auto caption = [&] {
    for (size_t i = 0; i < lines.size(); ++i)
      os << "set label " << i + 1 << " " << quoted(lines[i]) << " at screen 0.01, screen "
         << num(0.02 + line_h * static_cast<double>(lines.size() - 1 - i)) << " font '," << fmt::format("{:.1f}", 6 * unit) << "' tc rgb '#555555' front\n";
  };
  if (fig.panels.empty()) {
    std::ostringstream body;
    plot_panel(body, fig, block, true, unit, false);
    // Caption labels go after plot_panel's "unset label"; the bottom margin leaves room.
    std::string b = body.str();
    const auto at = b.find("plot ");
    os << b.substr(0, at);
    os << "set bmargin at screen " << num(0.145 + line_h * static_cast<double>(lines.size())) << "\n";
    caption();
    os << b.substr(at);
  } else {
    const int cols = std::max(1, fig.cols);
    const int rows = static_cast<int>((fig.panels.size() + cols - 1) / cols);
    const double cap = 0.03 + line_h * static_cast<double>(lines.size());
    const double top = 0.3 / pg.h_in;
    os << "set multiplot title " << quoted(fig.note.empty() ? fig.title : fig.title + "\n" + fig.note)
       << "\n";
    const double ph = (1.0 - cap - top) / rows;
    for (size_t k = 0; k < fig.panels.size(); ++k) {
      const int r = static_cast<int>(k) / cols, c = static_cast<int>(k) % cols;
      os << "set origin " << num(static_cast<double>(c) / cols) << "," << num(cap + (rows - 1 - r) * ph) << "\nset size "
         << num(1.0 / cols) << "," << num(ph) << "\n";
      std::ostringstream body;
      const bool key = !fig.key_in_first_panel_only || k == 0;
      plot_panel(body, fig.panels[k], block, key, unit * 0.95, true);
      std::string b = body.str();
      // Panels keep their legends inside, near the data: outside would squeeze each plot.
      for (const char* from : {"outside right top vertical"}) {
        const auto p = b.find(from);
        if (p != std::string::npos) b.replace(p, std::string(from).size(), "inside top right");
      }
      if (k == 0) {
        const auto at = b.find("plot ");
        os << b.substr(0, at);
        caption();
        os << b.substr(at);
      } else {
        os << b;
      }
    }
    os << "unset multiplot\n";
  }
  os << "unset output\n";
  return os.str();
}

void render_figure(const Figure& fig, const std::string& format, const std::filesystem::path& out) {
  const std::string script = gnuplot_script(fig, format, out);
  std::error_code ec;
  std::filesystem::remove(out, ec);
  // gnuplot's messages go to a log, shown only when it fails.
  const auto log = std::filesystem::temp_directory_path() / ("lar_gnuplot_" + std::to_string(::getpid()) + ".log");
  FILE* gp = ::popen(("gnuplot > '" + log.string() + "' 2>&1").c_str(), "w");
  if (!gp) throw RuntimeError("cannot start gnuplot (install the Debian package gnuplot-nox)");
  std::fwrite(script.data(), 1, script.size(), gp);
  const int rc = ::pclose(gp);
  std::string messages;
  {
    std::ifstream in(log);
    messages.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::filesystem::remove(log, ec);
  if (rc != 0)
    throw RuntimeError("gnuplot failed (exit status " + std::to_string(rc) + ") drawing " + fig.name +
                       (messages.empty() ? "" : ":\n" + messages.substr(0, 2000)));
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
  auto write_series = [&](const Figure& f) {
    for (const auto& s : f.series) {
      c << "series\t" << comment_safe(s.label) << "\t" << s.style.colour << "\n";
      for (const auto& p : s.points) c << num(p.x) << "\t" << num(p.y) << "\t" << num(p.err) << "\n";
    }
  };
  write_series(fig);
  for (const auto& p : fig.panels) write_series(p);
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
      Series s;
      std::string rest = line.substr(7);
      const auto tab = rest.find('\t');
      s.label = rest.substr(0, tab);
      if (tab != std::string::npos) s.style.colour = rest.substr(tab + 1);
      out.push_back(s);
      continue;
    }
    if (out.empty() || line.empty()) continue;
    std::istringstream ls(line);
    Point p;
    if (ls >> p.x >> p.y) {
      ls >> p.err;
      out.back().points.push_back(p);
    }
  }
  return out;
}

}  // namespace lar::report

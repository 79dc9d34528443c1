#pragma once
// Figures: data → a gnuplot script with the data inline → SVG / PNG / PDF. Every figure
// carries the ids of the runs it was drawn from: in a caption on the figure, in an XML
// comment of the SVG (with the data points), and in `runs()` for the CLI to print.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "registry/report/report.hpp"

namespace lar::report {

struct Point {
  double x = 0, y = 0;
};

struct Series {
  std::string label;
  std::vector<Point> points;         // drawn in this order
  std::vector<std::string> run_ids;  // the runs behind the points
  bool published = false;            // the paper's values (drawn dashed, open points)
  bool lines = true;                 // false: points only (scatter plots)
};

struct Figure {
  std::string name;   // "laa/fig5"
  std::string title;
  std::string xlabel, ylabel;
  bool logx = false;
  std::vector<Series> series;
  std::vector<std::string> runs() const;  // sorted, unique
};

// The gnuplot program that draws `fig` into `out` ("svg" | "png" | "pdf").
std::string gnuplot_script(const Figure& fig, const std::string& format, const std::filesystem::path& out);

// Draw the figure with gnuplot and check the file (see figure_file_ok). Throws
// lar::UserError for an unknown format, lar::RuntimeError when gnuplot fails.
void render_figure(const Figure& fig, const std::string& format, const std::filesystem::path& out);

// True when the file is a non-empty SVG (XML with an <svg> root), PNG or PDF (magic bytes).
bool figure_file_ok(const std::filesystem::path& file, const std::string& format, std::string* why = nullptr);

// The data points of an SVG written by render_figure (read back from its lar comment):
// one entry per series, in order. For tests and for checking a figure against the registry.
std::vector<Series> svg_embedded_data(const std::filesystem::path& svg);

// --- figures from an audited report --------------------------------------------------

// Metric of each row against a numeric axis (learning rate, sequence length), one series
// per combination of `series_axes`; the paper's values as dashed series where published.
Figure metric_vs_axis(const Report& rep, const std::string& x_axis, const std::string& y_metric,
                      const std::vector<std::string>& series_axes);

// One point per row: x_metric against y_metric (the loss–throughput frontier), ours and
// the paper's.
Figure metric_vs_metric(const Report& rep, const std::string& x_metric, const std::string& y_metric);

// One series per row: the table's metrics named `<y_prefix>@L` (ppl@4096, …) against L —
// evaluation at lengths (`lar eval --lengths`), e.g. perplexity vs context length.
Figure metrics_at_lengths(const Report& rep, const std::string& y_prefix);

// A training curve: (tokens or step, loss) points of one run.
struct Curve {
  std::string label;   // row id
  std::string run_id;
  std::vector<Point> points;
};
Figure curves_figure(const std::string& name, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Curve>& curves);

// The catalogue of `lar export figure` names.
struct FigureDef {
  std::string name;     // "laa/fig5"
  std::string table;    // paper spec it draws from: "laa/lr_sweep"
  std::string kind;     // curves | metric_vs_axis | metric_vs_metric | metrics_at_lengths
  std::string x, y;     // axis / metric names (curves: the metric series key, e.g. val_loss)
  std::vector<std::string> series_axes;
  std::string title;
};
const std::vector<FigureDef>& figure_catalogue();
const FigureDef& find_figure(const std::string& name);  // throws UserError with the choices

}  // namespace lar::report

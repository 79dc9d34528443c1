#pragma once
// Figures: data → a gnuplot script with the data inline → SVG / PNG / PDF. Every figure
// carries the ids of the runs it was drawn from: in a caption on the figure, in an XML
// comment of the SVG (with the data points), and in `runs()` for the CLI to print.
// Series carry their facets (architecture, optimiser, stack, …); apply_grammar() turns
// those into colours, line styles, markers and legends (style.hpp), the same in every
// figure.
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "registry/report/report.hpp"
#include "registry/report/style.hpp"

namespace lar::report {

struct Point {
  double x = 0, y = 0;
  double err = 0;  // ± one standard deviation over seeds (0: one seed / none)
};

struct Series {
  std::string label;                 // legend text; apply_grammar fills it from the facets when empty
  std::vector<Point> points;         // drawn in this order
  std::vector<std::string> run_ids;  // the runs behind the points
  bool published = false;            // the paper's values (open markers, thin dotted line)
  bool lines = true;                 // false: points only (scatter plots)
  Facets facets;                     // what the series is
  Style style;                       // set by apply_grammar
  std::vector<Point> raw;            // the unsmoothed curve, drawn faint behind `points`
  bool band = false;                 // draw `err` as a shaded band (curves), else as error bars
  std::optional<Point> best;         // ringed point (the LR sweep's best learning rate)
  bool emphasis = false;             // drawn thicker (the best learning rate's curve)
  bool keyed = true;                 // false: not in the legend
  bool keep_style = false;           // apply_grammar leaves `style` as set
};

// A series without the styling fields (set later by apply_grammar).
Series make_series(std::string label, std::vector<Point> points, std::vector<std::string> run_ids, bool published, bool lines,
                   Facets facets = {});

// A thin segment between two points (our cell → the paper's cell on the frontier).
struct Link {
  Point from, to;
  std::string colour = "#888888";
  int dash = 1;
};

struct TextLabel {
  Point at;
  std::string text;
  std::string colour = "#222222";
};

struct Figure {
  std::string name;   // "laa/fig5"
  std::string title;
  std::string note;   // a smaller second title line (smoothing, normalisation)
  std::string xlabel, ylabel;
  bool logx = false, logy = false;
  int log_base_x = 10;
  bool bars = false;  // series are bars at category positions (xtics)
  std::vector<std::pair<double, std::string>> xtics;  // explicit tick labels (categories, lengths)
  std::string xformat;  // gnuplot format of the x tics ("%.0s%c": SI prefixes)
  std::string colour_by;  // a facet coloured by a sweep ramp instead of the architecture
  std::vector<Series> series;
  std::vector<Link> links;
  std::vector<TextLabel> labels;
  // Small multiples: when `panels` is not empty they are drawn in a grid of `cols`
  // columns (row-major) and `series` of this figure is unused.
  std::vector<Figure> panels;
  int cols = 0;
  bool key_in_first_panel_only = false;
  std::vector<std::string> runs() const;  // sorted, unique (panels included)
};

// Styles and legends from the series' facets (style.hpp): colour by architecture (or the
// `colour_by` ramp), line style by optimiser / CCQ, shade and marker by stack; the paper's
// series share the style of our series with the same facets and read "… (paper)".
// Series whose label is set keep it. Applies to every panel.
void apply_grammar(Figure& fig);

// Exponential moving average y_t = a·y_{t−1} + (1−a)·x_t started at the first value
// (a in [0, 1); 0 returns the input).
std::vector<Point> ema(const std::vector<Point>& pts, double a);

// Mean ± std over seeds of curves sampled at the same x values (the x values all curves
// share, in order). One curve: err = 0.
std::vector<Point> mean_curve(const std::vector<std::vector<Point>>& curves);

// The paper's loss–throughput Pareto front: points no other point beats on both higher x
// and lower y, sorted by x.
std::vector<Point> pareto_front(std::vector<Point> pts);

// The gnuplot program that draws `fig` into `out` ("svg" | "png" | "pdf").
std::string gnuplot_script(const Figure& fig, const std::string& format, const std::filesystem::path& out);

// Draw the figure with gnuplot and check the file (see figure_file_ok). Throws
// lar::UserError for an unknown format, lar::RuntimeError when gnuplot fails.
void render_figure(const Figure& fig, const std::string& format, const std::filesystem::path& out);

// True when the file is a non-empty SVG (XML with an <svg> root), PNG or PDF (magic bytes).
bool figure_file_ok(const std::filesystem::path& file, const std::string& format, std::string* why = nullptr);

// The data points of an SVG written by render_figure (read back from its lar comment):
// one entry per series, in order (panels one after another). For tests and for checking
// a figure against the registry.
std::vector<Series> svg_embedded_data(const std::filesystem::path& svg);

// --- figures from an audited report --------------------------------------------------

// The facets of a table row: its axes without the seed, `x_axis` and the axes a
// matrix ties to others (budget.*, schedule.*, data.batch_size, model.n_heads).
Facets row_facets(const Row& row, const std::string& x_axis = "");

// Metric of each row against a numeric axis (learning rate, sequence length), one series
// per combination of `series_axes`; the paper's values as open points where published;
// seeds' spread as error bars.
Figure metric_vs_axis(const Report& rep, const std::string& x_axis, const std::string& y_metric,
                      const std::vector<std::string>& series_axes);

// Metrics "<prefix>L" (val_loss@4096, …) of each row against L, one series per row;
// `exp_y` draws exp(value) (perplexity from loss).
Figure metric_vs_suffix(const Report& rep, const std::string& prefix, bool exp_y);

// The loss–throughput frontier: one point per row, ours filled and labelled, the paper's
// open, joined by a thin segment (solid: Muon, dashed: AdamW); the paper's Pareto front.
Figure metric_vs_metric(const Report& rep, const std::string& x_metric, const std::string& y_metric);

// Bars of each metric, one panel per metric, categories = rows, ours solid and the paper's
// light; values relative to the baseline row (= 100) when `relative`, absolute values
// printed on the bars.
Figure bars_figure(const Report& rep, const std::vector<std::string>& metrics, bool relative);

// A training curve: (tokens or step, loss) points of one run.
struct Curve {
  std::string label;   // row id
  std::string run_id;
  std::vector<Point> points;
  Facets facets = {};
};
// One series per distinct label: seeds of a row (same label) become mean ± std, drawn as
// a band; `smooth` > 0 draws the EMA with the raw mean faint behind it.
Figure curves_figure(const std::string& name, const std::string& title, const std::string& xlabel,
                     const std::string& ylabel, const std::vector<Curve>& curves, double smooth = 0);

// Split a figure's series into small multiples: one panel per value of `row_facet` ×
// `col_facet` ("" for one row / column), in the values' order of appearance.
Figure split_panels(const Figure& fig, const std::string& row_facet, const std::string& col_facet);

// The catalogue of `lar export figure` names.
struct FigureDef {
  std::string name;     // "laa/fig5"
  std::string table;    // paper spec it draws from: "laa/lr_sweep"
  std::string kind;     // curves | metric_vs_axis | metric_vs_metric | metric_vs_length | bars
  std::string x, y;     // axis / metric names (curves: the metric series key, e.g. loss)
  std::vector<std::string> series_axes;
  std::string title;
  std::string grid_rows, grid_cols;  // facets of the --grid panels ("" : none)
  bool grid_default = false;         // drawn as panels unless --no-grid
  std::string colour_by;             // facet coloured by a ramp (the LR sweep's lr)
  bool mark_best = false;            // ring the lowest y per series / thicken the best curve
  bool logx = false, logy = false;
  int log_base_x = 10;
};
const std::vector<FigureDef>& figure_catalogue();
const FigureDef& find_figure(const std::string& name);  // throws UserError with the choices

// --- from the registry ----------------------------------------------------------------

struct PaperReport;  // adapter.hpp

// The default EMA factor for curves of `points` points: 1 − 20/points, in [0, 0.95]
// (0 below 10 points): the smoothing lags the data by about a twentieth of the curve.
double auto_smoothing(size_t points);

struct FigureOptions {
  std::optional<double> smooth;  // EMA factor of training curves (default auto_smoothing; 0: raw)
  std::optional<bool> grid;      // small multiples (default: the figure's)
};

// The figure `def` of an audited table; curves read the runs' metric series from the
// registry at `db` (none when it does not exist).
Figure build_figure(const FigureDef& def, const PaperReport& p, const std::filesystem::path& db,
                    const FigureOptions& opt = {});

// For `lar reproduce … --report DIR`: every catalogue figure drawn from `paper_table`
// ("laa/table2" → laa/fig3 and laa/frontier), rendered into `dir` (created) as
// <figure name with '/' → '_'>.<format> for each format. Returns the files written, in
// order; a table no figure draws from returns {}. Throws like render_figure.
std::vector<std::filesystem::path> render_table_figures(const PaperReport& p, const std::filesystem::path& db,
                                                        const std::filesystem::path& dir,
                                                        const std::vector<std::string>& formats = {"svg", "png", "pdf"});

// The same from the table's name: plans `paper_table` at `scale` with `seeds` seeds and
// joins the registry at `db` (paper_report()), then renders as above. This is the one
// `lar reproduce … --report DIR` calls:
//   report::render_table_figures(a.table, a.scale, a.seeds, default_db_path(), dir);
std::vector<std::filesystem::path> render_table_figures(const std::string& paper_table, const std::string& scale, int seeds,
                                                        const std::filesystem::path& db, const std::filesystem::path& dir,
                                                        const std::vector<std::string>& formats = {"svg", "png", "pdf"});

// The figures of a table (names), for help texts and the report's index.
std::vector<std::string> figures_of_table(const std::string& paper_table);

}  // namespace lar::report

#pragma once
// Line charts as inline SVG, rendered on the server: no JavaScript chart library, works
// with scripts off, and the page is one request. A chart is a few polylines over
// "nice" axis ticks; non-finite values break a line (a diverged run ends visibly).
#include <string>
#include <utility>
#include <vector>

namespace lar::serve {

struct ChartSeries {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
  std::string colour = "";  // "#rrggbb" (the figures' grammar: report::styles_for); "" → series_colour(i)
  bool dashed = false;      // AdamW / +CCQ, as in the paper figures
};

struct ChartOptions {
  std::string title;
  std::string x_label = "step";
  std::string y_label;
  int width = 600;
  int height = 260;
};

// Every point of every series is drawn after downsampling each series to at most
// `max_points_per_series` points; an empty chart says "no data".
std::string svg_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& opt,
                           size_t max_points_per_series = 800);

// At most `max_points` points, evenly spaced by index, always keeping the first and last.
std::vector<std::pair<double, double>> downsample(const std::vector<std::pair<double, double>>& pts, size_t max_points);

// About `target` round tick values ("nice numbers": 1, 2, 5 × 10^k) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int target = 5);

// The colour of series i (a fixed palette, readable on white).
const char* series_colour(size_t i);

}  // namespace lar::serve

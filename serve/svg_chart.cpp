#include "serve/svg_chart.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "serve/text.hpp"

namespace lar::serve {

const char* series_colour(size_t i) {
  static const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  return palette[i % 8];
}

std::vector<std::pair<double, double>> downsample(const std::vector<std::pair<double, double>>& pts, size_t max_points) {
  if (pts.size() <= max_points || max_points < 2) return pts;
  std::vector<std::pair<double, double>> out;
  out.reserve(max_points);
  const double stride = static_cast<double>(pts.size() - 1) / static_cast<double>(max_points - 1);
  for (size_t i = 0; i < max_points; ++i) out.push_back(pts[static_cast<size_t>(std::llround(stride * static_cast<double>(i)))]);
  out.back() = pts.back();
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  // k·step, not a running sum: no drift across ticks.
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9 && out.size() < 50; k += 1)
    out.push_back(k == 0 ? 0.0 : k * step);
  return out;
}

std::string svg_line_chart(const std::vector<ChartSeries>& series, const ChartOptions& opt, size_t max_points) {
  const double left = 64, right = 12, top = 28, bottom = 40;
  const double W = opt.width, H = opt.height, pw = W - left - right, ph = H - top - bottom;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "role=\"img\" aria-label=\"{}\">",
      opt.width, opt.height, opt.width, opt.height, html_escape(opt.title));
  s += fmt::format("<title>{}</title>", html_escape(opt.title));
  s += fmt::format("<text x=\"{}\" y=\"18\" font-size=\"13\" font-weight=\"bold\">{}</text>", left, html_escape(opt.title));

  std::vector<std::vector<std::pair<double, double>>> drawn;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& se : series) {
    drawn.push_back(downsample(se.points, max_points));
    for (const auto& [x, y] : drawn.back()) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  }
  if (!std::isfinite(x0)) {
    s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#888\">no data</text></svg>", left + pw / 2 - 20, top + ph / 2);
    return s;
  }
  if (x1 == x0) x0 -= 1, x1 += 1;
  if (y1 == y0) {
    const double pad = std::abs(y0) > 0 ? std::abs(y0) * 0.05 : 1.0;
    y0 -= pad, y1 += pad;
  } else {
    const double pad = (y1 - y0) * 0.04;
    y0 -= pad, y1 += pad;
  }
  auto X = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto Y = [&](double y) { return top + (1.0 - (y - y0) / (y1 - y0)) * ph; };

  // Axes, grid and ticks.
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fff\" stroke=\"#999\"/>", left, top, pw, ph);
  for (double t : nice_ticks(y0, y1)) {
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#eee\"/>", left, Y(t), left + pw, Y(t));
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">{}</text>", left - 4, Y(t) + 3,
                     html_escape(num_text(t, 4)));
  }
  for (double t : nice_ticks(x0, x1)) {
    s += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#eee\"/>", X(t), top, X(t), top + ph);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\">{}</text>", X(t), top + ph + 14,
                     html_escape(num_text(t, 6)));
  }
  s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\">{}</text>", left + pw / 2, H - 6,
                   html_escape(opt.x_label));
  s += fmt::format("<text x=\"12\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\" transform=\"rotate(-90 12 {:.1f})\">{}</text>",
                   top + ph / 2, top + ph / 2, html_escape(opt.y_label));

  auto colour_of = [&](size_t i) { return series[i].colour.empty() ? std::string(series_colour(i)) : series[i].colour; };
  // One path per series; a non-finite value lifts the pen.
  for (size_t i = 0; i < drawn.size(); ++i) {
    std::string d;
    bool pen = false;
    for (const auto& [x, y] : drawn[i]) {
      if (!std::isfinite(x) || !std::isfinite(y)) {
        pen = false;
        continue;
      }
      d += fmt::format("{}{:.1f},{:.1f}", pen ? "L" : "M", X(x), Y(y));
      pen = true;
    }
    if (!d.empty())
      s += fmt::format("<path class=\"series\" d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{}><title>{}</title></path>", d,
                       colour_of(i), series[i].dashed ? " stroke-dasharray=\"6 4\"" : "", html_escape(series[i].label));
  }
  // Legend (only when it tells something: several series).
  if (series.size() > 1) {
    double ly = top + 12;
    for (size_t i = 0; i < series.size() && i < 8; ++i, ly += 14) {
      s += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"2.5\"{}/>", left + pw - 200,
                       ly - 3, left + pw - 188, ly - 3, colour_of(i), series[i].dashed ? " stroke-dasharray=\"4 2\"" : "");
      s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\">{}</text>", left + pw - 186, ly,
                       html_escape(series[i].label.size() > 34 ? series[i].label.substr(0, 33) + "…" : series[i].label));
    }
  }
  s += "</svg>";
  return s;
}

}  // namespace lar::serve

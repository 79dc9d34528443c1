// The figures' visual grammar: fixed colours per architecture, line style by optimiser /
// CCQ, shade and marker by stack, legends in words, seeds as bands, EMA smoothing, small
// multiples; and what a reader gets: PNGs decoded (size, the series' colours present),
// SVGs read (legend words, colours, fonts), PDFs of the same page size.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "core/error.hpp"
#include "fixtures.hpp"
#include "png_reader.hpp"
#include "registry/report/figure.hpp"

using namespace lar;
using namespace lar::report;
using namespace lar::report::testing;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("lar_figstyle_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(path);
  }
  ~TempDir() {
    // LAR_FIGURE_KEEP=1 keeps the pictures for a person to look at.
    if (!std::getenv("LAR_FIGURE_KEEP")) fs::remove_all(path);
  }
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Facets cellf(const std::string& arch, const std::string& opt, const std::string& stack) {
  return {{"architecture", arch}, {"optimizer", opt}, {"stack", stack}};
}

// Six training curves: three mixers × two optimisers, hybrid, two seeds each, noisy.
Figure six_curves(double smooth) {
  std::vector<Curve> curves;
  const char* archs[] = {"gdn", "kda", "softmax"};
  const char* opts[] = {"normuon", "adamw"};
  for (int a = 0; a < 3; ++a)
    for (int o = 0; o < 2; ++o)
      for (int seed = 0; seed < 2; ++seed) {
        Curve c;
        c.label = std::string(archs[a]) + "." + opts[o];
        c.run_id = "exp/" + c.label + ".s" + std::to_string(seed);
        c.facets = cellf(archs[a], opts[o], a == 2 ? "dense" : "hybrid");
        for (int step = 1; step <= 200; ++step) {
          const double y = 2.5 + 0.3 * a + 0.15 * o + 3.0 / std::sqrt(step) + 0.08 * std::sin(step * 1.7 + seed);
          c.points.push_back({static_cast<double>(step), y});
        }
        curves.push_back(c);
      }
  Figure f = curves_figure("test/curves", "six curves", axis_label("step"), axis_label("loss"), curves, smooth);
  apply_grammar(f);
  return f;
}

}  // namespace

TEST(FigureStyle, ColourIsTheArchitecturesInEveryFigure) {
  const auto a = styles_for({cellf("gdn", "adamw", "pure"), cellf("kda", "adamw", "pure")});
  const auto b = styles_for({cellf("softmax", "normuon", "dense"), cellf("gdn", "normuon", "dense"), cellf("gla", "normuon", "dense")});
  EXPECT_EQ(a[0].colour, b[1].colour);
  EXPECT_EQ(a[0].colour, architecture_colour("gdn"));
  EXPECT_NE(a[0].colour, a[1].colour);
  std::set<std::string> all;
  for (const char* m : {"softmax", "linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve"}) all.insert(architecture_colour(m));
  EXPECT_EQ(all.size(), 8u);  // no two mixers share a colour
}

TEST(FigureStyle, LineStyleMarkerAndLegendWords) {
  const std::vector<Facets> f = {cellf("gdn", "normuon", "hybrid"), cellf("gdn", "adamw", "hybrid"), cellf("gdn", "normuon", "pure"),
                                 cellf("softmax", "adamw", "dense")};
  const auto st = styles_for(f);
  EXPECT_EQ(st[0].dash, 1);  // Muon solid
  EXPECT_EQ(st[1].dash, 2);  // AdamW dashed
  EXPECT_EQ(st[0].marker, 7);  // hybrid ●
  EXPECT_EQ(st[2].marker, 9);  // pure ▲
  EXPECT_EQ(st[3].marker, 5);  // dense ■
  EXPECT_EQ(st[0].colour, architecture_colour("gdn"));
  EXPECT_EQ(st[2].colour, shade(architecture_colour("gdn"), 0.38));  // pure: the mixer's colour, darker
  const auto words = legends_for(f);
  EXPECT_EQ(words[0], "GDN · Muon · hybrid");
  EXPECT_EQ(words[3], "Softmax · AdamW · dense");
  // Only what varies is named; CCQ is written as the paper writes it.
  EXPECT_EQ(legends_for({{{"architecture", "gla"}, {"ccq", "false"}}, {{"architecture", "gla"}, {"ccq", "true"}}}),
            (std::vector<std::string>{"GLA", "CCQ-GLA"}));
  const auto ccq = styles_for({{{"architecture", "gla"}, {"ccq", "false"}}, {{"architecture", "gla"}, {"ccq", "true"}}});
  EXPECT_EQ(ccq[0].dash, 1);
  EXPECT_EQ(ccq[1].dash, 2);  // +CCQ dashed, as CCQ Fig. 5
  EXPECT_EQ(facet_words("lr", "0.0003"), "lr 3e-4");
  EXPECT_EQ(axis_label("final_loss"), "final validation loss (nats/token)");
  EXPECT_EQ(axis_label("sec_per_iter"), "time per iteration (s)");
}

TEST(FigureStyle, SmoothingAndSeedBands) {
  EXPECT_DOUBLE_EQ(auto_smoothing(60), 1 - 20.0 / 60);
  EXPECT_DOUBLE_EQ(auto_smoothing(28610), 0.95);
  EXPECT_DOUBLE_EQ(auto_smoothing(5), 0.0);
  const auto e = ema({{0, 1}, {1, 3}, {2, 3}}, 0.5);
  EXPECT_DOUBLE_EQ(e[0].y, 1.0);
  EXPECT_DOUBLE_EQ(e[1].y, 2.0);
  EXPECT_DOUBLE_EQ(e[2].y, 2.5);
  const auto m = mean_curve({{{0, 1}, {1, 2}, {2, 9}}, {{0, 3}, {1, 4}}});
  ASSERT_EQ(m.size(), 2u);  // only the x both seeds have
  EXPECT_DOUBLE_EQ(m[0].y, 2.0);
  EXPECT_DOUBLE_EQ(m[0].err, std::sqrt(2.0));
  const Figure f = six_curves(0.9);
  ASSERT_EQ(f.series.size(), 6u);  // 12 runs, one series (mean ± std) per cell
  EXPECT_EQ(f.runs().size(), 12u);
  EXPECT_TRUE(f.series[0].band);
  EXPECT_GT(f.series[0].points[10].err, 0.0);
  EXPECT_EQ(f.series[0].raw.size(), 200u);
  EXPECT_EQ(f.series[0].label, "GDN · Muon · hybrid");
  EXPECT_EQ(f.series[5].label, "Softmax · AdamW · dense");
  const std::string s = gnuplot_script(f, "svg", "/tmp/x.svg");
  EXPECT_NE(s.find("with filledcurves"), std::string::npos);
  EXPECT_NE(s.find("fs transparent solid 0.2"), std::string::npos);
  EXPECT_NE(s.find("lc rgb \"" + tint(architecture_colour("gdn"), 0.62) + "\" lw 0.7"), std::string::npos) << "raw curve faint";
  EXPECT_NE(s.find("EMA-smoothed (factor 0.90)"), std::string::npos);
  const Figure raw = six_curves(0);
  EXPECT_TRUE(raw.series[0].raw.empty());
  EXPECT_EQ(gnuplot_script(raw, "svg", "/tmp/x.svg").find("EMA"), std::string::npos);
}

TEST(FigureStyle, PngShowsEverySeriesInItsColour) {
  TempDir tmp;
  const Figure f = six_curves(0.9);
  const fs::path png = tmp.path / "curves.png";
  render_figure(f, "png", png);
  const RgbImage img = read_png(png.string());
  EXPECT_EQ(img.width, 1300);  // 6.5 in at 200 dpi
  EXPECT_EQ(img.height, 800);
  const auto h = colour_histogram(img);
  EXPECT_GT(pixels_near(h, "#ffffff", 0), img.width * img.height / 2u) << "white background";
  // Each mixer's colour is on the page (lines, markers and legend samples), well above
  // anti-aliasing noise; the three are different.
  for (const char* arch : {"gdn", "kda", "softmax"}) {
    const size_t n = pixels_near(h, architecture_colour(arch), 10);
    EXPECT_GT(n, 1500u) << arch << " " << architecture_colour(arch);
  }
  // The faint raw curves are there too.
  EXPECT_GT(pixels_near(h, tint(architecture_colour("kda"), 0.62), 10), 300u);
}

TEST(FigureStyle, SvgAndPdfMatchThePng) {
  TempDir tmp;
  const Figure f = six_curves(0.9);
  render_figure(f, "svg", tmp.path / "c.svg");
  render_figure(f, "pdf", tmp.path / "c.pdf");
  const std::string svg = slurp(tmp.path / "c.svg");
  // Same 6.5 × 4 in page: 624 × 384 px at 96 px/in; the PDF 468 × 288 pt.
  EXPECT_NE(svg.find("width=\"624\" height=\"384\""), std::string::npos) << svg.substr(0, 600);
  EXPECT_NE(svg.find("DejaVu Sans"), std::string::npos);
  for (const char* words : {"GDN · Muon · hybrid", "KDA · AdamW · hybrid", "Softmax · Muon · dense"})
    EXPECT_NE(svg.find(words), std::string::npos) << words;
  // The series' colours as gnuplot writes them: rgb(r, g, b) strokes.
  auto rgb_of = [](const std::string& hex) {
    const unsigned c = static_cast<unsigned>(std::stoul(hex.substr(1), nullptr, 16));
    return std::to_string(c >> 16) + ", " + std::to_string((c >> 8) & 0xff) + ", " + std::to_string(c & 0xff);
  };
  for (const char* arch : {"gdn", "kda", "softmax"}) {
    std::regex stroke("stroke=['\"]rgb\\(\\s*" + std::regex_replace(rgb_of(architecture_colour(arch)), std::regex(", "), ",\\s*") + "\\)");
    EXPECT_TRUE(std::regex_search(svg, stroke)) << arch;
  }
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos) << "AdamW dashed";
  const auto data = svg_embedded_data(tmp.path / "c.svg");
  ASSERT_EQ(data.size(), 6u);
  EXPECT_EQ(data[0].style.colour, architecture_colour("gdn"));
  const std::string pdf = slurp(tmp.path / "c.pdf");
  EXPECT_TRUE(std::regex_search(pdf, std::regex("/MediaBox \\[ ?0 0 468 288 ?\\]"))) << "PDF page 6.5 × 4 in";
}

TEST(FigureStyle, GridOfSmallMultiples) {
  TempDir tmp;
  // The LR sweep's 2 × 5: rows optimiser (Muon first), columns mixer, colour the lr.
  std::vector<Curve> curves;
  const char* archs[] = {"softmax", "deltanet", "gdn", "kda", "gdn2"};
  for (const char* opt : {"adamw", "normuon"})
    for (const char* arch : archs)
      for (const char* lr : {"0.0003", "0.001", "0.003"}) {
        Curve c;
        c.label = std::string(arch) + "." + opt + ".lr" + lr;
        c.run_id = "exp/" + c.label + ".s0";
        c.facets = {{"architecture", arch}, {"optimizer", opt}, {"lr", lr}};
        for (int s = 1; s <= 60; ++s) c.points.push_back({double(s), 3 + std::stod(lr) * 300 / s + 1.0 / s});
        curves.push_back(c);
      }
  Figure f = curves_figure("laa/fig4", "sweep", "training step", "training loss", curves, 0.8);
  f.colour_by = "lr";
  f = split_panels(f, "optimizer", "architecture");
  apply_grammar(f);
  ASSERT_EQ(f.panels.size(), 10u);
  EXPECT_EQ(f.cols, 5);
  EXPECT_EQ(f.panels[0].title, "Softmax · Muon");  // Muon above AdamW, as the paper
  EXPECT_EQ(f.panels[9].title, "GDN-2 · AdamW");
  ASSERT_EQ(f.panels[0].series.size(), 3u);
  EXPECT_EQ(f.panels[0].series[0].label, "lr 3e-4");
  EXPECT_NE(f.panels[0].series[0].style.colour, f.panels[0].series[2].style.colour);
  EXPECT_EQ(f.panels[0].series[1].style.colour, f.panels[7].series[1].style.colour);  // one lr, one colour
  EXPECT_EQ(f.runs().size(), 30u);
  const std::string s = gnuplot_script(f, "png", "/tmp/g.png");
  EXPECT_NE(s.find("set multiplot"), std::string::npos);
  size_t plots = 0;
  for (size_t p = 0; (p = s.find("\nplot ", p)) != std::string::npos; ++p) ++plots;
  EXPECT_EQ(plots, 10u);
  render_figure(f, "png", tmp.path / "grid.png");
  const RgbImage img = read_png((tmp.path / "grid.png").string());
  EXPECT_EQ(img.width, 2000);  // 10 in wide for five columns
  const auto h = colour_histogram(img);
  for (size_t i = 0; i < 3; ++i) EXPECT_GT(pixels_near(h, sweep_colour(i, 3), 10), 1000u) << sweep_colour(i, 3);
}

TEST(FigureStyle, FrontierParetoAndBars) {
  EXPECT_EQ(pareto_front({{100, 2.43}, {73.6, 2.35}, {90, 2.5}, {70.9, 2.27}}).size(), 3u);
  TableInput in;
  in.metrics = {"tokens_per_s", "peak_mem_gb"};
  ReportCell a = cell("gdn2", "none", 0, {{"tokens_per_s", 93770}, {"peak_mem_gb", 7.5}});
  ReportCell b = cell("carve", "none", 0, {{"tokens_per_s", 93360}, {"peak_mem_gb", 6.54}});
  b.baseline = a.id;
  in.cells = {a, b};
  in.runs = {completed_run(a, 3.0, 2000), completed_run(b, 2.9, 1500)};
  Figure f = bars_figure(build_report(in), {"tokens_per_s", "peak_mem_gb"}, true);
  apply_grammar(f);
  ASSERT_EQ(f.panels.size(), 2u);
  const auto& tps = f.panels[0];
  ASSERT_EQ(tps.series.size(), 4u);  // ours and the paper's for each row
  EXPECT_DOUBLE_EQ(tps.series[0].points[0].y, 100.0);
  EXPECT_DOUBLE_EQ(tps.series[2].points[0].y, 75.0);
  EXPECT_NEAR(tps.series[3].points[0].y, 100.0 * 93360 / 93770, 1e-9);
  EXPECT_EQ(tps.series[2].style.colour, architecture_colour("carve"));
  EXPECT_EQ(tps.xtics[1].second, "CARVE");
  EXPECT_EQ(tps.ylabel, "relative to GDN-2 (%)");
  TempDir tmp;
  render_figure(f, "png", tmp.path / "bars.png");
  const auto h = colour_histogram(read_png((tmp.path / "bars.png").string()));
  EXPECT_GT(pixels_near(h, architecture_colour("carve"), 12), 1000u);
}

TEST(FigureStyle, FrontierOfTable2Cells) {
  // Six LAA Table 2 cells with the paper's values; ours measured slower and higher.
  struct C {
    const char *arch, *opt, *stack;
    double rel, loss, our_tps, our_loss;
  };
  const C cells[] = {{"gdn", "adamw", "pure", 100.0, 2.433, 1000, 3.10}, {"gdn", "normuon", "hybrid", 89.5, 2.321, 850, 3.02},
                     {"kda", "normuon", "hybrid", 70.9, 2.273, 600, 2.95}, {"kda", "adamw", "pure", 73.6, 2.347, 640, 3.05},
                     {"softmax", "normuon", "dense", 79.7, 2.349, 900, 3.00}, {"deltanet", "adamw", "hybrid", 87.0, 2.348, 700, 3.08}};
  TableInput in;
  in.metrics = {"rel_throughput_pct", "final_loss"};
  for (const auto& c : cells) {
    ReportCell rc;
    rc.id = std::string(c.arch) + "." + c.opt + "." + c.stack + ".s0";
    rc.hash = "h-" + rc.id;
    rc.axes = {{"architecture", c.arch}, {"optimizer", c.opt}, {"stack", c.stack}, {"seed", 0}};
    rc.config = config_for(c.arch, "none", 0);
    rc.reference = {{"rel_throughput_pct", c.rel}, {"final_loss", c.loss}};
    in.cells.push_back(rc);
    in.runs.push_back(completed_run(rc, c.our_loss, c.our_tps));
  }
  Figure f = metric_vs_metric(build_report(in), "rel_throughput_pct", "final_loss");
  f.name = "laa/frontier";
  f.title = "frontier";
  apply_grammar(f);
  ASSERT_EQ(f.labels.size(), 6u);
  EXPECT_EQ(f.labels[2].text, "KDA·M·hyb");
  ASSERT_EQ(f.links.size(), 6u);
  EXPECT_EQ(f.links[0].dash, 2);  // AdamW cell: dashed segment
  EXPECT_EQ(f.links[1].dash, 1);  // Muon: solid
  // The paper's front: KDA·Muon·hybrid (70.9, 2.273), GDN·Muon·hybrid (89.5, 2.321), GDN·AdamW·pure (100, 2.433).
  ASSERT_EQ(f.series[0].label, "paper's Pareto front");
  ASSERT_EQ(f.series[0].points.size(), 3u);
  EXPECT_DOUBLE_EQ(f.series[0].points[0].x, 70.9);
  EXPECT_DOUBLE_EQ(f.series[0].points[2].x, 100.0);
  EXPECT_EQ(f.series[1].label, "GDN · AdamW · pure");
  TempDir tmp;
  render_figure(f, "png", tmp.path / "frontier.png");
  render_figure(f, "svg", tmp.path / "frontier.svg");
  const std::string svg = slurp(tmp.path / "frontier.svg");
  EXPECT_NE(svg.find("KDA·M·hyb"), std::string::npos);
  EXPECT_NE(svg.find("paper's Pareto front"), std::string::npos);
  const auto h = colour_histogram(read_png((tmp.path / "frontier.png").string()));
  for (const char* arch : {"gdn", "kda", "softmax", "deltanet"}) EXPECT_GT(pixels_near(h, architecture_colour(arch), 10), 150u) << arch;
}

TEST(FigureStyle, RenderTableFiguresForReproduceReport) {
  TempDir tmp;
  const fs::path db = tmp.path / "none.db";  // no registry yet: the figures say "no data yet"
  const auto files = render_table_figures("laa/table2", "smoke", 0, db, tmp.path / "report", {"svg", "png"});
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0], tmp.path / "report" / "laa_fig3.svg");
  EXPECT_EQ(files[3], tmp.path / "report" / "laa_frontier.png");
  for (const auto& f : files) {
    std::string why;
    EXPECT_TRUE(figure_file_ok(f, f.extension().string().substr(1), &why)) << f << ": " << why;
  }
  EXPECT_NE(slurp(files[0]).find("no data yet"), std::string::npos);
  EXPECT_TRUE(render_table_figures("laa/table6", "smoke", 0, db, tmp.path / "none").empty());
  EXPECT_FALSE(fs::exists(tmp.path / "none"));
  EXPECT_EQ(figures_of_table("laa/lr_sweep"), (std::vector<std::string>{"laa/fig4", "laa/fig5"}));
}

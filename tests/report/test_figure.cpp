// Figure export: gnuplot writes valid SVG / PNG / PDF, and the SVG's embedded data are
// exactly the points the figure was built from.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "fixtures.hpp"
#include "registry/report/figure.hpp"

using namespace lar;
using namespace lar::report;
using namespace lar::report::testing;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("lar_fig_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// An LR sweep: two optimizers × three learning rates for gdn.
Report sweep_report() {
  TableInput in;
  in.experiment = "sweep";
  in.metrics = {"final_loss"};
  const double lrs[] = {1e-4, 3e-4, 1e-3};
  const double loss[2][3] = {{3.1, 2.9, 3.0}, {2.8, 2.7, 2.95}};
  const char* opts[] = {"adamw", "muon"};
  for (int o = 0; o < 2; ++o)
    for (int i = 0; i < 3; ++i) {
      ReportCell c;
      c.id = std::string("gdn.") + opts[o] + ".lr" + std::to_string(i) + ".s0";
      c.axes = {{"architecture", "gdn"}, {"optimizer", opts[o]}, {"lr", lrs[i]}, {"seed", 0}};
      c.config = config_for("gdn", "none", 0, lrs[i]);
      c.config["optimizer"]["name"] = opts[o];
      in.cells.push_back(c);
      in.runs.push_back(completed_run(c, loss[o][i]));
    }
  return build_report(in);
}

}  // namespace

TEST(Figure, MetricVsAxisPoints) {
  Figure f = metric_vs_axis(sweep_report(), "lr", "final_loss", {"architecture", "optimizer"});
  ASSERT_EQ(f.series.size(), 2u);  // no published values → no paper series
  apply_grammar(f);
  EXPECT_EQ(f.series[0].label, "GDN · AdamW");  // words, the architecture always named
  EXPECT_EQ(f.series[1].label, "GDN · Muon");
  EXPECT_EQ(f.series[0].style.dash, 2);
  ASSERT_EQ(f.series[0].points.size(), 3u);
  EXPECT_DOUBLE_EQ(f.series[0].points[1].x, 3e-4);
  EXPECT_DOUBLE_EQ(f.series[0].points[1].y, 2.9);
  EXPECT_DOUBLE_EQ(f.series[1].points[2].y, 2.95);
  EXPECT_EQ(f.runs().size(), 6u);
  EXPECT_EQ(f.runs().front(), "exp/gdn.adamw.lr0.s0");
}

TEST(Figure, ScriptHasInlineDataAndCaption) {
  Figure f = metric_vs_axis(sweep_report(), "lr", "final_loss", {"optimizer"});
  f.name = "t";
  f.logx = true;
  const std::string s = gnuplot_script(f, "svg", "/tmp/x.svg");
  EXPECT_NE(s.find("set terminal svg"), std::string::npos);
  EXPECT_NE(s.find("set logscale x"), std::string::npos);
  EXPECT_NE(s.find("$d0 << EOD\n0.0001 3.1000000000000001 0\n0.00029999999999999997 2.8999999999999999 0\n0.001 3 0\nEOD\n"),
            std::string::npos) << s;
  EXPECT_NE(s.find("6 runs: exp/gdn.adamw.lr0.s0"), std::string::npos) << s;
  EXPECT_THROW(gnuplot_script(f, "jpg", "/tmp/x.jpg"), UserError);
}

TEST(Figure, RendersValidSvgPngPdf) {
  TempDir tmp;
  Figure f = metric_vs_axis(sweep_report(), "lr", "final_loss", {"architecture", "optimizer"});
  f.name = "test/sweep";
  f.title = "final loss vs lr";
  f.logx = true;
  for (const std::string fmt : {"svg", "png", "pdf"}) {
    const fs::path out = tmp.path / ("fig." + fmt);
    render_figure(f, fmt, out);
    std::string why;
    EXPECT_TRUE(figure_file_ok(out, fmt, &why)) << fmt << ": " << why;
  }
  std::ifstream png(tmp.path / "fig.png", std::ios::binary);
  char magic[8];
  png.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // The SVG carries the exact data points and the run ids.
  auto data = svg_embedded_data(tmp.path / "fig.svg");
  ASSERT_EQ(data.size(), f.series.size());
  for (size_t i = 0; i < data.size(); ++i) {
    EXPECT_EQ(data[i].label, f.series[i].label);
    ASSERT_EQ(data[i].points.size(), f.series[i].points.size());
    for (size_t k = 0; k < data[i].points.size(); ++k) {
      EXPECT_EQ(data[i].points[k].x, f.series[i].points[k].x);
      EXPECT_EQ(data[i].points[k].y, f.series[i].points[k].y);
    }
  }
  std::ifstream svg(tmp.path / "fig.svg");
  std::string body((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(body.find("runs: exp/gdn.adamw.lr0.s0 "), std::string::npos);
  EXPECT_NE(body.find("<svg"), std::string::npos);
}

TEST(Figure, RejectsInvalidFiles) {
  TempDir tmp;
  const fs::path bad = tmp.path / "bad.png";
  std::ofstream(bad) << "not an image";
  std::string why;
  EXPECT_FALSE(figure_file_ok(bad, "png", &why));
  EXPECT_EQ(why, "no PNG signature");
  EXPECT_FALSE(figure_file_ok(bad, "pdf", &why));
  EXPECT_EQ(why, "no %PDF- header");
  EXPECT_FALSE(figure_file_ok(bad, "svg", &why));
  EXPECT_FALSE(figure_file_ok(tmp.path / "missing.svg", "svg", &why));
  EXPECT_EQ(why, "file missing");
}

TEST(Figure, FrontierAndCurves) {
  TableInput in;
  in.metrics = {"rel_throughput_pct", "final_loss"};
  auto a = cell("gdn", "none", 0, {{"rel_throughput_pct", 100.0}, {"final_loss", 2.433}});
  auto b = cell("kda", "none", 0, {{"rel_throughput_pct", 73.6}, {"final_loss", 2.347}});
  in.cells = {a, b};
  in.runs = {completed_run(a, 3.0, 2000), completed_run(b, 2.9, 1000)};
  Figure f = metric_vs_metric(build_report(in), "rel_throughput_pct", "final_loss");
  // The paper's Pareto front, our two cells, the paper's two cells, the open-marker key.
  ASSERT_EQ(f.series.size(), 6u);
  EXPECT_EQ(f.series[0].label, "paper's Pareto front");
  ASSERT_EQ(f.series[0].points.size(), 2u);  // 73.6 % at 2.347 and 100 % at 2.433: neither beats the other
  EXPECT_DOUBLE_EQ(f.series[0].points[1].x, 100.0);
  EXPECT_DOUBLE_EQ(f.series[1].points[0].x, 100.0);  // gdn row: relative throughput 100
  EXPECT_DOUBLE_EQ(f.series[2].points[0].x, 50.0);   // kda: half gdn's tokens/s
  EXPECT_DOUBLE_EQ(f.series[2].points[0].y, 2.9);
  EXPECT_FALSE(f.series[1].lines);  // a scatter, not a path
  EXPECT_TRUE(f.series[3].published);
  EXPECT_FALSE(f.series[3].keyed);
  // Each of our points is labelled and joined to the paper's point of the same cell.
  ASSERT_EQ(f.labels.size(), 2u);
  EXPECT_EQ(f.labels[1].text, "KDA");
  ASSERT_EQ(f.links.size(), 2u);
  EXPECT_DOUBLE_EQ(f.links[1].from.x, 50.0);
  EXPECT_DOUBLE_EQ(f.links[1].to.x, 73.6);
  EXPECT_DOUBLE_EQ(f.links[1].to.y, 2.347);
  apply_grammar(f);
  EXPECT_EQ(f.series[1].label, "GDN");
  EXPECT_EQ(f.series[2].label, "KDA");
  EXPECT_EQ(f.series[4].style.colour, f.series[2].style.colour);  // the paper's KDA point: KDA's colour
  const std::string script = gnuplot_script(f, "svg", "/tmp/f.svg");
  EXPECT_NE(script.find("with linespoints pt 7"), std::string::npos) << script;  // ours: filled, a segment sample in the key
  EXPECT_NE(script.find("with points pt 6"), std::string::npos) << script;  // paper: open
  EXPECT_NE(script.find("set arrow 2 from 50,2.8999999999999999 to 73.599999999999994,2.347 nohead"), std::string::npos) << script;
  EXPECT_NE(script.find("set label 11 \"KDA\" at 50,2.8999999999999999"), std::string::npos) << script;

  Figure c = curves_figure("laa/fig3", "curves", "tokens", "val_loss",
                           {{"gdn.none", "exp/gdn.none.s0", {{0, 5.5}, {1000, 3.0}}}});
  ASSERT_EQ(c.series.size(), 1u);
  EXPECT_EQ(c.runs(), std::vector<std::string>{"exp/gdn.none.s0"});
}

TEST(Figure, CatalogueNamesAndErrors) {
  EXPECT_EQ(find_figure("laa/fig5").table, "laa/lr_sweep");
  EXPECT_EQ(find_figure("laa/fig6").x, "seq_len");
  try {
    find_figure("laa/fig7");
    FAIL();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown figure 'laa/fig7' (choices: laa/fig3, laa/fig4, laa/fig5, laa/fig6, laa/frontier, "
                                         "ccq/fig3, ccq/fig4, ccq/fig3_4, ccq/fig5, carve/table3)"),
              std::string::npos) << e.what();
  }
}

// lar::serve building blocks: escaping, request validation, charts, artifact paths.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "serve/artifacts.hpp"
#include "serve/data.hpp"
#include "serve/http_error.hpp"
#include "serve/server.hpp"
#include "serve/svg_chart.hpp"
#include "serve/text.hpp"

namespace fs = std::filesystem;
using namespace lar::serve;

namespace {

int status_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const HttpError& e) {
    return e.status();
  }
  return 200;
}

}  // namespace

TEST(ServeText, HtmlEscapeCoversMarkupAndQuotes) {
  EXPECT_EQ(html_escape("<a href=\"x\" onclick='y'>&</a>"), "&lt;a href=&quot;x&quot; onclick=&#39;y&#39;&gt;&amp;&lt;/a&gt;");
  EXPECT_EQ(html_escape("plain"), "plain");
}

TEST(ServeText, UrlEncodeKeepsOnlyUnreserved) {
  EXPECT_EQ(url_encode("gdn.s0-a_b~"), "gdn.s0-a_b~");
  EXPECT_EQ(url_encode("a/b c&d=\"'"), "a%2Fb%20c%26d%3D%22%27");
}

TEST(ServeText, ValidNameRejectsQuotesSlashesAndLength) {
  EXPECT_TRUE(valid_name("laa-table2"));
  EXPECT_TRUE(valid_name("gdn.lr3e-4.s0"));
  EXPECT_FALSE(valid_name(""));
  EXPECT_FALSE(valid_name("x' OR '1'='1"));
  EXPECT_FALSE(valid_name("a/b"));
  EXPECT_FALSE(valid_name("a;b"));
  EXPECT_FALSE(valid_name(std::string(129, 'a')));
  EXPECT_TRUE(valid_value("a/b c"));
  EXPECT_FALSE(valid_value("gdn' --"));
}

TEST(ServeText, ParseCountBounds) {
  EXPECT_EQ(parse_count("0", 10, "limit"), 0u);
  EXPECT_EQ(parse_count("10", 10, "limit"), 10u);
  EXPECT_EQ(status_of([] { parse_count("11", 10, "limit"); }), 400);
  EXPECT_EQ(status_of([] { parse_count("-1", 10, "limit"); }), 400);
  EXPECT_EQ(status_of([] { parse_count("1e3", 10, "limit"); }), 400);
  try {
    parse_count("abc", 10, "offset");
    FAIL();
  } catch (const HttpError& e) {
    EXPECT_NE(std::string(e.what()).find("bad offset 'abc'"), std::string::npos) << e.what();
  }
}

TEST(ServeQuery, ParsesFiltersAndBoundsPages) {
  std::multimap<std::string, std::string> p = {{"experiment", "alpha"}, {"status", "completed,running"},
                                               {"axis.architecture", "gdn"}, {"axis.seed", ""},
                                               {"limit", "20"}, {"offset", "40"}, {"sort", "-final_loss"}};
  RunQuery q = parse_run_query(p);
  EXPECT_EQ(q.experiment, "alpha");
  EXPECT_EQ(q.status, (std::vector<std::string>{"completed", "running"}));
  ASSERT_EQ(q.axes.size(), 1u);  // an empty form field means "any"
  EXPECT_EQ(q.axes[0], (std::pair<std::string, std::string>{"architecture", "gdn"}));
  EXPECT_EQ(q.limit, 20u);
  EXPECT_EQ(q.offset, 40u);
  EXPECT_EQ(q.sort, "-final_loss");
  EXPECT_EQ(status_of([] { parse_run_query({{"limit", "501"}}); }), 400);
  EXPECT_EQ(status_of([] { parse_run_query({{"experiment", "a' OR 1=1 --"}}); }), 400);
  EXPECT_EQ(status_of([] { parse_run_query({{"axis.arch'", "x"}}); }), 400);
  EXPECT_EQ(status_of([] { parse_run_query({{"sort", "x;DROP TABLE runs"}}); }), 400);
  std::multimap<std::string, std::string> many;
  for (int i = 0; i < 17; ++i) many.emplace("axis.a" + std::to_string(i), "1");
  EXPECT_EQ(status_of([&] { parse_run_query(many); }), 400);
}

TEST(ServeChart, NiceTicksAreRoundAndCoverTheRange) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  auto t = nice_ticks(0.13, 0.87, 4);
  const std::vector<double> want = {0.2, 0.4, 0.6, 0.8};
  ASSERT_EQ(t.size(), want.size());
  for (size_t i = 0; i < t.size(); ++i) EXPECT_NEAR(t[i], want[i], 1e-12);
  EXPECT_EQ(nice_ticks(-3, 3, 3), (std::vector<double>{-2, 0, 2}));
}

TEST(ServeChart, DownsampleKeepsEndsAndBound) {
  std::vector<std::pair<double, double>> pts;
  for (int i = 0; i < 1001; ++i) pts.emplace_back(i, i * 2.0);
  auto d = downsample(pts, 11);
  ASSERT_EQ(d.size(), 11u);
  EXPECT_EQ(d.front().first, 0);
  EXPECT_EQ(d[5].first, 500);
  EXPECT_EQ(d.back().first, 1000);
  EXPECT_EQ(downsample(pts, 5000).size(), 1001u);
}

TEST(ServeChart, SvgHasOnePathPerSeriesEscapedLabelsAndBreaksAtNaN) {
  ChartSeries a{"<b>run</b>", {{0, 1}, {1, 2}, {2, std::nan("")}, {3, 1.5}}};
  ChartSeries b{"other", {{0, 3}, {3, 2}}};
  std::string svg = svg_line_chart({a, b}, {"loss & more", "step", "loss"});
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("loss &amp; more"), std::string::npos);
  EXPECT_NE(svg.find("&lt;b&gt;run&lt;/b&gt;"), std::string::npos);
  EXPECT_EQ(svg.find("<b>"), std::string::npos);
  size_t paths = 0;
  for (size_t p = svg.find("class=\"series\""); p != std::string::npos; p = svg.find("class=\"series\"", p + 1)) ++paths;
  EXPECT_EQ(paths, 2u);
  // The NaN lifts the pen: series a's path has two "M" commands.
  const size_t start = svg.find("d=\"M");
  const std::string d = svg.substr(start, svg.find('"', start + 3) - start);
  EXPECT_EQ(std::count(d.begin(), d.end(), 'M'), 2) << d;
  EXPECT_NE(svg_line_chart({}, {"empty", "step", ""}).find("no data"), std::string::npos);
}

TEST(ServeChart, SeriesTakeTheFiguresColourAndDash) {
  ChartSeries a{"gdn", {{0, 1}, {1, 2}}, "#1f63b4", false};
  ChartSeries b{"kda adamw", {{0, 3}, {1, 2}}, "#f07f0e", true};
  const std::string svg = svg_line_chart({a, b}, {"loss", "step", "loss"});
  EXPECT_NE(svg.find("stroke=\"#1f63b4\" stroke-width=\"1.5\"><title>gdn"), std::string::npos) << svg;
  EXPECT_NE(svg.find("stroke=\"#f07f0e\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"><title>kda adamw"), std::string::npos) << svg;
  // Without a colour: the palette by position, as before.
  ChartSeries c{"x", {{0, 1}, {1, 2}}};
  EXPECT_NE(svg_line_chart({c, c}, {"t", "step", ""}).find(series_colour(1)), std::string::npos);
}

class ServeArtifacts : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("lar_serve_art_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "run" / "checkpoints");
    std::ofstream(root_ / "run" / "metrics.jsonl") << "{\"step\":0}\n";
    std::ofstream(root_ / "run" / "checkpoints" / "step_00000001.ckpt") << "bin";
    std::ofstream(root_ / "secret.txt") << "top secret";
    fs::create_symlink(root_ / "secret.txt", root_ / "run" / "escape.txt");
    fs::create_symlink(root_, root_ / "run" / "up");
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

TEST_F(ServeArtifacts, ServesFilesInsideTheRunDirectory) {
  Artifact a = resolve_artifact(root_ / "run", "metrics.jsonl");
  EXPECT_EQ(a.path, fs::canonical(root_ / "run" / "metrics.jsonl"));
  EXPECT_EQ(a.bytes, 11u);
  EXPECT_EQ(a.content_type, "text/plain; charset=utf-8");
  EXPECT_FALSE(a.attachment);
  Artifact c = resolve_artifact(root_ / "run", "checkpoints/step_00000001.ckpt");
  EXPECT_TRUE(c.attachment);
  EXPECT_EQ(c.content_type, "application/octet-stream");
}

TEST_F(ServeArtifacts, RejectsTraversalAbsoluteAndSymlinkEscapes) {
  const fs::path run = root_ / "run";
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "../secret.txt"); }), 400);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "checkpoints/../../secret.txt"); }), 400);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "/etc/passwd"); }), 400);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "./metrics.jsonl"); }), 400);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, ""); }), 400);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "escape.txt"); }), 403);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "up/secret.txt"); }), 403);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "missing.txt"); }), 404);
  EXPECT_EQ(status_of([&] { resolve_artifact(run, "checkpoints"); }), 404);
  EXPECT_EQ(status_of([&] { resolve_artifact(root_ / "gone", "metrics.jsonl"); }), 404);
}

TEST_F(ServeArtifacts, ListsTopLevelAndCheckpoints) {
  auto list = list_artifacts(root_ / "run");
  std::vector<std::string> names;
  for (const auto& e : list) names.push_back(e.relative);
  // Symlinks to files are listed (serving them is checked separately); folders are not.
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoints/step_00000001.ckpt", "escape.txt", "metrics.jsonl"}));
}

TEST(ServeServer, LoopbackOnlyUnlessAllowed) {
  EXPECT_TRUE(is_loopback("127.0.0.1"));
  EXPECT_TRUE(is_loopback("localhost"));
  EXPECT_TRUE(is_loopback("::1"));
  EXPECT_FALSE(is_loopback("0.0.0.0"));
  EXPECT_FALSE(is_loopback("192.168.1.2"));
}

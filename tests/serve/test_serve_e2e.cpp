// End to end: `lar serve` on a test registry, Debian's headless Chromium loading every
// page (DOM checks on the rendered run list and charts), screenshots saved next to the
// test binary (LAR_SCREENSHOT_DIR). Chromium is part of the test setup (scripts/test.sh
// installs it); when it is missing this test fails and says so.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>

#include "tests/serve/helpers.hpp"

using namespace servetest;

namespace {

std::string chromium_path() {
  for (const char* p : {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a command, returns its stdout.
std::string capture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  std::array<char, 65536> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  ::pclose(p);
  return out;
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

class ServeBrowser : public ::testing::Test {
 protected:
  void SetUp() override {
    chromium_ = chromium_path();
    ASSERT_FALSE(chromium_.empty())
        << "headless Chromium is required for the dashboard end-to-end test and was not found: install it with "
           "`apt-get install -y chromium` (scripts/test.sh does this before running the tests)";
    home_ = temp_dir("e2e");
    db_ = make_registry(home_);
    server_ = std::make_unique<ServeProcess>(db_, home_ / "serve.log");
    ASSERT_GT(server_->port(), 0) << server_->log();
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(home_);
  }

  std::string flags() const {
    // Root in a container: no sandbox; a private profile per test run.
    return " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run --hide-scrollbars"
           " --user-data-dir=" + shell_quote((home_ / "profile").string());
  }
  // The DOM after the page loaded and its scripts ran for `budget_ms` of virtual time.
  std::string dom(const std::string& path, int budget_ms = 0) {
    std::string cmd = "timeout 120 " + chromium_ + flags();
    if (budget_ms > 0) cmd += " --virtual-time-budget=" + std::to_string(budget_ms);
    return capture(cmd + " --dump-dom " + shell_quote(server_->url(path)) + " 2>/dev/null");
  }
  fs::path screenshot(const std::string& path, const std::string& name) {
    const fs::path out = fs::path(LAR_SCREENSHOT_DIR) / name;
    fs::remove(out);
    capture("timeout 120 " + chromium_ + flags() + " --window-size=1280,1500 --screenshot=" + shell_quote(out.string()) + " " +
            shell_quote(server_->url(path)) + " >/dev/null 2>&1");
    return out;
  }

  std::string chromium_;
  fs::path home_, db_;
  std::unique_ptr<ServeProcess> server_;
};

}  // namespace

TEST_F(ServeBrowser, EveryPageRendersInChromium) {
  const std::string home = dom("/");
  EXPECT_NE(home.find("id=\"experiments\""), std::string::npos) << home.substr(0, 2000);
  EXPECT_NE(home.find(">alpha</a>"), std::string::npos);
  EXPECT_NE(home.find("<progress"), std::string::npos);

  const std::string runs = dom("/runs");
  EXPECT_EQ(count(runs, "<tr class=\"run\">"), 4u) << runs.substr(0, 3000);
  EXPECT_NE(runs.find(">alpha/gdn.s1</a>"), std::string::npos);
  // The markup in an axis value stays text in the browser's DOM.
  EXPECT_NE(runs.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);

  const std::string filtered = dom("/runs?experiment=alpha&axis.architecture=gdn&status=completed");
  EXPECT_EQ(count(filtered, "<tr class=\"run\">"), 1u);
  EXPECT_NE(filtered.find(">alpha/gdn.s0</a>"), std::string::npos);

  const std::string run = dom("/runs/alpha/gdn.s0");
  EXPECT_NE(run.find("id=\"charts\""), std::string::npos) << run.substr(0, 2000);
  EXPECT_EQ(count(run, "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\""), 3u);
  EXPECT_GE(count(run, "class=\"series\""), 3u);  // loss, lr, throughput curves drawn
  EXPECT_NE(run.find("id=\"history\""), std::string::npos);
  EXPECT_NE(run.find("model.architecture"), std::string::npos);

  const std::string cmp = dom("/compare?run=alpha/gdn.s0&run=alpha/deltanet.s0");
  EXPECT_EQ(count(cmp, "class=\"series\""), 6u);  // two runs × three charts
  EXPECT_NE(cmp.find("id=\"config-diff\""), std::string::npos);

  const std::string tables = dom("/tables");
  EXPECT_NE(tables.find("/tables/laa/table2"), std::string::npos);
  const std::string table = dom("/tables/laa/table2");
  EXPECT_NE(table.find("id=\"paper-table\""), std::string::npos) << table.substr(0, 2000);
  EXPECT_NE(table.find("id=\"audit\""), std::string::npos);
}

TEST_F(ServeBrowser, LiveScriptPollsTheApiUnderTheContentSecurityPolicy) {
  // With virtual time the page's poller runs: it fetched /api/version and updated its label.
  const std::string page = dom("/runs", 7000);
  EXPECT_NE(page.find("live · checked"), std::string::npos) << page.substr(0, 1500);
}

TEST_F(ServeBrowser, ScreenshotsOfRunListAndRunDetail) {
  for (const auto& [path, name] : std::vector<std::pair<std::string, std::string>>{
           {"/runs", "serve_runs.png"}, {"/runs/alpha/gdn.s0", "serve_run_detail.png"},
           {"/compare?run=alpha/gdn.s0&run=alpha/deltanet.s0&run=alpha/gdn.s1", "serve_compare.png"}}) {
    const fs::path png = screenshot(path, name);
    ASSERT_TRUE(fs::exists(png)) << "chromium wrote no screenshot for " << path;
    const std::string bytes = read_file(png);
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_GT(bytes.size(), 20000u) << png;  // a rendered page, not a blank one
    std::cout << "screenshot: " << png.string() << "\n";
  }
}

// `lar serve` over a real socket: the JSON API's values, the pages, live updates, and
// the security rules (read-only, loopback, traversal, SQL injection, bounded requests).
#include <gtest/gtest.h>
#include <httplib.h>

#include "core/hash.hpp"
#include "tests/serve/helpers.hpp"

using namespace servetest;

namespace {

class ServeApi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    home_ = new fs::path(temp_dir("api"));
    db_ = new fs::path(make_registry(*home_));
    // A file next to the run directories that no request may read.
    std::ofstream(*home_ / "runs" / "alpha" / "secret.txt") << "TOP-SECRET-42";
    std::ofstream(*home_ / "runs" / "alpha" / "gdn.s0" / "log.txt") << "<script>alert('log')</script>\n";
    fs::create_symlink(*home_ / "runs" / "alpha" / "secret.txt", *home_ / "runs" / "alpha" / "gdn.s0" / "link.txt");
    db_hash_ = new std::string(lar::sha256_hex(read_file(*db_)));
    server_ = new ServeProcess(*db_, *home_ / "serve.log");
    ASSERT_GT(server_->port(), 0) << server_->log();
  }
  static void TearDownTestSuite() {
    delete server_;
    fs::remove_all(*home_);
    delete home_;
    delete db_;
    delete db_hash_;
  }

  httplib::Result get(const std::string& path) {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(10, 0);
    return c.Get(path.c_str());
  }
  json get_json(const std::string& path, int expect_status = 200) {
    auto r = get(path);
    EXPECT_TRUE(r) << path;
    if (!r) return {};
    EXPECT_EQ(r->status, expect_status) << path << "\n" << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "application/json") << path;
    return json::parse(r->body);
  }

  static fs::path* home_;
  static fs::path* db_;
  static std::string* db_hash_;
  static ServeProcess* server_;
};

fs::path* ServeApi::home_ = nullptr;
fs::path* ServeApi::db_ = nullptr;
std::string* ServeApi::db_hash_ = nullptr;
ServeProcess* ServeApi::server_ = nullptr;

// Nothing from inside the server (SQL, paths, files) in an error body.
void expect_no_leak(const std::string& body) {
  for (const char* word : {"sqlite", "SELECT", "syntax", "TOP-SECRET", "root:", "json_extract", "lar.db"})
    EXPECT_EQ(body.find(word), std::string::npos) << "leaked '" << word << "' in: " << body;
}

}  // namespace

TEST_F(ServeApi, ExperimentsCountRunsAndProgress) {
  json e = get_json("/api/experiments");
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0]["name"], "alpha");
  EXPECT_EQ(e[0]["runs"], 3);
  EXPECT_EQ(e[0]["completed"], 2);
  EXPECT_EQ(e[0]["by_status"]["running"], 1);
  EXPECT_EQ(e[0]["step"], 50 + 40 + 20);
  EXPECT_EQ(e[0]["total_steps"], 50 + 40 + 50);
  EXPECT_NEAR(e[0]["progress"].get<double>(), 110.0 / 140.0, 1e-9);
  EXPECT_EQ(e[1]["name"], "beta");
  EXPECT_EQ(e[1]["by_status"]["failed"], 1);
}

TEST_F(ServeApi, RunsFilterByAxisStatusAndPage) {
  json all = get_json("/api/runs");
  EXPECT_EQ(all["total"], 4);
  EXPECT_EQ(all["runs"][0]["run_id"], "alpha/deltanet.s0");  // sorted by run id
  EXPECT_FALSE(all["runs"][0].contains("config"));              // listings stay small

  json gdn = get_json("/api/runs?experiment=alpha&axis.architecture=gdn");
  ASSERT_EQ(gdn["total"], 2);
  EXPECT_EQ(gdn["runs"][0]["run_id"], "alpha/gdn.s0");
  EXPECT_EQ(gdn["runs"][1]["run_id"], "alpha/gdn.s1");

  json done = get_json("/api/runs?axis.architecture=gdn&status=completed");
  ASSERT_EQ(done["total"], 1);
  EXPECT_EQ(done["runs"][0]["summary"]["final_loss"].get<double>(), 9.5);

  json page = get_json("/api/runs?limit=2&offset=1");
  EXPECT_EQ(page["count"], 2);
  EXPECT_EQ(page["offset"], 1);
  EXPECT_TRUE(page["has_more"].get<bool>());
  EXPECT_EQ(page["runs"][0]["run_id"], "alpha/gdn.s0");
  json last = get_json("/api/runs?limit=2&offset=2");
  EXPECT_FALSE(last["has_more"].get<bool>());

  // With axis filters the total is known only once the last page is reached.
  json first = get_json("/api/runs?axis.architecture=gdn&limit=1");
  EXPECT_TRUE(first["has_more"].get<bool>());
  EXPECT_TRUE(first["total"].is_null());
  EXPECT_EQ(get_json("/api/runs?status=running,failed&limit=1")["total"], 2);  // counted without axis filters

  // The plain listing (SQL OFFSET) and the registry's query builder return the same objects.
  json plain = get_json("/api/runs?limit=1&offset=1");
  json built = get_json("/api/runs?axis.architecture=gdn&limit=1");
  ASSERT_EQ(plain["runs"].size(), 1u);
  EXPECT_EQ(plain["runs"][0], built["runs"][0]);
  json desc = get_json("/api/runs?sort=-run_id&limit=4");
  ASSERT_EQ(desc["count"], 4);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(desc["runs"][i]["run_id"], all["runs"][3 - i]["run_id"]);
  json beyond = get_json("/api/runs?offset=10");
  EXPECT_EQ(beyond["count"], 0);
  EXPECT_EQ(beyond["total"], 4);

  json sorted = get_json("/api/runs?sort=-step&limit=1");
  EXPECT_EQ(sorted["runs"][0]["run_id"], "alpha/gdn.s0");

  EXPECT_EQ(get_json("/api/runs?limit=501", 400)["error"].get<std::string>().substr(0, 10), "bad limit ");
  get_json("/api/runs?offset=-3", 400);
  get_json("/api/runs?status=finished", 400);
  EXPECT_NE(get_json("/api/runs?axis.nosuchaxis=1", 400)["error"].get<std::string>().find("unknown key 'nosuchaxis'"),
            std::string::npos);
}

TEST_F(ServeApi, RunDetailHasConfigHistoryMetricsAndFiles) {
  json r = get_json("/api/runs/alpha/gdn.s1");
  EXPECT_EQ(r["run_id"], "alpha/gdn.s1");
  EXPECT_EQ(r["status"], "running");
  EXPECT_EQ(r["step"], 20);
  EXPECT_EQ(r["config"]["model"]["architecture"], "gdn");
  ASSERT_EQ(r["history"].size(), 1u);
  EXPECT_EQ(r["history"][0]["state"], "running");
  EXPECT_EQ(r["last_metrics"]["loss"]["step"], 19);
  EXPECT_NEAR(r["last_metrics"]["loss"]["value"].get<double>(), 10.0 - 0.19, 1e-12);
  EXPECT_EQ(r["metric_names"], (json{"loss", "lr", "tokens_per_s"}));
  std::vector<std::string> files;
  for (const auto& f : r["files"]) files.push_back(f["path"]);
  EXPECT_NE(std::find(files.begin(), files.end(), "metrics.jsonl"), files.end());
  EXPECT_NE(std::find(files.begin(), files.end(), "status.json"), files.end());

  json failed = get_json("/api/runs/beta/evil.s0");
  EXPECT_EQ(failed["status"], "failed");
  EXPECT_EQ(failed["reason"], "<img src=x onerror=alert(2)>");  // JSON carries data as is
  ASSERT_EQ(failed["history"].size(), 2u);

  EXPECT_EQ(get_json("/api/runs/alpha/nope", 404)["error"], "unknown run");
}

TEST_F(ServeApi, MetricSeriesAndDownsampling) {
  json m = get_json("/api/runs/alpha/gdn.s0/metrics?name=loss");
  EXPECT_EQ(m["total"], 50);
  ASSERT_EQ(m["points"].size(), 50u);
  EXPECT_EQ(m["points"][10]["step"], 10);
  EXPECT_NEAR(m["points"][10]["value"].get<double>(), 9.9, 1e-12);
  EXPECT_EQ(m["points"][10]["tokens"], 10240);

  json few = get_json("/api/runs/alpha/gdn.s0/metrics?name=loss&max_points=5");
  ASSERT_EQ(few["points"].size(), 5u);
  EXPECT_EQ(few["points"][0]["step"], 0);
  EXPECT_EQ(few["points"][4]["step"], 49);

  json names = get_json("/api/runs/alpha/gdn.s0/metrics");
  EXPECT_EQ(names["names"], (json{"loss", "lr", "tokens_per_s"}));
  EXPECT_EQ(get_json("/api/runs/alpha/gdn.s0/metrics?name=nothing")["total"], 0);
  get_json("/api/runs/alpha/gdn.s0/metrics?name=loss&max_points=10001", 400);
  get_json("/api/runs/alpha/gdn.s0/metrics?name=loss'--", 400);
}

TEST_F(ServeApi, PaperTableAndAuditUseTheReportModule) {
  json t = get_json("/api/tables/laa/table2");
  EXPECT_FALSE(t["metrics"].empty());
  EXPECT_FALSE(t["rows"].empty());
  EXPECT_FALSE(t["experiment"].get<std::string>().empty());
  // The registry holds no run of that experiment: every row has no value of ours.
  EXPECT_EQ(t["rows"][0]["ours"][t["metrics"][0].get<std::string>()]["n"], 0);
  json a = get_json("/api/audit/laa/table2");
  EXPECT_TRUE(a.is_object());
  EXPECT_EQ(get_json("/api/tables/laa/nosuch", 404)["error"], "unknown paper table");
  get_json("/api/tables/laa/table2?scale=x'y", 400);
  get_json("/api/tables/laa/table2?seeds=1000", 400);
}

TEST_F(ServeApi, PagesRenderAndEscapeEverything) {
  auto home = get("/");
  ASSERT_TRUE(home);
  EXPECT_EQ(home->status, 200);
  EXPECT_EQ(home->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(home->get_header_value("Content-Security-Policy").find("script-src 'self'"), std::string::npos);
  EXPECT_NE(home->body.find("<a href=\"/runs?experiment=alpha\">alpha</a>"), std::string::npos);
  EXPECT_NE(home->body.find("2 / 3 completed"), std::string::npos);

  auto runs = get("/runs?experiment=beta");
  ASSERT_TRUE(runs);
  EXPECT_EQ(runs->status, 200);
  EXPECT_NE(runs->body.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_EQ(runs->body.find("<script>alert"), std::string::npos);

  auto run = get("/runs/beta/evil.s0");
  ASSERT_TRUE(run);
  EXPECT_EQ(run->status, 200);
  EXPECT_NE(run->body.find("&lt;img src=x onerror=alert(2)&gt;"), std::string::npos);
  EXPECT_EQ(run->body.find("<img"), std::string::npos);
  EXPECT_NE(run->body.find("<svg"), std::string::npos);

  auto cmp = get("/compare?run=alpha/gdn.s0&run=alpha/deltanet.s0");
  ASSERT_TRUE(cmp);
  EXPECT_EQ(cmp->status, 200);
  EXPECT_NE(cmp->body.find("model.architecture"), std::string::npos);  // the config diff
  EXPECT_NE(cmp->body.find("1 of "), std::string::npos);               // only the architecture differs
  auto none = get("/compare");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 400);

  auto table = get("/tables/laa/table2");
  ASSERT_TRUE(table);
  EXPECT_EQ(table->status, 200);
  EXPECT_NE(table->body.find("(paper)"), std::string::npos);
  auto missing = get("/runs/alpha/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_NE(missing->body.find("unknown run"), std::string::npos);
}

TEST_F(ServeApi, ArtifactsOnlyFromInsideTheRunDirectory) {
  auto ok = get("/runs/alpha/gdn.s0/files/metrics.jsonl");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->body, read_file(*home_ / "runs" / "alpha" / "gdn.s0" / "metrics.jsonl"));
  // Text artifacts are text/plain (never rendered as HTML) with nosniff.
  auto log = get("/runs/alpha/gdn.s0/files/log.txt");
  ASSERT_TRUE(log);
  EXPECT_EQ(log->get_header_value("Content-Type"), "text/plain; charset=utf-8");
  EXPECT_EQ(log->get_header_value("X-Content-Type-Options"), "nosniff");

  for (const std::string path :
       {"/runs/alpha/gdn.s0/files/../secret.txt", "/runs/alpha/gdn.s0/files/%2e%2e/secret.txt",
        "/runs/alpha/gdn.s0/files/..%2fsecret.txt", "/runs/alpha/gdn.s0/files/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/runs/alpha/gdn.s0/files//etc/passwd", "/runs/alpha/gdn.s0/files/link.txt",
        "/runs/alpha/gdn.s0/files/checkpoints/../../secret.txt", "/runs/alpha/..%2f..%2f..%2fetc/files/passwd",
        "/runs/alpha/gdn.s0/files/%00metrics.jsonl", "/runs/%2e%2e/%2e%2e/files/etc/passwd"}) {
    auto r = get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_GE(r->status, 400) << path;
    EXPECT_LT(r->status, 500) << path;
    expect_no_leak(r->body);
  }
}

TEST_F(ServeApi, SqlInjectionAttemptsAre4xxAndChangeNothing) {
  for (const std::string path :
       {"/api/runs?experiment=alpha'%20OR%20'1'='1", "/api/runs?experiment=alpha%22;DROP%20TABLE%20runs;--",
        "/api/runs?axis.architecture=gdn'%20OR%201=1%20--", "/api/runs?axis.architecture')%20OR%201=1--=x",
        "/api/runs?status=completed'%20OR%20'1'='1", "/api/runs?sort=run_id;DELETE%20FROM%20runs",
        "/api/runs?sort=(SELECT%20sql%20FROM%20sqlite_master)", "/api/runs/alpha'%20OR%20'1'='1/x",
        "/api/runs/alpha/x'%20UNION%20SELECT%20*%20FROM%20runs--", "/api/runs/alpha/%25/metrics?name=loss",
        "/runs?experiment=alpha'--", "/runs/alpha/gdn.s0'--", "/api/tables/laa'--/table2",
        "/api/runs/alpha/gdn.s0/metrics?name=loss'%20OR%20'1'='1"}) {
    auto r = get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_GE(r->status, 400) << path << "\n" << r->body;
    EXPECT_LT(r->status, 500) << path << "\n" << r->body;
    expect_no_leak(r->body);
  }
  // Still all there.
  EXPECT_EQ(get_json("/api/runs")["total"], 4);
}

TEST_F(ServeApi, ReadOnlyLoopbackAndBoundedRequests) {
  httplib::Client c("127.0.0.1", server_->port());
  auto post = c.Post("/api/runs", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  auto del = c.Delete("/api/runs/alpha/gdn.s0");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 405);
  // DNS rebinding: a request addressed to another host name is refused.
  auto evil = c.Get("/api/experiments", {{"Host", "evil.example:80"}});
  ASSERT_TRUE(evil);
  EXPECT_EQ(evil->status, 403);
  auto local = c.Get("/api/experiments", {{"Host", "localhost"}});
  ASSERT_TRUE(local);
  EXPECT_EQ(local->status, 200);
  // Over-long request targets are cut off by the HTTP layer.
  auto huge = c.Get(("/api/runs?experiment=" + std::string(10000, 'a')).c_str());
  ASSERT_TRUE(huge);
  EXPECT_GE(huge->status, 400);
  EXPECT_LT(huge->status, 500);
  auto unknown = c.Get("/api/nothing");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);
  // The server never wrote to the registry.
  EXPECT_EQ(lar::sha256_hex(read_file(*db_)), *db_hash_);
}

TEST_F(ServeApi, VersionMovesWhenASyncIngestsProgress) {
  const std::string before = get_json("/api/version")["version"];
  EXPECT_EQ(get_json("/api/version")["version"], before);
  // The running run makes progress; `lar sync` (another process) ingests it.
  const fs::path d = *home_ / "runs" / "alpha" / "gdn.s1";
  {
    lar::MetricsWriter w(d / "metrics.jsonl");
    w.append({{"step", 20}, {"tokens", 20480}, {"wall_time", 10.0}, {"loss", 9.8}, {"lr", 1e-3}, {"tokens_per_s", 1020.0}});
  }
  lar::RunDir rd(d);
  auto st = *rd.read_status();
  st.step = 21;
  st.updated_at = lar::unix_now();
  rd.write_status(st);
  const pid_t pid =
      lar::test::spawn_lar({"sync", "--db", db_->string(), "--runs", (*home_ / "runs").string()}, *home_ / "sync.log");
  EXPECT_EQ(lar::test::wait_exit(pid), 0) << read_file(*home_ / "sync.log");
  json r = get_json("/api/runs/alpha/gdn.s1");
  EXPECT_EQ(r["step"], 21);
  EXPECT_NE(get_json("/api/version")["version"], before);
  *db_hash_ = lar::sha256_hex(read_file(*db_));
}

TEST(ServeCli, RefusesNonLoopbackWithoutTheFlagAndMissingDb) {
  const fs::path home = temp_dir("cli");
  const fs::path db = make_registry(home);
  const pid_t p1 = lar::test::spawn_lar({"serve", "--db", db.string(), "--host", "0.0.0.0", "--port", "0"}, home / "a.log");
  EXPECT_EQ(lar::test::wait_exit(p1), 2);
  EXPECT_NE(read_file(home / "a.log").find("--allow-remote"), std::string::npos) << read_file(home / "a.log");
  const pid_t p2 = lar::test::spawn_lar({"serve", "--db", (home / "none.db").string(), "--port", "0"}, home / "b.log");
  EXPECT_EQ(lar::test::wait_exit(p2), 2);
  EXPECT_NE(read_file(home / "b.log").find("no registry at"), std::string::npos) << read_file(home / "b.log");
  EXPECT_FALSE(fs::exists(home / "none.db"));
  {
    ServeProcess remote(db, home / "c.log", {"--host", "0.0.0.0", "--allow-remote"});
    ASSERT_GT(remote.port(), 0) << remote.log();
    EXPECT_NE(remote.log().find("WARNING"), std::string::npos) << remote.log();
    httplib::Client c("127.0.0.1", remote.port());
    auto r = c.Get("/api/experiments", {{"Host", "my-workstation:1234"}});  // any Host once remote is allowed
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
  }
  fs::remove_all(home);
}

TEST(ServeDeepPages, OffsetPagingMatchesTheListing) {
  // 40 runs: a page at offset 20 of size 1 takes the OFFSET path (20 > 16 x 1), the same
  // run read as the last of a first page of 21 takes the registry's query builder.
  const fs::path home = temp_dir("deep");
  for (int i = 0; i < 40; ++i)
    make_run(home / "runs", "many", "c" + std::to_string(100 + i), {{"architecture", "gdn"}, {"seed", i}},
             lar::RunState::completed, 2, 2);
  {
    auto reg = lar::registry::Registry::open(home / "lar.db");
    reg.sync(home / "runs");
  }
  ServeProcess server(home / "lar.db", home / "serve.log");
  ASSERT_GT(server.port(), 0) << server.log();
  httplib::Client c("127.0.0.1", server.port());
  auto get = [&](const std::string& path) {
    auto r = c.Get(path.c_str());
    EXPECT_TRUE(r && r->status == 200) << path;
    return r ? json::parse(r->body) : json();
  };
  json deep = get("/api/runs?limit=1&offset=20");
  json shallow = get("/api/runs?limit=21&offset=0");
  ASSERT_EQ(deep["count"], 1);
  EXPECT_EQ(deep["runs"][0]["run_id"], "many/c120");
  EXPECT_EQ(deep["runs"][0], shallow["runs"][20]);
  EXPECT_EQ(deep["total"], 40);
  EXPECT_TRUE(deep["has_more"].get<bool>());
  json last = get("/api/runs?limit=2&offset=38");
  EXPECT_FALSE(last["has_more"].get<bool>());
  EXPECT_EQ(last["runs"][1]["run_id"], "many/c139");
  json desc = get("/api/runs?limit=1&offset=39&sort=-run_id");
  EXPECT_EQ(desc["runs"][0]["run_id"], "many/c100");
  server.stop();
  fs::remove_all(home);
}

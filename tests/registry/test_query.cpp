// Queries: filters (experiment, axis aliases, config paths, numbers, negation, status),
// sorting, limits, run lookup by prefix / cell id / hash, error messages.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "helpers.hpp"
#include "registry/registry.hpp"

using namespace lar;
using namespace lar::registry;
using namespace regtest;

namespace {

std::vector<std::string> ids(const std::vector<RunRecord>& rs) {
  std::vector<std::string> out;
  for (const auto& r : rs) out.push_back(r.run_id);
  return out;
}

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

// Four runs of "t2" (gdn/deltanet × lr) and one of "other".
class Query : public ::testing::Test {
 protected:
  void SetUp() override {
    home = temp_dir("query");
    struct Spec { std::string cell, arch; double lr; RunState st; double loss; };
    std::vector<Spec> specs = {{"gdn.lr1e-3", "gdn", 1e-3, RunState::completed, 3.0},
                               {"gdn.lr3e-4", "gdn", 3e-4, RunState::completed, 2.5},
                               {"deltanet.lr1e-3", "deltanet", 1e-3, RunState::failed, 4.0},
                               {"deltanet.lr3e-4", "deltanet", 3e-4, RunState::running, 3.5}};
    for (const auto& s : specs) {
      json config = {{"model", {{"architecture", s.arch}, {"d_model", 64}, {"ccq", {{"enabled", s.arch == "gdn"}}}}},
                     {"optimizer", {{"name", "adamw"}, {"lr", s.lr}}}};
      fs::path d = make_run(home / "runs", "t2", s.cell, {{"architecture", s.arch}, {"lr", s.lr}}, config);
      write_status(d, s.st, 10, 10, {{"final_loss", s.loss}});
    }
    fs::path d = make_run(home / "runs", "other", "x", {{"seed", 0}}, {{"model", {{"architecture", "gdn"}}}});
    write_status(d, RunState::completed, 1, 1);  // no final_loss: sorts last
    reg = std::make_unique<Registry>(Registry::open(home / "lar.db"));
    reg->sync(home / "runs");
  }
  RunFilter where(std::initializer_list<std::string> clauses) {
    RunFilter f;
    for (const auto& c : clauses) f.where.push_back(RunFilter::parse_where(c));
    return f;
  }
  fs::path home;
  std::unique_ptr<Registry> reg;
};

}  // namespace

TEST_F(Query, AllRunsSortedByIdByDefault) {
  EXPECT_EQ(ids(reg->runs()), (std::vector<std::string>{"other/x", "t2/deltanet.lr1e-3", "t2/deltanet.lr3e-4",
                                                        "t2/gdn.lr1e-3", "t2/gdn.lr3e-4"}));
}

TEST_F(Query, FilterByExperimentAndStatus) {
  RunFilter f;
  f.experiment = "t2";
  f.status = {RunState::completed};
  EXPECT_EQ(ids(reg->runs(f)), (std::vector<std::string>{"t2/gdn.lr1e-3", "t2/gdn.lr3e-4"}));
  f.status = {RunState::failed, RunState::running};
  EXPECT_EQ(ids(reg->runs(f)), (std::vector<std::string>{"t2/deltanet.lr1e-3", "t2/deltanet.lr3e-4"}));
}

TEST_F(Query, WhereUsesAxisAliasesConfigPathsAndNumbers) {
  // `architecture` is an axis of t2 and an alias of model.architecture for "other".
  EXPECT_EQ(ids(reg->runs(where({"architecture=gdn"}))),
            (std::vector<std::string>{"other/x", "t2/gdn.lr1e-3", "t2/gdn.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"model.architecture=deltanet", "lr=0.0003"}))),
            (std::vector<std::string>{"t2/deltanet.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"lr=3e-4"}))),  // same number, other spelling
            (std::vector<std::string>{"t2/deltanet.lr3e-4", "t2/gdn.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"ccq=true"}))), (std::vector<std::string>{"t2/gdn.lr1e-3", "t2/gdn.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"d_model=64", "architecture!=gdn"}))),
            (std::vector<std::string>{"t2/deltanet.lr1e-3", "t2/deltanet.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"status=failed"}))), (std::vector<std::string>{"t2/deltanet.lr1e-3"}));
  EXPECT_EQ(ids(reg->runs(where({"summary.final_loss=2.5"}))), (std::vector<std::string>{"t2/gdn.lr3e-4"}));
  EXPECT_EQ(ids(reg->runs(where({"final_loss=4"}))), (std::vector<std::string>{"t2/deltanet.lr1e-3"}));
  EXPECT_TRUE(reg->runs(where({"architecture=mamba"})).empty());
}

TEST_F(Query, SortAndLimit) {
  RunFilter f;
  f.sort = "final_loss";
  EXPECT_EQ(ids(reg->runs(f)), (std::vector<std::string>{"t2/gdn.lr3e-4", "t2/gdn.lr1e-3", "t2/deltanet.lr3e-4",
                                                         "t2/deltanet.lr1e-3", "other/x"}));
  f.sort = "-final_loss";
  f.limit = 2;
  EXPECT_EQ(ids(reg->runs(f)), (std::vector<std::string>{"t2/deltanet.lr1e-3", "t2/deltanet.lr3e-4"}));
  f.sort = "lr";
  f.limit = 0;
  f.experiment = "t2";
  EXPECT_EQ(ids(reg->runs(f)), (std::vector<std::string>{"t2/deltanet.lr3e-4", "t2/gdn.lr3e-4",
                                                         "t2/deltanet.lr1e-3", "t2/gdn.lr1e-3"}));
}

TEST_F(Query, RecordsCarryCellAndConfig) {
  auto rs = reg->runs(where({"architecture=gdn", "lr=0.001"}));
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_EQ(rs[0].experiment, "t2");
  EXPECT_EQ(rs[0].cell_id, "gdn.lr1e-3");
  EXPECT_EQ(rs[0].hash, "h_t2_gdn.lr1e-3");
  EXPECT_EQ(rs[0].axes["architecture"], "gdn");
  EXPECT_EQ(rs[0].config["optimizer"]["name"], "adamw");
  EXPECT_TRUE(rs[0].history.empty());  // only on request
  RunFilter f = where({"architecture=gdn", "lr=0.001"});
  f.with_config = false;
  f.with_history = true;
  rs = reg->runs(f);
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_TRUE(rs[0].config.is_null());
  EXPECT_EQ(rs[0].history.size(), 1u);
}

TEST_F(Query, BadFiltersAreUserErrors) {
  EXPECT_EQ(user_error([&] { reg->runs(where({"architecure=gdn"})); }),
            "unknown key 'architecure' in --where architecure=gdn (did you mean 'architecture'?)");
  RunFilter f;
  f.sort = "-final_los";
  EXPECT_EQ(user_error([&] { reg->runs(f); }), "unknown key 'final_los' in --sort (did you mean 'final_loss'?)");
  f.sort = "run_id";
  f.experiment = "t3";
  EXPECT_TRUE(reg->runs(f).empty());  // not an error in the API: nothing ran yet
  EXPECT_EQ(user_error([&] { RunFilter::parse_where("architecture"); }),
            "bad --where 'architecture': expected KEY=VALUE or KEY!=VALUE");
  EXPECT_EQ(user_error([&] { RunFilter::parse_where("=gdn"); }),
            "bad --where '=gdn': expected KEY=VALUE or KEY!=VALUE");
}

TEST_F(Query, RunLookupByIdPrefixCellIdAndHash) {
  EXPECT_EQ(reg->run("t2/gdn.lr3e-4")->run_id, "t2/gdn.lr3e-4");
  EXPECT_EQ(reg->run("t2/gdn.lr3")->run_id, "t2/gdn.lr3e-4");  // unique prefix
  EXPECT_EQ(reg->run("x")->run_id, "other/x");                 // cell id
  EXPECT_EQ(reg->run("gdn.lr3")->run_id, "t2/gdn.lr3e-4");     // unique cell-id prefix
  EXPECT_EQ(reg->run("h_t2_deltanet.lr1")->run_id, "t2/deltanet.lr1e-3");  // hash prefix
  EXPECT_FALSE(reg->run("nothing").has_value());
  EXPECT_EQ(user_error([&] { reg->run("t2/gdn"); }),
            "run 't2/gdn' is ambiguous; it matches:\n  t2/gdn.lr1e-3\n  t2/gdn.lr3e-4");
  EXPECT_EQ(user_error([&] { reg->require_run("t2/gdn.lr3e-5"); }),
            "unknown run 't2/gdn.lr3e-5' (did you mean 't2/gdn.lr3e-4'?)");
  EXPECT_EQ(user_error([&] { reg->require_run("zzzzzzzzzzzzzzzzzz"); }), "unknown run 'zzzzzzzzzzzzzzzzzz'");
  EXPECT_EQ(user_error([&] { reg->require_run("gdn.lr3e-5"); }),
            "unknown run 'gdn.lr3e-5' (did you mean 'gdn.lr3e-4'?)");
  EXPECT_EQ(user_error([&] { reg->metric_series("t2/nope", "loss"); }), "unknown run 't2/nope'");
}

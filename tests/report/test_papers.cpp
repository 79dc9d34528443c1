// Every paper spec parses at every scale; the smaller scales keep the paper's matrix and
// get its published values; --seeds expansion; the known-issue lists.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/figure.hpp"

using namespace lar;
using namespace lar::report;
namespace fs = std::filesystem;

namespace {

struct PapersEnv {
  PapersEnv() { ::setenv("LAR_PAPERS", LAR_SOURCE_DIR "/experiments/papers", 1); }
};
const PapersEnv kEnv;

}  // namespace

TEST(Papers, EveryTableIsListed) {
  const auto all = list_paper_tables();
  for (const char* t : {"laa/table2", "laa/lr_sweep", "laa/fig6", "laa/table6", "laa/table7", "laa/table3",
                        "laa/table8", "laa/gdn2_3to1", "ccq/table2", "ccq/table3", "ccq/table7", "ccq/appendix_e", "ccq/fig5", "carve/main",
                        "carve/table3", "carve/table7", "carve/table8"})
    EXPECT_NE(std::find(all.begin(), all.end(), t), all.end()) << t;
  EXPECT_EQ(std::find(all.begin(), all.end(), "laa/common"), all.end());
  EXPECT_EQ(std::find(all.begin(), all.end(), "laa/notes"), all.end());
}

TEST(Papers, EverySpecParsesAtEveryScaleWithTheSameMatrix) {
  for (const auto& t : list_paper_tables()) {
    const fs::path spec = resolve_paper_spec(t);
    std::vector<std::vector<std::string>> signatures;
    for (const char* scale : {"smoke", "mini", "paper"}) {
      experiments::Plan plan;
      ASSERT_NO_THROW(plan = load_paper_plan(spec, scale)) << t << " @ " << scale;
      EXPECT_FALSE(plan.cells.empty()) << t;
      ASSERT_TRUE(plan.meta.contains("reference")) << t << ": no published values";
      EXPECT_FALSE(plan.meta["reference"]["source"].value("paper", "").empty()) << t;
      for (const auto& w : plan.warnings) ADD_FAILURE() << t << " @ " << scale << ": " << w;
      std::vector<std::string> sig;
      for (const auto& c : plan.cells) {
        std::string s;
        for (const auto& [a, v] : c.axes)
          if (v.is_string() || v.is_boolean()) s += a + "=" + v.dump() + ";";
        sig.push_back(s + (c.baseline ? "b" : "") + c.role);
      }
      // A scale may run more seeds (the seed axis is the last, so its cells are adjacent):
      // the matrix is the same set of configurations.
      sig.erase(std::unique(sig.begin(), sig.end()), sig.end());
      signatures.push_back(sig);
    }
    EXPECT_EQ(signatures[0], signatures[2]) << t << ": smoke and paper matrices differ";
    EXPECT_EQ(signatures[1], signatures[2]) << t << ": mini and paper matrices differ";
  }
}

TEST(Papers, LaaTable2SmokeHas18CellsWithPublishedValues) {
  auto plan = load_paper_plan(resolve_paper_spec("laa/table2"), "smoke");
  ASSERT_EQ(plan.cells.size(), 18u);
  int with_ref = 0;
  for (const auto& c : plan.cells) with_ref += c.reference.is_object() && c.reference.contains("final_loss");
  EXPECT_EQ(with_ref, 18);
  EXPECT_EQ(plan.cells[0].config["model"]["architecture"], "softmax");
  EXPECT_EQ(plan.cells[0].config["model"]["stack"], "dense");
  EXPECT_EQ(plan.cells[0].reference["final_loss"], 2.413);
  // the paper scale is the authors' run: 15B tokens, width 1024, seq 4096, batch 128, the
  // launchers' warmup (200 steps), AdamW lr 3e-4 → 3e-5, depth and head layout per mixer
  auto paper = load_paper_plan(resolve_paper_spec("laa/table2"), "paper");
  const json& cfg = paper.cells[0].config;  // softmax / AdamW / dense
  EXPECT_EQ(cfg["budget"]["tokens"], 1.5e10);
  EXPECT_EQ(cfg["model"]["n_layers"], 24);
  EXPECT_EQ(cfg["model"]["d_ff"], 2560);
  EXPECT_EQ(cfg["model"]["d_model"], 1024);
  EXPECT_EQ(cfg["data"]["seq_len"], 4096);
  EXPECT_EQ(cfg["data"]["batch_size"], 128);
  EXPECT_EQ(cfg["schedule"]["warmup_steps"], 200);
  EXPECT_EQ(cfg["optimizer"]["lr"], 3e-4);
  EXPECT_EQ(cfg["schedule"]["min_lr"], 3e-5);
  int gdn = 0;
  for (const auto& c : paper.cells) {
    const json& m = c.config["model"];
    if (m["architecture"] == "gdn") {
      ++gdn;
      EXPECT_EQ(m["n_layers"], 22) << c.id;
      EXPECT_EQ(m["linear_heads"], 4) << c.id;
      EXPECT_EQ(m["linear_head_dim"], 64) << c.id;
      EXPECT_EQ(m["n_v_heads"], 8) << c.id;
    }
    if (m["architecture"] == "deltanet") {
      EXPECT_EQ(m["value_dim"], 128) << c.id;
    }
  }
  EXPECT_EQ(gdn, 4);
}

TEST(Papers, SmallerScalesTakeThePaperScaleReference) {
  // fig6 at smoke times 256/1024/2048 tokens; the published 32K values go to the longest.
  auto plan = load_paper_plan(resolve_paper_spec("laa/fig6"), "smoke");
  int with_ref = 0;
  for (const auto& c : plan.cells)
    if (c.reference.is_object() && c.reference.contains("sec_per_iter")) {
      ++with_ref;
      EXPECT_EQ(c.config["data"]["seq_len"], 2048) << c.id;
    }
  EXPECT_EQ(with_ref, 3);
  auto t7 = load_paper_plan(resolve_paper_spec("laa/table7"), "smoke");
  ASSERT_EQ(t7.cells.size(), 15u);
  EXPECT_EQ(t7.cells[2].reference["final_loss"], 2.8228);  // gdn 350M/1B clvr
  ASSERT_TRUE(t7.cells[2].baseline);
  EXPECT_EQ(*t7.cells[2].baseline, t7.cells[0].id);
}

TEST(Papers, SeedsExpansion) {
  auto plan = load_paper_plan(resolve_paper_spec("laa/table6"), "smoke", 3);
  ASSERT_EQ(plan.cells.size(), 24u);
  const auto& c = plan.cells[2];  // first row (normuon, gdn, none), seed 2
  EXPECT_EQ(c.config["seed"], 2);
  EXPECT_EQ(c.id.substr(c.id.size() - 3), ".s2");
  EXPECT_EQ(c.hash.size(), 64u);
  EXPECT_NE(c.hash, plan.cells[0].hash);
  // the routed cell's baseline is the baseline row's cell with the same seed
  const auto& routed = plan.cells[5];  // (normuon, gdn, cler), seed 2
  ASSERT_TRUE(routed.baseline);
  EXPECT_EQ(*routed.baseline, c.id);
  // seed 0 is the spec's own cell, unchanged
  auto single = load_paper_plan(resolve_paper_spec("laa/table6"), "smoke");
  EXPECT_EQ(plan.cells[0].hash, single.cells[0].hash);
  EXPECT_EQ(plan.cells[0].id, single.cells[0].id);
}

TEST(Papers, KnownIssuesPerTable) {
  auto t6 = load_known_issues(resolve_paper_spec("laa/table6"));
  ASSERT_FALSE(t6.empty());
  EXPECT_EQ(t6[0].where, "Table 6 (p. 15)");
  EXPECT_NE(t6[0].text.find("+0.0013"), std::string::npos);
  auto ccq = load_known_issues(resolve_paper_spec("ccq/table2"));
  bool has_264 = false;
  for (const auto& k : ccq) has_264 |= k.text.find("+2.64") != std::string::npos;
  EXPECT_TRUE(has_264);
}

TEST(Papers, UnknownTableNamesTheChoices) {
  try {
    resolve_paper_spec("laa/table9");
    FAIL();
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("unknown paper table 'laa/table9'"), std::string::npos) << m;
    EXPECT_NE(m.find("laa/table2"), std::string::npos) << m;
  }
}

TEST(Papers, EveryFigureDrawsAMetricOfItsTable) {
  for (const auto& def : figure_catalogue()) {
    auto plan = load_paper_plan(resolve_paper_spec(def.table), "smoke");
    if (def.kind == "curves") continue;  // metric series of the runs, not table metrics
    const auto metrics = plan.meta["reference"]["metrics"].get<std::vector<std::string>>();
    if (def.kind == "metric_vs_length") {  // val_loss@L for every evaluation length
      EXPECT_TRUE(std::any_of(metrics.begin(), metrics.end(), [&](const std::string& m) { return m.rfind(def.y, 0) == 0; }))
          << def.name << ": " << def.y;
      continue;
    }
    std::vector<std::string> drawn;  // bars: one panel per comma-separated metric
    for (size_t start = 0, end = 0; end != std::string::npos; start = end + 1) {
      end = def.y.find(',', start);
      drawn.push_back(def.y.substr(start, end == std::string::npos ? end : end - start));
    }
    for (const auto& y : drawn) EXPECT_NE(std::find(metrics.begin(), metrics.end(), y), metrics.end()) << def.name << ": " << y;
    if (def.kind == "metric_vs_axis") {
      bool axis = false;
      for (const auto& [a, v] : plan.cells[0].axes) axis |= a == def.x;
      EXPECT_TRUE(axis) << def.name << ": no axis " << def.x;
    }
  }
}

TEST(Papers, ClaimsParseAtEveryScaleAndReadTheWayThePaperPrints) {
  // Every declared claim, read on the published values at the paper scale, says what the
  // paper says (or the values cannot tell, e.g. a no-gain claim with one pair).
  const std::map<std::string, int> claims_per_table = {
      {"laa/table2", 4}, {"laa/table6", 1}, {"laa/table7", 1}, {"laa/fig6", 1},    {"ccq/table2", 1},
      {"ccq/table3", 1}, {"ccq/table7", 1}, {"carve/main", 1}, {"carve/table7", 2}};
  for (const auto& [t, n] : claims_per_table) {
    for (const char* scale : {"smoke", "mini"}) {
      experiments::Plan plan;
      ASSERT_NO_THROW(plan = load_paper_plan(resolve_paper_spec(t), scale)) << t << " @ " << scale;
      EXPECT_EQ(plan.claims.size(), static_cast<size_t>(n)) << t << " @ " << scale;
    }
    auto plan = load_paper_plan(resolve_paper_spec(t), "paper");
    ASSERT_EQ(plan.claims.size(), static_cast<size_t>(n)) << t;
    Report rep = build_report(make_table_input(plan, resolve_paper_spec(t), nullptr));
    ASSERT_EQ(rep.claims.size(), static_cast<size_t>(n));
    for (const auto& c : rep.claims) {
      EXPECT_NE(c.paper_consistent, std::optional<bool>(false)) << t << ": " << c.claim.name << ": " << c.paper_reading;
      EXPECT_EQ(c.verdict, verdict::no_data) << t << ": no runs yet";
      EXPECT_FALSE(c.claim.source.empty()) << t << ": " << c.claim.name << " cites no table/page";
    }
  }
  // The counts the issue quotes.
  auto read = [](const std::string& t, size_t i) {
    auto plan = load_paper_plan(resolve_paper_spec(t), "paper");
    return build_report(make_table_input(plan, resolve_paper_spec(t), nullptr)).claims.at(i);
  };
  auto muon = read("laa/table2", 0);
  EXPECT_EQ(muon.links[0].published, 9);  // 8 linear pairs and softmax
  EXPECT_EQ(muon.links[0].published_agree, 9);
  auto hybrid = read("laa/table2", 1);
  EXPECT_EQ(hybrid.links[0].published, 8);
  EXPECT_EQ(hybrid.links[0].published_agree, 8);
  // Row ids carry the paper scale's per-architecture axes after these.
  EXPECT_EQ(read("laa/table2", 2).published_best.value_or("").rfind("kda.normuon.hybrid.lr3.6e-4.min_lr3.6e-5.", 0), 0u);
  auto cler = read("laa/table6", 0);
  EXPECT_EQ(cler.links[0].published, 4);
  EXPECT_EQ(cler.links[0].published_agree, 1);  // only DeltaNet/Muon improves, by 0.0004
  auto chain = read("laa/table7", 0);
  EXPECT_EQ(chain.pairs.size(), 10u);  // 5 tuples × 2 links
  EXPECT_EQ(read("laa/fig6", 0).published_best.value_or("").rfind("gdn.pure.", 0), 0u);
}

TEST(Papers, BaselineFamiliesHaveThePapersLayerCountsAndValues) {
  // CCQ §3.1: at 1.3B Mamba2 has 48 layers, the Transformer 24, the GLA / GDN backbones 21.
  auto plan = load_paper_plan(resolve_paper_spec("ccq/table4"), "paper");
  std::map<std::string, int> layers;
  for (const auto& c : plan.cells) layers[c.config["model"]["architecture"]] = c.config["model"]["n_layers"];
  EXPECT_EQ(layers["mamba2"], 48);
  EXPECT_EQ(layers["softmax"], 24);
  EXPECT_EQ(layers["gla"], 21);
  EXPECT_EQ(plan.cells[0].reference["longbench_avg"], 13.13);
  // Tables 2-3: the same families at both sizes; 500M: Mamba2 65, Transformer 35 layers.
  for (const char* t : {"ccq/table2", "ccq/table3"}) {
    std::map<std::pair<int, std::string>, std::set<int>> depth;
    for (const auto& c : load_paper_plan(resolve_paper_spec(t), "paper").cells) {
      const auto& m = c.config["model"];
      depth[{m["d_model"].get<int>(), m["architecture"].get<std::string>()}].insert(m["n_layers"].get<int>());
      if (m["architecture"] == "softmax") {
        EXPECT_EQ(m["stack"], "dense") << t;
      }
    }
    auto at = [&](int d, const std::string& a) { return depth[std::make_pair(d, a)]; };
    using D = std::set<int>;
    EXPECT_EQ(at(1024, "mamba2"), D{65}) << t;
    EXPECT_EQ(at(2048, "mamba2"), D{48}) << t;
    EXPECT_EQ(at(1024, "softmax"), D{35}) << t;
    EXPECT_EQ(at(2048, "softmax"), D{24}) << t;
    for (const char* a : {"gla", "gdn", "gla_hedgehog"}) {
      EXPECT_EQ(at(1024, a), D{21}) << t << " " << a;
      EXPECT_EQ(at(2048, a), D{21}) << t << " " << a;
    }
  }
  for (const auto& c : load_paper_plan(resolve_paper_spec("ccq/table2"), "paper").cells)
    if (c.config["model"]["architecture"] == "softmax") {
      EXPECT_EQ(c.reference["wikitext_ppl"], c.config["model"]["d_model"] == 1024 ? 331.69 : 41.55);
    }
  auto carve = load_paper_plan(resolve_paper_spec("carve/main"), "smoke");
  int mamba2 = 0, siso = 0, mimo = 0;
  for (const auto& c : carve.cells) {
    if (c.config["model"]["architecture"] == "mamba2") {
      ++mamba2;
      EXPECT_EQ(c.reference["wiki_ppl"], 16.79);
    }
    if (c.config["model"]["architecture"] == "mamba3") {
      const bool is_mimo = c.config["model"]["mamba3"]["form"] == "mimo";
      ++(is_mimo ? mimo : siso);
      EXPECT_EQ(c.reference["wiki_ppl"], is_mimo ? 16.45 : 16.30);
      if (is_mimo) {
        EXPECT_EQ(c.config["model"]["mamba3"]["mimo_rank"], 4);  // the paper's rank
      }
    }
  }
  EXPECT_EQ(mamba2, 3);  // 3 seeds
  EXPECT_EQ(siso, 3);
  EXPECT_EQ(mimo, 3);
}

// Every length a cell evaluates at has a column: where a table's reference metrics are
// length-indexed (acc_pct@4K, val_loss@512, ppl@4096), each length of every cell's
// eval.lengths, at every scale, is among them; otherwise a scale's runs record metrics the
// table never reads and its rows fail as "required field missing".
TEST(Papers, EveryEvaluationLengthHasAReferenceColumn) {
  const auto length_of = [](std::string s) -> long {
    long mult = 1;
    if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) {
      mult = 1024;
      s.pop_back();
    }
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return -1;
    return std::stol(s) * mult;
  };
  for (const auto& t : list_paper_tables()) {
    for (const char* scale : {"smoke", "mini", "paper"}) {
      const experiments::Plan plan = load_paper_plan(resolve_paper_spec(t), scale);
      std::set<long> columns;
      for (const auto& m : plan.meta["reference"]["metrics"].get<std::vector<std::string>>())
        if (auto at = m.find('@'); at != std::string::npos && length_of(m.substr(at + 1)) > 0)
          columns.insert(length_of(m.substr(at + 1)));
      if (columns.empty()) continue;
      for (const auto& c : plan.cells) {
        if (!c.config.contains("eval") || !c.config["eval"].contains("lengths")) continue;
        for (const auto& l : c.config["eval"]["lengths"])
          EXPECT_TRUE(columns.count(l.get<long>())) << t << " @ " << scale << ": " << c.id << " evaluates at " << l
                                                    << " tokens, which no reference metric names";
      }
    }
  }
}

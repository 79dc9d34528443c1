// Expansion semantics of experiment specs (docs/specs.md): grid, conditional axes, zip,
// exclude/include, extends, scales, roles, baselines, reference values, ids, hashes.
#include <algorithm>
#include <fstream>

#include "core/config_schema.hpp"
#include "core/config_hash.hpp"
#include "core/hash.hpp"
#include "experiments/ids.hpp"
#include "spec_fixture.hpp"

using namespace lar;
using namespace lar::experiments;
using lar::experiments::testing::ids;
using lar::experiments::testing::SpecDir;
using V = std::vector<std::string>;

namespace {

const Cell& cell(const Plan& p, const std::string& id) {
  for (const auto& c : p.cells)
    if (c.id == id) return c;
  throw std::runtime_error("no cell " + id);
}

const char* kTable2 = R"(name: laa-table2
description: "LAA Table 2"
base:
  model: {n_layers: 20, d_model: 1024, n_heads: 16}
  optimizer: {weight_decay: 0.1}
matrix:
  architecture: [softmax, deltanet, gdn, kda, gdn2]
  optimizer: [adamw, muon]
  stack: {by: architecture, softmax: [dense], default: [hybrid, pure]}
  lr: {by: optimizer, adamw: [1.0e-3], muon: [3.0e-4]}
  seed: [0]
exclude:
  - {architecture: kda, stack: pure}
include:
  - {architecture: gdn, optimizer: adamw, stack: pure, lr: 3.0e-3}
scales:
  smoke: {base: {model: {n_layers: 2, d_model: 64}, budget: {steps: 60}}}
  paper: {base: {model: {n_layers: 20}}, matrix: {seed: [0, 1]}}
default_scale: smoke
)";

}  // namespace

TEST(Expand, GridCounts) {
  SpecDir d;
  Plan p = d.load("name: g\nmatrix:\n  lr: [1e-3, 3e-4, 1e-4]\n  seed: [0, 1]\n  warmup: [0, 100]\n");
  EXPECT_EQ(p.cells.size(), 12u);
  EXPECT_EQ(p.experiment, "g");
  EXPECT_EQ(p.scale, "");
  EXPECT_EQ(p.cells.front().id, "lr1e-3.s0.warmup0");
  EXPECT_EQ(p.cells.back().id, "lr1e-4.s1.warmup100");
  EXPECT_EQ(p.cells[1].config["schedule"]["warmup_steps"], 100);
  EXPECT_EQ(p.cells[1].config["optimizer"]["lr"], 1e-3);
  // Axis order and values are kept per cell.
  ASSERT_EQ(p.cells[1].axes.size(), 3u);
  EXPECT_EQ(p.cells[1].axes[0].first, "lr");
  EXPECT_EQ(p.cells[1].axes[2].second, 100);
  EXPECT_EQ(p.meta["axes"], json::array({"lr", "seed", "warmup"}));
}

TEST(Expand, NoMatrixIsOneBaseCell) {
  SpecDir d;
  Plan p = d.load("name: one\nbase: {budget: {steps: 5}}\n");
  ASSERT_EQ(ids(p), V{"base"});
  EXPECT_EQ(p.cells[0].config["budget"]["steps"], 5);
  EXPECT_TRUE(p.cells[0].axes.empty());
}

TEST(Expand, Table2ConditionalAxesExcludeInclude) {
  SpecDir d;
  Plan p = d.load(kTable2);
  EXPECT_EQ(p.scale, "smoke");
  // softmax: 2 optimizers × dense; 4 linear × 2 optimizers × 2 stacks; − kda pure (2); + 1 include
  EXPECT_EQ(p.cells.size(), 2u + 16u - 2u + 1u);
  EXPECT_EQ(p.cells[0].id, "softmax.adamw.dense.lr1e-3.s0");
  EXPECT_EQ(p.cells[1].id, "softmax.muon.dense.lr3e-4.s0");
  EXPECT_EQ(p.cells.back().id, "gdn.adamw.pure.lr3e-3.s0");
  EXPECT_EQ(cell(p, "gdn.muon.hybrid.lr3e-4.s0").config["optimizer"]["lr"], 3e-4);
  EXPECT_EQ(cell(p, "gdn.muon.hybrid.lr3e-4.s0").config["model"]["stack"], "hybrid");
  for (const auto& c : p.cells) EXPECT_EQ(c.id.find("kda.adamw.pure"), std::string::npos) << c.id;
  // Scale overrides base; base overrides defaults; defaults fill the rest.
  const Cell& c = p.cells[0];
  EXPECT_EQ(c.config["model"]["n_layers"], 2);
  EXPECT_EQ(c.config["model"]["d_model"], 64);
  EXPECT_EQ(c.config["model"]["n_heads"], 16);
  EXPECT_EQ(c.config["budget"]["steps"], 60);
  EXPECT_EQ(c.config["optimizer"]["beta1"], 0.9);
  EXPECT_TRUE(p.warnings.empty());
  EXPECT_EQ(p.meta["description"], "LAA Table 2");
  EXPECT_EQ(p.meta["scales"], json::array({"smoke", "paper"}));
}

TEST(Expand, ScaleOverridesMatrixAxes) {
  SpecDir d;
  Plan p = d.load(kTable2, "paper");
  EXPECT_EQ(p.scale, "paper");
  EXPECT_EQ(p.cells.size(), 2 * (2u + 16u - 2u) + 2u);  // seeds [0, 1] (include too)
  EXPECT_EQ(p.cells[0].config["model"]["n_layers"], 20);
  EXPECT_EQ(p.cells[0].config["model"]["d_model"], 1024);
  EXPECT_EQ(p.cells[1].id, "softmax.adamw.dense.lr1e-3.s1");
}

TEST(Expand, ConditionalValuesFollowTheirAxis) {
  SpecDir d;
  Plan p = d.load(R"(name: c
matrix:
  optimizer: [adamw, muon, normuon]
  lr: {by: optimizer, adamw: [1e-3, 2e-3], default: [3e-4]}
)");
  EXPECT_EQ(ids(p), (V{"adamw.lr1e-3", "adamw.lr2e-3", "muon.lr3e-4", "normuon.lr3e-4"}));
}

TEST(Expand, ZipAdvancesTogether) {
  SpecDir d;
  Plan p = d.load(R"(name: z
matrix:
  lr: [1e-3, 3e-4, 1e-4]
  seed: [0, 1]
  schedule.warmup_steps: [100, 200, 300]
zip: [[lr, schedule.warmup_steps]]
)");
  EXPECT_EQ(ids(p), (V{"lr1e-3.s0.warmup_steps100", "lr1e-3.s1.warmup_steps100", "lr3e-4.s0.warmup_steps200",
                       "lr3e-4.s1.warmup_steps200", "lr1e-4.s0.warmup_steps300", "lr1e-4.s1.warmup_steps300"}));
  EXPECT_EQ(p.cells[2].config["schedule"]["warmup_steps"], 200);
}

TEST(Expand, ZipWithConditionalLists) {
  SpecDir d;
  Plan p = d.load(R"(name: z
matrix:
  optimizer: [adamw, muon]
  lr: {by: optimizer, adamw: [1e-3, 2e-3], muon: [3e-4]}
  warmup: {by: optimizer, adamw: [10, 20], muon: [30]}
zip: [[lr, warmup]]
)");
  EXPECT_EQ(ids(p), (V{"adamw.lr1e-3.warmup10", "adamw.lr2e-3.warmup20", "muon.lr3e-4.warmup30"}));
}

TEST(Expand, ExcludeAndIncludeWithOverrides) {
  SpecDir d;
  Plan p = d.load(R"(name: e
matrix:
  lr: [1e-3, 3e-4]
  seed: [0, 1, 2]
exclude:
  - {lr: 3e-4, seed: [1, 2]}
include:
  - {lr: 1e-2, seed: 0}
  - {lr: 1e-3, model.n_layers: 4}
)");
  EXPECT_EQ(ids(p), (V{"lr1e-3.s0", "lr1e-3.s1", "lr1e-3.s2", "lr3e-4.s0", "lr0.01.s0", "lr1e-3.s0.n_layers4",
                       "lr1e-3.s1.n_layers4", "lr1e-3.s2.n_layers4"}));
  EXPECT_EQ(cell(p, "lr1e-3.s1.n_layers4").config["model"]["n_layers"], 4);
  EXPECT_EQ(cell(p, "lr0.01.s0").config["optimizer"]["lr"], 0.01);
  // An include's config key is an axis of every cell (the template's value elsewhere), so
  // tables and claims tell the included rows apart from the matrix's.
  EXPECT_EQ(p.meta["axes"], json::array({"lr", "seed", "model.n_layers"}));
  const auto& inc = cell(p, "lr1e-3.s1.n_layers4").axes;
  ASSERT_EQ(inc.size(), 3u);
  EXPECT_EQ(inc[2].first, "model.n_layers");
  EXPECT_EQ(inc[2].second, 4);
  const auto& other = cell(p, "lr1e-3.s1").axes;
  ASSERT_EQ(other.size(), 3u);
  EXPECT_EQ(other[2].second, cell(p, "lr1e-3.s1").config["model"]["n_layers"]);
}

TEST(Expand, ExcludeMatchingNothingWarns) {
  SpecDir d;
  Plan p = d.load("name: w\nmatrix:\n  seed: [0, 1]\nexclude:\n  - {seed: 5}\n");
  EXPECT_EQ(p.cells.size(), 2u);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_EQ(d.strip(p.warnings[0]), "spec.yaml:5:5: warning: exclude[0] matches no cell");
}

TEST(Expand, ExtendsDeepMergesMapsAndReplacesLists) {
  SpecDir d;
  d.write("common/base.yaml", R"(name: parent
description: from the parent
base:
  model: {n_layers: 4, d_model: 128}
  optimizer: {lr: 1e-3, ns_coefficients: [1, 2, 3]}
matrix:
  seed: [0, 1, 2]
  lr: [1e-3, 1e-4]
)");
  auto spec = d.write("sub/child.yaml", R"(extends: ../common/base.yaml
name: child
base:
  model: {d_model: 256}
  optimizer: {ns_coefficients: [4, 5, 6]}
matrix:
  seed: [7]
)");
  Plan p = load_plan(spec, "");
  EXPECT_EQ(p.experiment, "child");
  EXPECT_EQ(p.meta["description"], "from the parent");
  EXPECT_EQ(ids(p), (V{"s7.lr1e-3", "s7.lr1e-4"}));  // lists replace; axis keeps its place
  const json& c = p.cells[0].config;
  EXPECT_EQ(c["model"]["n_layers"], 4);    // kept from the parent (maps merge)
  EXPECT_EQ(c["model"]["d_model"], 256);   // overridden
  EXPECT_EQ(c["optimizer"]["ns_coefficients"], json::array({4.0, 5.0, 6.0}));  // replaced, not merged
}

TEST(Expand, ExtendsChains) {
  SpecDir d;
  d.write("a.yaml", "name: a\nbase: {model: {n_layers: 3}}\n");
  d.write("b.yaml", "extends: a.yaml\nbase: {model: {d_model: 96}}\n");
  auto spec = d.write("c.yaml", "extends: b.yaml\nname: c\n");
  Plan p = load_plan(spec, "");
  EXPECT_EQ(p.cells[0].config["model"]["n_layers"], 3);
  EXPECT_EQ(p.cells[0].config["model"]["d_model"], 96);
}

TEST(Expand, RolesLaterRulesWin) {
  SpecDir d;
  Plan p = d.load(R"(name: r
matrix:
  architecture: [gdn]
  stack: [hybrid]
  routing: [none, cler, clvr]
roles:
  - {match: {routing: [cler, clvr]}, role: exploratory}
  - {match: {routing: clvr}, role: main}
)");
  EXPECT_EQ(cell(p, "gdn.hybrid.none").role, "main");
  EXPECT_EQ(cell(p, "gdn.hybrid.cler").role, "exploratory");
  EXPECT_EQ(cell(p, "gdn.hybrid.clvr").role, "main");
}

TEST(Expand, BaselinesLinkToTheReplacedCell) {
  SpecDir d;
  Plan p = d.load(R"(name: b
matrix:
  architecture: [gdn, deltanet]
  stack: [hybrid]
  routing: [none, cler, clvr]
baselines:
  - {match: {routing: [cler, clvr]}, baseline: {routing: none}}
)");
  EXPECT_EQ(cell(p, "gdn.hybrid.cler").baseline, "gdn.hybrid.none");
  EXPECT_EQ(cell(p, "deltanet.hybrid.clvr").baseline, "deltanet.hybrid.none");
  EXPECT_FALSE(cell(p, "gdn.hybrid.none").baseline.has_value());
  json rc = cell(p, "gdn.hybrid.cler").run_config_json();
  EXPECT_EQ(rc["baseline"], "gdn.hybrid.none");
  EXPECT_EQ(rc["cell_id"], "gdn.hybrid.cler");
  EXPECT_EQ(rc["experiment"], "b");
  EXPECT_EQ(rc["axes"], json({{"architecture", "gdn"}, {"stack", "hybrid"}, {"routing", "cler"}}));
  EXPECT_EQ(rc["role"], "main");
  EXPECT_EQ(rc["hash"], cell(p, "gdn.hybrid.cler").hash);
  EXPECT_EQ(rc["config"]["model"]["routing"], "cler");
  EXPECT_TRUE(cell(p, "gdn.hybrid.none").run_config_json()["baseline"].is_null());
}

TEST(Expand, ReferenceValuesAttachToMatchingCells) {
  SpecDir d;
  Plan p = d.load(R"(name: ref
matrix:
  architecture: [softmax, gdn]
  stack: {by: architecture, softmax: [dense], default: [hybrid]}
  seed: [0, 1]
reference:
  source: {paper: laa, table: "Table 2", page: 12}
  metrics: [saturation_loss, final_loss]
  rows:
    - {match: {architecture: softmax, stack: dense}, values: [2.587, 2.413]}
    - {match: {architecture: gdn}, values: [2.464, null]}
    - {match: {architecture: kda}, values: [1, 2]}
)");
  EXPECT_EQ(cell(p, "softmax.dense.s1").reference, json({{"saturation_loss", 2.587}, {"final_loss", 2.413}}));
  EXPECT_EQ(cell(p, "gdn.hybrid.s0").reference["saturation_loss"], 2.464);
  EXPECT_TRUE(cell(p, "gdn.hybrid.s0").reference["final_loss"].is_null());
  EXPECT_EQ(p.meta["reference"]["metrics"], json::array({"saturation_loss", "final_loss"}));
  EXPECT_EQ(p.meta["reference"]["source"]["page"], 12);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_EQ(d.strip(p.warnings[0]), "spec.yaml:12:7: warning: reference.rows[2] matches no cell");
}

TEST(Ids, NumberFormatting) {
  EXPECT_EQ(id_number(3e-4), "3e-4");
  EXPECT_EQ(id_number(0.0003), "3e-4");
  EXPECT_EQ(id_number(1e-3), "1e-3");
  EXPECT_EQ(id_number(0.01), "0.01");
  EXPECT_EQ(id_number(2.5), "2.5");
  EXPECT_EQ(id_number(1000.0), "1e3");
  EXPECT_EQ(id_number(1.5e-4), "1.5e-4");
  EXPECT_EQ(id_part("seed", "seed", 3), "s3");
  EXPECT_EQ(id_part("ccq", "model.ccq.enabled", true), "ccq");
  EXPECT_EQ(id_part("ccq", "model.ccq.enabled", false), "noccq");
  EXPECT_EQ(id_part("data.path", "data.path", "a b/c"), "a_b_c");
  EXPECT_EQ(id_part("eval.lengths", "eval.lengths", json::array({1024, 2048})), "lengths1024-2048");
}

// ---------------------------------------------------------------- hashing

TEST(Hash, GoldenCanonicalDump) {
  // A fixed config literal: its canonical text and SHA-256 must never change (hashes
  // identify runs across machines and versions).
  json cfg = json::parse(R"({"seed": 0, "optimizer": {"name": "muon", "lr": 0.0003}, "model": {"architecture": "gdn", "n_layers": 2}})");
  EXPECT_EQ(canonical_dump(cfg),
            R"({"model":{"architecture":"gdn","n_layers":2},"optimizer":{"lr":0.0003,"name":"muon"},"seed":0})");
  EXPECT_EQ(sha256_hex(canonical_dump(cfg)), "067ca58f8c0ebd89f60752c75fb1396b7c504b9cd6ef52a02cd05a56a60145fb");
}

// (The `cuda` kernel keys at their defaults are left out: core/config_hash.hpp.)
TEST(Hash, CellHashIsSha256OfCanonicalConfig) {
  SpecDir d;
  Plan p = d.load(kTable2);
  for (const auto& c : p.cells) {
    json named = c.config;
    ASSERT_TRUE(named.contains("cuda")) << c.id;
    named.erase("cuda");
    named["optimizer"].erase("zero_stage");
    EXPECT_EQ(c.hash, sha256_hex(canonical_dump(named))) << c.id;
    EXPECT_EQ(c.hash, config_hash(c.config)) << c.id;
    EXPECT_EQ(c.config, with_defaults(c.config)) << c.id;
    EXPECT_TRUE(validate_config(c.config).empty()) << c.id;
    EXPECT_EQ(c.short_hash(), c.hash.substr(0, 12));
  }
}

TEST(Hash, KeyOrderAndNumberSpellingDoNotMatter) {
  SpecDir d;
  Plan a = d.load("name: h\nbase:\n  model: {n_layers: 2, d_model: 64}\n  optimizer: {lr: 3e-4, weight_decay: 0}\n");
  Plan b = d.load("name: h\nbase:\n  optimizer: {weight_decay: 0.0, lr: 0.0003}\n  model: {d_model: 64.0, n_layers: 2}\n");
  Plan c = d.load("name: h\nbase:\n  optimizer: {lr: 3.0e-4, weight_decay: 0.0e0}\n  model: {d_model: 64, n_layers: +2}\n");
  EXPECT_EQ(a.cells[0].hash, b.cells[0].hash);
  EXPECT_EQ(a.cells[0].hash, c.cells[0].hash);
  Plan e = d.load("name: h\nbase:\n  optimizer: {lr: 3.1e-4, weight_decay: 0}\n  model: {n_layers: 2, d_model: 64}\n");
  EXPECT_NE(a.cells[0].hash, e.cells[0].hash);
  // The same config reached through an axis or through base hashes the same.
  Plan f = d.load("name: h\nbase:\n  model: {n_layers: 2, d_model: 64}\n  optimizer: {weight_decay: 0}\nmatrix:\n  lr: [3e-4]\n");
  EXPECT_EQ(a.cells[0].hash, f.cells[0].hash);
}

// The `cuda` keys choose kernels: recorded in every cell's config, hashed only away from their
// defaults — so cells planned before the keys existed keep their hashes (and their runs), a
// cell asking for other kernels is another run, through base or through an axis alike.
TEST(Hash, CudaKeysAtTheirDefaultsAreNotHashed) {
  SpecDir d;
  Plan a = d.load("name: h\nbase:\n  model: {n_layers: 2}\n");
  EXPECT_EQ(a.cells[0].config["cuda"]["attention"], "auto");
  EXPECT_EQ(a.cells[0].config["cuda"]["ccq_group"], 0);
  json before = a.cells[0].config;
  before.erase("cuda");  // a config written before the schema had the cuda keys
  before["optimizer"].erase("zero_stage");  // and ZeRO's stage
  EXPECT_EQ(a.cells[0].hash, sha256_hex(canonical_dump(before)));
  Plan same = d.load("name: h\nbase:\n  model: {n_layers: 2}\n  cuda: {attention: auto, gemm: heuristic, ccq_group: 0}\n");
  EXPECT_EQ(same.cells[0].hash, a.cells[0].hash);
  Plan flash = d.load("name: h\nbase:\n  model: {n_layers: 2}\n  cuda: {attention: flash}\n");
  EXPECT_NE(flash.cells[0].hash, a.cells[0].hash);
  Plan keep = d.load("name: h\nbase:\n  model: {n_layers: 2}\n  cuda: {linear_keep: og}\n");
  EXPECT_NE(keep.cells[0].hash, a.cells[0].hash);
  EXPECT_NE(keep.cells[0].hash, flash.cells[0].hash);
  // an axis over a cuda key: its default value hashes as the plain config, the others as base does
  Plan axis = d.load("name: h\nbase:\n  model: {n_layers: 2}\nmatrix:\n  cuda.attention: [auto, flash]\n");
  ASSERT_EQ(axis.cells.size(), 2u);
  EXPECT_EQ(axis.cells[0].hash, a.cells[0].hash);
  EXPECT_EQ(axis.cells[1].hash, flash.cells[0].hash);
  for (const auto& c : axis.cells) EXPECT_EQ(c.hash, config_hash(c.config)) << c.id;
}

// ZeRO-1 gives the unsharded numbers bit for bit and its checkpoints resume at any stage:
// the stage never names a run (an axis over it would plan one run twice).
TEST(Hash, ZeroStageIsNotHashed) {
  SpecDir d;
  Plan a = d.load("name: h\nbase:\n  model: {n_layers: 2}\n");
  EXPECT_EQ(a.cells[0].config["optimizer"]["zero_stage"], 0);
  Plan one = d.load("name: h\nbase:\n  model: {n_layers: 2}\n  optimizer: {zero_stage: 1}\n");
  EXPECT_EQ(one.cells[0].hash, a.cells[0].hash);
  try {
    d.load("name: h\nbase:\n  model: {n_layers: 2}\nmatrix:\n  optimizer.zero_stage: [0, 1]\n");
    ADD_FAILURE() << "an axis over optimizer.zero_stage planned";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("have identical configs"), std::string::npos) << e.what();
  }
}

TEST(Hash, CudaKeysAreValidatedWithTheSpec) {
  SpecDir d;
  EXPECT_NE(d.error("name: h\nbase:\n  cuda: {attention: sdpa}\n").find("cuda.attention"), std::string::npos);
  EXPECT_NE(d.error("name: h\nbase:\n  cuda: {attention: sdpa}\n").find("unknown value 'sdpa' (choices: auto, cudnn, flash)"),
            std::string::npos)
      << d.error("name: h\nbase:\n  cuda: {attention: sdpa}\n");
  EXPECT_NE(d.error("name: h\nbase:\n  cuda: {ccq_group: 65}\n").find("expected an integer from 0 to 64, got 65"),
            std::string::npos)
      << d.error("name: h\nbase:\n  cuda: {ccq_group: 65}\n");
  EXPECT_NE(d.error("name: h\nbase:\n  cuda: {atention: flash}\n").find("did you mean 'attention'?"), std::string::npos)
      << d.error("name: h\nbase:\n  cuda: {atention: flash}\n");
}

TEST(Hash, ExperimentNameAndIdAreNotPartOfTheHash) {
  SpecDir d;
  Plan a = d.load("name: one\nmatrix:\n  seed: [1]\n");
  Plan b = d.load("name: two\nbase: {seed: 1}\n");
  EXPECT_EQ(a.cells[0].hash, b.cells[0].hash);
}

TEST(Expand, TheExampleInDocsSpecsLoads) {
  // docs/specs.md is what spec authors copy from: its example must stay valid.
  std::ifstream in(std::string(LAR_SOURCE_DIR) + "/docs/specs.md");
  std::string doc((std::istreambuf_iterator<char>(in)), {});
  size_t start = doc.find("```yaml\n");
  ASSERT_NE(start, std::string::npos);
  start += 8;
  std::string yaml = doc.substr(start, doc.find("```", start) - start);
  for (size_t p; (p = yaml.find("{base: {...}}")) != std::string::npos;) yaml.replace(p, 13, "{}");
  SpecDir d;
  d.write("common/lm-base.yaml", "name: lm-base\nbase:\n  data: {seq_len: 256}\n  model: {n_layers: 4}\n");
  Plan p = load_plan(d.write("exp/table2.yaml", yaml), "");
  EXPECT_EQ(p.experiment, "laa-table2");
  EXPECT_EQ(p.cells[0].config["data"]["seq_len"], 256);   // from the extended file
  EXPECT_EQ(p.cells[0].config["model"]["n_layers"], 2);   // smoke scale over both bases
  EXPECT_EQ(p.scale, "smoke");
  EXPECT_EQ(p.cells.size(), 17u);
  EXPECT_EQ(p.cells[0].id, "softmax.adamw.dense.lr1e-3.warmup_steps1000.s0");
  EXPECT_EQ(p.cells[0].reference["final_loss"], 2.413);
  EXPECT_EQ(p.cells.back().id, "gdn.adamw.pure.lr3e-3.warmup_steps1000.s0");
  EXPECT_EQ(cell(p, "gdn.muon.pure.lr3e-4.warmup_steps500.s0").config["schedule"]["warmup_steps"], 500);
  EXPECT_EQ(p.meta["reference"]["source"]["arxiv"], "2607.07953");
  EXPECT_TRUE(p.warnings.empty());
  EXPECT_EQ(cell(p, "gdn2.adamw.pure.lr1e-3.warmup_steps1000.s0").role, "exploratory");
  EXPECT_EQ(cell(p, "gdn.adamw.pure.lr1e-3.warmup_steps1000.s0").role, "main");
  // The baseline follows the optimizer's conditional lr and warmup.
  EXPECT_EQ(cell(p, "kda.muon.hybrid.lr3e-4.warmup_steps500.s0").baseline, "kda.adamw.hybrid.lr1e-3.warmup_steps1000.s0");
  EXPECT_FALSE(cell(p, "kda.adamw.hybrid.lr1e-3.warmup_steps1000.s0").baseline.has_value());
}

TEST(Expand, LeanLoadKeepsIdsAndHashes) {
  SpecDir d;
  Plan full = d.load(kTable2);
  Plan lean = load_plan(d.dir() / "spec.yaml", "", {.configs = false});
  ASSERT_EQ(full.cells.size(), lean.cells.size());
  for (size_t i = 0; i < full.cells.size(); ++i) {
    EXPECT_EQ(full.cells[i].id, lean.cells[i].id);
    EXPECT_EQ(full.cells[i].hash, lean.cells[i].hash);
    EXPECT_EQ(full.cells[i].role, lean.cells[i].role);
    EXPECT_TRUE(lean.cells[i].config.is_null());
  }
}

TEST(Expand, AxisWinsOverBaseAndScaleCanAddAxes) {
  SpecDir d;
  Plan p = d.load(R"(name: o
base: {optimizer: {lr: 5e-3}, model: {d_model: 32}}
matrix:
  lr: [1e-3]
scales:
  small: {matrix: {d_model: [16, 24]}}
)",
                  "small");
  EXPECT_EQ(ids(p), (V{"lr1e-3.d_model16", "lr1e-3.d_model24"}));
  EXPECT_EQ(p.cells[0].config["optimizer"]["lr"], 1e-3);
  EXPECT_EQ(p.cells[1].config["model"]["d_model"], 24);
}

TEST(Expand, UnmatchedRoleAndBaselineRulesWarn) {
  SpecDir d;
  Plan p = d.load(R"(name: w
matrix:
  seed: [0, 1]
roles:
  - {match: {seed: 7}, role: exploratory}
baselines:
  - {match: {model.d_model: 512}, baseline: {seed: 0}}
)");
  ASSERT_EQ(p.warnings.size(), 2u);
  EXPECT_EQ(d.strip(p.warnings[0]), "spec.yaml:5:5: warning: roles[0] matches no cell");
  EXPECT_EQ(d.strip(p.warnings[1]), "spec.yaml:7:5: warning: baselines[0] matches no cell");
}

TEST(Expand, MatchOnConfigValuesAndAnchors) {
  SpecDir d;
  Plan p = d.load(R"(name: m
base: {model: {d_model: 32}}
matrix:
  seed: &seeds [0, 1]
  warmup: *seeds
exclude:
  - {model.d_model: 32, seed: 1, warmup: 0}
include:
  - {seed: 5, warmup: 5, model: {n_layers: 3, d_model: 48}}
roles:
  - {match: {d_model: 48}, role: exploratory}
)");
  EXPECT_EQ(ids(p), (V{"s0.warmup0", "s0.warmup1", "s1.warmup1", "s5.warmup5.n_layers3.d_model48"}));
  EXPECT_EQ(p.cells.back().role, "exploratory");
  EXPECT_EQ(p.cells.back().config["model"]["d_model"], 48);
  EXPECT_EQ(p.cells[0].role, "main");
}

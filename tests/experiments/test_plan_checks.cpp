// The trainer's config rules at plan time (trainer/config_check.hpp): every rule the
// trainer applies refuses a spec before anything is written, at the line that set the
// value — base, a scale's base, an included file, an axis value or an include entry.
#include <filesystem>

#include "spec_fixture.hpp"
#include "trainer/config_check.hpp"

using namespace lar;
using namespace lar::experiments;
using lar::experiments::testing::SpecDir;

namespace {

struct Case {
  const char* name;
  const char* spec;
  const char* error;
};

// One rule each; the expected text is the whole message, location first.
const Case kCases[] = {
    {"d_model not divisible by n_heads (base)", "name: x\nbase:\n  model: {d_model: 96, n_heads: 5}\n",
     "spec.yaml:3:20: error: cell 'base': model.d_model: 96 is not divisible by model.n_heads = 5"},
    {"negative lr (axis value)", "name: x\nmatrix:\n  lr: [1.0e-3, -3.0e-4]\n",
     "spec.yaml:3:16: error: cell 'lr-3e-4': optimizer.lr: must be > 0, got -0.0003"},
    {"seq_len 0", "name: x\nbase:\n  data: {seq_len: 0}\n",
     "spec.yaml:3:19: error: cell 'base': data.seq_len: must be > 0, got 0"},
    {"vocab_size 0", "name: x\nbase:\n  model: {vocab_size: 0}\n",
     "spec.yaml:3:23: error: cell 'base': model.vocab_size: must be > 0, got 0"},
    {"negative budget.steps", "name: x\nbase:\n  budget: {steps: -5}\n",
     "spec.yaml:3:19: error: cell 'base': budget.steps: must be > 0, got -5"},
    {"min_lr above the peak", "name: x\nbase:\n  optimizer: {lr: 1.0e-4}\n  schedule: {min_lr: 1.0e-3}\n",
     "spec.yaml:4:22: error: cell 'base': schedule.min_lr: 0.001 is above the peak lr optimizer.lr = 0.0001"},
    {"n_heads not divisible by n_kv_heads", "name: x\nbase:\n  model: {n_heads: 4, n_kv_heads: 3}\n",
     "spec.yaml:3:20: error: cell 'base': model.n_heads: 4 is not divisible by model.n_kv_heads = 3 (GQA groups)"},
    {"batch that does not split into micro-batches", "name: x\nbase:\n  data: {batch_size: 6, micro_batches: 4}\n",
     "spec.yaml:3:22: error: cell 'base': data.batch_size 6 does not split into 1 rank(s) × data.micro_batches 4 equal "
     "micro-batches"},
    {"routing on a mixer without a write residual (architecture axis)",
     "name: x\nbase:\n  model: {routing: cler, n_layers: 2}\nmatrix:\n  architecture: [gla]\n  stack: [pure]\n",
     "spec.yaml:3:20: error: cell 'gla.pure': model.routing: 'cler' needs a delta-rule mixer (deltanet, gdn, kda, "
     "gdn2, carve); 'gla' has no write residual"},
    {"CARVE content rank out of range",
     "name: x\nbase:\n  model: {architecture: carve, stack: pure, carve: {content_rank: 40}}\n",
     "spec.yaml:3:67: error: cell 'base': model.carve.content_rank: must be in 1..32, got 40"},
    {"Mamba-3 MIMO rank below 1",
     "name: x\nbase:\n  model: {architecture: mamba3, stack: pure, mamba3: {form: mimo, mimo_rank: 0}}\n",
     "spec.yaml:3:78: error: cell 'base': model.mamba3.mimo_rank: must be ≥ 1, got 0"},
    {"CCQ lambda_init outside (0, 1) (include entry)",
     "name: x\nbase:\n  model: {architecture: gla, stack: pure}\nmatrix:\n  seed: [0]\n"
     "include:\n  - {seed: 1, model.ccq.enabled: true, model.ccq.lambda_init: 1.5}\n",
     "spec.yaml:7:63: error: cell 's1.enabled.lambda_init1.5': model.ccq.lambda_init: must lie in (0, 1), got "
     "1.500000"},
    {"synthetic task needs a longer sequence", "name: x\nbase:\n  data: {task: mqar, seq_len: 8, num_kv_pairs: 8}\n",
     "spec.yaml:3:31: error: cell 'base': data.seq_len 8 is too short for mqar with data.num_kv_pairs 8"},
    {"scale override",
     "name: x\nbase:\n  model: {d_model: 64, n_heads: 4}\nscales:\n  mini:\n    base:\n      model: {n_heads: 6}\n"
     "default_scale: mini\n",
     "spec.yaml:7:24: error: cell 'base': model.d_model: 64 is not divisible by model.n_heads = 6"},
};

class PlanChecks : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(PlanChecks, RefusedAtTheLineThatSetIt) {
  SpecDir d;
  std::string got = d.error(GetParam().spec);
  // Messages that continue past the rule (e.g. the mqar minimum) are compared on their start.
  EXPECT_EQ(got.substr(0, std::string(GetParam().error).size()), GetParam().error) << got;
}

INSTANTIATE_TEST_SUITE_P(Rules, PlanChecks, ::testing::ValuesIn(kCases), [](const auto& info) {
  std::string n;
  for (char c : std::string(info.param.name)) n += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return n;
});

TEST(PlanChecks, BlamesTheIncludedFileThatSetTheValue) {
  SpecDir d;
  d.write("common.yaml", "base:\n  model:\n    d_model: 90\n");
  std::string got = d.error("name: x\nextends: common.yaml\nbase:\n  model: {n_heads: 8}\n");
  // n_heads is set later (the spec's own base) than d_model (the extended file): both are
  // named; the message points at the one the spec set itself.
  EXPECT_EQ(got, "spec.yaml:4:20: error: cell 'base': model.d_model: 90 is not divisible by model.n_heads = 8");
  got = d.error("name: x\nextends: common.yaml\n");
  EXPECT_EQ(got, "common.yaml:3:14: error: cell 'base': model.d_model: 90 is not divisible by model.n_heads = 4");
}

TEST(PlanChecks, NamesTheFirstBadCellOfAMatrix) {
  SpecDir d;
  std::string got = d.error("name: x\nmatrix:\n  model.n_heads: [4, 6]\n  seed: [0, 1]\n");
  EXPECT_EQ(got, "spec.yaml:3:22: error: cell 'n_heads6.s0': model.d_model: 64 is not divisible by model.n_heads = 6");
}

TEST(PlanChecks, MissingDataIsAWarningWhenPlanningAndAnErrorWhenRequired) {
  SpecDir d;
  auto spec = d.write("spec.yaml", "name: x\nbase:\n  data: {path: /nonexistent/shards}\n");
  Plan p = load_plan(spec, "");
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes[0].find("data.path: no prepared data at /nonexistent/shards"), std::string::npos) << p.notes[0];
  std::string got = d.error_of([&] { load_plan(spec, "", {.require_data = true}); });
  EXPECT_EQ(got.rfind("spec.yaml:3:16: error: cell 'base': data.path: no prepared data at /nonexistent/shards", 0), 0u)
      << got;
}

TEST(PlanChecks, ListingWithoutConfigsStillChecks) {
  SpecDir d;
  auto spec = d.write("spec.yaml", "name: x\nmatrix:\n  lr: [1.0e-3, 0.0]\n");
  std::string got = d.error_of([&] { load_plan(spec, "", {.configs = false}); });
  EXPECT_EQ(got, "spec.yaml:3:16: error: cell 'lr0': optimizer.lr: must be > 0, got 0");
  Plan p = load_plan(d.write("ok.yaml", "name: y\nmatrix:\n  lr: [1.0e-3]\n"), "", {.configs = false});
  EXPECT_TRUE(p.cells.at(0).config.is_null());
}

TEST(ConfigKeysNamed, FindsDottedKeysAndALeadingTopLevelKey) {
  using trainer::config_keys_named;
  EXPECT_EQ(config_keys_named("model.d_model: 96 is not divisible by model.n_heads = 5"),
            (std::vector<std::string>{"model.d_model", "model.n_heads"}));
  EXPECT_EQ(config_keys_named("threads: must be ≥ 0, got -1"), (std::vector<std::string>{"threads"}));
  // Prose words that happen to be top-level keys ("seed") and map names ("model") are not keys.
  EXPECT_EQ(config_keys_named("data from the seed; model is fine; eval.lengths: [1]"),
            (std::vector<std::string>{"eval.lengths"}));
  EXPECT_TRUE(config_keys_named("nothing here.").empty());
}

// An extending spec may narrow an axis: branches it inherits for dropped values do not
// apply, while a branch the spec itself writes must still name a value.
TEST(PlanChecks, NarrowedAxisDropsInheritedBranches) {
  SpecDir d;
  d.write("wide.yaml",
          "name: wide\nbase:\n  model: {stack: pure, n_layers: 2}\nmatrix:\n  architecture: [gdn, kda]\n"
          "  model.n_layers: {by: architecture, gdn: [2], kda: [3]}\n");
  Plan p = load_plan(d.write("narrow.yaml", "name: narrow\nextends: wide.yaml\nmatrix:\n  architecture: [gdn]\n"), "");
  ASSERT_EQ(p.cells.size(), 1u);
  EXPECT_EQ(p.cells[0].config["model"]["n_layers"], 2);
  std::string got = d.error_of([&] {
    load_plan(d.write("typo.yaml", "name: typo\nextends: wide.yaml\nmatrix:\n  architecture: [gdn]\n"
                                   "  model.n_layers: {by: architecture, gdm: [4]}\n"),
              "");
  });
  EXPECT_EQ(got.rfind("typo.yaml:5:38: error: matrix.model.n_layers: 'gdm' is not a value of axis 'architecture'", 0),
            0u)
      << got;
}

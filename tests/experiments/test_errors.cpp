// Every validation error of experiment specs: exact message and file:line:col.
#include "spec_fixture.hpp"

using namespace lar;
using namespace lar::experiments;
using lar::experiments::testing::SpecDir;

namespace {

struct Case {
  const char* name;
  const char* yaml;
  const char* error;
  const char* scale = "";
};

// Each spec is minimal: one mistake, reported where it is.
const Case kCases[] = {
    {"yaml syntax", "name: x\nmatrix:\n  seed: [0, 1\nbase: {}\n",
     "spec.yaml:4:5: error: YAML syntax: end of sequence flow not found"},
    {"duplicate top-level key", "name: x\nbase: {}\nname: y\n",
     "spec.yaml:3:1: error: duplicate key 'name' (first defined at 1:1)"},
    {"duplicate nested key", "name: x\nbase:\n  model:\n    n_layers: 2\n    d_model: 4\n    n_layers: 3\n",
     "spec.yaml:6:5: error: duplicate key 'n_layers' (first defined at 4:5)"},
    {"duplicate flow key", "name: x\nmatrix: {seed: [0], seed: [1]}\n",
     "spec.yaml:2:21: error: duplicate key 'seed' (first defined at 2:10)"},
    {"several documents", "name: x\n---\nname: y\n",
     "spec.yaml: error: a spec holds one YAML document, found several ('---')"},
    {"merge key", "name: x\nbase:\n  <<: {seed: 1}\n",
     "spec.yaml:3:3: error: YAML merge keys ('<<') are not supported; use 'extends:' to share settings"},
    {"empty file", "# nothing\n", "spec.yaml:1:1: error: the spec is empty"},
    {"not a map", "- name: x\n", "spec.yaml:1:1: error: a spec is a map of keys (name, base, matrix, ...), got a list"},
    {"unknown top-level key", "name: x\nmatirx:\n  seed: [0]\n",
     "spec.yaml:2:1: error: spec: unknown key 'matirx' (did you mean 'matrix'?)"},
    {"missing name", "base: {}\n", "spec.yaml:1:1: error: missing 'name' (the experiment name)"},
    {"bad name", "name: Table 2\n",
     "spec.yaml:1:7: error: name 'Table 2' may only hold a-z, 0-9, '_', '.', '-'"},
    {"name not a string", "name: [a]\n", "spec.yaml:1:7: error: name: expected a string, got a list"},
    {"base not a map", "name: x\nbase: [1]\n", "spec.yaml:2:7: error: base: expected a map, got a list"},
    {"base unknown key", "name: x\nbase:\n  optimizer: {lrr: 1e-3}\n",
     "spec.yaml:3:15: error: base.optimizer: unknown key 'lrr' (did you mean 'lr'?)"},
    {"base unknown section", "name: x\nbase:\n  optimiser: {lr: 1e-3}\n",
     "spec.yaml:3:3: error: base: unknown key 'optimiser' (did you mean 'optimizer'?)"},
    {"base wrong type", "name: x\nbase:\n  model: {n_layers: two}\n",
     "spec.yaml:3:21: error: base.model.n_layers: expected integer, got \"two\""},
    {"base fractional integer", "name: x\nbase:\n  budget: {steps: 2.5}\n",
     "spec.yaml:3:19: error: base.budget.steps: expected integer, got 2.5"},
    {"base map expected", "name: x\nbase:\n  model: 3\n",
     "spec.yaml:3:10: error: base.model: expected map, got 3"},
    {"base unknown architecture", "name: x\nbase:\n  model: {architecture: gdnn}\n",
     "spec.yaml:3:25: error: base.model.architecture: unknown value 'gdnn' (choices: softmax, linear, gla, deltanet, gdn, kda, gdn2, carve, mamba2, mamba3, gla_hedgehog); did you mean 'gdn'?"},
    {"unknown axis", "name: x\nmatrix:\n  architectur: [gdn]\n",
     "spec.yaml:3:3: error: matrix: unknown axis 'architectur' (did you mean 'architecture'?)"},
    {"unknown dotted axis", "name: x\nmatrix:\n  schedule.warmup_step: [1]\n",
     "spec.yaml:3:3: error: matrix: unknown axis 'schedule.warmup_step' (did you mean 'schedule.warmup_steps'?)"},
    {"axis names a group", "name: x\nmatrix:\n  model.carve: [1]\n",
     "spec.yaml:3:3: error: matrix: 'model.carve' is a group of settings, not one value; use one of model.carve.content_chunk, model.carve.content_grad, model.carve.content_rank, model.carve.freeze_content, model.carve.qkv"},
    {"unknown architecture", "name: x\nmatrix:\n  architecture: [gdn, kdaa]\n  stack: [pure]\n",
     "spec.yaml:3:23: error: matrix.architecture: unknown value 'kdaa' (choices: softmax, linear, gla, deltanet, gdn, kda, gdn2, carve, mamba2, mamba3, gla_hedgehog); did you mean 'kda'?"},
    {"unknown optimizer", "name: x\nmatrix:\n  optimizer: [adamw, muonn]\n",
     "spec.yaml:3:22: error: matrix.optimizer: unknown value 'muonn' (choices: adamw, muon, normuon); did you mean 'muon'?"},
    {"unknown stack", "name: x\nmatrix:\n  stack: [dense, hybird]\n",
     "spec.yaml:3:18: error: matrix.stack: unknown value 'hybird' (choices: dense, pure, hybrid); did you mean 'hybrid'?"},
    {"unknown routing", "name: x\nmatrix:\n  routing: [none, clerr]\n",
     "spec.yaml:3:19: error: matrix.routing: unknown value 'clerr' (choices: none, cler, cler_h, clvr); did you mean 'cler'?"},
    {"axis value wrong type", "name: x\nmatrix:\n  seed: [0, one]\n",
     "spec.yaml:3:13: error: matrix.seed: expected integer, got \"one\""},
    {"quoted number is a string", "name: x\nmatrix:\n  lr: [\"3e-4\"]\n",
     "spec.yaml:3:8: error: matrix.lr: expected number, got \"3e-4\""},
    {"empty axis", "name: x\nmatrix:\n  seed: []\n", "spec.yaml:3:9: error: matrix.seed: empty list of values"},
    {"axis not a list", "name: x\nmatrix:\n  seed: 0\n",
     "spec.yaml:3:9: error: matrix.seed: expected a list of values like [a, b] or {by: AXIS, VALUE: [...], default: [...]}, got the number 0"},
    {"duplicate axis value", "name: x\nmatrix:\n  lr: [1e-3, 3e-4, 0.001]\n",
     "spec.yaml:3:20: error: matrix.lr: value 0.001 is listed twice (first at 3:8)"},
    {"two axes set one path", "name: x\nmatrix:\n  lr: [1e-3]\n  optimizer.lr: [2e-3]\n",
     "spec.yaml:4:3: error: matrix.optimizer.lr: conflicting overrides: 'optimizer.lr' and 'lr' both set optimizer.lr (first at 3:3)"},
    {"conditional on unknown axis", "name: x\nmatrix:\n  lr: {by: optimizer, adamw: [1e-3]}\n  optimizer: [adamw]\n",
     "spec.yaml:3:12: error: matrix.lr: 'by: optimizer' is not an axis declared before 'lr'"},
    {"conditional typo in by", "name: x\nmatrix:\n  optimizer: [adamw]\n  lr: {by: optimiser, adamw: [1e-3]}\n",
     "spec.yaml:4:12: error: matrix.lr: 'by: optimiser' is not an axis declared before 'lr' (did you mean 'optimizer'?)"},
    {"conditional branch typo", "name: x\nmatrix:\n  optimizer: [adamw, muon]\n  lr: {by: optimizer, adamw: [1e-3], muno: [3e-4]}\n",
     "spec.yaml:4:38: error: matrix.lr: 'muno' is not a value of axis 'optimizer'"},
    {"conditional branch typo with hint", "name: x\nmatrix:\n  optimizer: [adamw, normuon]\n  lr: {by: optimizer, adamw: [1e-3], normuom: [3e-4]}\n",
     "spec.yaml:4:38: error: matrix.lr: 'normuom' is not a value of axis 'optimizer' (did you mean 'normuon'?)"},
    {"conditional without value", "name: x\nmatrix:\n  optimizer: [adamw, muon]\n  lr: {by: optimizer, adamw: [1e-3]}\n",
     "spec.yaml:4:7: error: matrix.lr: no values for optimizer=muon (add 'muon: [...]' or 'default: [...]')"},
    {"conditional empty branch", "name: x\nmatrix:\n  optimizer: [adamw]\n  lr: {by: optimizer, adamw: []}\n",
     "spec.yaml:4:30: error: matrix.lr.adamw: empty list of values"},
    {"conditional wrong value", "name: x\nmatrix:\n  optimizer: [adamw]\n  lr: {by: optimizer, default: [fast]}\n",
     "spec.yaml:4:33: error: matrix.lr.default: expected number, got \"fast\""},
    {"zip unknown axis", "name: x\nmatrix:\n  lr: [1e-3]\n  warmup: [1]\nzip: [[lr, warmpu]]\n",
     "spec.yaml:5:12: error: zip: 'warmpu' is not an axis of the matrix (did you mean 'warmup'?)"},
    {"zip length mismatch", "name: x\nmatrix:\n  lr: [1e-3, 2e-3]\n  warmup: [1, 2, 3]\nzip: [[lr, warmup]]\n",
     "spec.yaml:5:7: error: zip group [lr, warmup]: 'lr' has 2 values but 'warmup' has 3"},
    {"zip conditional length mismatch",
     "name: x\nmatrix:\n  optimizer: [adamw, muon]\n  lr: {by: optimizer, adamw: [1e-3], muon: [1e-4, 2e-4]}\n  warmup: [1]\nzip: [[lr, warmup]]\n",
     "spec.yaml:6:7: error: zip group [lr, warmup]: 'lr' has 2 values but 'warmup' has 1 (for optimizer=muon)"},
    {"zip axis twice", "name: x\nmatrix:\n  lr: [1e-3]\n  warmup: [1]\n  seed: [0]\nzip: [[lr, warmup], [seed, lr]]\n",
     "spec.yaml:6:28: error: zip: axis 'lr' is already zipped (at 6:8)"},
    {"zip group of one", "name: x\nmatrix:\n  lr: [1e-3]\nzip: [[lr]]\n", "spec.yaml:4:7: error: zip: a group needs at least two axes"},
    {"zip not a list of lists", "name: x\nmatrix:\n  lr: [1e-3]\nzip: [lr, seed]\n",
     "spec.yaml:4:7: error: zip: expected a list of axis groups like [[lr, schedule.warmup_steps]], got a group that is the string 'lr'"},
    {"zero cells", "name: x\nmatrix:\n  seed: [0, 1]\nexclude:\n  - {seed: [0, 1]}\n",
     "spec.yaml:2:1: error: the matrix expands to zero cells"},
    {"exclude unknown key", "name: x\nmatrix:\n  seed: [0]\nexclude:\n  - {sede: 0}\n",
     "spec.yaml:5:6: error: exclude[0]: 'sede' is not an axis or config value"},
    {"exclude unknown key with hint", "name: x\nmatrix:\n  seed: [0]\nexclude:\n  - {routng: none}\n",
     "spec.yaml:5:6: error: exclude[0]: 'routng' is not an axis or config value (did you mean 'routing'?)"},
    {"exclude unknown value", "name: x\nmatrix:\n  architecture: [gdn]\n  stack: [pure]\nexclude:\n  - {architecture: gdnn}\n",
     "spec.yaml:6:20: error: exclude[0].architecture: unknown value 'gdnn' (choices: softmax, linear, gla, deltanet, gdn, kda, gdn2, carve, mamba2, mamba3, gla_hedgehog); did you mean 'gdn'?"},
    {"include conflicting override", "name: x\nmatrix:\n  seed: [0]\ninclude:\n  - {seed: 1, lr: 1e-3, optimizer.lr: 2e-3}\n",
     "spec.yaml:5:25: error: include[0]: conflicting overrides: 'optimizer.lr' is set twice (first at 5:15)"},
    {"include conflicting nested override", "name: x\nmatrix:\n  seed: [0]\ninclude:\n  - {seed: 1, model.n_layers: 2, model: {n_layers: 3}}\n",
     "spec.yaml:5:42: error: include[0]: conflicting overrides: 'model.n_layers' is set twice (first at 5:15)"},
    {"include unknown key", "name: x\nmatrix:\n  seed: [0]\ninclude:\n  - {seed: 1, n_layer: 2}\n",
     "spec.yaml:5:15: error: include[0]: unknown axis or config key 'n_layer' (did you mean 'n_layers'?)"},
    {"include wrong value", "name: x\nmatrix:\n  seed: [0]\ninclude:\n  - {seed: x}\n",
     "spec.yaml:5:12: error: include[0].seed: expected integer, got \"x\""},
    {"include duplicates a matrix cell", "name: x\nmatrix:\n  seed: [0, 1]\ninclude:\n  - {seed: 1}\n",
     "spec.yaml:5:5: error: two cells have the id 's1' (the matrix at spec.yaml:2:1 and include[0] at spec.yaml:5:5)"},
    {"identical configs", "name: x\nmatrix:\n  seed: [0, 1]\ninclude:\n  - {seed: 1, model.n_layers: 2}\n",
     "spec.yaml:5:5: error: cells 's1' and 's1.n_layers2' have identical configs (hash HASH)"},
    {"softmax with pure", "name: x\nmatrix:\n  architecture: [softmax, gdn]\n  stack: [hybrid]\n",
     "spec.yaml:4:11: error: cell 'softmax.hybrid': architecture 'softmax' needs stack 'dense', not 'hybrid' (use a conditional axis: stack: {by: architecture, softmax: [dense], default: [hybrid, pure]})"},
    {"linear with dense", "name: x\nmatrix:\n  architecture: [gdn]\n",
     "spec.yaml:3:18: error: cell 'gdn': architecture 'gdn' needs stack 'pure' or 'hybrid' (stack 'dense' makes every layer softmax)"},
    {"linear with dense from base", "name: x\nbase: {model: {architecture: kda}}\nmatrix:\n  seed: [0]\n",
     "spec.yaml:3:1: error: cell 's0': architecture 'kda' needs stack 'pure' or 'hybrid' (stack 'dense' makes every layer softmax)"},
    {"unknown scale", "name: x\nscales:\n  smoke: {base: {}}\n  paper: {}\n", "spec.yaml:2:1: error: unknown scale 'mini' (scales: smoke, paper)",
     "mini"},
    {"unknown scale typo", "name: x\nscales:\n  smoke: {base: {}}\n", "spec.yaml:2:1: error: unknown scale 'smok' (scales: smoke) (did you mean 'smoke'?)",
     "smok"},
    {"scale without scales", "name: x\n", "spec.yaml:1:1: error: unknown scale 'smoke': the spec declares no scales", "smoke"},
    {"no scale chosen", "name: x\nscales:\n  smoke: {}\n",
     "spec.yaml:2:1: error: choose a scale with --scale (scales: smoke) or set default_scale"},
    {"bad default scale", "name: x\nscales:\n  smoke: {}\ndefault_scale: smok\n",
     "spec.yaml:4:16: error: default_scale: 'smok' is not a scale (scales: smoke) (did you mean 'smoke'?)"},
    {"scale unknown key", "name: x\nscales:\n  smoke: {bse: {}}\ndefault_scale: smoke\n",
     "spec.yaml:3:11: error: scales.smoke: unknown key 'bse' (did you mean 'base'?)"},
    {"scale base error", "name: x\nscales:\n  smoke: {base: {budget: {steps: -1.5}}}\ndefault_scale: smoke\n",
     "spec.yaml:3:34: error: scales.smoke.base.budget.steps: expected integer, got -1.5"},
    {"scale matrix error", "name: x\nmatrix:\n  seed: [0]\nscales:\n  smoke: {matrix: {seed: []}}\ndefault_scale: smoke\n",
     "spec.yaml:5:26: error: matrix.seed: empty list of values"},
    {"role unknown", "name: x\nmatrix:\n  seed: [0]\nroles:\n  - {match: {seed: 0}, role: explorative}\n",
     "spec.yaml:5:30: error: roles[0].role: unknown role 'explorative' (roles: main, exploratory) (did you mean 'exploratory'?)"},
    {"role without match", "name: x\nmatrix:\n  seed: [0]\nroles:\n  - {role: main}\n",
     "spec.yaml:5:5: error: roles[0]: missing 'match'"},
    {"baseline missing", "name: x\nmatrix:\n  architecture: [gdn]\n  stack: [hybrid]\n  routing: [cler]\nbaselines:\n  - {match: {routing: cler}, baseline: {routing: none}}\n",
     "spec.yaml:7:5: error: baselines[0]: the baseline of cell 'gdn.hybrid.cler' would be 'gdn.hybrid.none', which is not in the plan"},
    {"baseline not an axis", "name: x\nmatrix:\n  seed: [0, 1]\nbaselines:\n  - {match: {seed: 1}, baseline: {sed: 0}}\n",
     "spec.yaml:5:35: error: baselines[0].baseline: 'sed' is not an axis of the matrix (did you mean 'seed'?)"},
    {"reference value count", "name: x\nmatrix:\n  seed: [0]\nreference:\n  metrics: [a, b]\n  rows:\n    - {match: {seed: 0}, values: [1]}\n",
     "spec.yaml:7:34: error: reference.rows[0].values: 1 values for 2 metrics (a, b)"},
    {"reference value type", "name: x\nmatrix:\n  seed: [0]\nreference:\n  metrics: [a]\n  rows:\n    - {match: {seed: 0}, values: [high]}\n",
     "spec.yaml:7:35: error: reference.rows[0].values: expected a number (or null), got the string 'high'"},
    {"reference rows overlap", "name: x\nmatrix:\n  seed: [0, 1]\nreference:\n  metrics: [a]\n  rows:\n    - {match: {seed: 0}, values: [1]}\n    - {match: {seed: [0, 1]}, values: [2]}\n",
     "spec.yaml:8:7: error: reference.rows[1] and reference.rows[0] (at 7:7) both match cell 's0'"},
    {"extends missing file", "extends: nowhere.yaml\nname: x\n", "spec.yaml:1:10: error: extends: cannot read 'nowhere.yaml'"},
};

}  // namespace

TEST(Errors, EveryValidationErrorHasMessageAndLocation) {
  for (const auto& c : kCases) {
    SCOPED_TRACE(c.name);
    SpecDir d;
    std::string got = d.error(c.yaml, c.scale);
    std::string want = c.error;
    if (auto p = want.find("HASH"); p != std::string::npos && got.size() >= 13)
      want.replace(p, 4, got.substr(got.size() - 13, 12));  // the hash itself is tested elsewhere
    EXPECT_EQ(got, want);
  }
}

TEST(Errors, ExtendsCycle) {
  SpecDir d;
  d.write("a.yaml", "extends: b.yaml\nname: a\n");
  d.write("b.yaml", "name: b\nextends: a.yaml\n");
  std::string got = d.error_of([&] { load_plan(d.dir() / "a.yaml", ""); });
  EXPECT_EQ(got, "b.yaml:2:10: error: extends cycle: a.yaml -> b.yaml -> a.yaml");
}

TEST(Errors, ExtendsErrorsNameTheParentFile) {
  SpecDir d;
  d.write("common/base.yaml", "name: p\nbase:\n  model: {n_layer: 2}\n");
  d.write("exp/child.yaml", "extends: ../common/base.yaml\nname: c\n");
  std::string got = d.error_of([&] { load_plan(d.dir() / "exp/child.yaml", ""); });
  EXPECT_EQ(got, "common/base.yaml:3:11: error: base.model: unknown key 'n_layer' (did you mean 'n_layers'?)");
}

TEST(Errors, MissingSpecFile) {
  SpecDir d;
  std::string got = d.error_of([&] { load_plan(d.dir() / "none.yaml", ""); });
  EXPECT_EQ(got, "cannot read spec 'none.yaml': no such file or not readable");
}

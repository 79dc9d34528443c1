#include "core/config_schema.hpp"

#include <sstream>

#include "core/config_hash.hpp"
#include "core/error.hpp"
#include "core/hash.hpp"

namespace lar {

namespace {

SchemaNode leaf(SchemaType t, json dflt, std::string doc) {
  SchemaNode n;
  n.type = t;
  n.default_value = std::move(dflt);
  n.doc = std::move(doc);
  return n;
}
SchemaNode integer(long d, std::string doc) { return leaf(SchemaType::integer, d, std::move(doc)); }
SchemaNode number(double d, std::string doc) { return leaf(SchemaType::number, d, std::move(doc)); }
SchemaNode boolean(bool d, std::string doc) { return leaf(SchemaType::boolean, d, std::move(doc)); }
SchemaNode string(std::string d, std::string doc) { return leaf(SchemaType::string, std::move(d), std::move(doc)); }
SchemaNode choice(std::vector<std::string> choices, std::string d, std::string doc) {
  SchemaNode n = leaf(SchemaType::enumeration, d, std::move(doc));
  n.choices = std::move(choices);
  return n;
}
SchemaNode map(std::string doc, std::map<std::string, SchemaNode> children) {
  SchemaNode n;
  n.doc = std::move(doc);
  n.children = std::move(children);
  return n;
}

SchemaNode build_schema() {
  return map("run config", {
    {"seed", integer(0, "seed of every random stream (init, data order)")},
    {"backend", choice({"auto", "cpu", "cuda"}, "auto", "compute backend; auto = cuda when built with it and a GPU is present")},
    {"deterministic", boolean(false, "bit-identical results on the GPU (slower reductions)")},
    {"precision", choice({"auto", "fp32", "tf32", "mixed"}, "auto", "cuda backend: fp32 = every op in fp32 (the GPU reference); mixed = bf16 tensor-core GEMMs (fp32 accumulation) and bf16 flash attention over fp32 weights and activations; tf32 = the same with TF32 GEMMs; auto = mixed. The cpu backend is always fp32")},
    {"threads", integer(0, "CPU threads for the cpu backend; 0 = all cores")},
    {"cuda", map("cuda backend: which kernels run (the cpu backend ignores these). Each is recorded with the run; a key at its default is left out of the run's hash (core/config_hash.hpp)", {
      {"attention", choice({"auto", "cudnn", "flash"}, "auto", "softmax attention: auto = cuDNN's fused attention where libcudnn.so.9 loads and covers the shape, else lar's flash kernels (deterministic runs: always flash); cudnn = cuDNN or an error; flash = lar's kernels. cuDNN and flash differ in the last bits")},
      {"gemm", choice({"heuristic", "tune", "cublas"}, "heuristic", "GEMM algorithms: heuristic = cuBLASLt's pick with lar's measured H200 table; tune = time cuBLASLt's candidates once per shape and keep the fastest (the bits then depend on the timings: not bit-reproducible across processes; refused with deterministic); cublas = plain cuBLAS")},
      {"linear_path", choice({"auto", "fused", "chunked"}, "auto", "chunk kernels of the linear mixers (deltanet, gdn, gla, kda, gdn2, carve): fused = one CTA per (batch, head) over the whole sequence; chunked = the two-phase kernels that spread the chunks over the GPU; auto = the faster per pass by a cost model of batch·heads against the SMs. fused and chunked differ in the last bits")},
      {"linear_keep", choice({"all", "p", "og"}, "all", "what a linear layer keeps for the backward: all = P = x·[Wq;Wk;Wv]ᵀ and the output gate og, from one GEMM (the fastest); p = P only, og recomputed (a [tokens, value channels] buffer less per layer, one GEMM more); og = og only, P recomputed (the smallest). p and og give the same bits; all differs from them in the last bits")},
      {"ccq_fwd", choice({"auto", "par", "ws"}, "auto", "CCQ forward kernels: par = chunk-parallel; ws = warp-specialised (one CTA per (batch, head)); auto = ws while its waves of batch·heads over the SMs cost less. They differ in the last bits")},
      {"ccq_bwd", choice({"auto", "par", "ws"}, "auto", "CCQ backward kernels, as ccq_fwd")},
      {"ccq_group", integer(0, "CCQ's chunk-parallel kernels: chunks per group, 1 to 64; 0 = the fewest that fit batch·heads·groups CTAs in one wave")},
    })},
    {"model", map("the network", {
      {"architecture", choice({"softmax", "linear", "gla", "deltanet", "gdn", "kda", "gdn2", "carve", "mamba2", "mamba3", "gla_hedgehog"}, "softmax", "token mixer of the linear layers (softmax: every layer softmax; mamba2, mamba3, gla_hedgehog: the papers' Mamba-2, Mamba-3 and GLA-Hedgehog baselines)")},
      {"stack", choice({"dense", "pure", "hybrid"}, "dense", "dense: all softmax; pure: all linear; hybrid: 1 softmax per hybrid_ratio linear")},
      {"hybrid_ratio", integer(2, "hybrid stacks: linear layers per softmax layer (2 = every third layer softmax)")},
      {"n_layers", integer(2, "number of blocks")},
      {"d_model", integer(64, "residual width")},
      {"n_heads", integer(4, "attention / mixer heads")},
      {"n_kv_heads", integer(0, "softmax key/value heads (GQA groups); 0 = n_heads")},
      {"head_dim", integer(0, "key/query head dimension dk; 0 = d_model / n_heads")},
      {"value_dim", integer(0, "linear mixers: value head dimension dv; 0 = their key head dimension")},
      {"linear_heads", integer(0, "linear mixers: query/key heads; 0 = n_heads (softmax layers keep n_heads)")},
      {"linear_head_dim", integer(0, "linear mixers: query/key head dimension dk; 0 = head_dim (softmax layers keep head_dim)")},
      {"n_v_heads", integer(0, "linear mixers: value heads (grouped value heads: value head j reads the q, k of key head j·heads/n_v_heads; v, β, the gates and the output gate are per value head); 0 = the key heads; a multiple of them")},
      {"d_ff", integer(0, "SwiGLU hidden width; 0 = 8/3·d_model rounded up to a multiple of 32")},
      {"vocab_size", integer(256, "vocabulary size (must cover the data's tokens)")},
      {"rope_base", number(10000.0, "RoPE base of softmax layers")},
      {"window", integer(0, "softmax sliding window in tokens; 0 = full causal")},
      {"qk_l2norm", boolean(false, "L2-normalise q, k per head in every linear mixer (the delta rules and CCQ always do): GLA's matched control for CCQ")},
      {"short_conv", boolean(true, "short causal depthwise conv + SiLU on q, k, v of linear mixers")},
      {"conv_size", integer(4, "width of the short conv")},
      {"chunk_size", integer(64, "chunk length of the chunkwise-parallel form")},
      {"gate_rank", integer(16, "low rank of the GLA / KDA / GDN2 gate projections")},
      {"routing", choice({"none", "cler", "cler_h", "clvr"}, "none", "cross-layer routing (LAA §4)")},
      {"routing_rank", integer(0, "low-rank routing projections; 0 = full rank")},
      {"routing_inject", choice({"mixer", "layer"}, "mixer", "cler_h / clvr: add P_l·side to the residual stream after the mixer (mixer) or after the whole layer, mixer and FFN (layer: the LAA authors' code)")},
      {"routing_signal", choice({"residual", "update"}, "residual", "cler / cler_h: the published write residual, v − αSk (residual) or the written update β·(v − αSk) (update: fla's v_new, the LAA authors' code; deltanet/gdn/kda — gdn2 and carve have no β and publish their residual either way)")},
      {"init_std", number(0.02, "std of the normal init of projection weights")},
      {"ccq", map("Curvature-Conditioned Query read correction", {
        {"enabled", boolean(false, "apply CCQ on the linear mixer's read")},
        {"centered", boolean(true, "Σ = C̄ − μμᵀ (true) or Σ = C̄ (false)")},
        {"lambda", leaf(SchemaType::number_or_learned, "learned", "'learned' (per token and head) or a fixed value")},
        {"lambda_init", number(0.01, "λ at init for the learned gate")},
        {"disable_at_eval", boolean(false, "train with CCQ, evaluate with λ = 0")},
      })},
      {"carve", map("CARVE content-aware erase", {
        {"content_rank", integer(16, "rank r of U_b (≤ 32)")},
        {"content_chunk", integer(0, "content chunk L; 0 = chunk_size")},
        {"content_grad", boolean(true, "let gradients flow through the content signal m_c")},
        {"freeze_content", boolean(false, "keep W_U2 at zero (the frozen-content ablation)")},
        {"qkv", choice({"gdn2", "paper"}, "gdn2", "gdn2: the gdn2 layer's q, k, v (short conv + SiLU, L2 norm of q, k); paper: q, k, v = SiLU(W h) as the paper prints them (no conv, no L2 norm)")},
      })},
      {"mamba", map("Mamba-2 / Mamba-3 layer shape (heads = expand·d_model / head_dim; n_heads is not used)", {
        {"expand", integer(2, "inner width = expand · d_model")},
        {"head_dim", integer(64, "head (value) dimension P")},
        {"state_size", integer(128, "state size N (the key dimension of B and C)")},
        {"n_groups", integer(1, "groups of heads sharing B and C")},
      })},
      {"mamba3", map("Mamba-3 options", {
        {"form", choice({"siso", "mimo"}, "siso", "siso: one B, C, x per head; mimo: mimo_rank of each per head, written into one state")},
        {"mimo_rank", integer(4, "MIMO rank R (form: mimo; the paper's 4); the chunkwise form's chunks hold chunk_size·R rows")},
        {"rope_fraction", number(0.5, "fraction of the state rotated by the data-dependent RoPE: 0.5 or 1")},
      })},
    })},
    {"optimizer", map("optimiser", {
      {"name", choice({"adamw", "muon", "normuon"}, "adamw", "optimiser of 2-D hidden matrices; the rest always use AdamW")},
      {"lr", number(1e-3, "peak learning rate")},
      {"scalar_lr", number(0.0, "AdamW lr of non-Muon parameters under muon/normuon; 0 = lr")},
      {"beta1", number(0.9, "AdamW β1")},
      {"beta2", number(0.95, "AdamW β2")},
      {"eps", number(1e-8, "AdamW ε")},
      {"weight_decay", number(0.1, "decoupled weight decay (not on norms, biases, gate scalars)")},
      {"scalar_weight_decay", number(0.0, "weight decay of the AdamW group under muon/normuon")},
      {"grad_clip", number(1.0, "clip by global norm; 0 = off")},
      {"momentum", number(0.95, "Muon momentum")},
      {"nesterov", boolean(true, "Muon Nesterov momentum")},
      {"ns_steps", integer(5, "Newton–Schulz iterations")},
      {"ns_coefficients", leaf(SchemaType::number_list, json::array({3.4445, -4.7750, 2.0315}), "quintic Newton–Schulz coefficients (a, b, c)")},
      {"scale_mode", choice({"default", "spectral"}, "default", "default: sqrt(max(1, rows/cols)); spectral: the LAA repo's rule (docs)")},
      {"normuon_beta2", number(0.95, "NorMuon second-moment EMA")},
      {"zero_stage", integer(0, "data-parallel runs: 0 = every rank holds the whole optimiser state; 1 = ZeRO-1, the state sharded over the ranks (AdamW moments by element range, Muon/NorMuon matrices whole; the cuda backend once its GPU check has passed, trainer/optim/device_zero.hpp); 2 and 3 are not implemented")},
    })},
    {"schedule", map("learning-rate schedule", {
      {"name", choice({"wsd", "cosine", "constant"}, "wsd", "wsd: warmup-stable-decay (minus_sqrt); cosine; constant after warmup")},
      {"warmup_steps", integer(0, "linear warmup steps")},
      {"decay_fraction", number(0.2, "wsd: fraction of steps in the decay phase; above 1 the decay began before the run (Megatron's WSD with a decay longer than the run)")},
      {"min_lr", number(0.0, "lr at the end of the decay")},
    })},
    {"data", map("training data", {
      {"task", choice({"lm", "mqar", "sniah", "mkniah", "sko"}, "lm", "lm: token shards; others: synthetic tasks generated from the seed")},
      {"path", string("", "lm: folder of prepared shards; '' = the embedded corpus (<data root>/brown)")},
      {"seq_len", integer(128, "tokens per sequence")},
      {"batch_size", integer(8, "sequences per step")},
      {"micro_batches", integer(1, "gradient accumulation: the batch (per rank) runs as this many equal micro-batches")},
      {"num_kv_pairs", integer(8, "mqar / sko: key-value pairs per sequence")},
      {"needle", choice({"passkey", "number", "uuid"}, "passkey", "sniah: kind of needle")},
      {"num_needles", integer(4, "mkniah: needles per haystack")},
      {"num_overwrites", integer(4, "sko: keys re-bound to a new value")},
    })},
    {"budget", map("training length", {
      {"steps", integer(100, "optimiser steps")},
      {"tokens", number(0.0, "if > 0: steps = tokens / (batch_size·seq_len)")},
    })},
    {"eval", map("evaluation", {
      {"every", integer(0, "validation every N steps; 0 = only at the end of each phase")},
      {"batches", integer(4, "validation batches")},
      {"lengths", leaf(SchemaType::integer_list, json::array(), "extra evaluation lengths (extrapolation / retrieval at length)")},
    })},
    {"checkpoint", map("checkpoints", {
      {"every", integer(0, "checkpoint every N steps; 0 = only at the end and on preemption")},
      {"keep", integer(2, "checkpoints kept")},
    })},
    {"log", map("logging", {
      {"every", integer(1, "train-loss line every N steps")},
    })},
  });
}

const SchemaNode* child(const SchemaNode& n, const std::string& key) {
  auto it = n.children.find(key);
  return it == n.children.end() ? nullptr : &it->second;
}

std::vector<std::string> keys_of(const SchemaNode& n) {
  std::vector<std::string> out;
  for (const auto& [k, v] : n.children) out.push_back(k);
  return out;
}

bool type_ok(const SchemaNode& n, const json& v, std::string& why) {
  switch (n.type) {
    case SchemaType::map: return v.is_object();
    case SchemaType::integer:
      if (v.is_number_integer()) return true;
      if (v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<long>(v.get<double>()))) return true;
      return false;
    case SchemaType::number: return v.is_number();
    case SchemaType::boolean: return v.is_boolean();
    case SchemaType::string: return v.is_string();
    case SchemaType::enumeration:
      if (!v.is_string()) return false;
      for (const auto& c : n.choices) if (c == v.get<std::string>()) return true;
      {
        std::string all;
        for (const auto& c : n.choices) all += (all.empty() ? "" : ", ") + c;
        why = "unknown value '" + v.get<std::string>() + "' (choices: " + all + ")";
        std::string hint = did_you_mean(v.get<std::string>(), n.choices);
        if (!hint.empty()) why += "; " + hint;
      }
      return false;
    case SchemaType::number_list:
    case SchemaType::integer_list:
      if (!v.is_array()) return false;
      for (const auto& e : v)
        if (n.type == SchemaType::number_list ? !e.is_number() : !e.is_number_integer()) return false;
      return true;
    case SchemaType::number_or_learned:
      return v.is_number() || (v.is_string() && v.get<std::string>() == "learned");
  }
  return false;
}

std::string type_desc(const SchemaNode& n) {
  if (n.type == SchemaType::enumeration) {
    std::string all;
    for (const auto& c : n.choices) all += (all.empty() ? "" : "|") + c;
    return all;
  }
  return to_string(n.type);
}

// Integer keys with a bounded range (checked with the types).
const std::map<std::string, std::pair<long, long>>& integer_ranges() {
  static const std::map<std::string, std::pair<long, long>> r = {{"cuda.ccq_group", {0, 64}}};
  return r;
}

void validate_rec(const SchemaNode& n, const json& v, const std::string& path, std::vector<SchemaIssue>& out) {
  std::string why;
  if (!type_ok(n, v, why)) {
    if (why.empty()) why = "expected " + type_desc(n) + ", got " + v.dump();
    out.push_back({path, why, false});
    return;
  }
  if (n.type == SchemaType::integer)
    if (auto r = integer_ranges().find(path); r != integer_ranges().end()) {
      const double x = v.get<double>();
      if (x < r->second.first || x > r->second.second)
        out.push_back({path, "expected an integer from " + std::to_string(r->second.first) + " to " +
                                 std::to_string(r->second.second) + ", got " + v.dump(), false});
    }
  if (n.type != SchemaType::map) return;
  for (const auto& [k, sub] : v.items()) {
    std::string p = path.empty() ? k : path + "." + k;
    const SchemaNode* c = child(n, k);
    if (!c) {
      std::string msg = "unknown key '" + k + "'";
      std::string hint = did_you_mean(k, keys_of(n));
      if (!hint.empty()) msg += " (" + hint + ")";
      out.push_back({p, msg, true});
      continue;
    }
    validate_rec(*c, sub, p, out);
  }
}

json defaults_rec(const SchemaNode& n, const json& v) {
  if (n.type != SchemaType::map) return v.is_null() ? n.default_value : v;
  json out = v.is_object() ? v : json::object();
  for (const auto& [k, c] : n.children) out[k] = defaults_rec(c, v.is_object() && v.contains(k) ? v[k] : json());
  return out;
}

void describe_rec(const SchemaNode& n, const std::string& path, std::ostringstream& os) {
  for (const auto& [k, c] : n.children) {
    std::string p = path.empty() ? k : path + "." + k;
    if (c.type == SchemaType::map) {
      os << p << ":  (" << c.doc << ")\n";
      describe_rec(c, p, os);
    } else {
      os << "  " << p << " [" << type_desc(c) << "] = " << c.default_value.dump() << "  — " << c.doc << "\n";
    }
  }
}

}  // namespace

std::string to_string(SchemaType t) {
  switch (t) {
    case SchemaType::map: return "map";
    case SchemaType::integer: return "integer";
    case SchemaType::number: return "number";
    case SchemaType::boolean: return "boolean";
    case SchemaType::string: return "string";
    case SchemaType::enumeration: return "enumeration";
    case SchemaType::number_list: return "list of numbers";
    case SchemaType::integer_list: return "list of integers";
    case SchemaType::number_or_learned: return "number or 'learned'";
  }
  return "?";
}

const SchemaNode& config_schema() {
  static const SchemaNode schema = build_schema();
  return schema;
}

const SchemaNode* schema_lookup(const std::string& dotted) {
  const SchemaNode* n = &config_schema();
  std::string part;
  std::istringstream ss(dotted);
  while (std::getline(ss, part, '.')) {
    n = child(*n, part);
    if (!n) return nullptr;
  }
  return n;
}

std::vector<SchemaIssue> validate_config(const json& config) {
  std::vector<SchemaIssue> out;
  validate_rec(config_schema(), config, "", out);
  return out;
}

json with_defaults(const json& config) { return defaults_rec(config_schema(), config); }

json hashed_config(const json& config) {
  if (!config.is_object()) return config;
  json out = config;
  // ZeRO's stage lays the optimiser state out across ranks; the numbers are bit-identical and
  // checkpoints resume at any stage, so it never names a run.
  if (out.contains("optimizer") && out["optimizer"].is_object()) out["optimizer"].erase("zero_stage");
  if (!out.contains("cuda") || !out["cuda"].is_object()) return out;
  json& cuda = out["cuda"];
  const SchemaNode* schema = child(config_schema(), "cuda");
  for (const auto& [k, c] : schema->children)
    if (cuda.contains(k) && cuda[k] == c.default_value) cuda.erase(k);
  if (cuda.empty()) out.erase("cuda");
  return out;
}

std::string config_hash(const json& config) { return sha256_hex(canonical_dump(hashed_config(config))); }

const std::map<std::string, std::string>& axis_aliases() {
  static const std::map<std::string, std::string> a = {
      {"architecture", "model.architecture"}, {"stack", "model.stack"},
      {"routing", "model.routing"},           {"optimizer", "optimizer.name"},
      {"lr", "optimizer.lr"},                 {"seed", "seed"},
      {"warmup", "schedule.warmup_steps"},    {"schedule", "schedule.name"},
      {"seq_len", "data.seq_len"},            {"task", "data.task"},
      {"d_model", "model.d_model"},           {"n_layers", "model.n_layers"},
      {"steps", "budget.steps"},              {"ccq", "model.ccq.enabled"},
  };
  return a;
}

std::string resolve_axis(const std::string& axis) {
  auto it = axis_aliases().find(axis);
  return it == axis_aliases().end() ? axis : it->second;
}

std::string describe_schema() {
  std::ostringstream os;
  describe_rec(config_schema(), "", os);
  return os.str();
}

}  // namespace lar

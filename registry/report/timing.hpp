#pragma once
// A timing model for sizing scales: from a cell's resolved config, the H200 wall time of
// its run, and of a whole table with -j cells sharing one GPU. Computed on the CPU from
// the measured 350M-class numbers of docs/perf.md (GDN 344M 0.1464 s/step, KDA 345M
// 0.1824, dense softmax 291M 0.1508 at 8 × 4096 tokens; the chunk kernels' fwd+bwd ms per
// layer at B=8 T=4096 H=16) scaled by FLOPs, with a small-width GEMM efficiency and a
// per-layer latency floor for small models (docs/reproduce.md, "Sizing a scale"). It is a
// model, not a measurement: one `lar-bench gpu-train` at the new shape checks it.
#include <string>
#include <vector>

#include "core/json.hpp"
#include "experiments/cell.hpp"

namespace lar::report {

struct CellTiming {
  std::string id;
  std::string arch, stack;
  double params = 0;         // weights (embeddings and head included)
  double tokens = 0;         // trained
  double steps = 0;
  double flops_per_step = 0; // 6·N·tokens + mixer/attention + optimiser
  double step_s = 0;         // predicted seconds a step on the GPU, alone
  double busy_s = 0;         // of the whole run: GPU-busy seconds (what other cells cannot overlap)
  double wall_s = 0;         // of the whole run alone: startup + steps + evaluation
};

struct TableTiming {
  std::vector<CellTiming> cells;
  int jobs = 1;
  double sum_wall_s = 0;     // the cells one after another
  double table_s = 0;        // predicted, -j cells side by side on one GPU
};

// The model's constants (every one named in docs/reproduce.md).
struct TimingModel {
  // Anchors (docs/perf.md, the 350M training step): seconds a step at B=8 × T=4096.
  double gdn_step_s = 0.1464, kda_step_s = 0.1824, softmax_step_s = 0.1508;
  double gdn_delta_kernels_s = 0.02241;  // delta_fwd + delta_bwd of that GDN step (20 layers)
  // Chunk kernels, fwd+bwd ms per layer at B=8 T=4096 H=16 dk=64 (lar-bench linear-cuda).
  double kernel_ms(const std::string& arch) const;
  double small_width = 512;      // GEMM efficiency ≈ 1.5·d/(d + small_width), at most 1
  double layer_floor_s = 1.5e-4; // per layer and step (launch-bound floor of tiny models)
  double step_floor_s = 1.0e-4;  // per step (optimiser, loss, bookkeeping)
  double startup_s = 4;          // process start, CUDA context, GEMM heuristics, data
  double busy_of_floor = 0.5;    // share of the latency floor the GPU is busy (overlappable rest)
  // Side by side on one GPU (fitted on the 68 mini runs of LAA Tables 2, 3 and 8 at -j 6,
  // docs/results/laa): a step holds the GPU for shared_compute × the FLOP model's compute,
  // plus per 16K tokens shared_layer_s a layer, shared_linear_s a linear layer (× its chunk
  // kernel's cost relative to gdn's) and shared_muon_s a layer under Muon / NorMuon. The
  // FLOP model leaves out the memory-bound ops (norms, gates, convolutions, the loss) that
  // dominate these widths; the fit puts them here.
  double shared_compute = 0.356;
  double shared_layer_s = 9.55e-4, shared_linear_s = 5.2e-4, shared_muon_s = 6.39e-4;
  double shared_tokens = 16384;
};

CellTiming estimate_cell(const experiments::Cell& cell, const TimingModel& m = {});
TableTiming estimate_table(const experiments::Plan& plan, int jobs, const TimingModel& m = {});

// Training FLOPs a token of a config: 6 × the weights the token passes (matrices, embedding
// and head) plus causal softmax attention (6·T·heads·head_dim per softmax layer, half of
// the full T×T product). No optimiser and no linear-mixer recurrence (both O(d·dk) a token,
// under 1% here). What `tflops_per_gpu` multiplies tokens/s by (LAA Table 8).
double model_flops_per_token(const json& config);

// Parameters of a config by the model's shapes (docs/spec.md §2, approximately: gates and norms
// of linear mixers as 1·d² a layer).
double estimate_params(const json& config);
// The chunk kernel of one linear layer of config, fwd+bwd, ms at B=8 T=4096 in its bench: the
// 64-wide kernels' time per 1024 value channels, past 64 keys the H200's times of the wide paths
// (the key-block split for gla and GLA-Hedgehog, the recurrent wide-key kernels otherwise, Mamba
// included; docs/perf.md). 0 for softmax.
double layer_kernel_ms(const json& config, const TimingModel& m = TimingModel{});

// Markdown: one line per cell, the whole table at -j, and against `paper` (the same spec at
// its paper scale, cell by cell): the fraction of the paper's tokens and parameters.
std::string timing_markdown(const TableTiming& t, const experiments::Plan& plan, const experiments::Plan* paper);

}  // namespace lar::report

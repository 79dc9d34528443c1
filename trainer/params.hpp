#pragma once
// Parameters and gradients live in two flat buffers of the backend's dtype (fp32 in
// training, fp64 in gradient-check tests), one contiguous range per parameter, described
// by a table of ParamInfo.
//
// FOR THE OPTIMISER (trainer/optim/): iterate `ParamStore::table()`; parameter i occupies
// elements [offset, offset + numel) of `params()` and of `grads()`. Its `kind` decides
// the group:
//   matrix_hidden — 2-D hidden weight matrices [rows=out, cols=in]: Muon/NorMuon under
//                   muon/normuon, AdamW with weight decay under adamw.
//   embedding, head — 2-D but never Muon: AdamW (scalar_lr under muon), with weight decay.
//   norm, bias, scalar — AdamW, NO weight decay (docs/spec.md §5: not on norms, biases, gate scalars).
// On the CPU backend `host_params()` / `host_grads()` are plain float* (training is
// fp32); the gradients are complete (summed over the batch, divided by the number of
// loss tokens) when the optimiser runs. Parameter order is deterministic (declaration
// order, layer by layer), so the table is identical across runs of the same config.
#include <cstdint>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/backend.hpp"

namespace lar::trainer {

enum class ParamKind { matrix_hidden, embedding, head, norm, bias, scalar };
std::string to_string(ParamKind k);
// Weight decay applies (docs/spec.md §5): matrix_hidden, embedding, head.
bool decays(ParamKind k);

// How a parameter is initialised (from the run's init RNG stream, one sub-stream per
// parameter name, so adding a parameter never changes the others' values).
struct InitRule {
  enum Kind { normal, constant, uniform } kind = normal;
  double a = 0.02;  // normal: std; constant: value; uniform: low
  double b = 0.0;   // uniform: high
  static InitRule Normal(double std) { return {normal, std, 0}; }
  static InitRule Constant(double v) { return {constant, v, 0}; }
  static InitRule Uniform(double lo, double hi) { return {uniform, lo, hi}; }
};

// What a module declares. Names are local ("wq"); the model prefixes "layers.3.mixer.".
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  ParamKind kind = ParamKind::matrix_hidden;
  InitRule init;
};

struct ParamInfo {
  std::string name;            // full name, e.g. "layers.0.mixer.wq"
  int64_t offset = 0;          // in elements, into params() and grads()
  int64_t numel = 0;
  std::vector<int64_t> shape;  // matrices: [rows=out, cols=in]
  ParamKind kind = ParamKind::matrix_hidden;
  InitRule init;
  int layer = -1;              // block index, -1 for embedding / final norm / head
};

// Owns the two flat buffers. Build: declare everything (`add`), then `allocate()`.
class ParamStore {
 public:
  explicit ParamStore(kernels::Backend& be) : be_(be) {}
  ~ParamStore();
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  // Declare a parameter; returns its index. Parameters declared one after another are
  // adjacent in memory (the model relies on this to fuse W_gate;W_up into one GEMM).
  int add(const ParamSpec& spec, const std::string& prefix, int layer);
  void allocate();                         // both buffers; grads zeroed, params uninitialised
  void init(uint64_t seed);                // every parameter from its InitRule

  const std::vector<ParamInfo>& table() const { return table_; }
  int64_t numel() const { return total_; }
  int index_of(const std::string& full_name) const;  // throws RuntimeError when unknown

  kernels::Tensor params() const { return flat(params_); }
  kernels::Tensor grads() const { return flat(grads_); }
  kernels::Tensor param(int i) const { return view(params_, i); }  // shaped like the table
  kernels::Tensor grad(int i) const { return view(grads_, i); }
  void zero_grads();

  // CPU backends only (nullptr otherwise): the flat buffers as host memory.
  float* host_params() const;
  float* host_grads() const;

  // The table as JSON (for checkpoints and logs).
  json table_json() const;

 private:
  kernels::Tensor flat(void* p) const;
  kernels::Tensor view(void* p, int i) const;
  kernels::Backend& be_;
  std::vector<ParamInfo> table_;
  int64_t total_ = 0;
  void* params_ = nullptr;
  void* grads_ = nullptr;
};

}  // namespace lar::trainer

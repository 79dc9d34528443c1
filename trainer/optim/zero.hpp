#pragma once
// ZeRO-1: the optimiser state sharded over the data-parallel ranks (optimizer.zero_stage: 1,
// docs/distributed.md). Every rank still holds all parameters and computes all gradients;
// what is split is the optimiser's state and its step:
//
//   AdamW tensors (under adamw: all; under muon/normuon: embedding, head, norms, ...) are
//     concatenated in table order and cut into `world` equal element ranges, each cut moved
//     down to a kNormBlock boundary of the tensor it falls in (optimizer.hpp: the norm's
//     blocks), so that every block has one owner;
//   Muon/NorMuon matrices stay whole (Newton–Schulz needs the whole matrix): largest first
//     (ties: table order), each to the rank with the fewest Muon elements so far (ties: the
//     lowest rank).
// The plan depends only on the table, the optimiser and the world size: every rank computes
// the same one, whatever the timing.
//
// Per step (each rank, the collectives behind Communicator):
//   zero.reduce_gradients(grads);  // reduce-scatter: the owner of a piece gets its sum
//   double norm = zero.clip_gradients(grads);  // block sums all-reduced, added in order
//   zero.step(params, grads, schedule, step);  // this rank's pieces, then all-gather
//
// Bit-identical to the unsharded Optimizer given the same summed gradients: the AdamW update
// is elementwise, a Muon matrix is updated whole by the same code, the clip norm adds the
// same block sums in the same order, and the all-gather copies bits. The reduce-scatter's
// summation order is the communicator's (the fake group of tests/dist: rank 0, 1, 2, ... in
// order; NCCL deterministic mode: a fixed ring order).
//
// Checkpoints: save_state() gathers the shards into Optimizer::save_state's unsharded format
// (the same bytes an unsharded run writes), so a run resumes on any world size, sharded or
// not; load_state() reads that format and keeps this rank's share.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer/optim/optimizer.hpp"

namespace lar::optim {

// Elements [offset, offset + count) of a flat buffer, owned by rank `owner`.
struct Segment {
  std::size_t offset = 0;
  std::size_t count = 0;
  int owner = 0;
};

// The collectives ZeRO-1 needs. Buffers are float/double pointers in the implementation's
// memory (host for the tests' fake group, device memory for NCCL); every rank calls the
// same collectives in the same order with the same segment lists.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // For every segment: afterwards its owner's buf[offset, offset + count) holds the sum over
  // the ranks of their buf there (other ranks' contents there are unspecified).
  virtual void reduce_scatter(float* buf, const std::vector<Segment>& segments) = 0;
  // For every segment: afterwards every rank's buf[offset, offset + count) holds the owner's.
  virtual void all_gather(float* buf, const std::vector<Segment>& segments) = 0;
  // Element-wise sum over the ranks, in place (every rank gets the result).
  virtual void all_reduce(float* buf, std::size_t n) = 0;
  virtual void all_reduce(double* buf, std::size_t n) = 0;
};

// One piece of a tensor: elements [lo, hi) of params[param], updated by rank `owner`.
struct ZeroPiece {
  std::size_t param = 0;
  std::size_t lo = 0, hi = 0;
  int owner = 0;
  bool muon = false;  // a whole Muon/NorMuon matrix
};

struct ZeroPlan {
  int world = 1;
  std::vector<ZeroPiece> pieces;  // table order, then lo; covers every element once
  // This rank's pieces (indices into `pieces`).
  std::vector<std::size_t> of_rank(int rank) const;
  // Flat-buffer segments of every piece, adjacent ones of one owner merged (the
  // reduce-scatter and all-gather lists).
  std::vector<Segment> segments(const std::vector<ParamView>& params) const;
};

// The plan for `params` under `config` on `world` ranks (world ≥ 1; RuntimeError otherwise).
ZeroPlan plan_zero(const OptimizerConfig& config, const std::vector<ParamView>& params, int world);

// Optimiser-state bytes: `full` for the unsharded optimiser (what each rank holds at
// zero_stage 0), `per_rank[r]` for rank r's shard under ZeRO-1 on `world` ranks.
struct StateBytes {
  std::size_t full = 0;
  std::vector<std::size_t> per_rank;
};
StateBytes optimizer_state_bytes(const OptimizerConfig& config, const std::vector<ParamView>& params, int world);

// What a rank of a ZeRO-1 group needs beyond the plan, shared by the host ZeroOptimizer and
// the device one (device_zero.hpp): the collectives' segment lists, this rank's pieces as a
// parameter table of their own (an optimiser over it is the rank's shard), the unsharded
// state layout and the norm's block numbering.
struct ZeroLayout {
  ZeroPlan plan;
  std::vector<Segment> segments;           // all ranks' flat segments (gradients, parameters)
  // This rank's pieces as a table: AdamW ranges as 1 × n views at their flat offset (the
  // update is elementwise; kind, hence group and decay, are kept), Muon matrices whole.
  std::vector<ParamView> shard_views;
  std::vector<std::size_t> shard_pieces;   // indices into plan.pieces, one per shard view
  std::vector<std::size_t> shard_full_m, shard_full_v;  // their offsets in the unsharded m_ / v_
  std::vector<Segment> m_segs, v_segs;     // every rank's state in the unsharded m_ / v_
  std::size_t m_len = 0, v_len = 0;        // the unsharded m_ / v_ lengths
  std::vector<std::size_t> block_base;     // first global norm block of each parameter
  std::size_t n_blocks = 0;

  // Where the shard's state lives in the unsharded layout: shard floats
  // [shard_off, shard_off + count) of m_ or v_ are the unsharded floats [full_off, ...).
  struct StateMap {
    bool v = false;
    std::size_t shard_off = 0, full_off = 0, count = 0;
  };
  // `shard`: an Optimizer over shard_views (its slot layout says where the state went).
  std::vector<StateMap> state_map(const Optimizer& shard) const;
};
ZeroLayout zero_layout(const OptimizerConfig& config, const std::vector<ParamView>& params, int world, int rank);

class ZeroOptimizer {
 public:
  // `comm` must outlive this object. Allocates state only for this rank's pieces.
  ZeroOptimizer(OptimizerConfig config, std::vector<ParamView> params, std::size_t total_size,
                Communicator& comm);

  // grads: this rank's local gradients (the flat buffer); afterwards this rank's pieces hold
  // the sum over the ranks (the rest is unspecified until the next backward).
  void reduce_gradients(float* grads);
  // As Optimizer::clip_gradients on the summed gradients of this rank's pieces (collective;
  // every rank returns the same norm). NaN/Inf: returned, gradients untouched.
  double clip_gradients(float* grads);
  // Updates this rank's pieces, then all-gathers the parameters (collective).
  void step(float* params, const float* grads, const Schedule& schedule, std::int64_t step);
  void step(float* params, const float* grads, double lr_factor, double scalar_factor);

  // Collective: every rank returns the unsharded state blob (Optimizer::save_state's bytes).
  std::string save_state();
  // Not collective: reads an unsharded blob (any world size wrote it) and keeps this rank's share.
  void load_state(const std::string& blob);

  std::int64_t steps_taken() const { return shard_->steps_taken(); }
  const ZeroPlan& plan() const { return lay_.plan; }
  std::size_t state_bytes() const { return sizeof(float) * shard_->state_floats(); }

 private:
  std::unique_ptr<Optimizer> full_layout() const;  // an unsharded optimiser (state zeroed)

  OptimizerConfig cfg_;
  std::vector<ParamView> params_;
  std::size_t total_size_ = 0;
  Communicator& comm_;
  ZeroLayout lay_;
  std::unique_ptr<Optimizer> shard_;            // this rank's pieces as its own parameter table
  std::vector<ZeroLayout::StateMap> map_;       // this rank's state in the unsharded layout
};

}  // namespace lar::optim

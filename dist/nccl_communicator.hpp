#pragma once
// optim::Communicator over an NCCL communicator (LAR_HAVE_NCCL): ZeRO-1's collectives
// (trainer/optim/zero.hpp) between the ranks of a data-parallel run.
//
//   auto comm = data_parallel.communicator();   // NcclDataParallel: its NCCL communicator
//   optim::ZeroOptimizer zero(cfg, views, numel, *comm);
//
// - reduce_scatter: one ncclReduce per segment (root = its owner) in one NCCL group, so the
//   segments of a rank need not be contiguous (Muon matrices are assigned whole); all_gather:
//   one ncclBroadcast per segment (root = its owner) in one group; all_reduce: ncclAllReduce.
//   The reductions' order is NCCL's: fixed in deterministic runs (NCCL_ALGO=Ring,
//   NCCL_PROTO=Simple, set by NcclDataParallel), but not the fake group's rank order, so the
//   bits match an all-reduce run only as far as NCCL's reduce and all-reduce agree.
// - Buffers may be device memory (used in place) or host memory (staged through a device
//   buffer): the host ZeroOptimizer and a device one can both use it.
// - Every call is ordered after the work queued on `compute_stream` and blocks until its
//   collectives are done, polling ncclCommGetAsyncError against `timeout_s`; a failure or a
//   timeout throws RuntimeError (the caller aborts the communicator: DataParallel::abort).
#include <cstddef>
#include <vector>

#include "trainer/optim/zero.hpp"

namespace lar::dist {

class NcclCommunicator final : public optim::Communicator {
 public:
  // comm: an initialised ncclComm_t, compute_stream: a cudaStream_t (both as void* so that
  // this header needs neither nccl.h nor the CUDA runtime). Neither is owned.
  NcclCommunicator(void* comm, void* compute_stream, int rank, int world, double timeout_s);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void reduce_scatter(float* buf, const std::vector<optim::Segment>& segments) override;
  void all_gather(float* buf, const std::vector<optim::Segment>& segments) override;
  void all_reduce(float* buf, std::size_t n) override;
  void all_reduce(double* buf, std::size_t n) override;

 private:
  enum class Op { reduce, broadcast, all_reduce };
  void run(void* buf, std::size_t elem_bytes, bool is_double, std::size_t extent, Op op,
           const std::vector<optim::Segment>& segments);

  void* comm_;
  void* compute_;
  void* stream_ = nullptr;  // the collectives' stream
  void* ready_ = nullptr;   // compute → collectives
  void* done_ = nullptr;    // collectives → compute / host
  void* staging_ = nullptr; // device copy of host buffers
  std::size_t staging_bytes_ = 0;
  int rank_, world_;
  double timeout_s_;
};

}  // namespace lar::dist

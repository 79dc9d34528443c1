#include "dist/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace lar::dist {

namespace {

using Clock = std::chrono::steady_clock;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string("zero: ") + what + ": " + cudaGetErrorString(e));
}

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

// A call on a (possibly non-blocking) communicator: wait until NCCL has accepted it.
void nccl_check(ncclComm_t comm, ncclResult_t r, const char* what, double timeout_s) {
  const auto start = Clock::now();
  while (r == ncclInProgress) {
    if (std::chrono::duration<double>(Clock::now() - start).count() > timeout_s)
      throw RuntimeError(std::string("zero: ") + what + ": NCCL did not accept the call within " +
                         std::to_string(int(timeout_s)) + " s");
    std::this_thread::yield();
    ncclCommGetAsyncError(comm, &r);
  }
  if (r != ncclSuccess)
    throw RuntimeError(std::string("zero: ") + what + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(comm) + ")");
}

}  // namespace

NcclCommunicator::NcclCommunicator(void* comm, void* compute_stream, int rank, int world, double timeout_s)
    : comm_(comm), compute_(compute_stream), rank_(rank), world_(world), timeout_s_(timeout_s) {
  cudaStream_t s = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaEventCreateWithFlags(&a, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventCreateWithFlags(&b, cudaEventDisableTiming), "cudaEventCreate");
  stream_ = s, ready_ = a, done_ = b;
}

NcclCommunicator::~NcclCommunicator() {
  if (staging_) cudaFree(staging_);
  if (ready_) cudaEventDestroy(as_event(ready_));
  if (done_) cudaEventDestroy(as_event(done_));
  if (stream_) cudaStreamDestroy(as_stream(stream_));
}

void NcclCommunicator::run(void* buf, std::size_t elem_bytes, bool is_double, std::size_t extent, Op op,
                           const std::vector<optim::Segment>& segments) {
  if (!comm_) throw RuntimeError("zero: the NCCL communicator was aborted");
  if (extent == 0) return;
  ncclComm_t comm = as_comm(comm_);
  cudaStream_t st = as_stream(stream_);
  cudaPointerAttributes attr{};
  const bool on_device = cudaPointerGetAttributes(&attr, buf) == cudaSuccess &&
                         (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
  (void)cudaGetLastError();  // an unregistered host pointer may leave an error behind
  const std::size_t bytes = extent * elem_bytes;
  char* dev = static_cast<char*>(buf);
  cuda_check(cudaEventRecord(as_event(ready_), as_stream(compute_)), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(st, as_event(ready_), 0), "cudaStreamWaitEvent");
  if (!on_device) {
    if (bytes > staging_bytes_) {
      if (staging_) cudaFree(staging_);
      staging_ = nullptr;
      cuda_check(cudaMalloc(&staging_, bytes), "cudaMalloc");
      staging_bytes_ = bytes;
    }
    dev = static_cast<char*>(staging_);
    cuda_check(cudaMemcpyAsync(dev, buf, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync");
  }
  const ncclDataType_t type = is_double ? ncclDouble : ncclFloat;
  if (op == Op::all_reduce) {
    nccl_check(comm, ncclAllReduce(dev, dev, extent, type, ncclSum, comm, st), "ncclAllReduce", timeout_s_);
  } else {
    nccl_check(comm, ncclGroupStart(), "ncclGroupStart", timeout_s_);
    for (const optim::Segment& s : segments) {
      if (!s.count) continue;
      char* p = dev + s.offset * elem_bytes;
      if (op == Op::reduce)
        nccl_check(comm, ncclReduce(p, p, s.count, type, ncclSum, s.owner, comm, st), "ncclReduce", timeout_s_);
      else
        nccl_check(comm, ncclBroadcast(p, p, s.count, type, s.owner, comm, st), "ncclBroadcast", timeout_s_);
    }
    nccl_check(comm, ncclGroupEnd(), "ncclGroupEnd", timeout_s_);
  }
  if (!on_device) cuda_check(cudaMemcpyAsync(buf, dev, bytes, cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
  cuda_check(cudaEventRecord(as_event(done_), st), "cudaEventRecord");
  const auto start = Clock::now();
  for (long spins = 0;; ++spins) {
    const cudaError_t e = cudaEventQuery(as_event(done_));
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) throw RuntimeError(std::string("zero: CUDA error ") + cudaGetErrorString(e));
    ncclResult_t r = ncclSuccess;
    ncclCommGetAsyncError(comm, &r);
    if (r != ncclSuccess && r != ncclInProgress)
      throw RuntimeError(std::string("zero: NCCL error ") + ncclGetErrorString(r) + ": a peer rank failed");
    if (std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_)
      throw RuntimeError("zero: a collective timed out after " + std::to_string(int(timeout_s_)) +
                         " s: a peer rank died, hangs or is far slower (LAR_DIST_TIMEOUT)");
    if (spins < 2000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  cuda_check(cudaStreamWaitEvent(as_stream(compute_), as_event(done_), 0), "cudaStreamWaitEvent");
}

namespace {
std::size_t extent_of(const std::vector<optim::Segment>& segments) {
  std::size_t e = 0;
  for (const optim::Segment& s : segments) e = std::max(e, s.offset + s.count);
  return e;
}
}  // namespace

void NcclCommunicator::reduce_scatter(float* buf, const std::vector<optim::Segment>& segments) {
  run(buf, sizeof(float), false, extent_of(segments), Op::reduce, segments);
}
void NcclCommunicator::all_gather(float* buf, const std::vector<optim::Segment>& segments) {
  run(buf, sizeof(float), false, extent_of(segments), Op::broadcast, segments);
}
void NcclCommunicator::all_reduce(float* buf, std::size_t n) { run(buf, sizeof(float), false, n, Op::all_reduce, {}); }
void NcclCommunicator::all_reduce(double* buf, std::size_t n) { run(buf, sizeof(double), true, n, Op::all_reduce, {}); }

}  // namespace lar::dist

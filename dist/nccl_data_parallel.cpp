#include "dist/nccl_data_parallel.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"
#include "dist/env.hpp"
#include "dist/id_exchange.hpp"
#include "dist/nccl_communicator.hpp"
#include "kernels/cuda/cuda_backend.hpp"

namespace lar::dist {

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RuntimeError(std::string(what) + ": " + cudaGetErrorString(e));
}

using Clock = std::chrono::steady_clock;

}  // namespace

struct NcclDataParallel::Impl {
  kernels::cuda::CudaBackend* be = nullptr;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;  // the collectives' stream
  cudaEvent_t ready = nullptr;    // compute stream → collectives
  cudaEvent_t done = nullptr;     // collectives → compute stream / host
  double* dev = nullptr;          // sum()'s device buffer
  double* host = nullptr;         // pinned
  std::size_t scalars = 0;
  int rank = 0;
  bool aborted = false;

  [[noreturn]] void fail(const std::string& why) {
    abort_comm();
    throw RuntimeError(why);
  }

  // Abort with a deadline: ncclCommAbort frees kernels stuck on a dead peer; should it
  // hang itself, the process would, so a watchdog ends it.
  void abort_comm() {
    if (!comm || aborted) return;
    aborted = true;
    std::thread watchdog([] {
      std::this_thread::sleep_for(std::chrono::seconds(20));
      std::cerr << "lar train: ncclCommAbort did not return within 20 s; exiting\n";
      std::_Exit(1);
    });
    watchdog.detach();
    ncclCommAbort(comm);
    comm = nullptr;
  }

  // An NCCL call on a non-blocking communicator: ncclInProgress means queued; wait for
  // the communicator to accept it before the next call.
  void nccl(ncclResult_t r, const char* what, double timeout_s) {
    if (r == ncclInProgress) {
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
      do {
        if (Clock::now() > deadline)
          fail(std::string(what) + ": NCCL did not accept the call within " + std::to_string(int(timeout_s)) + " s");
        std::this_thread::yield();
        ncclCommGetAsyncError(comm, &r);
      } while (r == ncclInProgress);
    }
    if (r != ncclSuccess)
      fail(std::string(what) + ": " + ncclGetErrorString(r) + (comm ? std::string(" (") + ncclGetLastError(comm) + ")" : ""));
  }

  // Poll an event until done, watching NCCL's asynchronous errors and the deadline.
  void wait(cudaEvent_t ev, double timeout_s, const std::string& what) {
    const auto start = Clock::now();
    for (long spins = 0;; ++spins) {
      cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) fail(what + ": CUDA error " + cudaGetErrorString(e));
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm, &st);
      if (st != ncclSuccess && st != ncclInProgress)
        fail(what + ": NCCL error " + ncclGetErrorString(st) + " (" + ncclGetLastError(comm) +
             "): a peer rank failed");
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > timeout_s)
        fail(what + " timed out after " + std::to_string(int(timeout_s)) +
             " s: a peer rank died, hangs or is far slower (LAR_DIST_TIMEOUT)");
      if (spins < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
};

NcclDataParallel::NcclDataParallel(kernels::Backend& be, const NcclOptions& o) : impl_(new Impl), o_(o) {
  auto* cb = dynamic_cast<kernels::cuda::CudaBackend*>(&be);
  if (!cb) throw UserError("data-parallel training needs the cuda backend (this rank runs " + be.name() + ")");
  Impl& m = *impl_;
  m.be = cb;
  m.rank = o.rank;
  // NCCL reads these when the communicator forms.
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (o.deterministic) {
    ::setenv("NCCL_ALGO", "Ring", 1);
    ::setenv("NCCL_PROTO", "Simple", 1);
  }
  ncclUniqueId id;
  if (o.rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw RuntimeError(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
    publish_id(o.id_file, std::string(id.internal, sizeof id.internal));
  } else {
    const std::string bytes = wait_for_id(o.id_file, sizeof id.internal, o.init_timeout_s);
    std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  }
  cuda_check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaEventCreateWithFlags(&m.ready, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventCreateWithFlags(&m.done, cudaEventDisableTiming), "cudaEventCreate");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;  // initialisation and every call return at once: we poll with deadlines
  ncclResult_t r = ncclCommInitRankConfig(&m.comm, o.world, id, o.rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress)
    throw RuntimeError(std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r));
  const auto start = Clock::now();
  for (;;) {
    ncclCommGetAsyncError(m.comm, &r);
    if (r == ncclSuccess) break;
    if (r != ncclInProgress) m.fail(std::string("NCCL communicator initialisation failed: ") + ncclGetErrorString(r));
    if (std::chrono::duration<double>(Clock::now() - start).count() > o.init_timeout_s)
      m.fail("NCCL communicator initialisation timed out after " + std::to_string(int(o.init_timeout_s)) +
             " s: rank " + std::to_string(o.rank) + " of " + std::to_string(o.world) +
             " waits for the others (are all ranks started?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Everyone has read the id: rank 0 removes its file.
  sum({0.0}, o.init_timeout_s);
  if (o.rank == 0) {
    std::error_code ec;
    std::filesystem::remove(o.id_file, ec);
  }
}

NcclDataParallel::~NcclDataParallel() {
  zero_comm_.reset();  // its stream and events, before the communicator goes
  Impl& m = *impl_;
  if (m.comm) {
    // Finalize (flush outstanding work), with a deadline; abort when it does not end.
    ncclResult_t r = ncclCommFinalize(m.comm);
    const auto start = Clock::now();
    while (r == ncclInProgress && std::chrono::duration<double>(Clock::now() - start).count() < 10) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ncclCommGetAsyncError(m.comm, &r);
    }
    if (r == ncclSuccess) ncclCommDestroy(m.comm), m.comm = nullptr;
    else m.abort_comm();
  }
  if (m.dev) cudaFree(m.dev);
  if (m.host) cudaFreeHost(m.host);
  if (m.ready) cudaEventDestroy(m.ready);
  if (m.done) cudaEventDestroy(m.done);
  if (m.stream) cudaStreamDestroy(m.stream);
}

void NcclDataParallel::reduce_async(const kernels::Tensor& grads, int64_t offset, int64_t count) {
  Impl& m = *impl_;
  if (!m.comm) throw RuntimeError("the NCCL communicator was aborted");
  if (grads.dtype != kernels::DType::f32) throw RuntimeError("reduce_async: gradients are not fp32");
  float* p = grads.ptr<float>() + offset;
  cuda_check(cudaEventRecord(m.ready, m.be->stream()), "cudaEventRecord");
  cuda_check(cudaStreamWaitEvent(m.stream, m.ready, 0), "cudaStreamWaitEvent");
  m.nccl(ncclAllReduce(p, p, static_cast<size_t>(count), ncclFloat, ncclSum, m.comm, m.stream), "ncclAllReduce",
         o_.timeout_s);
}

void NcclDataParallel::wait_reduced() {
  Impl& m = *impl_;
  if (!m.comm) throw RuntimeError("the NCCL communicator was aborted");
  // The sums wait for this rank's own backward; the deadline covers that compute too.
  cuda_check(cudaEventRecord(m.done, m.stream), "cudaEventRecord");
  m.wait(m.done, o_.timeout_s, "gradient all-reduce");
  cuda_check(cudaStreamWaitEvent(m.be->stream(), m.done, 0), "cudaStreamWaitEvent");
}

std::vector<double> NcclDataParallel::sum(const std::vector<double>& values, double timeout_s) {
  Impl& m = *impl_;
  if (!m.comm) throw RuntimeError("the NCCL communicator was aborted");
  if (timeout_s <= 0) timeout_s = o_.timeout_s;
  if (values.size() > m.scalars) {
    if (m.dev) cudaFree(m.dev), cudaFreeHost(m.host);
    m.scalars = std::max<std::size_t>(values.size(), 16);
    cuda_check(cudaMalloc(&m.dev, m.scalars * sizeof(double)), "cudaMalloc");
    cuda_check(cudaMallocHost(&m.host, m.scalars * sizeof(double)), "cudaMallocHost");
  }
  std::copy(values.begin(), values.end(), m.host);
  const std::size_t bytes = values.size() * sizeof(double);
  cuda_check(cudaMemcpyAsync(m.dev, m.host, bytes, cudaMemcpyHostToDevice, m.stream), "cudaMemcpyAsync");
  m.nccl(ncclAllReduce(m.dev, m.dev, values.size(), ncclDouble, ncclSum, m.comm, m.stream), "ncclAllReduce",
         timeout_s);
  cuda_check(cudaMemcpyAsync(m.host, m.dev, bytes, cudaMemcpyDeviceToHost, m.stream), "cudaMemcpyAsync");
  cuda_check(cudaEventRecord(m.done, m.stream), "cudaEventRecord");
  m.wait(m.done, timeout_s, "collective");
  return std::vector<double>(m.host, m.host + values.size());
}

void NcclDataParallel::abort() { impl_->abort_comm(); }

optim::Communicator* NcclDataParallel::communicator() {
  if (!impl_->comm) throw RuntimeError("the NCCL communicator was aborted");
  if (!zero_comm_)
    zero_comm_ = std::make_unique<NcclCommunicator>(impl_->comm, impl_->be->stream(), o_.rank, o_.world, o_.timeout_s);
  return zero_comm_.get();
}

int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

std::unique_ptr<kernels::Backend> make_rank_backend(int local_rank) {
  const int n = visible_gpus();
  if (n == 0) throw RuntimeError("data-parallel rank found no CUDA device");
  // One GPU visible (a scheduler bound this rank to its GPU): that one. Else by local rank.
  const int device = n == 1 ? 0 : local_rank;
  if (device >= n)
    throw UserError("local rank " + std::to_string(local_rank) + " has no GPU: " + std::to_string(n) +
                    " visible (one rank per GPU)");
  return std::make_unique<kernels::cuda::CudaBackend>(device);
}

void configure_rank(trainer::TrainOptions& opts, const DistEnv& env) {
  opts.make_backend = [local = env.local_rank](const json&) { return make_rank_backend(local); };
  opts.make_data_parallel = [env](kernels::Backend& be, const json& cfg, const std::filesystem::path& run_dir) {
    NcclOptions o;
    o.rank = env.rank;
    o.world = env.world;
    o.id_file = id_file_path(run_dir, env.token);
    o.deterministic = cfg.at("deterministic").get<bool>();
    o.init_timeout_s = env_number("LAR_DIST_INIT_TIMEOUT", 300, "seconds");
    o.timeout_s = dist_timeout_s();
    return std::unique_ptr<trainer::DataParallel>(new NcclDataParallel(be, o));
  };
}

}  // namespace lar::dist

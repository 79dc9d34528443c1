#pragma once
// N in-process ranks as threads, with optim::Communicator collectives over host buffers:
// sums are exact float/double additions in rank order (rank 0's value, + rank 1's, + ...),
// the order the tests' unsharded references use. Each collective registers the rank's
// buffer, meets the others at a barrier, reads the peers' buffers, and meets them again
// before anyone may touch a buffer that another rank still reads.
//
//   FakeGroup g(3);
//   g.run([&](int rank, optim::Communicator& comm) { ... });   // one thread per rank
//
// Code inside run() must not throw past a collective (the other ranks would wait forever):
// record results and check them after run() returns.
#include <barrier>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "trainer/optim/zero.hpp"

namespace lar::testing {

class FakeGroup {
 public:
  explicit FakeGroup(int n) : n_(n), bufs_(static_cast<std::size_t>(n)), sync_(n) {}

  void run(const std::function<void(int, optim::Communicator&)>& fn) {
    std::vector<std::thread> threads;
    std::exception_ptr first;
    std::mutex mu;
    for (int r = 0; r < n_; ++r)
      threads.emplace_back([&, r] {
        Rank comm(*this, r);
        try {
          fn(r, comm);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = std::current_exception();
        }
      });
    for (std::thread& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

  int collectives() const { return collectives_; }

 private:
  class Rank;

 public:
  // Rank r's communicator, for ranks run on threads of the caller's own (one per rank,
  // each rank calling the same collectives).
  std::unique_ptr<optim::Communicator> member(int r) { return std::make_unique<Rank>(*this, r); }

 private:
  class Rank final : public optim::Communicator {
   public:
    Rank(FakeGroup& g, int r) : g_(g), r_(r) {}
    int rank() const override { return r_; }
    int world() const override { return g_.n_; }

    void reduce_scatter(float* buf, const std::vector<optim::Segment>& segs) override {
      enter(buf);
      // The owner sums its segments in place; no other rank reads those elements.
      for (const optim::Segment& s : segs) {
        if (s.owner != r_) continue;
        for (std::size_t i = s.offset; i < s.offset + s.count; ++i) {
          float x = peer<float>(0)[i];
          for (int q = 1; q < g_.n_; ++q) x += peer<float>(q)[i];
          buf[i] = x;
        }
      }
      g_.sync_.arrive_and_wait();
    }

    void all_gather(float* buf, const std::vector<optim::Segment>& segs) override {
      enter(buf);
      for (const optim::Segment& s : segs)
        if (s.owner != r_ && s.count)
          std::memcpy(buf + s.offset, peer<float>(s.owner) + s.offset, sizeof(float) * s.count);
      g_.sync_.arrive_and_wait();
    }

    void all_reduce(float* buf, std::size_t n) override { reduce_all(buf, n); }
    void all_reduce(double* buf, std::size_t n) override { reduce_all(buf, n); }

   private:
    template <typename T>
    void reduce_all(T* buf, std::size_t n) {
      enter(buf);
      std::vector<T> out(n);
      for (std::size_t i = 0; i < n; ++i) {
        T x = peer<T>(0)[i];
        for (int q = 1; q < g_.n_; ++q) x += peer<T>(q)[i];
        out[i] = x;
      }
      g_.sync_.arrive_and_wait();  // every rank has read every buffer
      std::copy(out.begin(), out.end(), buf);
    }
    void enter(void* buf) {
      g_.bufs_[static_cast<std::size_t>(r_)] = buf;
      if (r_ == 0) ++g_.collectives_;
      g_.sync_.arrive_and_wait();
    }
    template <typename T>
    T* peer(int q) const {
      return static_cast<T*>(g_.bufs_[static_cast<std::size_t>(q)]);
    }
    FakeGroup& g_;
    int r_;
  };

  int n_;
  std::vector<void*> bufs_;
  std::barrier<> sync_;
  int collectives_ = 0;
};

}  // namespace lar::testing

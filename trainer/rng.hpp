#pragma once
// Deterministic random streams derived from the run seed. Every consumer takes its own
// named stream (stream_seed(seed, "init/layers.0.mixer.wq")), so adding a consumer never
// shifts another one's numbers. Portable: no std:: distributions (their algorithms are
// implementation-defined), only integer arithmetic and Box–Muller.
#include <cmath>
#include <cstdint>
#include <string_view>

namespace lar::trainer {

inline uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The seed of the stream `name` of run seed `seed` (FNV-1a of the name, mixed).
inline uint64_t stream_seed(uint64_t seed, std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  uint64_t x = seed ^ h;
  return splitmix64(x);
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(seed) {}
  uint64_t next() { return splitmix64(state_); }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0,1)
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }

 private:
  uint64_t state_;
};

}  // namespace lar::trainer

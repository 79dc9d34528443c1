#pragma once
// Counter-based random numbers for the data pipeline. Every sample is generated from
// (seed, domain, index) alone, so a val batch is the same every time it is asked for and
// a resumed run continues exactly: the data position is just an index, no hidden state.
// The maths is SplitMix64 (Steele et al.), and every draw is defined here bit for bit
// (no std:: distributions, whose output differs between standard libraries).
#include <cstdint>
#include <string_view>

namespace lar::data {

constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a of a short name, so that streams are separated by readable domain labels.
constexpr uint64_t domain_hash(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

class Rng {
 public:
  // The generator for sample `index` of stream `domain` under `seed`.
  Rng(uint64_t seed, std::string_view domain, uint64_t index)
      : state_(splitmix64(splitmix64(seed ^ domain_hash(domain)) ^ splitmix64(index + 0x632be59bd9b4e019ULL))) {}

  uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // Uniform integer in [0, n), n ≥ 1, without modulo bias (rejection sampling).
  uint64_t below(uint64_t n) {
    if (n <= 1) return 0;
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = next(); while (x >= limit);
    return x % n;
  }

  // Uniform integer in [lo, hi] (inclusive).
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo) + 1)); }

  // Uniform double in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

}  // namespace lar::data

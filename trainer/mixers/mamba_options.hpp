#pragma once
// Internal to trainer/mixers: the shape options shared by the Mamba-2 and Mamba-3 layers
// (model.mamba.*), resolved and checked from a MixerConfig.
#include <string>

#include "core/error.hpp"
#include "trainer/mixer.hpp"

namespace lar::trainer::mixers {

struct MambaShape {
  int d = 0;       // d_model
  int Di = 0;      // inner width expand·d_model
  int P = 64;      // head (value) dimension
  int H = 0;       // heads Di / P
  int N = 128;     // state size (key dimension)
  int G = 1;       // groups sharing B and C
  int chunk = 64;
};

inline MambaShape mamba_shape(const MixerConfig& cfg) {
  MambaShape s;
  const json& mo = cfg.model;
  json m = mo.contains("mamba") && mo["mamba"].is_object() ? mo["mamba"] : json::object();
  const int expand = m.value("expand", 2);
  s.P = m.value("head_dim", 64);
  s.N = m.value("state_size", 128);
  s.G = m.value("n_groups", 1);
  s.chunk = mo.value("chunk_size", 64);
  s.d = cfg.d_model;
  if (expand < 1) throw UserError("model.mamba.expand: must be ≥ 1, got " + std::to_string(expand));
  if (s.P < 1) throw UserError("model.mamba.head_dim: must be ≥ 1, got " + std::to_string(s.P));
  if (s.N < 1) throw UserError("model.mamba.state_size: must be ≥ 1, got " + std::to_string(s.N));
  if (s.chunk < 1) throw UserError("model.chunk_size: must be ≥ 1, got " + std::to_string(s.chunk));
  s.Di = expand * s.d;
  if (s.Di % s.P != 0)
    throw UserError("model.mamba.head_dim: " + std::to_string(s.P) + " does not divide model.mamba.expand · model.d_model = " +
                    std::to_string(s.Di));
  s.H = s.Di / s.P;
  if (s.G < 1 || s.H % s.G != 0)
    throw UserError("model.mamba.n_groups: " + std::to_string(s.G) + " must be ≥ 1 and divide the " + std::to_string(s.H) +
                    " heads (expand · d_model / head_dim)");
  return s;
}

}  // namespace lar::trainer::mixers

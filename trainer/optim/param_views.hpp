#pragma once
// The trainer's parameter table (trainer/params.hpp) seen as the optimiser's ParamViews.
// Header-only so that lar_optim does not link the trainer (the trainer links lar_optim).
//   Optimizer opt(OptimizerConfig::from_json(cfg), optim::param_views(store.table()), store.numel());
#include <cstddef>
#include <vector>

#include "core/error.hpp"
#include "trainer/optim/optimizer.hpp"
#include "trainer/params.hpp"

namespace lar::optim {

inline ParamKind param_kind(trainer::ParamKind k) {
  switch (k) {
    case trainer::ParamKind::matrix_hidden: return ParamKind::matrix_hidden;
    case trainer::ParamKind::embedding: return ParamKind::embedding;
    case trainer::ParamKind::head: return ParamKind::head;
    case trainer::ParamKind::norm: return ParamKind::norm;
    case trainer::ParamKind::bias: return ParamKind::bias;
    case trainer::ParamKind::scalar: return ParamKind::scalar;
  }
  throw RuntimeError("optimizer: unknown trainer::ParamKind");
}

// 2-D: [rows, cols]; 1-D [n] and scalars: 1 × n; more dims: shape[0] × (the rest).
inline std::vector<ParamView> param_views(const std::vector<trainer::ParamInfo>& table) {
  std::vector<ParamView> views;
  views.reserve(table.size());
  for (const trainer::ParamInfo& p : table) {
    ParamView v;
    v.name = p.name;
    v.offset = static_cast<std::size_t>(p.offset);
    v.kind = param_kind(p.kind);
    if (p.shape.size() >= 2 && p.shape[0] > 0) {
      v.rows = static_cast<int>(p.shape[0]);
      v.cols = static_cast<int>(p.numel / p.shape[0]);
    } else {
      v.rows = 1;
      v.cols = static_cast<int>(p.numel);
    }
    if (static_cast<std::int64_t>(v.size()) != p.numel)
      throw RuntimeError("optimizer: parameter '" + p.name + "' has a shape that does not match its numel");
    views.push_back(v);
  }
  return views;
}

}  // namespace lar::optim

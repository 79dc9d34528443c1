#include "trainer/params.hpp"

#include <vector>

#include "core/error.hpp"
#include "trainer/rng.hpp"

namespace lar::trainer {

using kernels::DType;
using kernels::Tensor;

std::string to_string(ParamKind k) {
  switch (k) {
    case ParamKind::matrix_hidden: return "matrix_hidden";
    case ParamKind::embedding: return "embedding";
    case ParamKind::head: return "head";
    case ParamKind::norm: return "norm";
    case ParamKind::bias: return "bias";
    case ParamKind::scalar: return "scalar";
  }
  return "?";
}

bool decays(ParamKind k) {
  return k == ParamKind::matrix_hidden || k == ParamKind::embedding || k == ParamKind::head;
}

ParamStore::~ParamStore() {
  if (params_) be_.free_bytes(params_);
  if (grads_) be_.free_bytes(grads_);
}

int ParamStore::add(const ParamSpec& spec, const std::string& prefix, int layer) {
  if (params_) throw RuntimeError("ParamStore::add after allocate()");
  ParamInfo p;
  p.name = prefix + spec.name;
  p.shape = spec.shape;
  p.numel = 1;
  for (auto d : spec.shape) p.numel *= d;
  p.offset = total_;
  p.kind = spec.kind;
  p.init = spec.init;
  p.layer = layer;
  for (const auto& q : table_)
    if (q.name == p.name) throw RuntimeError("duplicate parameter name " + p.name);
  total_ += p.numel;
  table_.push_back(std::move(p));
  return static_cast<int>(table_.size()) - 1;
}

void ParamStore::allocate() {
  std::size_t bytes = std::max<int64_t>(total_, 1) * kernels::dtype_size(be_.dtype());
  params_ = be_.alloc_bytes(bytes);
  grads_ = be_.alloc_bytes(bytes);
  be_.zero(params());
  be_.zero(grads());
}

void ParamStore::init(uint64_t seed) {
  for (int i = 0; i < static_cast<int>(table_.size()); ++i) {
    const auto& p = table_[i];
    Rng rng(stream_seed(seed, "init/" + p.name));
    std::vector<double> v(p.numel);
    for (auto& x : v) {
      switch (p.init.kind) {
        case InitRule::normal: x = p.init.a * rng.normal(); break;
        case InitRule::constant: x = p.init.a; break;
        case InitRule::uniform: x = p.init.a + (p.init.b - p.init.a) * rng.uniform(); break;
      }
    }
    if (be_.dtype() == DType::f64) {
      be_.upload(v.data(), param(i));
    } else {
      std::vector<float> f(v.begin(), v.end());
      be_.upload(f.data(), param(i));
    }
  }
}

int ParamStore::index_of(const std::string& name) const {
  for (int i = 0; i < static_cast<int>(table_.size()); ++i)
    if (table_[i].name == name) return i;
  throw RuntimeError("unknown parameter " + name);
}

Tensor ParamStore::flat(void* p) const { return Tensor(p, be_.dtype(), {total_}); }

Tensor ParamStore::view(void* p, int i) const {
  const auto& info = table_.at(i);
  return Tensor(static_cast<char*>(p) + info.offset * kernels::dtype_size(be_.dtype()), be_.dtype(),
                info.shape);
}

void ParamStore::zero_grads() { be_.zero(grads()); }

float* ParamStore::host_params() const {
  return be_.device() == kernels::Device::cpu && be_.dtype() == DType::f32 ? static_cast<float*>(params_) : nullptr;
}

float* ParamStore::host_grads() const {
  return be_.device() == kernels::Device::cpu && be_.dtype() == DType::f32 ? static_cast<float*>(grads_) : nullptr;
}

json ParamStore::table_json() const {
  json t = json::array();
  for (const auto& p : table_)
    t.push_back({{"name", p.name}, {"offset", p.offset}, {"shape", p.shape}, {"kind", to_string(p.kind)}});
  return t;
}

}  // namespace lar::trainer

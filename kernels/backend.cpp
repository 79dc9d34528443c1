#include "kernels/backend.hpp"

#include <algorithm>
#include <map>
#include <thread>

#include "core/error.hpp"

namespace lar::kernels {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::bf16: return 2;
  }
  return 0;
}

std::string to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::bf16: return "bf16";
  }
  return "?";
}

Tensor::Tensor(void* d, DType t, std::initializer_list<int64_t> shape)
    : Tensor(d, t, std::vector<int64_t>(shape)) {}

Tensor::Tensor(void* d, DType t, const std::vector<int64_t>& shape) : data(d), dtype(t) {
  if (shape.size() > 4) throw RuntimeError("Tensor: more than 4 dims");
  ndim = static_cast<int>(shape.size());
  for (int i = 0; i < ndim; ++i) dims[i] = shape[i];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
  return s + "]";
}

Tensor Tensor::view(std::initializer_list<int64_t> shape) const {
  Tensor t(data, dtype, shape);
  if (t.numel() != numel())
    throw RuntimeError("Tensor::view: " + shape_str() + " cannot become " + t.shape_str());
  return t;
}

Tensor Tensor::matrix(int64_t cols) const {
  if (cols <= 0 || numel() % cols) throw RuntimeError("Tensor::matrix: " + shape_str() + " has no " + std::to_string(cols) + " columns");
  return Tensor(data, dtype, {numel() / cols, cols});
}

Tensor Tensor::slice0(int64_t begin, int64_t count) const {
  if (ndim == 0 || begin < 0 || begin + count > dims[0])
    throw RuntimeError("Tensor::slice0 out of range on " + shape_str());
  Tensor t = *this;
  t.dims[0] = count;
  int64_t row = numel() / dims[0];
  t.data = static_cast<char*>(data) + begin * row * dtype_size(dtype);
  return t;
}

// ---- Backend defaults of the additive ops ----

void Backend::block_sum_squares(const Tensor& x, const std::vector<SumRange>& ranges, int64_t block,
                                const Tensor& out) {
  if (x.dtype != DType::f32 || out.dtype != DType::f64 || block < 1)
    throw RuntimeError(name() + ": block_sum_squares needs an f32 buffer, f64 sums and block ≥ 1");
  std::vector<double> sums(static_cast<std::size_t>(out.numel()));
  download(out, sums.data());
  for (const SumRange& r : ranges) {
    if (r.offset < 0 || r.n < 0 || r.offset + r.n > x.numel() || r.out < 0 ||
        r.out + (r.n + block - 1) / block > out.numel())
      throw RuntimeError(name() + ": block_sum_squares range outside its buffers");
    for (int64_t k = 0; k * block < r.n; ++k) {
      const int64_t n = std::min(block, r.n - k * block);
      const Tensor view(static_cast<char*>(x.data) + (r.offset + k * block) * static_cast<int64_t>(sizeof(float)),
                        DType::f32, {n});
      sums[static_cast<std::size_t>(r.out + k)] = sum_squares(view);
    }
  }
  upload(sums.data(), out);
}

void Backend::convert(const Tensor& src, const Tensor& dst) {
  if (src.dtype != dst.dtype)
    throw RuntimeError(name() + ": convert " + to_string(src.dtype) + " → " + to_string(dst.dtype) +
                       " is not supported");
  copy(src, dst);
}

void Backend::add_rmsnorm_fwd(const Tensor& x, const Tensor& r, const Tensor& h, const Tensor& w, const Tensor& y,
                              const Tensor& rstd, double eps) {
  if (h.data != x.data) copy(x, h);
  axpy(1.0, r, h);
  rmsnorm_fwd(h, w, y, rstd, eps);
}

double Backend::cross_entropy_fwd_bwd(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                                      const Tensor& losses, double grad_scale, const Tensor& dlogits) {
  const double total = cross_entropy_fwd(logits, targets, mask, losses, Tensor());
  cross_entropy_bwd(logits, targets, mask, grad_scale, dlogits);
  return total;
}

// ---- Arena ----

Arena::~Arena() {
  for (auto& b : blocks_) be_.free_bytes(b.ptr);
}

void* Arena::take(std::size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;  // every tensor 64-byte aligned
  if (!blocks_.empty() && used_ + bytes > blocks_.back().size) {
    // Overflow: first try to extend the current block in place (CUDA: mapped on demand
    // into reserved address space), in steps of 32 MiB, so one block follows the peak.
    constexpr std::size_t kGrowStep = std::size_t(32) << 20;
    const std::size_t want = (used_ + bytes + kGrowStep - 1) / kGrowStep * kGrowStep;
    if (be_.grow_bytes(blocks_.back().ptr, want)) blocks_.back().size = want;
  }
  if (blocks_.empty() || used_ + bytes > blocks_.back().size) {
    // Overflow: open a new block (old ones stay valid until reset, which coalesces).
    if (!blocks_.empty()) full_blocks_used_ += used_;
    // Blocks double up to 1 GiB, then grow by 1 GiB: the first step's blocks (all live
    // until reset coalesces them) overshoot the peak by at most about a block, not 2×.
    constexpr std::size_t kMaxGrowth = std::size_t(1) << 30;
    std::size_t size = std::max<std::size_t>(
        bytes, blocks_.empty() ? (1u << 20) : std::min(blocks_.back().size * 2, kMaxGrowth));
    blocks_.push_back({be_.alloc_growable(size), size});
    used_ = 0;
  }
  void* p = static_cast<char*>(blocks_.back().ptr) + used_;
  used_ += bytes;
  total_used_ = full_blocks_used_ + used_;
  peak_ = std::max(peak_, total_used_);
  return p;
}

Tensor Arena::alloc(DType t, std::initializer_list<int64_t> shape) {
  return alloc(t, std::vector<int64_t>(shape));
}

Tensor Arena::alloc(DType t, const std::vector<int64_t>& shape) {
  Tensor x(nullptr, t, shape);
  x.data = take(std::max<std::size_t>(x.bytes(), 1));
  return x;
}

Tensor Arena::zeros(DType t, std::initializer_list<int64_t> shape) {
  Tensor x = alloc(t, shape);
  be_.zero(x);
  return x;
}

void Arena::release(Mark m) {
  if (m.block == blocks_.size() && m.offset <= used_) {
    used_ = m.offset;
    total_used_ = full_blocks_used_ + used_;
  }
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    // Coalesce into one block that holds the peak, so the next steps never overflow.
    for (auto& b : blocks_) be_.free_bytes(b.ptr);
    blocks_.clear();
    std::size_t size = peak_ + std::min<std::size_t>(peak_ / 8, std::size_t(64) << 20);
    blocks_.push_back({be_.alloc_growable(size), size});
  }
  used_ = 0;
  full_blocks_used_ = 0;
  total_used_ = 0;
}

// ---- registry ----

namespace {
struct Registered {
  BackendFactory factory;
  std::function<bool()> usable;
};
std::map<std::string, Registered>& registry() {
  static std::map<std::string, Registered> r;
  return r;
}
}  // namespace

BackendRegistration::BackendRegistration(const std::string& name, BackendFactory factory,
                                         std::function<bool()> usable) {
  registry()[name] = {std::move(factory), std::move(usable)};
}

bool backend_available(const std::string& name) { return registry().count(name) > 0; }

bool backend_usable(const std::string& name) {
  auto it = registry().find(name);
  return it != registry().end() && (!it->second.usable || it->second.usable());
}

std::string resolve_backend(const std::string& kind) {
  // A CUDA build on a machine without a GPU (CI) runs on the CPU.
  if (kind == "auto") return backend_usable("cuda") ? "cuda" : "cpu";
  return kind;
}

std::unique_ptr<Backend> make_backend(const std::string& kind, int threads, DType dtype,
                                      const Backend::Options& options) {
  const std::string k = resolve_backend(kind);
  auto it = registry().find(k);
  if (it == registry().end())
    throw UserError("backend '" + kind + "' is not available in this build (available: " +
                    [] {
                      std::string s;
                      for (auto& [n, f] : registry()) s += (s.empty() ? "" : ", ") + n;
                      return s;
                    }() + ")");
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto be = it->second.factory(threads, dtype);
  be->set_options(options);
  return be;
}

}  // namespace lar::kernels

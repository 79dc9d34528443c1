// The CUDA backend's kernels (fp32 math, double where the CPU reference reduces in
// double; storage fp32 or, for activations in mixed precision, bf16). Written to be
// obviously right first: one warp per attention row, one block per normalisation row, no
// atomics so every result is bit-reproducible. The tensor-core bf16 paths that make it
// fast build on this and are checked against it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda.h>

#include "core/env.hpp"
#include "kernels/attention/cudnn_attention.hpp"
#include "kernels/attention/flash_attention.hpp"
#include "kernels/cuda/backend_device.cuh"
#include "kernels/cuda/cuda_backend.hpp"
#include "kernels/cuda/cuda_backend_internal.hpp"
#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/optim/optim_kernels.hpp"
#include "kernels/linear/shape.hpp"

namespace lar::kernels::cuda {

namespace {
// ---------------------------------------------------------------- elementwise
__global__ void fill_kernel(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = v;
}

__global__ void axpy_kernel(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += alpha * x[i];
}

// Element i of an fp32 or bf16 tensor as float; 16 bytes of them (4 fp32 or 8 bf16) at once.
__device__ inline float elem_f(const float* x, int64_t i) { return x[i]; }
__device__ inline float elem_f(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }
__device__ inline void vec16_f(const float* p, float (&v)[4]) {
  const float4 u = *reinterpret_cast<const float4*>(p);
  v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
}
__device__ inline void vec16_f(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x, v[2 * k + 1] = f.y;
  }
}

// Per-block partial sums of x² (double), then one block adds the partials in order. T is
// float or bf16: n counts elements of T (a bf16 tensor read as fp32 would run past its end).
template <class T>
__global__ void sum_squares_partial(const T* x, int64_t n, double* partial) {
  constexpr int kV = 16 / sizeof(T);  // elements per 16-byte load (the grad norm reads 1.4 GB)
  double acc = 0;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t nv = n / kV;
#pragma unroll 4
    for (int64_t i = tid; i < nv; i += stride) {
      float v[kV];
      vec16_f(x + i * kV, v);
#pragma unroll
      for (int e = 0; e < kV; ++e) acc += static_cast<double>(v[e]) * v[e];
    }
    done = nv * kV;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const double v = elem_f(x, i);
    acc += v * v;
  }
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Per-block counts of non-finite elements (T float or bf16).
template <class T>
__global__ void nonfinite_partial(const T* x, int64_t n, double* partial) {
  double acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    acc += isfinite(elem_f(x, i)) ? 0.0 : 1.0;
  double s = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// The partials added by one block in a fixed tree (warp shuffles, then the warps in order):
// deterministic for a fixed n. (One thread adding them in sequence waited on each load.)
__global__ void sum_partials(const double* partial, int n, double* out) {
  double v = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) v += partial[i];
  v = block_sum_d(v);
  if (threadIdx.x == 0) *out = v;
}

// One CUDA block per norm block (Backend::block_sum_squares): block b lies in the last range
// whose first block is ≤ b; tab holds (offset, n, out, first block) per range. Threads add
// strided elements in double, then block_sum_d's fixed tree: deterministic.
__global__ void block_sum_squares_kernel(const float* x, const int64_t* tab, int nr, int64_t block, double* out) {
  const int64_t b = blockIdx.x;
  int lo = 0, hi = nr - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab[4 * mid + 3] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int64_t k = b - tab[4 * lo + 3];
  const int64_t start = tab[4 * lo] + k * block, len = min(block, tab[4 * lo + 1] - k * block);
  double acc = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const double v = x[start + i];
    acc += v * v;
  }
  const double s = block_sum_d(acc);
  if (threadIdx.x == 0) out[tab[4 * lo + 2] + k] = s;
}

// Four elements per thread step (16-byte loads, 8-byte stores) where both pointers allow it:
// the scalar loop moved ≈ 2 TB/s. Grids of blocks_for((n + 3) / 4, …) threads suffice then.
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(x) & 15) | (reinterpret_cast<uintptr_t>(y) & 7)) == 0) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 v = reinterpret_cast<const float4*>(x)[i];
      reinterpret_cast<Bf16x4*>(y)[i] = Bf16x4{__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

}  // namespace

void launch_f32_to_bf16(const float* x, __nv_bfloat16* y, int64_t n, int blocks, cudaStream_t st) {
  f32_to_bf16_kernel<<<blocks, 256, 0, st>>>(x, y, n);
  LAR_CUDA_LAUNCHED();
}
void launch_bf16_to_f32(const __nv_bfloat16* x, float* y, int64_t n, int blocks, cudaStream_t st) {
  bf16_to_f32_kernel<<<blocks, 256, 0, st>>>(x, y, n);
  LAR_CUDA_LAUNCHED();
}

// ================================================================== CudaBackend

std::vector<std::pair<std::string, double>> CudaBackend::profile_report() {
  synchronize();
  auto out = prof_.report();
  // GEMM rows: calls and achieved TFLOP/s appended; their sum as one more row.
  double gemm_total = 0, gemm_flops = 0;
  int64_t gemm_calls = 0;
  for (auto& [name, secs] : out) {
    auto it = gemm_stats_.find(name);
    if (it == gemm_stats_.end()) continue;
    gemm_total += secs;
    gemm_flops += it->second.flops;
    gemm_calls += it->second.calls;
    char buf[64];
    std::snprintf(buf, sizeof buf, " ×%lld %.0f TF/s", static_cast<long long>(it->second.calls),
                  secs > 0 ? it->second.flops / secs * 1e-12 : 0.0);
    name += buf;
  }
  if (gemm_calls > 0) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "gemm (all shapes) ×%lld %.0f TF/s", static_cast<long long>(gemm_calls),
                  gemm_total > 0 ? gemm_flops / gemm_total * 1e-12 : 0.0);
    out.emplace_back(buf, gemm_total);
    std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  }
  gemm_stats_.clear();
  return out;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

CudaBackend::CudaBackend(int device) {
  LAR_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  LAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  gpu_name_ = prop.name;
  gpu_sms_ = prop.multiProcessorCount;
  smem_optin_ = prop.sharedMemPerBlockOptin;
  gpu_major_ = prop.major;
  device_ = device;
  total_mem_ = prop.totalGlobalMem;
  name_ = "cuda-f32 (" + gpu_name_ + ")";
  LAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  LAR_CUBLAS_CHECK(cublasCreate(&cublas_));
  LAR_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // Plain fp32 (no TF32) so that this path is the GPU's fp32 reference.
  LAR_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
  LAR_CUBLAS_CHECK(cublasLtCreate(&lt_));
  profile_ = profiling_enabled();
}

CudaBackend::~CudaBackend() {
  cudnn_attn_.reset();  // its cuDNN handle is bound to stream_
  if (scratch_) cudaFree(scratch_);
  if (big_scratch_) cudaFree(big_scratch_);
  if (idx_scratch_) cudaFree(idx_scratch_);
  if (rope_table_) cudaFree(rope_table_);
  if (gemm_scratch_) cudaFree(gemm_scratch_);
  if (mirror_) cudaFree(mirror_);
  gemm_plans_.clear();
  if (lt_workspace_) cudaFree(lt_workspace_);
  if (lt_) cublasLtDestroy(lt_);
  while (!growables_.empty()) free_bytes(reinterpret_cast<void*>(growables_.back()->base));
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaBackend::synchronize() { LAR_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaBackend::set_options(const Options& o) {
  if (o.precision != "auto" && o.precision != "fp32" && o.precision != "tf32" && o.precision != "mixed")
    throw UserError("precision: '" + o.precision + "' is not one of auto, fp32, tf32, mixed");
  Backend::set_options(o);
  mixed_ = o.precision != "fp32";
  bf16_gemm_ = o.precision == "mixed" || o.precision == "auto";
  // fp32 keeps pedantic fp32 GEMMs, so that path stays the GPU's fp32 reference.
  LAR_CUBLAS_CHECK(cublasSetMathMode(cublas_, mixed_ ? CUBLAS_DEFAULT_MATH : CUBLAS_PEDANTIC_MATH));
  // GEMM algorithm choice (cuda.gemm): deterministic runs never time candidates (the choice
  // would depend on the timings, the bits with it).
  const std::string& gm = o.cuda.gemm;
  if (!gm.empty() && gm != "tune" && gm != "heuristic" && gm != "cublas")
    throw UserError("cuda.gemm: '" + gm + "' is not one of heuristic, tune, cublas");
  if (gm == "tune" && o.deterministic)
    throw UserError("cuda.gemm: 'tune' picks GEMM algorithms by their timings, so the bits vary between processes; "
                    "a deterministic run takes heuristic or cublas");
  // the other kernel keys, checked here so that a bad value fails before the run starts
  (void)attention::attention_mode(o.cuda.attention);
  (void)linear::kernel_choice(o.cuda.linear_path, o.cuda.ccq_fwd, o.cuda.ccq_bwd, o.cuda.ccq_group);
  const std::string& keep = o.cuda.linear_keep;
  if (!keep.empty() && keep != "all" && keep != "p" && keep != "og")
    throw UserError("cuda.linear_keep: '" + keep + "' is not one of all, p, og");
  h200_ = gpu_sms_ == 132 && gpu_major_ == 9;  // where kH200Gemms was measured
  gemm_mode_ = gm == "cublas" ? GemmMode::cublas : gm == "tune" ? GemmMode::tune : GemmMode::heuristic;
  gemm_plans_.clear();
  name_ = std::string(!mixed_ ? "cuda-f32" : bf16_gemm_ ? "cuda-mixed-bf16" : "cuda-mixed-tf32") +
          (o.deterministic ? " deterministic" : "") + (bf16_gemm_ ? std::string(", gemm ") + gemm_mode() : "") +
          " (" + gpu_name_ + ")";
}

void CudaBackend::fill(const Tensor& t, double value) {
  require_f32(t, "fill");
  touch(t);
  fill_kernel<<<blocks_for(t.numel(), 256), 256, 0, stream_>>>(t.ptr<float>(), t.numel(), static_cast<float>(value));
  LAR_CUDA_LAUNCHED();
}

const void* CudaBackend::gemm_operand(const Tensor& t, std::size_t off) {
  if (t.dtype == DType::bf16) return t.data;
  require_f32(t, "gemm operand");
  const char* p = static_cast<const char*>(t.data);
  if (mirror_ && p >= weights_ && p + t.bytes() <= weights_ + weights_bytes_) {
    if (!mirror_fresh_) {  // one pass over all weights after each optimiser step / upload
      OpTimer timer(*this, "weights → bf16 mirror");
      const int64_t n = static_cast<int64_t>(weights_bytes_ / 4);
      f32_to_bf16_kernel<<<blocks_for((n + 3) / 4, 256), 256, 0, stream_>>>(reinterpret_cast<const float*>(weights_),
                                                                            static_cast<bf16*>(mirror_), n);
      LAR_CUDA_LAUNCHED();
      mirror_fresh_ = true;
    }
    return static_cast<const bf16*>(mirror_) + (p - weights_) / 4;
  }
  auto* dst = reinterpret_cast<bf16*>(static_cast<char*>(gemm_scratch_) + off);
  f32_to_bf16_kernel<<<blocks_for(t.numel(), 256), 256, 0, stream_>>>(t.ptr<float>(), dst, t.numel());
  LAR_CUDA_LAUNCHED();
  return dst;
}

void CudaBackend::axpy(double alpha, const Tensor& x, const Tensor& y) {
  OpTimer timer(*this, "axpy");
  require_f32(x, "axpy x");
  require_f32(y, "axpy y");
  touch(y);
  axpy_kernel<<<blocks_for(x.numel(), 256), 256, 0, stream_>>>(static_cast<float>(alpha), x.ptr<float>(),
                                                              y.ptr<float>(), x.numel());
  LAR_CUDA_LAUNCHED();
}

// Runs a per-block partial kernel (Σ x², or the count of non-finite elements) over an fp32
// or bf16 tensor and adds the partials in a fixed order on the device (deterministic for a
// fixed grid).
const double* CudaBackend::reduce_on_device(bool squares, const Tensor& x) {
  if (x.dtype != DType::f32 && x.dtype != DType::bf16)
    throw RuntimeError(std::string("cuda ") + (squares ? "sum_squares" : "all_finite") + ": needs an f32 or bf16 tensor");
  double* partial = scratch_doubles(kReduceBlocks + 1);
  const int64_t n = x.numel();
  if (x.dtype == DType::bf16) {
    if (squares) sum_squares_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<bf16>(), n, partial);
    else nonfinite_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<bf16>(), n, partial);
  } else {
    if (squares) sum_squares_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<float>(), n, partial);
    else nonfinite_partial<<<kReduceBlocks, 256, 0, stream_>>>(x.ptr<float>(), n, partial);
  }
  LAR_CUDA_LAUNCHED();
  sum_partials<<<1, 1024, 0, stream_>>>(partial, kReduceBlocks, partial + kReduceBlocks);
  LAR_CUDA_LAUNCHED();
  return partial + kReduceBlocks;
}

double CudaBackend::reduce_to_host(bool squares, const Tensor& x) {
  OpTimer timer(*this, "reduce (norms)");
  const double* total = reduce_on_device(squares, x);
  double out = 0;
  LAR_CUDA_CHECK(cudaMemcpyAsync(&out, total, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return out;
}

double CudaBackend::sum_squares(const Tensor& x) { return reduce_to_host(true, x); }

bool CudaBackend::all_finite(const Tensor& x) { return reduce_to_host(false, x) == 0; }

void CudaBackend::block_sum_squares(const Tensor& x, const std::vector<SumRange>& ranges, int64_t block,
                                    const Tensor& out) {
  OpTimer timer(*this, "reduce (norms)");
  if (x.dtype != DType::f32 || out.dtype != DType::f64 || block < 1)
    throw RuntimeError("cuda block_sum_squares: needs an f32 buffer, f64 sums and block ≥ 1");
  std::vector<int64_t> tab;
  int64_t blocks = 0;
  for (const SumRange& r : ranges) {
    const int64_t nb = (r.n + block - 1) / block;
    if (r.offset < 0 || r.n < 0 || r.offset + r.n > x.numel() || r.out < 0 || r.out + nb > out.numel())
      throw RuntimeError("cuda block_sum_squares: range outside its buffers");
    tab.insert(tab.end(), {r.offset, r.n, r.out, blocks});
    blocks += nb;
  }
  if (blocks == 0) return;
  if (blocks > std::numeric_limits<int>::max()) throw RuntimeError("cuda block_sum_squares: too many blocks");
  // The table rides in the scratch doubles (int64 and double are both 8 bytes).
  int64_t* dtab = reinterpret_cast<int64_t*>(scratch_doubles(tab.size()));
  LAR_CUDA_CHECK(cudaMemcpyAsync(dtab, tab.data(), tab.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream_));
  block_sum_squares_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream_>>>(
      x.ptr<float>(), dtab, static_cast<int>(ranges.size()), block, out.ptr<double>());
  LAR_CUDA_LAUNCHED();
}

void CudaBackend::convert(const Tensor& src, const Tensor& dst) {
  OpTimer timer(*this, "convert");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda convert: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  const int64_t n = src.numel();
  if (src.dtype == dst.dtype) {
    LAR_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, stream_));
  } else if (src.dtype == DType::f32 && dst.dtype == DType::bf16) {
    f32_to_bf16_kernel<<<blocks_for((n + 3) / 4, 256), 256, 0, stream_>>>(src.ptr<float>(), dst.ptr<bf16>(), n);
    LAR_CUDA_LAUNCHED();
  } else if (src.dtype == DType::bf16 && dst.dtype == DType::f32) {
    bf16_to_f32_kernel<<<blocks_for(n, 256), 256, 0, stream_>>>(src.ptr<bf16>(), dst.ptr<float>(), n);
    LAR_CUDA_LAUNCHED();
  } else {
    throw RuntimeError("cuda convert: " + to_string(src.dtype) + " → " + to_string(dst.dtype) + " is not supported");
  }
}

void CudaBackend::register_weights(const Tensor& flat) {
  require_f32(flat, "weights");
  if (mirror_) {
    synchronize();
    track_free(mirror_);
    LAR_CUDA_CHECK(cudaFree(mirror_));
    mirror_ = nullptr;
  }
  weights_ = static_cast<const char*>(flat.data);
  weights_bytes_ = flat.bytes();
  mirror_fresh_ = false;
  // The mirror is only used by bf16 GEMMs; allocated here so its size counts from the start.
  if (bf16_gemm_ && weights_bytes_) {
    LAR_CUDA_CHECK(cudaMalloc(&mirror_, weights_bytes_ / 2));
    track_alloc(mirror_, weights_bytes_ / 2);
  }
}

// ---- optimiser updates (kernels/cuda/optim) ----

void CudaBackend::adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                             const AdamWStep& s) {
  OpTimer timer(*this, "optimiser");
  const int64_t n = w.numel();
  if (g.numel() != n || m.numel() != n || v.numel() != n) throw RuntimeError("cuda adamw_step: sizes differ");
  // Inside the registered weights the update also writes the bf16 mirror's copy of w, so
  // the mirror stays as fresh as it was (no refresh pass after the optimiser step).
  uint16_t* mirror = nullptr;
  const char* p = static_cast<const char*>(w.data);
  if (mirror_ && p >= weights_ && p + w.bytes() <= weights_ + weights_bytes_ && (p - weights_) % 4 == 0)
    mirror = static_cast<uint16_t*>(mirror_) + (p - weights_) / 4;
  else
    touch(w);
  optim::adamw_step(w.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), n, s, mirror, stream_);
}

void CudaBackend::adamw_step_multi(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                                   const std::vector<AdamWSegment>& segments) {
  OpTimer timer(*this, "optimiser");
  for (const Tensor* t : {&w, &g, &m, &v}) require_f32(*t, "adamw_step_multi buffer");
  if (g.numel() != w.numel()) throw RuntimeError("cuda adamw_step_multi: w and g differ in size");
  for (const AdamWSegment& s : segments)
    if (s.n < 0 || s.offset < 0 || s.m_offset < 0 || s.v_offset < 0 || s.offset + s.n > w.numel() ||
        s.m_offset + s.n > m.numel() || s.v_offset + s.n > v.numel())
      throw RuntimeError("cuda adamw_step_multi: a segment lies outside its buffers");
  // Inside the registered weights the update also writes the bf16 mirror (see adamw_step).
  uint16_t* mirror = nullptr;
  const char* p = static_cast<const char*>(w.data);
  if (mirror_ && p >= weights_ && p + w.bytes() <= weights_ + weights_bytes_ && (p - weights_) % 4 == 0)
    mirror = static_cast<uint16_t*>(mirror_) + (p - weights_) / 4;
  else
    touch(w);
  optim::adamw_step_multi(w.ptr<float>(), g.ptr<float>(), m.ptr<float>(), v.ptr<float>(), segments, mirror, stream_);
}

void CudaBackend::momentum_step(const Tensor& g, const Tensor& buf, const Tensor& u, double mu, bool nesterov) {
  OpTimer timer(*this, "optimiser");
  if (buf.numel() != g.numel() || u.numel() != g.numel()) throw RuntimeError("cuda momentum_step: sizes differ");
  touch(buf);
  touch(u);
  optim::momentum_step(g.ptr<float>(), buf.ptr<float>(), u.ptr<float>(), g.numel(), static_cast<float>(mu), nesterov,
                       stream_);
}

void CudaBackend::scale(const Tensor& x, double alpha) {
  OpTimer timer(*this, "optimiser");
  touch(x);
  optim::scale(x.ptr<float>(), x.numel(), static_cast<float>(alpha), stream_);
}

void CudaBackend::transpose(const Tensor& src, const Tensor& dst, double alpha) {
  OpTimer timer(*this, "optimiser");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda transpose: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  optim::transpose(src.ptr<float>(), dst.ptr<float>(), src.rows(), src.last(), static_cast<float>(alpha), stream_);
}

void CudaBackend::normuon_normalize(const Tensor& o, const Tensor& V, double beta2, double eps) {
  OpTimer timer(*this, "optimiser");
  const int64_t rows = o.rows(), cols = o.last();
  if (V.numel() != std::max(rows, cols)) throw RuntimeError("cuda normuon_normalize: V has " + V.shape_str());
  touch(o);
  double* scratch = scratch_doubles(static_cast<std::size_t>(optim::normuon_scratch_doubles(rows, cols)));
  optim::normuon_normalize(o.ptr<float>(), V.ptr<float>(), rows, cols, beta2, eps, scratch, stream_);
}

void CudaBackend::decayed_update(const Tensor& w, const Tensor& o, double decay, double step) {
  OpTimer timer(*this, "optimiser");
  if (w.numel() != o.numel()) throw RuntimeError("cuda decayed_update: sizes differ");
  touch(w);
  optim::decayed_update(w.ptr<float>(), o.ptr<float>(), w.numel(), static_cast<float>(decay),
                        static_cast<float>(step), stream_);
}

void CudaBackend::frobenius_normalize(const Tensor& src, const Tensor& dst, bool transposed, double eps) {
  OpTimer timer(*this, "optimiser");
  require_f32(src, "frobenius_normalize");
  if (src.numel() != dst.numel()) throw RuntimeError("cuda frobenius_normalize: " + src.shape_str() + " → " + dst.shape_str());
  touch(dst);
  // sum_squares's reduction (the same partials and tree, so the same sum), left on the device.
  const double* sum_sq = reduce_on_device(true, src);
  optim::scale_by_inv_norm(src.ptr<float>(), dst.ptr<float>(), src.rows(), src.last(), transposed, sum_sq, eps,
                           stream_);
}

// Registered as "cuda"; usable only when a device is present, so `backend: auto` falls
// back to the CPU on a machine without a GPU.
static BackendRegistration reg{"cuda", [](int, DType dtype) -> std::unique_ptr<Backend> {
                                 if (dtype != DType::f32)
                                   throw RuntimeError("the cuda backend runs in f32 storage; asked for " +
                                                      to_string(dtype));
                                 if (cuda_device_count() == 0)
                                   throw RuntimeError("the cuda backend found no CUDA device");
                                 return std::make_unique<CudaBackend>(0);
                               },
                               [] { return cuda_device_count() > 0; }};

}  // namespace lar::kernels::cuda

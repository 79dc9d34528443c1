// cuDNN fused attention through the backend graph API (see cudnn_attention.hpp). The
// graphs follow the pattern cuDNN's SDPA engines match (the same operations, data types
// and virtual-tensor layouts that NVIDIA's own frontend emits for a causal, dropout-free
// SDPA): a graph that deviates from it finds no engine.
#include "kernels/attention/cudnn_attention.hpp"

#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/cuda_check.hpp"

#ifdef LAR_HAVE_CUDNN
#include <cudnn_graph.h>
#include <dlfcn.h>
#endif

namespace lar::kernels::cuda::attention {

AttentionMode attention_mode(const std::string& v) {
  if (v.empty() || v == "auto") return AttentionMode::auto_;
  if (v == "cudnn") return AttentionMode::cudnn;
  if (v == "flash") return AttentionMode::flash;
  throw UserError("cuda.attention: '" + v + "' is not one of auto, cudnn, flash");
}

bool cudnn_covers(const FlashShape& s) {
  return s.S == s.T && s.T >= 1 && s.B >= 1 && (s.D == 64 || s.D == 128) && s.Hkv >= 1 && s.Hq % s.Hkv == 0;
}

#ifdef LAR_HAVE_CUDNN

namespace {

// The cuDNN entry points, resolved from libcudnn.so.9 at first use.
struct Api {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_desc = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_desc = nullptr;
  decltype(&cudnnBackendSetAttribute) set_attr = nullptr;
  decltype(&cudnnBackendGetAttribute) get_attr = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
  long version = 0;
  std::string error;  // why it is unusable ("" when usable)
};

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      a.error = std::string("cannot load libcudnn.so.9 (") + (e ? e : "unknown") +
                "); put cuDNN 9's lib folder on LD_LIBRARY_PATH";
      return;
    }
    bool ok = true;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && ok) ok = false, a.error = std::string("libcudnn.so.9 lacks ") + name;
    };
    load(a.get_version, "cudnnGetVersion");
    load(a.error_string, "cudnnGetErrorString");
    load(a.last_error, "cudnnGetLastErrorString");
    load(a.create, "cudnnCreate");
    load(a.destroy, "cudnnDestroy");
    load(a.set_stream, "cudnnSetStream");
    load(a.create_desc, "cudnnBackendCreateDescriptor");
    load(a.destroy_desc, "cudnnBackendDestroyDescriptor");
    load(a.set_attr, "cudnnBackendSetAttribute");
    load(a.get_attr, "cudnnBackendGetAttribute");
    load(a.finalize, "cudnnBackendFinalize");
    load(a.execute, "cudnnBackendExecute");
    if (!ok) return;
    a.version = static_cast<long>(a.get_version());
    if (a.version < 90000 || a.version >= 100000) {
      a.error = "libcudnn.so.9 reports version " + std::to_string(a.version) + ", not 9.x";
      a.version = 0;
    } else if (a.version == 91000 || a.version == 91001) {  // NVIDIA's frontend refuses these too
      a.error = "cuDNN 9.10.0/9.10.1 have known bugs in bf16 SDPA; use 9.10.2 or newer";
      a.version = 0;
    }
  });
  return a;
}

[[noreturn]] void fail(cudnnStatus_t st, const char* what) {
  const Api& a = api();
  char msg[1024] = {0};
  a.last_error(msg, sizeof msg);
  throw RuntimeError(std::string("cuDNN attention: ") + what + ": " + a.error_string(st) +
                     (msg[0] ? std::string(" (") + msg + ")" : std::string()));
}

void check(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) fail(st, what);
}

using Dims = std::array<int64_t, 4>;

// Tensor unique ids: the non-virtual tensors (bound in the variant pack) first, the
// virtual ones from 100 up.
enum : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf, kDO, kDQ, kDK, kDV, kOne, kSoftmaxSum, kDQAccum, kWindow,
  kVirtual = 100
};

// Every descriptor of one operation graph, destroyed together (the plan refers to them).
class Graph {
 public:
  explicit Graph(cudnnHandle_t h) : handle_(h) {}
  ~Graph() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api().destroy_desc(*it);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = nullptr;
    check(api().create_desc(type, &d), "cudnnBackendCreateDescriptor");
    owned_.push_back(d);
    return d;
  }
  static void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  int64_t count, const void* value) {
    check(api().set_attr(d, name, type, count, value), "cudnnBackendSetAttribute");
  }
  static void set_desc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t v) {
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }
  static void finalize(cudnnBackendDescriptor_t d, const char* what) { check(api().finalize(d), what); }

  // A tensor: uid ≥ kVirtual is virtual (lives only inside the fused kernel).
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dim, const Dims& stride,
                                  bool by_value = false) {
    cudnnBackendDescriptor_t t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    const bool is_virtual = uid >= kVirtual;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim.data());
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride.data());
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    finalize(t, "tensor descriptor");
    return t;
  }
  // A virtual tensor with the next free uid.
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, const Dims& dim, const Dims& stride) {
    return tensor(next_virtual_++, type, dim, stride);
  }
  // A float scalar passed by value at execution (scale, −inf, 1, window).
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, true);
  }

  // y = op(x [, b [, t]]) elementwise (broadcasting b); axis for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t prec = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    finalize(pw, "pointwise descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    finalize(op, "pointwise operation");
    ops_.push_back(op);
  }
  // c = a · b (batched over the leading two dims, broadcasting b's heads over a's).
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(mm, "matmul descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set_desc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    finalize(op, "matmul operation");
    ops_.push_back(op);
  }
  // y = reduce(x) over the dims where y has extent 1 (or fewer heads: GQA sums).
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t rd = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    finalize(rd, "reduction descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    set_desc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    finalize(op, "reduction operation");
    ops_.push_back(op);
  }
  // y = x viewed with other dims/strides (a transpose of the last two dims here).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    set_desc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    finalize(op, "reshape operation");
    ops_.push_back(op);
  }

  // The operation graph, the heuristics' engine configs in order, and the first plan that
  // finalises. Returns false (with the reason) when no engine takes the graph.
  bool build_plan(std::string* why) {
    cudnnBackendDescriptor_t graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
        ops_.data());
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    cudnnStatus_t st = api().finalize(graph);
    if (st != CUDNN_STATUS_SUCCESS) return reason(st, "operation graph", why);
    cudnnBackendDescriptor_t heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    st = api().finalize(heur);
    if (st != CUDNN_STATUS_SUCCESS) return reason(st, "engine heuristics", why);
    int64_t count = 0;
    check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
          "heuristic results");
    if (count <= 0) {
      if (why) *why = "cuDNN heuristics found no engine for the attention graph";
      return false;
    }
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i) cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    int64_t got = 0;
    check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                         cfgs.data()),
          "heuristic results");
    std::string last;
    for (int64_t i = 0; i < got; ++i) {
      cudnnBackendDescriptor_t p = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      set(p, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
      set_desc(p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i]);
      st = api().finalize(p);
      if (st != CUDNN_STATUS_SUCCESS) {
        reason(st, "execution plan", &last);
        continue;
      }
      int64_t ws = 0, n = 0;
      check(api().get_attr(p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws),
            "plan workspace size");
      plan = p;
      workspace = static_cast<std::size_t>(ws);
      return true;
    }
    if (why) *why = "no engine config of " + std::to_string(got) + " finalised: " + last;
    return false;
  }

  cudnnBackendDescriptor_t plan = nullptr;
  std::size_t workspace = 0;

 private:
  static bool reason(cudnnStatus_t st, const char* what, std::string* why) {
    if (why) {
      char msg[1024] = {0};
      api().last_error(msg, sizeof msg);
      *why = std::string(what) + ": " + api().error_string(st) + (msg[0] ? std::string(" (") + msg + ")" : "");
    }
    return false;
  }
  cudnnHandle_t handle_;
  std::vector<cudnnBackendDescriptor_t> owned_, ops_;
  int64_t next_virtual_ = kVirtual;
};

// Layouts (cuDNN's logical order is [b, h, s, d]; ours is [b, s, h, d] in memory).
struct Layout {
  int64_t b, hq, hk, s, d;
  bool window;  // a sliding window (its length is a run-time scalar)
  explicit Layout(const FlashShape& f) : b(f.B), hq(f.Hq), hk(f.Hkv), s(f.T), d(f.D), window(f.window > 0) {}
  Dims q_dim() const { return {b, hq, s, d}; }
  Dims q_str() const { return {s * hq * d, d, hq * d, 1}; }
  Dims k_dim() const { return {b, hk, s, d}; }
  Dims k_str() const { return {s * hk * d, d, hk * d, 1}; }
  Dims kt_dim() const { return {b, hk, d, s}; }  // K (or V) seen transposed
  Dims kt_str() const { return {s * hk * d, d, 1, hk * d}; }
  Dims s_dim() const { return {b, hq, s, s}; }  // the score matrix
  Dims s_str() const { return {hq * s * s, s * s, s, 1}; }
  Dims st_dim() const { return {b, hq, s, s}; }  // its transpose (kv rows, q columns)
  Dims st_str() const { return {hq * s * s, s * s, 1, s}; }
  Dims row_dim() const { return {b, hq, s, 1}; }  // one value per query row (stats)
  Dims row_str() const { return {hq * s, s, 1, 1}; }
  Dims full_dim() const { return {b, hq, s, d}; }  // per-q-head dk / dv before the GQA sum
  Dims full_str() const { return {hq * s * d, s * d, d, 1}; }
};

// Causal mask on score x (rows are queries, columns keys): keep row ≥ col, else −inf;
// with a window (window ≠ null, the window length as a float scalar) also keep only
// col + window > row, i.e. row − col < window: cuDNN's diagonal band, as two masks.
cudnnBackendDescriptor_t causal_mask(Graph& g, const Layout& L, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t neg_inf, cudnnBackendDescriptor_t window) {
  auto row = g.virt(CUDNN_DATA_INT32, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  auto col = g.virt(CUDNN_DATA_INT32, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  auto y = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, keep, y);
  if (window == nullptr) return y;
  auto row2 = g.virt(CUDNN_DATA_INT32, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, y, nullptr, nullptr, row2, CUDNN_DATA_FLOAT, 2);
  auto col2 = g.virt(CUDNN_DATA_INT32, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, y, nullptr, nullptr, col2, CUDNN_DATA_FLOAT, 3);
  auto colw = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_ADD, col2, window, nullptr, colw);
  auto keep2 = g.virt(CUDNN_DATA_BOOLEAN, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_CMP_GT, colw, row2, nullptr, keep2, CUDNN_DATA_BOOLEAN);
  auto y2 = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, y, neg_inf, keep2, y2);
  return y2;
}

void build_fwd(Graph& g, const Layout& L) {
  auto Q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto KT = g.tensor(kK, CUDNN_DATA_BFLOAT16, L.kt_dim(), L.kt_str());
  auto V = g.tensor(kV, CUDNN_DATA_BFLOAT16, L.k_dim(), L.k_str());
  auto O = g.tensor(kO, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);
  auto window = L.window ? g.scalar(kWindow) : nullptr;

  auto S = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.matmul(Q, KT, S);
  auto Ss = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_MUL, S, scale, nullptr, Ss);
  auto Sm = causal_mask(g, L, Ss, neg_inf, window);
  // softmax with stats: max, exp(x − max), Σ, stats = max + log Σ, P = exp / Σ (bf16)
  auto mx = g.virt(CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, Sm, mx);
  auto sub = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_SUB, Sm, mx, nullptr, sub);
  auto ex = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_EXP, sub, nullptr, nullptr, ex);
  auto sum = g.virt(CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  auto lg = g.virt(CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, lg);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, lg, nullptr, stats);
  auto P = g.virt(CUDNN_DATA_BFLOAT16, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_DIV, ex, sum, nullptr, P);
  g.matmul(P, V, O);
}

void build_bwd(Graph& g, const Layout& L) {
  auto Q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto KT = g.tensor(kK, CUDNN_DATA_BFLOAT16, L.kt_dim(), L.kt_str());
  auto VT = g.tensor(kV, CUDNN_DATA_BFLOAT16, L.kt_dim(), L.kt_str());
  auto O = g.tensor(kO, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto dO = g.tensor(kDO, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  auto dQ = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, L.q_dim(), L.q_str());
  auto dK = g.tensor(kDK, CUDNN_DATA_BFLOAT16, L.k_dim(), L.k_str());
  auto dV = g.tensor(kDV, CUDNN_DATA_BFLOAT16, L.k_dim(), L.k_str());
  auto scale = g.scalar(kScale);
  auto neg_inf = g.scalar(kNegInf);
  auto one = g.scalar(kOne);
  auto window = L.window ? g.scalar(kWindow) : nullptr;
  // fp32 scratch in the workspace: Σ dO·O per row, and dQ accumulated in fp32
  auto softmax_sum = g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  auto dQ_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, L.full_dim(), L.full_str());

  // softmax_sum = Σ_d dO ⊙ O (× 1, the dropout-free scale the engine pattern expects)
  auto dOO = g.virt(CUDNN_DATA_FLOAT, L.q_dim(), {L.hq * L.s * L.d, L.s * L.d, L.hq * L.d, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, dO, O, nullptr, dOO);
  auto rs = g.virt(CUDNN_DATA_FLOAT, L.row_dim(), L.row_str());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, rs);
  g.pointwise(CUDNN_POINTWISE_MUL, rs, one, nullptr, softmax_sum);
  // P = exp(mask(scale·Q·Kᵀ − stats))
  auto S = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.matmul(Q, KT, S);
  auto Ss = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_MUL, S, scale, nullptr, Ss);
  auto Sl = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_SUB, Ss, stats, nullptr, Sl);
  auto Sm = causal_mask(g, L, Sl, neg_inf, window);
  auto P = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_EXP, Sm, nullptr, nullptr, P);
  // dV = Pᵀ · dO (summed over the query heads of a kv head under GQA)
  auto PT = g.virt(CUDNN_DATA_BFLOAT16, L.st_dim(), L.st_str());
  g.reshape(P, PT);
  if (L.hq == L.hk) {
    g.matmul(PT, dO, dV);
  } else {
    auto dVf = g.virt(CUDNN_DATA_BFLOAT16, L.full_dim(), L.full_str());
    g.matmul(PT, dO, dVf);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dVf, dV);
  }
  // dS = scale · P ⊙ (dO·Vᵀ − softmax_sum)
  auto dP = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.matmul(dO, VT, dP);
  auto dPs = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_SUB, dP, softmax_sum, nullptr, dPs);
  auto dSp = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_MUL, dPs, P, nullptr, dSp);
  auto dS = g.virt(CUDNN_DATA_FLOAT, L.s_dim(), L.s_str());
  g.pointwise(CUDNN_POINTWISE_MUL, dSp, scale, nullptr, dS);
  // dK = dSᵀ · Q
  auto dST = g.virt(CUDNN_DATA_BFLOAT16, L.st_dim(), L.st_str());
  g.reshape(dS, dST);
  if (L.hq == L.hk) {
    g.matmul(dST, Q, dK);
  } else {
    auto dKf = g.virt(CUDNN_DATA_BFLOAT16, L.full_dim(), L.full_str());
    g.matmul(dST, Q, dKf);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dKf, dK);
  }
  // dQ = dS · K, accumulated in fp32, then rounded to bf16
  auto K = g.virt(CUDNN_DATA_BFLOAT16, L.k_dim(), L.k_str());
  g.reshape(KT, K);
  g.matmul(dS, K, dQ_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dQ_accum, nullptr, nullptr, dQ);
}

std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }

// The value the mask writes: −inf from cuDNN 9.10 on, the lowest float before (what the
// engines of those versions expect).
float neg_inf_value() {
  return api().version >= 91000 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::lowest();
}

void execute(cudnnHandle_t h, const Graph& g, std::vector<int64_t> uids, std::vector<void*> ptrs, void* workspace,
             cudaStream_t stream) {
  check(api().set_stream(h, stream), "cudnnSetStream");
  cudnnBackendDescriptor_t vp = nullptr;
  check(api().create_desc(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp), "variant pack");
  struct Free {
    cudnnBackendDescriptor_t d;
    ~Free() { api().destroy_desc(d); }
  } free_vp{vp};
  Graph::set(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  Graph::set(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()),
             ptrs.data());
  Graph::set(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  Graph::finalize(vp, "variant pack");
  check(api().execute(h, g.plan, vp), "cudnnBackendExecute");
}

}  // namespace

bool cudnn_available() { return api().error.empty(); }
std::string cudnn_unavailable_reason() { return api().error; }
long cudnn_version() { return api().version; }

struct CudnnAttention::Entry {
  std::unique_ptr<Graph> fwd, bwd;
  bool ok = false;
  std::string why;
};

CudnnAttention::CudnnAttention() {
  if (!cudnn_available()) throw RuntimeError("cuDNN attention: " + cudnn_unavailable_reason());
  cudnnHandle_t h = nullptr;
  check(api().create(&h), "cudnnCreate");
  handle_ = h;
}

CudnnAttention::~CudnnAttention() {
  plans_.clear();  // the plans refer to the handle
  if (handle_) api().destroy(static_cast<cudnnHandle_t>(handle_));
}

CudnnAttention::Entry& CudnnAttention::entry(const FlashShape& s) {
  const Key key{s.B, s.T, s.Hq, s.Hkv, s.D, s.window};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto e = std::make_unique<Entry>();
  if (!cudnn_covers(s)) {
    e->why = "shape outside cuDNN's path (S != T, head dim not 64/128, or Hq % Hkv != 0)";
  } else {
    const Layout L(s);
    const auto h = static_cast<cudnnHandle_t>(handle_);
    try {
      e->fwd = std::make_unique<Graph>(h);
      build_fwd(*e->fwd, L);
      std::string why;
      if (e->fwd->build_plan(&why)) {
        e->bwd = std::make_unique<Graph>(h);
        build_bwd(*e->bwd, L);
        if (e->bwd->build_plan(&why))
          e->ok = true;
        else
          e->why = "backward: " + why;
      } else {
        e->why = "forward: " + why;
      }
    } catch (const RuntimeError& err) {
      e->why = err.what();
    }
    if (!e->ok) e->fwd.reset(), e->bwd.reset();
  }
  return *plans_.emplace(key, std::move(e)).first->second;
}

bool CudnnAttention::prepare(const FlashShape& s, std::string* why) {
  Entry& e = entry(s);
  if (!e.ok && why) *why = e.why;
  return e.ok;
}

std::size_t CudnnAttention::fwd_workspace_bytes(const FlashShape& s) {
  Entry& e = entry(s);
  if (!e.ok) throw RuntimeError("cuDNN attention: " + e.why);
  return align256(e.fwd->workspace);
}

std::size_t CudnnAttention::bwd_workspace_bytes(const FlashShape& s) {
  Entry& e = entry(s);
  if (!e.ok) throw RuntimeError("cuDNN attention: " + e.why);
  const std::size_t rows = static_cast<std::size_t>(s.B * s.Hq * s.T);
  return align256(e.bwd->workspace) + align256(rows * sizeof(float)) +
         align256(rows * static_cast<std::size_t>(s.D) * sizeof(float));
}

void CudnnAttention::fwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, __nv_bfloat16* o, float* lse, void* workspace,
                         cudaStream_t stream) {
  Entry& e = entry(s);
  if (!e.ok) throw RuntimeError("cuDNN attention: " + e.why);
  float scale = static_cast<float>(s.scale), neg_inf = neg_inf_value(), window = static_cast<float>(s.window);
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  std::vector<void*> ptrs{const_cast<__nv_bfloat16*>(q), const_cast<__nv_bfloat16*>(k), const_cast<__nv_bfloat16*>(v),
                          o, lse, &scale, &neg_inf};
  if (s.window > 0) uids.push_back(kWindow), ptrs.push_back(&window);
  execute(static_cast<cudnnHandle_t>(handle_), *e.fwd, std::move(uids), std::move(ptrs), workspace, stream);
}

void CudnnAttention::bwd(const FlashShape& s, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const __nv_bfloat16* o, const float* lse,
                         const __nv_bfloat16* dout, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                         void* workspace, cudaStream_t stream) {
  Entry& e = entry(s);
  if (!e.ok) throw RuntimeError("cuDNN attention: " + e.why);
  const std::size_t rows = static_cast<std::size_t>(s.B * s.Hq * s.T);
  char* ws = static_cast<char*>(workspace);
  void* softmax_sum = ws + align256(e.bwd->workspace);
  void* dq_accum = ws + align256(e.bwd->workspace) + align256(rows * sizeof(float));
  // cuDNN clears its fp32 dQ accumulator itself from 9.6 on; earlier versions need it zeroed.
  if (api().version < 90600)
    LAR_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, rows * static_cast<std::size_t>(s.D) * sizeof(float), stream));
  float scale = static_cast<float>(s.scale), neg_inf = neg_inf_value(), one = 1.0f,
        window = static_cast<float>(s.window);
  auto cp = [](const void* p) { return const_cast<void*>(p); };
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kNegInf, kOne, kSoftmaxSum, kDQAccum};
  std::vector<void*> ptrs{cp(q), cp(k), cp(v),    cp(o),   cp(dout),    cp(lse),    dq,
                          dk,    dv,    &scale,   &neg_inf, &one,      softmax_sum, dq_accum};
  if (s.window > 0) uids.push_back(kWindow), ptrs.push_back(&window);
  execute(static_cast<cudnnHandle_t>(handle_), *e.bwd, std::move(uids), std::move(ptrs),
          e.bwd->workspace ? workspace : nullptr, stream);
}

#else  // !LAR_HAVE_CUDNN: the build has no cuDNN headers; every caller takes the flash path.

bool cudnn_available() { return false; }
std::string cudnn_unavailable_reason() { return "this build has no cuDNN (LAR_HAVE_CUDNN unset)"; }
long cudnn_version() { return 0; }

struct CudnnAttention::Entry {};
CudnnAttention::CudnnAttention() { throw RuntimeError("cuDNN attention: " + cudnn_unavailable_reason()); }
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::prepare(const FlashShape&, std::string* why) {
  if (why) *why = cudnn_unavailable_reason();
  return false;
}
std::size_t CudnnAttention::fwd_workspace_bytes(const FlashShape&) { return 0; }
std::size_t CudnnAttention::bwd_workspace_bytes(const FlashShape&) { return 0; }
void CudnnAttention::fwd(const FlashShape&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                         __nv_bfloat16*, float*, void*, cudaStream_t) {
  throw RuntimeError("cuDNN attention: " + cudnn_unavailable_reason());
}
void CudnnAttention::bwd(const FlashShape&, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                         const __nv_bfloat16*, const float*, const __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*,
                         __nv_bfloat16*, void*, cudaStream_t) {
  throw RuntimeError("cuDNN attention: " + cudnn_unavailable_reason());
}

#endif  // LAR_HAVE_CUDNN

}  // namespace lar::kernels::cuda::attention

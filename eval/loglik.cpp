#include "eval/loglik.hpp"

#include <algorithm>
#include <numeric>

#include "core/error.hpp"

namespace lar::eval {

namespace {

struct Row {
  std::vector<int32_t> tokens;  // the sequence, ≤ max_len + 1 tokens
  size_t first_scored = 0;      // index into tokens of the first continuation token
};

void check_vocab(const std::vector<int32_t>& t, int vocab) {
  for (int32_t id : t)
    if (id < 0 || id >= vocab)
      throw UserError("token id " + std::to_string(id) + " is outside the model's vocabulary (model.vocab_size " +
                      std::to_string(vocab) + ")");
}

// Rows [begin, end) of `order` as one batch: inputs tokens[0..n-2], targets tokens[1..n-1].
data::Batch make_batch(const std::vector<Row>& rows, const std::vector<size_t>& idx) {
  size_t T = 1;
  for (size_t i : idx) T = std::max(T, rows[i].tokens.size() - 1);
  data::Batch b;
  b.batch = static_cast<int>(idx.size());
  b.seq_len = static_cast<int>(T);
  b.inputs.assign(idx.size() * T, 0);
  b.targets.assign(idx.size() * T, 0);
  b.loss_mask.assign(idx.size() * T, 0.f);
  for (size_t r = 0; r < idx.size(); ++r) {
    const auto& t = rows[idx[r]].tokens;
    for (size_t p = 0; p + 1 < t.size(); ++p) {
      b.inputs[r * T + p] = t[p];
      b.targets[r * T + p] = t[p + 1];
      b.loss_mask[r * T + p] = 1.f;
    }
  }
  return b;
}

}  // namespace

std::vector<Scored> score(trainer::Model& model, const std::vector<Request>& requests, const ScoreOptions& o) {
  if (o.max_len < 1) throw UserError("max length must be ≥ 1, got " + std::to_string(o.max_len));
  const int vocab = model.shape().vocab;
  std::vector<Row> rows(requests.size());
  std::vector<Scored> out(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& q = requests[i];
    if (q.context.empty()) throw RuntimeError("loglikelihood request without context");
    check_vocab(q.context, vocab);
    check_vocab(q.continuation, vocab);
    if (q.continuation.size() > static_cast<size_t>(o.max_len))
      throw UserError("a continuation of " + std::to_string(q.continuation.size()) +
                      " tokens does not fit the maximum length " + std::to_string(o.max_len));
    std::vector<int32_t> full = q.context;
    full.insert(full.end(), q.continuation.begin(), q.continuation.end());
    const size_t keep = std::min(full.size(), static_cast<size_t>(o.max_len) + 1);
    out[i].dropped_context = static_cast<int>(full.size() - keep);
    rows[i].tokens.assign(full.end() - static_cast<std::ptrdiff_t>(keep), full.end());
    rows[i].first_scored = keep - q.continuation.size();
  }
  // Longest first, so that rows of similar lengths share a batch (less padding).
  std::vector<size_t> order(rows.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return rows[a].tokens.size() > rows[b].tokens.size(); });
  const size_t B = static_cast<size_t>(std::max(1, o.batch));
  std::vector<int32_t> pred;
  std::vector<double> nll, top_nll;
  for (size_t s = 0; s < order.size(); s += B) {
    std::vector<size_t> idx(order.begin() + s, order.begin() + std::min(order.size(), s + B));
    data::Batch b = make_batch(rows, idx);
    model.evaluate(b, &pred, &nll);
    if (o.top) {  // the same inputs scored against the model's own argmax
      data::Batch bt = b;
      bt.targets = pred;
      model.evaluate(bt, nullptr, &top_nll);
    }
    const size_t T = b.seq_len;
    for (size_t r = 0; r < idx.size(); ++r) {
      const Row& row = rows[idx[r]];
      Scored& sc = out[idx[r]];
      sc.greedy = true;
      for (size_t k = row.first_scored; k < row.tokens.size(); ++k) {
        const size_t p = r * T + (k - 1);  // position predicting tokens[k]
        sc.token_logprobs.push_back(-nll[p]);
        sc.logprob += -nll[p];
        sc.argmax.push_back(pred[p]);
        if (pred[p] != row.tokens[k]) sc.greedy = false;
        if (o.top) sc.top_logprobs.push_back(-top_nll[p]);
      }
    }
  }
  return out;
}

std::vector<std::vector<int32_t>> generate(trainer::Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                           int max_tokens, int max_len, int batch, int32_t stop) {
  if (max_len < 1) throw UserError("max length must be ≥ 1, got " + std::to_string(max_len));
  const int vocab = model.shape().vocab;
  std::vector<std::vector<int32_t>> out(prompts.size());
  const size_t B = static_cast<size_t>(std::max(1, batch));
  std::vector<int32_t> pred;
  for (size_t s = 0; s < prompts.size(); s += B) {
    const size_t n = std::min(prompts.size(), s + B) - s;
    std::vector<std::vector<int32_t>> seq(n);
    std::vector<bool> done(n, false);
    for (size_t r = 0; r < n; ++r) {
      if (prompts[s + r].empty()) throw RuntimeError("generation needs a non-empty prompt");
      check_vocab(prompts[s + r], vocab);
      seq[r] = prompts[s + r];
    }
    for (int step = 0; step < max_tokens; ++step) {
      // Each row's window: its last max_len tokens.
      size_t T = 1;
      for (size_t r = 0; r < n; ++r) T = std::max(T, std::min(seq[r].size(), static_cast<size_t>(max_len)));
      data::Batch b;
      b.batch = static_cast<int>(n);
      b.seq_len = static_cast<int>(T);
      b.inputs.assign(n * T, 0);
      b.targets.assign(n * T, 0);
      b.loss_mask.assign(n * T, 0.f);
      std::vector<size_t> last(n);
      for (size_t r = 0; r < n; ++r) {
        const size_t len = std::min(seq[r].size(), static_cast<size_t>(max_len));
        std::copy(seq[r].end() - static_cast<std::ptrdiff_t>(len), seq[r].end(), b.inputs.begin() + r * T);
        last[r] = r * T + len - 1;
      }
      model.evaluate(b, &pred);
      bool all_done = true;
      for (size_t r = 0; r < n; ++r) {
        if (done[r]) continue;
        const int32_t t = pred[last[r]];
        if (t == stop) {
          done[r] = true;
          continue;
        }
        seq[r].push_back(t);
        out[s + r].push_back(t);
        all_done = false;
      }
      if (all_done) break;
    }
  }
  return out;
}

}  // namespace lar::eval

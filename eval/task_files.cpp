#include "eval/task_files.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/hash.hpp"
#include "eval/loglik.hpp"

namespace lar::eval {

namespace fs = std::filesystem;

std::string to_string(TaskKind k) {
  switch (k) {
    case TaskKind::multiple_choice: return "multiple_choice";
    case TaskKind::lambada: return "lambada";
    case TaskKind::perplexity: return "perplexity";
  }
  return "?";
}

namespace {

struct Line {
  long number = 0;
  json value;
};

bool is_jsonl(const fs::path& p) {
  const std::string e = p.extension().string();
  return e == ".jsonl" || e == ".json" || e == ".ndjson";
}

// Every non-empty line parsed; UserError FILE:LINE:COL on the first bad one.
std::vector<Line> read_jsonl(const fs::path& path, const std::string& text) {
  std::vector<Line> out;
  size_t pos = 0;
  long number = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    ++number;
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      out.push_back({number, json::parse(line)});
    } catch (const json::parse_error& e) {
      throw UserError(path.string() + ":" + std::to_string(number) + ":" + std::to_string(std::max<size_t>(1, e.byte)) +
                      ": not valid JSON: " + e.what());
    }
    if (!out.back().value.is_object())
      throw UserError(path.string() + ":" + std::to_string(number) + ":1: expected a JSON object per line");
  }
  if (out.empty()) throw UserError(path.string() + ": no documents (the file is empty)");
  return out;
}

std::string where(const TaskFile& t, const Line& l, const std::string& key) {
  return t.path.string() + ":" + std::to_string(l.number) + ":1: " + key;
}

const json& need(const TaskFile& t, const Line& l, const char* key, json::value_t type, const char* what) {
  if (!l.value.contains(key)) throw UserError(where(t, l, key) + ": missing (expected " + what + ")");
  const json& v = l.value.at(key);
  const bool ok = type == json::value_t::number_integer ? v.is_number_integer() : v.type() == type;
  if (!ok) throw UserError(where(t, l, key) + ": expected " + what + ", got " + v.dump());
  return v;
}

// The tokens before a document: the separator, as lm-eval's empty-context prefix.
std::vector<int32_t> prefix_of(const data::Tokenizer& tok) {
  if (tok.eod_id() >= 0) return {tok.eod_id()};
  return {};
}

// lm-eval's split of (context, continuation): trailing spaces of the context move to the
// continuation; the continuation's tokens are those of the whole string past the
// context's (so a SentencePiece merge across the boundary is scored as it would be read).
Request make_request(const data::Tokenizer& tok, std::string ctx, std::string cont) {
  while (!ctx.empty() && ctx.back() == ' ') {
    ctx.pop_back();
    cont.insert(cont.begin(), ' ');
  }
  Request q;
  std::vector<int32_t> whole, c;
  tok.encode(ctx + cont, whole);
  tok.encode(ctx, c);
  size_t n = std::min(c.size(), whole.size());
  while (n > 0 && !std::equal(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(n), whole.begin())) --n;
  q.context = prefix_of(tok);
  q.context.insert(q.context.end(), whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(n));
  q.continuation.assign(whole.begin() + static_cast<std::ptrdiff_t>(n), whole.end());
  if (q.context.empty() && !q.continuation.empty()) {  // no separator token: the first token is given
    q.context.push_back(q.continuation.front());
    q.continuation.erase(q.continuation.begin());
  }
  return q;
}

long word_count(const std::string& s) {
  long n = 0;
  bool in = false;
  for (unsigned char ch : s) {
    const bool space = std::isspace(ch) != 0;
    if (!space && !in) ++n;
    in = !space;
  }
  return n;
}

json score_multiple_choice(LoadedRun& run, const TaskFile& t, const std::vector<Line>& lines, const TaskOptions& o,
                           json* samples) {
  const auto& tok = run.tokenizer();
  std::vector<Request> reqs;
  struct Doc {
    size_t first = 0, count = 0;
    int gold = 0;
    std::vector<double> norm_bytes;
  };
  std::vector<Doc> docs;
  for (const auto& l : lines) {
    Doc d;
    d.first = reqs.size();
    const json& gold = need(t, l, "gold", json::value_t::number_integer, "the index of the right choice");
    if (l.value.contains("contexts")) {
      const json& ctxs = need(t, l, "contexts", json::value_t::array, "a list of contexts");
      const std::string cont = need(t, l, "continuation", json::value_t::string, "a string").get<std::string>();
      for (const auto& c : ctxs) {
        if (!c.is_string()) throw UserError(where(t, l, "contexts") + ": expected strings, got " + c.dump());
        reqs.push_back(make_request(tok, c.get<std::string>(), " " + cont));
        d.norm_bytes.push_back(static_cast<double>(std::max<size_t>(1, cont.size())));
      }
    } else {
      const std::string ctx = need(t, l, "context", json::value_t::string, "a string").get<std::string>();
      const json& choices = need(t, l, "choices", json::value_t::array, "a list of strings");
      const std::string delim = l.value.value("delimiter", std::string(" "));
      for (const auto& c : choices) {
        if (!c.is_string()) throw UserError(where(t, l, "choices") + ": expected strings, got " + c.dump());
        const std::string ch = c.get<std::string>();
        reqs.push_back(make_request(tok, ctx, delim + ch));
        d.norm_bytes.push_back(static_cast<double>(std::max<size_t>(1, ch.size())));
      }
    }
    d.count = reqs.size() - d.first;
    if (d.count < 2) throw UserError(where(t, l, "choices") + ": needs at least 2 choices");
    d.gold = gold.get<int>();
    if (d.gold < 0 || d.gold >= static_cast<int>(d.count))
      throw UserError(where(t, l, "gold") + ": " + std::to_string(d.gold) + " is not the index of one of the " +
                      std::to_string(d.count) + " choices");
    docs.push_back(std::move(d));
  }
  auto scored = score(run.model(), reqs, {o.batch, o.max_len, false});
  double acc = 0, acc_norm = 0;
  for (size_t i = 0; samples && i < docs.size(); ++i)
    for (size_t k = 0; k < docs[i].count; ++k) {
      const Scored& sc = scored[docs[i].first + k];
      samples->push_back({{"task", t.name}, {"doc", i}, {"line", lines[i].number}, {"choice", k},
                          {"gold", docs[i].gold}, {"logprob", sc.logprob}, {"greedy", sc.greedy},
                          {"tokens", sc.token_logprobs.size()}});
    }
  for (const auto& d : docs) {
    size_t best = 0, best_norm = 0;
    for (size_t k = 1; k < d.count; ++k) {
      if (scored[d.first + k].logprob > scored[d.first + best].logprob) best = k;
      if (scored[d.first + k].logprob / d.norm_bytes[k] > scored[d.first + best_norm].logprob / d.norm_bytes[best_norm])
        best_norm = k;
    }
    acc += best == static_cast<size_t>(d.gold);
    acc_norm += best_norm == static_cast<size_t>(d.gold);
  }
  const double n = static_cast<double>(docs.size());
  return {{"n", docs.size()}, {"acc", acc / n}, {"acc_norm", acc_norm / n}};
}

json score_lambada(LoadedRun& run, const TaskFile& t, const std::vector<Line>& lines, const TaskOptions& o,
                   json* samples) {
  const auto& tok = run.tokenizer();
  std::vector<Request> reqs;
  for (const auto& l : lines) {
    std::string text = need(t, l, "text", json::value_t::string, "a string").get<std::string>();
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    const size_t sp = text.find_last_of(' ');
    if (sp == std::string::npos || sp == 0)
      throw UserError(where(t, l, "text") + ": needs a context and a last word separated by a space");
    reqs.push_back(make_request(tok, text.substr(0, sp), text.substr(sp)));
  }
  auto scored = score(run.model(), reqs, {o.batch, o.max_len, false});
  double acc = 0, ll = 0;
  for (size_t i = 0; samples && i < scored.size(); ++i)
    samples->push_back({{"task", t.name}, {"doc", i}, {"line", lines[i].number}, {"logprob", scored[i].logprob},
                        {"greedy", scored[i].greedy}, {"tokens", scored[i].token_logprobs.size()}});
  for (const auto& s : scored) {
    acc += s.greedy;
    ll += s.logprob;
  }
  const double n = static_cast<double>(scored.size());
  return {{"n", scored.size()}, {"acc", acc / n}, {"ppl", std::exp(-ll / n)}};
}

json score_perplexity(LoadedRun& run, const std::vector<std::string>& docs, const TaskOptions& o) {
  const auto& tok = run.tokenizer();
  std::vector<Request> reqs;
  long words = 0, bytes = 0, tokens = 0;
  for (const auto& doc : docs) {
    words += word_count(doc);
    bytes += static_cast<long>(doc.size());
    std::vector<int32_t> ids = prefix_of(tok);
    const size_t pre = ids.size();
    tok.encode(doc, ids);
    // Rolling windows: each predicts the next max_len tokens given what precedes them (the
    // scorer keeps the last max_len + 1 tokens of context + continuation).
    size_t s = pre == 0 ? 1 : pre;
    while (s < ids.size()) {
      const size_t n = std::min(static_cast<size_t>(o.max_len), ids.size() - s);
      Request q;
      q.context.assign(ids.begin() + static_cast<std::ptrdiff_t>(s > static_cast<size_t>(o.max_len) ? s - o.max_len : 0),
                       ids.begin() + static_cast<std::ptrdiff_t>(s));
      q.continuation.assign(ids.begin() + static_cast<std::ptrdiff_t>(s), ids.begin() + static_cast<std::ptrdiff_t>(s + n));
      tokens += static_cast<long>(n);
      reqs.push_back(std::move(q));
      s += n;
    }
  }
  auto scored = score(run.model(), reqs, {o.batch, o.max_len, false});
  double nll = 0;
  for (const auto& sc : scored) nll -= sc.logprob;
  const double inf = std::numeric_limits<double>::infinity();
  return {{"n", docs.size()},
          {"words", words},
          {"bytes", bytes},
          {"tokens", tokens},
          {"ppl", words > 0 ? std::exp(nll / words) : inf},
          {"byte_ppl", bytes > 0 ? std::exp(nll / bytes) : inf},
          {"bits_per_byte", bytes > 0 ? nll / bytes / std::log(2.0) : inf},
          {"token_ppl", tokens > 0 ? std::exp(nll / tokens) : inf}};
}

}  // namespace

TaskFile open_task_file(const std::string& arg) {
  TaskFile t;
  std::string file = arg;
  const size_t eq = arg.find('=');
  if (eq != std::string::npos && eq > 0) {
    t.name = arg.substr(0, eq);
    file = arg.substr(eq + 1);
  }
  if (file.empty()) throw UserError("--task '" + arg + "': no file given (expected [NAME=]FILE)");
  std::error_code ec;
  t.path = fs::absolute(file, ec);
  if (!fs::is_regular_file(t.path, ec)) throw UserError("--task " + file + ": no such file");
  if (t.name.empty()) {
    t.name = t.path.stem().string();
    std::transform(t.name.begin(), t.name.end(), t.name.begin(), [](unsigned char c) { return std::tolower(c); });
  }
  for (char c : t.name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'))
      throw UserError("--task " + arg + ": task name '" + t.name + "' may hold only letters, digits, '_' and '-'");
  const std::string text = read_file(t.path);
  t.sha256 = sha256_hex(text);
  if (!is_jsonl(t.path)) {
    t.kind = TaskKind::perplexity;
    return t;
  }
  const auto lines = read_jsonl(t.path, text);
  const json& first = lines.front().value;
  if (first.contains("choices") || first.contains("contexts"))
    t.kind = TaskKind::multiple_choice;
  else if (first.contains("text"))
    t.kind = t.name.rfind("lambada", 0) == 0 ? TaskKind::lambada : TaskKind::perplexity;
  else
    throw UserError(t.path.string() + ":" + std::to_string(lines.front().number) +
                    ":1: cannot tell the task's shape: expected \"context\" + \"choices\" + \"gold\", \"contexts\" + "
                    "\"continuation\" + \"gold\", or \"text\"");
  return t;
}

json run_task(LoadedRun& run, const TaskFile& task, const TaskOptions& opts, json* samples) {
  TaskOptions o = opts;
  if (o.max_len <= 0) o.max_len = run.train_length();
  const std::string text = read_file(task.path);
  if (sha256_hex(text) != task.sha256) throw UserError(task.path.string() + ": changed while being evaluated");
  json r;
  if (task.kind == TaskKind::perplexity && !is_jsonl(task.path)) {
    r = score_perplexity(run, {text}, o);
  } else {
    auto lines = read_jsonl(task.path, text);
    if (o.limit > 0 && static_cast<long>(lines.size()) > o.limit) lines.resize(static_cast<size_t>(o.limit));
    if (task.kind == TaskKind::multiple_choice) {
      r = score_multiple_choice(run, task, lines, o, samples);
    } else if (task.kind == TaskKind::lambada) {
      r = score_lambada(run, task, lines, o, samples);
    } else {
      std::vector<std::string> docs;
      for (const auto& l : lines) docs.push_back(need(task, l, "text", json::value_t::string, "a string").get<std::string>());
      r = score_perplexity(run, docs, o);
    }
  }
  r["kind"] = to_string(task.kind);
  r["max_len"] = o.max_len;
  return r;
}

}  // namespace lar::eval

#include "eval/completions.hpp"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <mutex>

#include "core/error.hpp"
#include "eval/loglik.hpp"

namespace lar::eval {

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

bool loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

// The prompts of a request as token lists.
std::vector<std::vector<int32_t>> prompts_of(const json& p, const data::Tokenizer& tok) {
  std::vector<std::vector<int32_t>> out;
  auto text = [&](const std::string& s) {
    std::vector<int32_t> ids;
    tok.encode(s, ids);
    return ids;
  };
  auto ints = [&](const json& a) {
    std::vector<int32_t> ids;
    for (const auto& v : a) {
      if (!v.is_number_integer()) throw UserError("prompt: token lists hold integers, got " + v.dump());
      ids.push_back(v.get<int32_t>());
    }
    return ids;
  };
  if (p.is_string()) {
    out.push_back(text(p.get<std::string>()));
  } else if (p.is_array() && !p.empty() && p.front().is_number_integer()) {
    out.push_back(ints(p));
  } else if (p.is_array() && !p.empty()) {
    for (const auto& e : p) {
      if (e.is_string()) out.push_back(text(e.get<std::string>()));
      else if (e.is_array()) out.push_back(ints(e));
      else throw UserError("prompt: expected strings or token lists, got " + e.dump());
    }
  } else {
    throw UserError("prompt: expected a string, a list of strings, or token lists");
  }
  for (const auto& ids : out)
    if (ids.empty()) throw UserError("prompt: an empty prompt cannot be scored or continued");
  return out;
}

// The text of token k of `ids`: what decoding it adds after the tokens before it (a few
// tokens of context keep SentencePiece's word-initial spaces, which a lone piece loses).
std::string piece_text(const data::Tokenizer& tok, const std::vector<int32_t>& ids, size_t k) {
  const size_t from = k >= 8 ? k - 8 : 0;
  if (from == k) return tok.decode({ids[k]});
  const std::string before = tok.decode(std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.begin() + static_cast<std::ptrdiff_t>(k)));
  const std::string with = tok.decode(std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.begin() + static_cast<std::ptrdiff_t>(k + 1)));
  if (with.compare(0, before.size(), before) == 0) return with.substr(before.size());
  return tok.decode({ids[k]});
}

}  // namespace

json complete(LoadedRun& run, const json& req, const CompletionsOptions& o) {
  if (!req.is_object()) throw UserError("the request body must be a JSON object");
  if (!req.contains("prompt")) throw UserError("prompt: required");
  const auto& tok = run.tokenizer();
  const auto prompts = prompts_of(req.at("prompt"), tok);
  const int max_len = o.max_len > 0 ? o.max_len : run.train_length();
  auto get_int = [&](const char* k, int def, int lo, int hi) {
    if (!req.contains(k) || req.at(k).is_null()) return def;
    if (!req.at(k).is_number_integer()) throw UserError(std::string(k) + ": expected an integer, got " + req.at(k).dump());
    const int v = req.at(k).get<int>();
    if (v < lo || v > hi) throw UserError(fmt::format("{}: {} is outside [{}, {}]", k, v, lo, hi));
    return v;
  };
  const int max_tokens = get_int("max_tokens", 16, 0, 1 << 16);
  const bool want_logprobs = req.contains("logprobs") && !req.at("logprobs").is_null();
  const int top_n = get_int("logprobs", 0, 0, 5);
  if (top_n > 1) throw UserError("logprobs: this server returns the top 1 alternative at most, got " + std::to_string(top_n));
  const bool echo = req.value("echo", false);
  if (req.contains("temperature") && !req.at("temperature").is_null()) {
    if (!req.at("temperature").is_number()) throw UserError("temperature: expected a number");
    if (req.at("temperature").get<double>() != 0.0)
      throw UserError("temperature: only greedy decoding (temperature 0) is served");
  }
  if (get_int("n", 1, 1, 1) != 1) throw UserError("n: one completion per prompt");
  std::vector<std::string> stops;
  if (req.contains("stop") && !req.at("stop").is_null()) {
    const json& s = req.at("stop");
    if (s.is_string()) stops.push_back(s.get<std::string>());
    else if (s.is_array())
      for (const auto& e : s) {
        if (!e.is_string()) throw UserError("stop: expected strings");
        stops.push_back(e.get<std::string>());
      }
    else throw UserError("stop: expected a string or a list of strings");
  }

  std::vector<std::vector<int32_t>> gen(prompts.size());
  if (max_tokens > 0) gen = generate(run.model(), prompts, max_tokens, max_len, o.batch, tok.eod_id());
  json choices = json::array();
  std::vector<std::string> texts(prompts.size()), finish(prompts.size(), "length");
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (max_tokens > 0 && static_cast<int>(gen[i].size()) < max_tokens) finish[i] = "stop";
    std::string t = tok.decode(gen[i]);
    size_t cut = std::string::npos;
    for (const auto& s : stops)
      if (!s.empty()) cut = std::min(cut, t.find(s));
    if (cut != std::string::npos) {
      t.resize(cut);
      finish[i] = "stop";
      // Keep the generated tokens that the text still covers.
      std::vector<int32_t> kept;
      for (int32_t id : gen[i]) {
        std::vector<int32_t> probe = kept;
        probe.push_back(id);
        if (tok.decode(probe).size() > t.size()) break;
        kept = std::move(probe);
      }
      gen[i] = kept;
    }
    texts[i] = t;
  }
  // Log-probabilities of the echoed prompt and/or the generated tokens: every token after
  // the first of prompt + generation, scored as one sequence.
  std::vector<Scored> scored;
  if (want_logprobs) {
    std::vector<Request> reqs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Request q;
      q.context = {prompts[i].front()};
      q.continuation.assign(prompts[i].begin() + 1, prompts[i].end());
      q.continuation.insert(q.continuation.end(), gen[i].begin(), gen[i].end());
      reqs.push_back(std::move(q));
    }
    scored = score(run.model(), reqs, {o.batch, max_len, top_n > 0});
  }
  long prompt_tokens = 0, completion_tokens = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompt_tokens += static_cast<long>(prompts[i].size());
    completion_tokens += static_cast<long>(gen[i].size());
    json c = {{"index", i}, {"finish_reason", finish[i]}};
    c["text"] = echo ? tok.decode(prompts[i]) + texts[i] : texts[i];
    if (!want_logprobs) {
      c["logprobs"] = nullptr;
    } else {
      // Positions: 0 is the prompt's first token (no log-probability), then the scored ones.
      std::vector<int32_t> all = prompts[i];
      all.insert(all.end(), gen[i].begin(), gen[i].end());
      const size_t from = echo ? 0 : prompts[i].size();
      json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
      size_t offset = 0;
      for (size_t k = 0; k < all.size(); ++k) {
        const std::string piece = piece_text(tok, all, k);
        if (k >= from) {
          tokens.push_back(piece);
          offsets.push_back(offset);
          const Scored& s = scored[i];
          if (k == 0) {
            lps.push_back(nullptr);
            tops.push_back(nullptr);
          } else {
            lps.push_back(s.token_logprobs[k - 1]);
            if (top_n > 0) tops.push_back({{tok.decode({s.argmax[k - 1]}), s.top_logprobs[k - 1]}});
            else tops.push_back(json::object());
          }
        }
        offset += piece.size();
      }
      c["logprobs"] = {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
    }
    choices.push_back(c);
  }
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch());
  return {{"id", fmt::format("cmpl-{}", now.count())},
          {"object", "text_completion"},
          {"created", now.count()},
          {"model", o.model_name},
          {"choices", choices},
          {"usage",
           {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens}}}};
}

struct CompletionsServer::Impl {
  LoadedRun& run;
  CompletionsOptions opt;
  httplib::Server http;
  std::mutex model_mutex;  // one request on the model at a time
  int port = -1;
  Impl(LoadedRun& r, CompletionsOptions o) : run(r), opt(std::move(o)) {}

  void error(httplib::Response& res, int status, const std::string& msg, const char* type) {
    res.status = status;
    res.set_content(dump({{"error", {{"message", msg}, {"type", type}, {"param", nullptr}, {"code", nullptr}}}}),
                    "application/json");
  }

  void routes() {
    http.set_payload_max_length(64 * 1024 * 1024);
    http.set_read_timeout(60, 0);
    http.set_tcp_nodelay(true);
    http.new_task_queue = [] { return new httplib::ThreadPool(4); };
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump({{"object", "list"},
                            {"data", json::array({{{"id", opt.model_name}, {"object", "model"}, {"owned_by", "lar"}}})}}),
                      "application/json");
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      json body;
      try {
        body = json::parse(req.body);
      } catch (const json::parse_error& e) {
        return error(res, 400, std::string("the body is not valid JSON: ") + e.what(), "invalid_request_error");
      }
      try {
        std::lock_guard<std::mutex> lock(model_mutex);
        res.set_content(dump(complete(run, body, opt)), "application/json");
      } catch (const UserError& e) {
        error(res, 400, e.what(), "invalid_request_error");
      } catch (const std::exception& e) {
        std::cerr << "lar serve-model: " << e.what() << "\n";
        error(res, 500, "internal error (see the server's log)", "server_error");
      }
    });
  }
};

CompletionsServer::CompletionsServer(LoadedRun& run, CompletionsOptions o) : impl_(std::make_unique<Impl>(run, std::move(o))) {
  if (!impl_->opt.allow_remote && !loopback(impl_->opt.host))
    throw UserError("--host " + impl_->opt.host + " is not a loopback address; add --allow-remote to serve other machines");
  impl_->routes();
}

CompletionsServer::~CompletionsServer() = default;

void CompletionsServer::bind() {
  auto& i = *impl_;
  i.port = i.opt.port == 0 ? i.http.bind_to_any_port(i.opt.host)
                           : (i.http.bind_to_port(i.opt.host, i.opt.port) ? i.opt.port : -1);
  if (i.port <= 0)
    throw RuntimeError(fmt::format("cannot listen on {}:{} (in use, or not an address of this machine)", i.opt.host, i.opt.port));
}

std::string CompletionsServer::url() const {
  const std::string& h = impl_->opt.host;
  return fmt::format("http://{}:{}/v1", h.find(':') != std::string::npos && h.front() != '[' ? "[" + h + "]" : h, impl_->port);
}

void CompletionsServer::run() { impl_->http.listen_after_bind(); }
void CompletionsServer::stop() { impl_->http.stop(); }

}  // namespace lar::eval

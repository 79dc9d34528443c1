#include "serve/server.hpp"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>

#include "core/error.hpp"
#include "registry/report/adapter.hpp"
#include "registry/report/render.hpp"
#include "serve/artifacts.hpp"
#include "serve/data.hpp"
#include "serve/http_error.hpp"
#include "serve/pages.hpp"
#include "serve/text.hpp"

namespace lar::serve {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

namespace {

// Content-Security-Policy: scripts and styles only from this server (no inline script,
// no third-party origin), nothing may frame the dashboard.
const char* kCsp =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The host name of a Host header ("127.0.0.1:8765" → "127.0.0.1", "[::1]:80" → "::1").
std::string host_name(const std::string& header) {
  if (!header.empty() && header[0] == '[') {
    size_t end = header.find(']');
    return end == std::string::npos ? header : header.substr(1, end - 1);
  }
  size_t colon = header.rfind(':');
  return colon == std::string::npos ? header : header.substr(0, colon);
}

// PAPER/TABLE from two route captures, each [A-Za-z0-9_-]+ (the route regex), and only
// tables the papers folder lists: nothing else reaches the spec loader.
std::string paper_table_of(const httplib::Request& req) {
  const std::string pt = std::string(req.matches[1]) + "/" + std::string(req.matches[2]);
  const auto all = report::list_paper_tables();
  if (std::find(all.begin(), all.end(), pt) == all.end()) throw HttpError(404, "unknown paper table");
  return pt;
}

report::Report build_paper_report(Connection& c, const std::string& paper_table, const httplib::Request& req) {
  std::string scale = req.get_param_value("scale");
  if (!scale.empty() && !valid_name(scale, 32)) throw HttpError(400, "bad scale");
  int seeds = 0;
  if (req.has_param("seeds") && !req.get_param_value("seeds").empty())
    seeds = static_cast<int>(parse_count(req.get_param_value("seeds"), 64, "seeds"));
  const auto spec = report::resolve_paper_spec(paper_table);
  const auto plan = report::load_paper_plan(spec, scale, seeds);
  const auto input = report::make_table_input(plan, spec, &c.reg);
  return report::build_report(input);
}

}  // namespace

struct Server::Impl {
  ServeOptions opt;
  ConnectionPool pool;
  httplib::Server http;
  int port = -1;

  explicit Impl(ServeOptions o) : opt(std::move(o)), pool(opt.db, static_cast<size_t>(std::max(opt.threads, 1))) {}

  PageContext context(Connection& c) { return {data_version(c)}; }

  // Runs `fn` with a borrowed connection; maps errors to statuses. The body of an error
  // names the offending request value at most — never SQL, paths or file contents.
  template <typename Fn>
  httplib::Server::Handler handler(bool api, Fn fn) {
    return [this, api, fn](const httplib::Request& req, httplib::Response& res) {
      int status = 200;
      std::string message;
      try {
        auto lease = pool.acquire();
        try {
          fn(*lease, req, res);
          return;
        } catch (const HttpError& e) {
          status = e.status(), message = e.what();
        } catch (const UserError& e) {
          status = 400, message = e.what();
        }
        if (api) {
          res.set_content(dump({{"error", message}, {"status", status}}), "application/json");
        } else {
          res.set_content(error_page(status, message, context(*lease)), "text/html; charset=utf-8");
        }
        res.status = status;
        return;
      } catch (const std::exception& e) {
        std::cerr << "lar serve: " << req.method << " " << req.path << ": " << e.what() << "\n";
      }
      res.status = 500;
      if (api) res.set_content(dump({{"error", "internal error (see the server's log)"}, {"status", 500}}), "application/json");
      else res.set_content("<!DOCTYPE html><title>error</title><h1>Error 500</h1><p>internal error (see the server's log)</p>",
                           "text/html; charset=utf-8");
    };
  }

  void json_reply(httplib::Response& res, const json& j) { res.set_content(dump(j), "application/json"); }
  void html_reply(httplib::Response& res, const std::string& html) { res.set_content(html, "text/html; charset=utf-8"); }

  static std::string run_id_of(const httplib::Request& req) { return std::string(req.matches[1]) + "/" + std::string(req.matches[2]); }

  void routes() {
    using Req = httplib::Request;
    using Res = httplib::Response;
    http.set_default_headers({{"X-Content-Type-Options", "nosniff"},
                              {"X-Frame-Options", "DENY"},
                              {"Referrer-Policy", "no-referrer"},
                              {"Cache-Control", "no-store"},
                              {"Content-Security-Policy", kCsp}});
    // Requests are small GETs: bodies, long waits and other methods are refused.
    http.set_payload_max_length(16 * 1024);
    http.set_read_timeout(5, 0);
    http.set_write_timeout(10, 0);
    http.set_keep_alive_max_count(100);
    // Headers and body go out in separate writes: without TCP_NODELAY, Nagle's
    // algorithm and the client's delayed ACK add ~40 ms to every response.
    http.set_tcp_nodelay(true);
    const size_t threads = static_cast<size_t>(std::max(opt.threads, 1));
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    const bool check_host = !opt.allow_remote;
    const std::string bound = opt.host;
    http.set_pre_routing_handler([check_host, bound](const Req& req, Res& res) {
      if (req.method != "GET" && req.method != "HEAD") {
        res.status = 405;
        res.set_header("Allow", "GET, HEAD");
        res.set_content("{\"error\":\"read-only dashboard: GET only\",\"status\":405}", "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }
      // DNS rebinding: a page from another site that resolves its own name to
      // 127.0.0.1 still sends its own Host header; a loopback dashboard answers only
      // requests addressed to a loopback name.
      if (check_host) {
        const std::string h = host_name(req.get_header_value("Host"));
        if (!is_loopback(h) && h != bound) {
          res.status = 403;
          res.set_content("{\"error\":\"Host not allowed\",\"status\":403}", "application/json");
          return httplib::Server::HandlerResponse::Handled;
        }
      }
      // A query part with two '=' ("a=b=c") is ambiguous (the HTTP layer keeps only the
      // last piece); browsers encode '=' inside values, so refuse it.
      if (const size_t q = req.target.find('?'); q != std::string::npos) {
        size_t start = q + 1;
        while (start <= req.target.size()) {
          size_t amp = req.target.find('&', start);
          const std::string_view part(req.target.data() + start, (amp == std::string::npos ? req.target.size() : amp) - start);
          if (std::count(part.begin(), part.end(), '=') > 1) {
            res.status = 400;
            res.set_content("{\"error\":\"malformed query string\",\"status\":400}", "application/json");
            return httplib::Server::HandlerResponse::Handled;
          }
          if (amp == std::string::npos) break;
          start = amp + 1;
        }
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_error_handler([](const Req&, Res& res) {
      if (!res.body.empty()) return;
      res.set_content(fmt::format("{{\"error\":\"{}\",\"status\":{}}}", res.status == 404 ? "not found" : "bad request", res.status),
                      "application/json");
    });

    http.Get("/static/style.css", [](const Req&, Res& res) { res.set_content(kStyleCss, "text/css; charset=utf-8"); });
    http.Get("/static/live.js", [](const Req&, Res& res) { res.set_content(kLiveJs, "application/javascript; charset=utf-8"); });

    // --- JSON API ---------------------------------------------------------------------
    http.Get("/api/version", handler(true, [this](Connection& c, const Req&, Res& res) { json_reply(res, {{"version", data_version(c)}}); }));
    http.Get("/api/experiments", handler(true, [this](Connection& c, const Req&, Res& res) { json_reply(res, experiments_json(c)); }));
    http.Get("/api/runs", handler(true, [this](Connection& c, const Req& req, Res& res) {
      json_reply(res, runs_json(c, parse_run_query(req.params)));
    }));
    http.Get(R"(/api/runs/([^/]+)/([^/]+)/metrics)", handler(true, [this](Connection& c, const Req& req, Res& res) {
      size_t max_points = kDefaultPoints;
      if (req.has_param("max_points")) max_points = parse_count(req.get_param_value("max_points"), kMaxPoints, "max_points");
      json_reply(res, metric_json(c, run_id_of(req), req.get_param_value("name"), max_points));
    }));
    http.Get(R"(/api/runs/([^/]+)/([^/]+))", handler(true, [this](Connection& c, const Req& req, Res& res) {
      json_reply(res, run_json(c, run_id_of(req)));
    }));
    http.Get(R"(/api/tables/([A-Za-z0-9_-]+)/([A-Za-z0-9_-]+))", handler(true, [this](Connection& c, const Req& req, Res& res) {
      json_reply(res, report::table_json(build_paper_report(c, paper_table_of(req), req)));
    }));
    http.Get(R"(/api/audit/([A-Za-z0-9_-]+)/([A-Za-z0-9_-]+))", handler(true, [this](Connection& c, const Req& req, Res& res) {
      json_reply(res, report::audit_json(build_paper_report(c, paper_table_of(req), req)));
    }));
    http.Get(R"(/api/.*)", handler(true, [](Connection&, const Req&, Res&) { throw HttpError(404, "no such API endpoint"); }));

    // --- pages ------------------------------------------------------------------------
    http.Get("/", handler(false, [this](Connection& c, const Req&, Res& res) { html_reply(res, experiments_page(c, context(c))); }));
    http.Get("/runs", handler(false, [this](Connection& c, const Req& req, Res& res) {
      html_reply(res, runs_page(c, parse_run_query(req.params), context(c)));
    }));
    http.Get(R"(/runs/([^/]+)/([^/]+)/files/(.+))", handler(false, [](Connection& c, const Req& req, Res& res) {
      const registry::RunRecord r = find_run(c, run_id_of(req));
      const Artifact a = resolve_artifact(r.run_dir, req.matches[3]);
      std::ifstream in(a.path, std::ios::binary);
      std::ostringstream buf;
      buf << in.rdbuf();
      if (!in && !in.eof()) throw HttpError(404, "cannot read artifact");
      if (a.attachment) res.set_header("Content-Disposition", "attachment; filename=\"" + url_encode(a.path.filename().string()) + "\"");
      res.set_content(buf.str(), a.content_type.c_str());
    }));
    http.Get(R"(/runs/([^/]+)/([^/]+))", handler(false, [this](Connection& c, const Req& req, Res& res) {
      html_reply(res, run_page(c, run_id_of(req), context(c)));
    }));
    http.Get("/compare", handler(false, [this](Connection& c, const Req& req, Res& res) {
      std::vector<std::string> ids;
      for (auto [it, end] = req.params.equal_range("run"); it != end; ++it) ids.push_back(it->second);
      html_reply(res, compare_page(c, ids, context(c)));
    }));
    http.Get("/tables", handler(false, [this](Connection& c, const Req&, Res& res) {
      html_reply(res, tables_index_page(report::list_paper_tables(), context(c)));
    }));
    http.Get(R"(/tables/([A-Za-z0-9_-]+)/([A-Za-z0-9_-]+))", handler(false, [this](Connection& c, const Req& req, Res& res) {
      const std::string pt = paper_table_of(req);
      html_reply(res, table_page(build_paper_report(c, pt, req), pt, req.get_param_value("scale"), context(c)));
    }));
  }
};

Server::Server(ServeOptions opt) {
  if (!is_loopback(opt.host) && !opt.allow_remote)
    throw UserError("refusing to serve on '" + opt.host +
                    "': the dashboard binds to loopback only unless you pass --allow-remote (it has no authentication)");
  if (opt.port < 0 || opt.port > 65535) throw UserError(fmt::format("bad --port {}: expected 0..65535", opt.port));
  check_servable(opt.db);
  impl_ = std::make_unique<Impl>(std::move(opt));
  // Open one connection now: a broken database fails here, not on the first request.
  { auto lease = impl_->pool.acquire(); }
  impl_->routes();
}

Server::~Server() = default;

int Server::bind() {
  auto& i = *impl_;
  i.port = i.opt.port == 0 ? i.http.bind_to_any_port(i.opt.host) : (i.http.bind_to_port(i.opt.host, i.opt.port) ? i.opt.port : -1);
  if (i.port <= 0) throw RuntimeError(fmt::format("cannot listen on {}:{} (in use, or not an address of this machine)", i.opt.host, i.opt.port));
  return i.port;
}

void Server::run() {
  if (impl_->port <= 0) bind();
  impl_->http.listen_after_bind();
}

void Server::stop() { impl_->http.stop(); }

std::string Server::url() const {
  const std::string& h = impl_->opt.host;
  return fmt::format("http://{}:{}/", h.find(':') != std::string::npos && h[0] != '[' ? "[" + h + "]" : h, impl_->port);
}

}  // namespace lar::serve

#pragma once
// What the dashboard reads, as JSON: the same objects feed the JSON API and the pages.
// Every query goes through the registry's public API (lar::registry::Registry) or, for
// the few aggregates it lacks (progress per experiment, axis names, the change marker),
// through parameterised statements on a read-only connection (registry::open_read_only).
#include <condition_variable>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/json.hpp"
#include "registry/db.hpp"
#include "registry/registry.hpp"

namespace lar::serve {

namespace fs = std::filesystem;

// Bounds on what one request may ask for.
inline constexpr size_t kDefaultPage = 50;
inline constexpr size_t kMaxPage = 500;
inline constexpr size_t kMaxOffset = 1000000;
inline constexpr size_t kMaxAxisFilters = 16;
inline constexpr size_t kDefaultPoints = 1000;
inline constexpr size_t kMaxPoints = 10000;
inline constexpr size_t kMaxCompare = 8;
// Plain listings page by SQL OFFSET once offset > kDeepPageFactor × limit.
inline constexpr size_t kDeepPageFactor = 16;

// One reader: the registry (opened read-only) and a raw read-only connection.
struct Connection {
  explicit Connection(const fs::path& db);
  registry::Registry reg;
  registry::Db raw;
};

// Connections for concurrent requests: a Registry is used by one thread at a time, so
// each request borrows one (created on demand, at most `max` in all).
class ConnectionPool {
 public:
  ConnectionPool(fs::path db, size_t max);
  class Lease {
   public:
    Lease(ConnectionPool* pool, std::unique_ptr<Connection> c) : pool_(pool), c_(std::move(c)) {}
    Lease(Lease&&) = default;
    ~Lease();
    Connection& operator*() { return *c_; }
    Connection* operator->() { return c_.get(); }

   private:
    ConnectionPool* pool_;
    std::unique_ptr<Connection> c_;
  };
  Lease acquire();
  const fs::path& db() const { return db_; }

 private:
  fs::path db_;
  size_t max_;
  size_t created_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Connection>> idle_;
};

// Fails with a UserError when `db` is missing or needs a migration (lar serve never
// writes; `lar sync` migrates).
void check_servable(const fs::path& db);

// [{name, runs, by_status: {state: n}, completed, step, total_steps, progress (0..1),
//   updated_at}] for every experiment, newest activity first is left to the caller.
json experiments_json(Connection& c);

// A run listing request, parsed from query parameters:
//   experiment=NAME  status=S[,S…]  axis.<name>=VALUE (repeatable, ≤ 16)  sort=KEY|-KEY
//   limit=N (≤ 500, default 50)  offset=N
struct RunQuery {
  std::string experiment;
  std::vector<std::string> status;
  std::vector<std::pair<std::string, std::string>> axes;
  std::string sort = "run_id";
  size_t limit = kDefaultPage;
  size_t offset = 0;
};
// Throws HttpError 400 naming the parameter for anything malformed or out of bounds.
RunQuery parse_run_query(const std::multimap<std::string, std::string>& params);

// {"runs": [...], "offset", "limit", "count" (on this page), "has_more", "total"}; total
// is null when axis filters are given and more pages follow (counting would read every
// match).
json runs_json(Connection& c, const RunQuery& q);

// The run (404 when unknown): registry record with config and history, plus
// last metrics, metric names, evals, checkpoints and artifact files.
registry::RunRecord find_run(Connection& c, const std::string& run_id);
json run_json(Connection& c, const std::string& run_id);

// {"run", "name", "total", "points": [{step, tokens, value, wall_time}]}: a series
// downsampled to at most max_points; without a name, {"run", "names": [...]}.
json metric_json(Connection& c, const std::string& run_id, const std::string& name, size_t max_points);

// Axis names the cells of `experiment` (all experiments when "") have, sorted (≤ 64;
// read from at most 2,000 cells: the filter form needs names, not a census).
std::vector<std::string> axis_names(Connection& c, const std::string& experiment);

// Changes whenever the registry's runs change (a sync added rows or moved a status):
// pages poll it and reload when it moves.
std::string data_version(Connection& c);

// The metric series as chart points (x = step).
std::vector<std::pair<double, double>> series_points(const std::vector<registry::MetricPoint>& pts);

}  // namespace lar::serve

#pragma once
// The dashboard's HTML pages. Every page is rendered on the server from the same data the
// JSON API returns; every value is HTML-escaped; charts are inline SVG. A page carries
// the registry's change marker (data-version) and /static/live.js reloads it when the
// marker moves, so pages follow runs as `lar sync` ingests them.
#include <map>
#include <string>
#include <vector>

#include "registry/report/report.hpp"
#include "serve/data.hpp"

namespace lar::serve {

struct PageContext {
  std::string version;  // data_version() when the page was rendered
};

std::string experiments_page(Connection& c, const PageContext& ctx);
std::string runs_page(Connection& c, const RunQuery& q, const PageContext& ctx);
std::string run_page(Connection& c, const std::string& run_id, const PageContext& ctx);
// run_ids: 1..kMaxCompare runs (HttpError 400 otherwise).
std::string compare_page(Connection& c, const std::vector<std::string>& run_ids, const PageContext& ctx);
std::string tables_index_page(const std::vector<std::string>& tables, const PageContext& ctx);
std::string table_page(const report::Report& r, const std::string& paper_table, const std::string& scale,
                       const PageContext& ctx);
std::string error_page(int status, const std::string& message, const PageContext& ctx);

// The two static files (served with long-lived caching disabled: they are tiny).
extern const char* const kStyleCss;
extern const char* const kLiveJs;

}  // namespace lar::serve

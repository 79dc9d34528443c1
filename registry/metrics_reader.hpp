#pragma once
// Fast reader of metrics.jsonl for ingest: complete lines from a byte offset, parsed with
// a SAX handler straight into flat rows (no JSON tree per line). Same rules as
// lar::read_metrics in core/run_dir.hpp: a last line without '\n' is torn and left for
// the next read; a complete line that is not a JSON object is counted as bad and skipped.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace lar::registry {

struct ParsedMetrics {
  struct Row {
    uint32_t name = 0;   // index into names
    long step = 0;
    uint64_t line = 0;   // byte offset of the line in the file
    double tokens = 0;   // NaN when the line has none
    double value = 0;    // NaN for null (a non-finite value the trainer logged)
    double wall_time = 0;
  };
  struct Eval {
    long step = 0;
    double tokens = 0;
    double wall_time = 0;
    std::string results;  // canonical JSON object of the line's eval metrics
  };
  std::vector<std::string> names;
  std::vector<Row> rows;     // in file order
  std::vector<Eval> evals;   // lines carrying val_* / acc* metrics
  uint64_t next_offset = 0;  // just past the last complete line
  int bad_lines = 0;
};

ParsedMetrics parse_metrics_file(const std::filesystem::path& path, uint64_t offset);

// Eval metrics (also kept in the evals table): val_loss, val_*, acc, acc@<len>, …
bool is_eval_metric(const std::string& name);

}  // namespace lar::registry

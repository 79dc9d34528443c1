#pragma once
// The launch progress display for a console, shared by `lar launch` and `lar reproduce`.
//   terminal: one line per event (start, finish, notes) above a live status line that is
//             redrawn in place about once a second:
//             [2/12 done · 1 failed · 2 running · 7 queued] gdn.s0 40/100 loss 3.21 · …
//   otherwise (a log file, CI): the event lines only, no control characters.
#include <iosfwd>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runner/launch.hpp"

namespace lar::runner {

class ConsoleProgress {
 public:
  ConsoleProgress(std::ostream& out, bool terminal, bool dry_run);
  void operator()(const ProgressEvent& ev);
  // Clears the live line (call before printing anything else).
  void finish();

 private:
  void line(const std::string& text);
  void redraw(const ProgressEvent& ev);

  std::ostream& out_;
  bool terminal_;
  bool dry_run_;
  bool live_shown_ = false;
  void print_plan_counts();
  std::vector<std::pair<std::string, int>> planned_;  // action → cells, in first-seen order
  bool plan_printed_ = false;
};

// The closing summary: counts, the cells that did not complete (with reasons), and what to
// do next. Returns the exit code `lar launch` uses: 0 all completed, 130 interrupted,
// 1 otherwise.
int print_summary(std::ostream& out, const LaunchSummary& s);

}  // namespace lar::runner

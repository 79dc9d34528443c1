#include "runner/console.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <cstdio>
#include <ostream>

#include "runner/progress.hpp"
#include "runner/slurm_queue.hpp"

namespace lar::runner {

static int terminal_width() {
  winsize ws{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20) return ws.ws_col;
  return 100;
}

ConsoleProgress::ConsoleProgress(std::ostream& out, bool terminal, bool dry_run)
    : out_(out), terminal_(terminal), dry_run_(dry_run) {}

void ConsoleProgress::line(const std::string& text) {
  if (terminal_ && live_shown_) out_ << "\r\x1b[K";
  live_shown_ = false;
  out_ << text << "\n";
}

void ConsoleProgress::print_plan_counts() {
  if (plan_printed_ || planned_.empty()) return;
  plan_printed_ = true;
  int total = 0;
  std::string parts;
  for (const auto& [action, n] : planned_) {
    total += n;
    parts += (parts.empty() ? "" : ", ") + std::to_string(n) + " " + action;
  }
  line("plan: " + std::to_string(total) + " cells — " + parts);
}

void ConsoleProgress::finish() {
  print_plan_counts();
  if (terminal_ && live_shown_) out_ << "\r\x1b[K" << std::flush;
  live_shown_ = false;
}

void ConsoleProgress::redraw(const ProgressEvent& ev) {
  if (!terminal_ || !ev.summary) return;
  const LaunchSummary& s = *ev.summary;
  std::string text = "[" + std::to_string(s.completed) + "/" + std::to_string(s.total) + " done";
  if (s.failed + s.diverged) text += " · " + std::to_string(s.failed + s.diverged) + " failed";
  text += " · " + std::to_string(ev.running) + " running";
  if (ev.queued) text += " · " + std::to_string(ev.queued) + " queued";
  text += "]";
  for (const auto& c : s.cells) {
    if (c.state != RunState::running) continue;
    CellProgress p = read_cell_progress(c.run_dir);
    char buf[160];
    std::snprintf(buf, sizeof buf, " %s %ld/%ld", c.cell_id.c_str(), p.step, p.total_steps);
    text += buf;
    if (p.loss) {
      std::snprintf(buf, sizeof buf, " loss %.3f", *p.loss);
      text += buf;
    }
    if (p.eta_s) text += " ETA " + format_duration(*p.eta_s);
    text += " ·";
  }
  if (text.back() == static_cast<char>(0xb7)) text.resize(text.size() - 3);  // trailing " ·"
  int width = terminal_width() - 1;
  // Cut at the width, counting UTF-8 code points (not continuation bytes).
  int cols = 0;
  size_t cut = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;
    if (++cols > width) {
      cut = i;
      break;
    }
  }
  out_ << "\r\x1b[K" << text.substr(0, cut) << std::flush;
  live_shown_ = true;
}

void ConsoleProgress::operator()(const ProgressEvent& ev) {
  using Kind = ProgressEvent::Kind;
  if (ev.kind != Kind::planned) print_plan_counts();
  switch (ev.kind) {
    case Kind::planned: {
      std::string action = ev.message.substr(0, ev.message.find(':'));
      auto it = std::find_if(planned_.begin(), planned_.end(), [&](const auto& p) { return p.first == action; });
      if (it == planned_.end()) planned_.push_back({action, 1});
      else ++it->second;
      if (dry_run_) {
        line("  " + ev.cell_id + "  " + ev.message);
      } else {
        // Per-cell plan lines only for cells with something to say; counts follow.
        if (ev.message.rfind("resume", 0) == 0) line("  resume " + ev.cell_id + ev.message.substr(6));
      }
      return;
    }
    case Kind::note:
      line("note: " + (ev.cell_id.empty() ? "" : ev.cell_id + ": ") + ev.message);
      break;
    case Kind::started:
      line("start  " + ev.cell_id + " (" + ev.message + ")");
      redraw(ev);
      break;
    case Kind::finished: {
      std::string state = to_string(ev.state);
      std::string text = (ev.state == RunState::completed ? "done   " : "stop   ") + ev.cell_id + " " + state;
      if (ev.state == RunState::failed || ev.state == RunState::diverged) text = "FAIL   " + ev.cell_id + " " + state;
      if (!ev.message.empty() && ev.state != RunState::completed) text += ": " + ev.message;
      line(text);
      redraw(ev);
      break;
    }
    case Kind::stopping:
      line(ev.message);
      redraw(ev);
      break;
    case Kind::tick:
      redraw(ev);
      break;
  }
  if (!terminal_) out_ << std::flush;
}

int print_summary(std::ostream& out, const LaunchSummary& s) {
  if (s.dry_run) {
    int run = 0;
    for (const auto& c : s.cells)
      if (c.action == CellAction::start_new || c.action == CellAction::resume) ++run;
    out << s.experiment << ": " << s.total << " cells; " << run << " to run, " << s.skipped
        << " already completed (dry run: nothing written)\n";
    return 0;
  }
  out << s.experiment << ": " << s.total << " cells — " << s.completed << " completed";
  if (s.skipped) out << " (" << s.skipped << " skipped, already done)";
  out << ", " << s.failed << " failed";
  if (s.diverged) out << ", " << s.diverged << " diverged";
  if (s.stopped) out << ", " << s.stopped << " stopped";
  if (s.pending) out << ", " << s.pending << " not started";
  out << "\n";
  for (const auto& c : s.cells) {
    if (c.state == RunState::completed || c.state == RunState::pending) continue;
    out << "  " << to_string(c.state) << "  " << c.cell_id;
    if (!c.reason.empty()) out << ": " << c.reason;
    out << "\n    " << c.run_dir.string() << "\n";
  }
  bool followup_ok = true;
  if (const auto& f = s.followup) {
    out << "follow-up job " << f->job_id << ": " << f->state;
    if (!f->reason.empty()) out << " (" << explain_slurm_reason(f->reason) << ")";
    out << "\n    " << f->script << "\n";
    if (std::filesystem::exists(f->output)) out << "    output: " << f->output << "\n";
    followup_ok = f->ok();
  }
  if (s.interrupted) {
    out << "interrupted: run the same `lar launch` again to resume (completed cells are skipped)\n";
    return 130;
  }
  return s.all_completed() && followup_ok ? 0 : 1;
}

}  // namespace lar::runner

#pragma once
// Where lar keeps its state. Everything lives under one home folder:
//   $LAR_HOME (default: the current directory)
//     lar.db                      the SQLite registry (never on NFS)
//     runs/<experiment>/<cell>/   run directories — the source of truth
//     data/                       prepared token shards (data/brown is the default corpus)
#include <filesystem>
#include <string>

namespace lar {
std::filesystem::path lar_home();           // $LAR_HOME or "."
std::filesystem::path default_db_path();    // $LAR_DB or <home>/lar.db
std::filesystem::path runs_root();          // <home>/runs
std::filesystem::path data_root();          // $LAR_DATA or <home>/data
std::filesystem::path run_dir_for(const std::string& experiment, const std::string& cell_id);
}  // namespace lar

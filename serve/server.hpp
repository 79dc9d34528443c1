#pragma once
// `lar serve`: the dashboard's HTTP server (cpp-httplib). Read-only over the registry;
// binds to loopback unless told otherwise. Routes (docs/serve.md):
//   pages  /  /runs  /runs/EXP/CELL  /runs/EXP/CELL/files/PATH  /compare?run=…  /tables  /tables/PAPER/TABLE
//   API    /api/experiments  /api/runs  /api/runs/EXP/CELL  /api/runs/EXP/CELL/metrics?name=…
//          /api/tables/PAPER/TABLE  /api/audit/PAPER/TABLE  /api/version
//
//   lar::serve::Server s({.db = "lar.db", .port = 0});
//   int port = s.bind();   // the port it got
//   s.run();               // blocks until stop() (from another thread)
#include <filesystem>
#include <memory>
#include <string>

namespace lar::serve {

struct ServeOptions {
  std::filesystem::path db;
  std::string host = "127.0.0.1";
  int port = 8765;            // 0: any free port
  bool allow_remote = false;  // needed to bind anything but a loopback address
  int threads = 8;            // request workers (each borrows one read-only connection)
};

// 127.0.0.0/8, ::1 and "localhost".
bool is_loopback(const std::string& host);

class Server {
 public:
  // Checks the registry (UserError when missing or needing a migration) and the host
  // (UserError for a non-loopback host without allow_remote).
  explicit Server(ServeOptions opt);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds; returns the port (the chosen one for port 0). RuntimeError when it cannot.
  int bind();
  // Serves until stop(). Call bind() first.
  void run();
  void stop();
  // http://HOST:PORT/ after bind().
  std::string url() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lar::serve

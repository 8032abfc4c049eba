// The TCP server's event loops (server.h): a Reactor owns an epoll set and the connections handed
// to it; Server (server.cpp) makes them and runs each on its own thread. The connections' state
// machine is in server_reactor.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "server.h"

namespace kvpool {

struct Conn;  // one connection's state (server_reactor.cpp)

struct Reactor {
  Server* srv = nullptr;
  int ep = -1;
  int wake = -1;
  bool listening = false;
  int64_t paused_until = 0;
  int64_t wait_started = 0;  // when the current epoll_wait was called (read_step's stall check)
  std::unordered_map<int, std::unique_ptr<Conn>> conns;
  std::vector<char> scratch = std::vector<char>(64 * 1024);
  std::mutex inbox_mu;  // connections accepted by another loop, handed to this one
  std::vector<std::unique_ptr<Conn>> inbox;

  // Server starts a loop with listen_on() and run() and ends it with the wake eventfd (stop());
  // the others are the loop's own steps.
  Reactor();  // defined where Conn is complete, as the destructor is
  ~Reactor();
  void listen_on();
  void want(Conn& c, uint32_t ev);
  void close_conn(int fd);
  void accept_some(int64_t now);
  void adopt(std::unique_ptr<Conn> c, int64_t now);
  void adopt_inbox(int64_t now);
  int flush(Conn& c, uint64_t* budget);
  void on_hello(Conn& c, int64_t now);
  void on_header(Conn& c);
  int read_step(Conn& c, uint64_t* budget, int64_t now);
  bool progress(Conn& c, int64_t now);
  bool progress_once(Conn& c, int64_t now);
  void reap(int64_t now);
  void run();
};

}  // namespace kvpool

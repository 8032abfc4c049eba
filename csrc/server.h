// The engine's TCP server: a few epoll event loops (no thread per connection), each connection a
// small non-blocking state machine. Safe under hostile peers:
//   - bounded threads (server_threads, started once; failure to start is an error at construction),
//   - bounded connections in total and per peer address (refused at accept),
//   - the handshake must finish within connect_timeout_ms, every request frame (header, payload
//     and reply) within timeout_ms from its first byte, and an authenticated connection idle for
//     idle_timeout_ms is closed (trickling resets nothing),
//   - no lock is held across socket I/O: memory is reached through pinned regions (RegionAccess),
//   - the secret is proven by HMAC challenge-response (wire.h), compared in constant time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine.h"

namespace kvpool {

struct Reactor;

// Cryptographic randomness (getrandom(2)).
void fill_random(void* p, size_t n);
// The hello's proofs (wire.h): client=true for HMAC(secret, "kvpool-engine-client" | a | b).
std::string hello_mac(const std::string& secret, bool client, const uint8_t* a, const uint8_t* b);

class Server {
 public:
  Server(const EngineOptions& opt, Registry& reg, uint64_t incarnation);
  ~Server();
  void stop();
  uint16_t port() const { return port_; }
  void set_descriptor(const std::string& blob);
  std::string descriptor();
  std::vector<std::pair<std::string, uint64_t>> stats() const;

  // Called by the reactors.
  bool admit(const std::string& peer);  // counts the connection in when under the bounds
  void release(const std::string& peer);
  Reactor* pick_reactor();

  const EngineOptions opt;
  Registry& reg;
  const uint64_t incarnation;
  int listen_fd = -1;
  std::atomic<bool> stopping{false};

  std::atomic<uint64_t> n_accepted{0}, n_refused_total{0}, n_refused_peer{0}, n_handshake_timeout{0},
      n_frame_timeout{0}, n_idle_closed{0}, n_auth_refused{0}, n_open{0}, n_bad_frame{0},
      n_fenced{0}, n_reset_dropped{0};

 private:
  uint16_t port_ = 0;
  std::vector<std::unique_ptr<Reactor>> reactors_;
  std::atomic<uint64_t> rr_{0};
  std::vector<std::thread> threads_;
  mutable std::mutex peers_mu_;
  std::unordered_map<std::string, int> per_peer_;
  int total_ = 0;
  std::mutex desc_mu_;
  std::string descriptor_;
};

}  // namespace kvpool

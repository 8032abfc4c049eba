// The TCP server (server.h): the listening socket, the event loops' threads, the connection
// bounds and the stats; the handshake's randomness and proofs. The event loops and the
// connections' state machine: server_reactor.{h,cpp}.

#include "server.h"

#include "server_reactor.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <system_error>

#include "hmac.h"

namespace kvpool {

void fill_random(void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(b + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      std::random_device rd;  // no getrandom(2): the library's OS source
      for (; got < n; ++got) b[got] = static_cast<uint8_t>(rd());
    }
  }
}

std::string hello_mac(const std::string& secret, bool client, const uint8_t* a, const uint8_t* b) {
  std::string msg(client ? "kvpool-engine-client" : "kvpool-engine-server");
  msg.append(reinterpret_cast<const char*>(a), kNonce);
  msg.append(reinterpret_cast<const char*>(b), kNonce);
  auto d = hmac_sha256(secret, msg);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

Reactor* Server::pick_reactor() {
  return reactors_[rr_.fetch_add(1) % reactors_.size()].get();
}

// ---------------------------------------------------------------- server

Server::Server(const EngineOptions& o, Registry& r, uint64_t inc) : opt(o), reg(r), incarnation(inc) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(opt.port);
  if (getaddrinfo(opt.host.c_str(), ps.c_str(), &hints, &res) != 0 || !res)
    throw KvError(E_INVALID, "cannot resolve hostname '" + opt.host + "'");
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 4096) != 0) {
    std::string why = strerror(errno);
    freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    throw KvError(E_INVALID, "cannot listen on " + opt.host + ":" + ps + ": " + why +
                                 " (pick another port or hostname)");
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  listen_fd = fd;
  int nthreads = std::max(1, opt.server_threads);
  for (int i = 0; i < nthreads; ++i) {
    auto re = std::make_unique<Reactor>();
    re->srv = this;
    re->ep = epoll_create1(EPOLL_CLOEXEC);
    re->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (re->ep < 0 || re->wake < 0) {
      stop();
      throw KvError(E_INVALID, std::string("cannot create the server's event loop: ") + strerror(errno) +
                                   " (raise the open-file limit)");
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = re->wake;
    epoll_ctl(re->ep, EPOLL_CTL_ADD, re->wake, &ev);
    re->listen_on();
    reactors_.push_back(std::move(re));
  }
  for (auto& re : reactors_) {
    try {
      Reactor* raw = re.get();
      threads_.emplace_back([raw] { raw->run(); });
    } catch (const std::system_error& e) {
      stop();
      throw KvError(E_INVALID, std::string("cannot start the server's threads: ") + e.what() +
                                   " (raise the thread limit, ulimit -u, or lower server_threads)");
    }
  }
}

Server::~Server() { stop(); }

void Server::stop() {
  if (stopping.exchange(true)) return;
  for (auto& re : reactors_) {
    uint64_t one = 1;
    if (re->wake >= 0) (void)!::write(re->wake, &one, sizeof(one));
  }
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  reactors_.clear();  // their event loops' epoll and eventfd descriptors
  if (listen_fd >= 0) ::close(listen_fd);
  listen_fd = -1;
}

void Server::set_descriptor(const std::string& blob) {
  std::lock_guard lk(desc_mu_);
  descriptor_ = blob;
}

std::string Server::descriptor() {
  std::lock_guard lk(desc_mu_);
  return descriptor_;
}

bool Server::admit(const std::string& peer) {
  std::lock_guard lk(peers_mu_);
  if (total_ >= opt.max_connections) {
    n_refused_total.fetch_add(1);
    return false;
  }
  int& n = per_peer_[peer];
  if (n >= opt.max_connections_per_peer) {
    n_refused_peer.fetch_add(1);
    return false;
  }
  ++n;
  ++total_;
  return true;
}

void Server::release(const std::string& peer) {
  std::lock_guard lk(peers_mu_);
  auto it = per_peer_.find(peer);
  if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
  --total_;
}

std::vector<std::pair<std::string, uint64_t>> Server::stats() const {
  return {{"accepted", n_accepted.load()},
          {"open", n_open.load()},
          {"refused_total_limit", n_refused_total.load()},
          {"refused_peer_limit", n_refused_peer.load()},
          {"handshake_timeouts", n_handshake_timeout.load()},
          {"frame_timeouts", n_frame_timeout.load()},
          {"idle_closed", n_idle_closed.load()},
          {"auth_refused", n_auth_refused.load()},
          {"bad_frames", n_bad_frame.load()},
          {"fenced_accesses", n_fenced.load()},
          {"reset_dropped", n_reset_dropped.load()}};
}

}  // namespace kvpool

// The TCP server's event loops and the connections' non-blocking state machine (hello, header,
// payload, reply): accept under the connection bounds, the handshake, requests checked against
// the registry before any byte is touched, GPU regions through pinned staging, deadlines.

#include "server_reactor.h"

#include "cuda.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "hmac.h"

namespace kvpool {

namespace {

constexpr size_t kOutHigh = 64 * 1024;   // stop reading requests while this much output waits
constexpr uint64_t kBudget = 8u << 20;   // bytes moved per connection per wake-up (fairness)
constexpr uint64_t kChunk = 4u << 20;    // bytes per syscall into/out of registered memory
constexpr uint64_t kStage = 1u << 20;    // GPU regions: bytes per staging copy (pinned, per connection)
constexpr int kTickMs = 100;             // deadline scan period
constexpr int kAcceptPauseMs = 50;       // accept back-off at the fd limit
constexpr int64_t kStallMs = 50;         // after this long since epoll_wait, ask a socket itself

enum Phase { P_HELLO, P_HDR, P_PAYLOAD };

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether the initiator reset the connection (or it broke): it gave up on the frames still
// queued on it, which must not be read (see Reactor::run).
bool reset_pending(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLERR | POLLHUP)) != 0;
}

std::string peer_key(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

}  // namespace

struct Conn {
  int fd = -1;
  std::string peer;
  Phase phase = P_HELLO;
  bool authed = false;
  bool close_after = false;  // close once the output is sent
  bool in_frame = false;
  int64_t deadline = 0;
  uint32_t events = 0;
  uint8_t snonce[kNonce];
  uint8_t in[sizeof(Hello)];
  size_t inlen = 0;
  ReqHdr h{};
  std::shared_ptr<RegionState> region;  // WRITE destination (null: drain the payload)
  uint64_t off = 0;
  int32_t st = ST_OK;
  std::string out;
  size_t out_off = 0;
  std::shared_ptr<RegionState> stream;  // READ source being sent after `out`
  uint64_t s_addr = 0, s_len = 0, s_off = 0;
  // GPU regions: two pinned staging halves and a stream (made on the first GPU frame, freed with
  // the connection). Pipelined: the copy of one piece (device <-> the other half) runs on the
  // stream while this half goes through the socket. A READ sends half g_cur[g_lo, g_hi) with the
  // next g_next bytes being copied into the other half (device bytes up to g_staged requested);
  // a WRITE gathers g_fill bytes into half g_cur while the previous half is copied to the device.
  // A copy in flight holds an access to its region (g_pend) until settle(), which progress() calls
  // before it returns: unregister waits for one copy at most, never for the peer.
  std::unique_ptr<char, void (*)(char*)> gbuf{nullptr, [](char* p) { cuda::host_free(p); }};
  void* gstream = nullptr;
  int gdev = -1;
  int g_cur = 0;
  uint64_t g_lo = 0, g_hi = 0, g_fill = 0, g_next = 0, g_staged = 0;
  std::shared_ptr<RegionState> g_pend;
  bool g_err = false;  // a copy failed: the READ stream stops, the WRITE is refused

  ~Conn() {
    settle();
    if (gstream != nullptr) cuda::stream_destroy(gdev, gstream);
  }

  char* half(int i) { return gbuf.get() + static_cast<uint64_t>(i) * kStage; }

  // Staging memory and a stream of `device` (an earlier device's stream is settled and replaced).
  bool stage_buffer(int device) {
    if (!gbuf) gbuf.reset(static_cast<char*>(cuda::host_alloc(2 * kStage)));
    if (gbuf && gdev != device) {
      settle();
      if (gstream != nullptr) cuda::stream_destroy(gdev, gstream);
      gstream = cuda::stream_create(device);
      gdev = gstream != nullptr ? device : -1;
    }
    return gbuf != nullptr && gstream != nullptr;
  }

  // Starts a copy on the stream (the previous one settled first); call inside a RegionAccess of
  // `r`. False (g_err set) when it could not start.
  bool start_copy(const std::shared_ptr<RegionState>& r, bool to_device, uint64_t dev, char* host, uint64_t n) {
    if (!settle()) return false;
    r->active.fetch_add(1);  // the caller's access is live: unregister is still waiting for it
    g_pend = r;
    int rc = to_device ? cuda::to_device_async(gdev, dev, host, n, gstream)
                       : cuda::to_host_async(gdev, host, dev, n, gstream);
    if (rc != 0) g_err = true;
    return rc == 0;
  }

  // Waits for the copy in flight (if any) and releases its access. False once any copy failed.
  bool settle() {
    if (g_pend) {
      if (cuda::stream_sync(gdev, gstream) != 0) g_err = true;
      g_pend->active.fetch_sub(1);
      g_pend.reset();
    }
    return !g_err;
  }
};

Reactor::Reactor() = default;

Reactor::~Reactor() {
  for (auto& c : inbox) ::close(c->fd);  // handed over while shutting down
  if (ep >= 0) ::close(ep);
  if (wake >= 0) ::close(wake);
}

void Reactor::listen_on() {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLEXCLUSIVE;
  ev.data.fd = srv->listen_fd;
  listening = epoll_ctl(ep, EPOLL_CTL_ADD, srv->listen_fd, &ev) == 0;
}

void Reactor::want(Conn& c, uint32_t ev) {
  if (c.events == ev) return;
  epoll_event e{};
  e.events = ev;
  e.data.fd = c.fd;
  epoll_ctl(ep, EPOLL_CTL_MOD, c.fd, &e);
  c.events = ev;
}

void Reactor::close_conn(int fd) {
  auto it = conns.find(fd);
  if (it == conns.end()) return;
  srv->release(it->second->peer);  // counted out before the peer can see the close
  srv->n_open.fetch_sub(1);
  ::close(fd);  // also leaves the epoll set
  conns.erase(it);
}

void Reactor::accept_some(int64_t now) {
  for (int i = 0; i < 64; ++i) {
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    int fd = ::accept4(srv->listen_fd, reinterpret_cast<sockaddr*>(&ss), &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: stop listening for a moment instead of spinning on a ready socket.
        epoll_ctl(ep, EPOLL_CTL_DEL, srv->listen_fd, nullptr);
        listening = false;
        paused_until = now + kAcceptPauseMs;
      }
      return;
    }
    std::string peer = peer_key(ss);
    if (!srv->admit(peer)) {
      Challenge busy{kBusyMagic, 0, {}};  // a reason instead of a bare close (fits any socket buffer)
      (void)!::send(fd, &busy, sizeof(busy), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->peer = std::move(peer);
    c->deadline = now + srv->opt.connect_timeout_ms;
    fill_random(c->snonce, kNonce);
    Challenge ch{kChallengeMagic, srv->opt.secret.empty() ? 0u : 1u, {}};
    std::memcpy(ch.nonce, c->snonce, kNonce);
    c->out.assign(reinterpret_cast<const char*>(&ch), sizeof(ch));
    srv->n_accepted.fetch_add(1);
    srv->n_open.fetch_add(1);
    // Spread connections over the loops round-robin (a peer's lanes land on different threads).
    Reactor* to = srv->pick_reactor();
    if (to == this) {
      adopt(std::move(c), now);
    } else {
      {
        std::lock_guard lk(to->inbox_mu);
        to->inbox.push_back(std::move(c));
      }
      uint64_t one = 1;
      (void)!::write(to->wake, &one, sizeof(one));
    }
  }
}

void Reactor::adopt(std::unique_ptr<Conn> c, int64_t now) {
  int fd = c->fd;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  c->events = EPOLLIN;
  if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
    srv->release(c->peer);
    srv->n_open.fetch_sub(1);
    ::close(fd);
    return;
  }
  Conn* raw = c.get();
  conns[fd] = std::move(c);
  if (!progress(*raw, now)) close_conn(fd);
}

void Reactor::adopt_inbox(int64_t now) {
  std::vector<std::unique_ptr<Conn>> in;
  {
    std::lock_guard lk(inbox_mu);
    in.swap(inbox);
  }
  for (auto& c : in) adopt(std::move(c), now);
}

// Sends pending output, then the READ stream. 1: all sent, 0: would block (or budget used),
// -1: the connection must close.
int Reactor::flush(Conn& c, uint64_t* budget) {
  for (;;) {
    size_t pend = c.out.size() - c.out_off;
    uint64_t spend = c.stream ? c.s_len - c.s_off : 0;
    if (pend == 0 && spend == 0) {
      c.out.clear();
      c.out_off = 0;
      return 1;
    }
    if (*budget == 0) return 0;
    iovec iov[2];
    int n = 0;
    if (pend) iov[n++] = {&c.out[c.out_off], pend};
    RegionAccess acc(spend ? c.stream.get() : nullptr);
    if (!acc.ok()) {
      srv->n_fenced.fetch_add(1);  // unregistered mid-reply: the stream cannot continue
      return -1;
    }
    const bool gpu = spend && c.stream->r.device >= 0;
    if (gpu && c.g_lo == c.g_hi) {  // this half is sent: take the next piece, prefetch the one after
      if (c.g_next == 0) {           // the first piece: nothing was prefetched
        uint64_t k = std::min(spend, kStage);
        if (!c.stage_buffer(c.stream->r.device) ||
            !c.start_copy(c.stream, false, c.s_addr + c.s_off, c.half(c.g_cur), k))
          return -1;  // the reply header promised the bytes: the stream cannot continue
        c.g_next = k;
        c.g_staged = c.s_off + k;
        c.g_cur ^= 1;
      }
      if (!c.settle()) return -1;
      c.g_cur ^= 1;
      c.g_lo = 0;
      c.g_hi = c.g_next;
      c.g_next = 0;
      if (c.g_staged < c.s_len) {  // copy the next piece while this one is sent
        uint64_t k = std::min(c.s_len - c.g_staged, kStage);
        if (!c.start_copy(c.stream, false, c.s_addr + c.g_staged, c.half(c.g_cur ^ 1), k)) return -1;
        c.g_next = k;
        c.g_staged += k;
      }
    }
    if (gpu) iov[n++] = {c.half(c.g_cur) + c.g_lo, c.g_hi - c.g_lo};
    else if (spend) iov[n++] = {reinterpret_cast<char*>(c.s_addr + c.s_off), std::min(spend, kChunk)};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = ::sendmsg(c.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    }
    auto left = static_cast<uint64_t>(w);
    *budget -= std::min(*budget, left);
    uint64_t k = std::min<uint64_t>(left, pend);
    c.out_off += k;
    left -= k;
    if (spend) {
      c.s_off += left;
      if (gpu) c.g_lo += left;
      if (c.s_off == c.s_len) {
        c.settle();  // nothing is in flight at the end (g_next is 0); kept for safety
        c.stream.reset();
        c.in_frame = false;
      }
    }
  }
}

void Reactor::on_hello(Conn& c, int64_t now) {
  Hello hm;
  std::memcpy(&hm, c.in, sizeof(hm));
  const std::string& secret = srv->opt.secret;
  bool ok = secret.empty();
  if (!ok) {
    std::string want_mac = hello_mac(secret, true, c.snonce, hm.nonce);
    ok = ct_equal(hm.proof, kMac, want_mac.data(), want_mac.size());
  }
  HelloOk r{kHelloOkMagic, ok ? ST_OK : ST_AUTH, ok ? srv->incarnation : 0};
  c.out.append(reinterpret_cast<const char*>(&r), sizeof(r));
  if (ok && !secret.empty()) c.out += hello_mac(secret, false, hm.nonce, c.snonce);
  else c.out.append(kMac, '\0');
  c.inlen = 0;
  if (!ok) {
    srv->n_auth_refused.fetch_add(1);
    c.close_after = true;
    return;
  }
  c.authed = true;
  c.phase = P_HDR;
  c.deadline = now + srv->opt.idle_timeout_ms;
}

void Reactor::on_header(Conn& c) {
  std::memcpy(&c.h, c.in, sizeof(ReqHdr));
  c.inlen = 0;
  const ReqHdr& h = c.h;
  bool fatal = false;
  int32_t st = validate_request(h, srv->opt.max_frame, &fatal);
  RespHdr resp{kRespMagic, st, h.id, 0, 0};
  if (fatal) {
    srv->n_bad_frame.fetch_add(1);
    c.out.append(reinterpret_cast<const char*>(&resp), sizeof(resp));
    c.close_after = true;
    return;
  }
  if (h.op == OP_WRITE) {
    c.region = st == ST_OK ? srv->reg.pin(h.addr, h.len, true) : nullptr;
    c.st = st != ST_OK ? st : (c.region ? ST_OK : ST_REMOTE_BOUNDS);
    if (c.region && h.reg != 0 && h.reg != c.region->id) {  // registered again since: not theirs
      c.region.reset();  // the payload is drained, the WRITE refused
      c.st = ST_REREGISTERED;
    }
    if (c.region && c.region->r.device >= 0 && !c.stage_buffer(c.region->r.device)) {
      c.region.reset();  // no pinned memory for staging: the payload is drained, the WRITE refused
      c.st = ST_TRANSPORT;
    }
    c.off = 0;
    c.g_fill = 0;
    c.g_err = false;
    c.phase = P_PAYLOAD;
    return;
  }
  if (h.op == OP_READ) {
    std::shared_ptr<RegionState> r = st == ST_OK ? srv->reg.pin(h.addr, h.len, true) : nullptr;
    if (st == ST_OK && !r) st = ST_REMOTE_BOUNDS;
    if (r && h.reg != 0 && h.reg != r->id) {  // registered again since the peer's descriptor
      r.reset();
      st = ST_REREGISTERED;
    }
    resp.status = st;
    resp.len = st == ST_OK ? h.len : 0;
    c.out.append(reinterpret_cast<const char*>(&resp), sizeof(resp));
    if (st == ST_OK) {
      c.stream = std::move(r);
      c.s_addr = h.addr;
      c.s_len = h.len;
      c.s_off = 0;
      c.g_lo = c.g_hi = c.g_next = 0;
      c.g_err = false;
      return;  // the frame ends when the stream is sent
    }
  } else if (h.op == OP_GET_DESC) {
    std::string blob = srv->descriptor();
    resp.len = blob.size();
    c.out.append(reinterpret_cast<const char*>(&resp), sizeof(resp));
    c.out += blob;
  } else {  // PING
    c.out.append(reinterpret_cast<const char*>(&resp), sizeof(resp));
  }
  c.in_frame = false;
}

// One read step. 1: progress, 0: would block, -1: close.
int Reactor::read_step(Conn& c, uint64_t* budget, int64_t now) {
  // The event's flags say nothing of a reset after epoll_wait collected them. After a stall
  // (this thread descheduled or stopped, a page fault, a slow device copy of another connection),
  // before or after `now` (when epoll_wait returned, at most kTickMs after it was called), the
  // initiator may have timed out and reset the connection: ask the socket before reading more.
  const bool stalled = now - wait_started > kTickMs + kStallMs || now_ms() - now > kStallMs;
  if (stalled && reset_pending(c.fd)) {
    srv->n_reset_dropped.fetch_add(1);
    return -1;
  }
  ssize_t r;
  if (c.phase == P_PAYLOAD) {
    uint64_t left = c.h.len - c.off;
    bool drop = false;  // a failed device copy: the rest is drained, the WRITE refused
    {
      RegionAccess acc(c.region.get());
      if (!acc.ok()) {  // unregistered mid-payload: the rest is drained, the WRITE refused
        srv->n_fenced.fetch_add(1);
        c.region.reset();
        c.st = ST_REMOTE_BOUNDS;
      }
      if (c.region && c.region->r.device >= 0) {
        // GPU region: gather a piece into one half; when full (or at the end) copy it to the
        // device on the stream and gather the next piece into the other half meanwhile
        r = ::recv(c.fd, c.half(c.g_cur) + c.g_fill, std::min(left, kStage - c.g_fill), MSG_DONTWAIT);
        if (c.g_err) drop = true;
        if (r > 0 && !drop) {
          c.g_fill += static_cast<uint64_t>(r);
          bool last = c.off + static_cast<uint64_t>(r) == c.h.len;
          if (c.g_fill == kStage || last) {
            uint64_t at = c.h.addr + c.off + static_cast<uint64_t>(r) - c.g_fill;
            if (!c.start_copy(c.region, true, at, c.half(c.g_cur), c.g_fill)) drop = true;
            c.g_cur ^= 1;
            c.g_fill = 0;
            if (last && !c.settle()) drop = true;  // the reply says the bytes are in GPU memory
          }
        }
      } else if (c.region) {
        r = ::recv(c.fd, reinterpret_cast<char*>(c.h.addr + c.off), std::min(left, kChunk), MSG_DONTWAIT);
      } else {
        r = ::recv(c.fd, scratch.data(), std::min<uint64_t>(left, scratch.size()), MSG_DONTWAIT);
      }
    }
    if (drop) {
      c.region.reset();  // after the access ended
      c.st = ST_TRANSPORT;
    }
    if (r > 0) {
      c.off += static_cast<uint64_t>(r);
      *budget -= std::min(*budget, static_cast<uint64_t>(r));
      if (c.off == c.h.len) {
        RespHdr resp{kRespMagic, c.st, c.h.id, 0, 0};
        c.out.append(reinterpret_cast<const char*>(&resp), sizeof(resp));
        c.region.reset();
        c.phase = P_HDR;
        c.in_frame = false;
      }
      return 1;
    }
  } else {
    size_t need = c.phase == P_HDR ? sizeof(ReqHdr) : (c.inlen < sizeof(HelloHdr) ? sizeof(HelloHdr) : sizeof(Hello));
    r = ::recv(c.fd, c.in + c.inlen, need - c.inlen, MSG_DONTWAIT);
    if (r > 0) {
      c.inlen += static_cast<size_t>(r);
      if (c.inlen < need) return 1;
      if (c.phase == P_HDR) {
        on_header(c);
      } else if (need == sizeof(HelloHdr)) {
        HelloHdr hh;
        std::memcpy(&hh, c.in, sizeof(hh));
        if (hh.magic != kHelloMagic) {
          srv->n_bad_frame.fetch_add(1);
          return -1;
        }
        if (hh.version != kProtoVersion) {
          HelloOk v{kHelloOkMagic, ST_VERSION, 0};
          c.out.append(reinterpret_cast<const char*>(&v), sizeof(v));
          c.close_after = true;
        }
      } else {
        on_hello(c, now);
      }
      return 1;
    }
  }
  if (r == 0) return -1;
  if (errno == EINTR) return 1;
  return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
}

// Moves what the connection allows without blocking. False: close it. No staging copy stays in
// flight after it returns (a failed one is seen by the frame's next step).
bool Reactor::progress(Conn& c, int64_t now) {
  bool ok = progress_once(c, now);
  c.settle();
  return ok;
}

bool Reactor::progress_once(Conn& c, int64_t now) {
  uint64_t budget = kBudget;
  for (;;) {
    if (c.stream || c.close_after || c.out.size() - c.out_off >= kOutHigh) {
      int f = flush(c, &budget);
      if (f < 0) return false;
      if (f == 0) {
        want(c, budget ? EPOLLOUT : EPOLLIN | EPOLLOUT);
        break;
      }
      if (c.close_after) return false;
    }
    int r = budget ? read_step(c, &budget, now) : 0;
    if (r < 0) return false;
    if (r == 0) {
      int f = flush(c, &budget);
      if (f < 0) return false;
      want(c, f == 1 ? EPOLLIN : (budget ? EPOLLOUT : EPOLLIN | EPOLLOUT));
      if (f == 1 && c.close_after) return false;
      break;
    }
  }
  if (c.authed) {
    bool busy = c.phase != P_HDR || c.inlen > 0 || c.stream || c.out_off < c.out.size();
    if (!busy) {
      c.in_frame = false;
      c.deadline = now + srv->opt.idle_timeout_ms;
    } else if (!c.in_frame) {
      c.in_frame = true;  // a whole-frame deadline: trickling does not extend it
      c.deadline = now + srv->opt.timeout_ms;
    }
  }
  return true;
}

void Reactor::reap(int64_t now) {
  std::vector<int> expired;
  for (auto& kv : conns)
    if (kv.second->deadline <= now) expired.push_back(kv.first);
  for (int fd : expired) {
    Conn& c = *conns[fd];
    if (!c.authed) srv->n_handshake_timeout.fetch_add(1);
    else if (c.in_frame) srv->n_frame_timeout.fetch_add(1);
    else srv->n_idle_closed.fetch_add(1);
    close_conn(fd);
  }
}

void Reactor::run() {
  std::vector<epoll_event> evs(256);
  int64_t last_scan = now_ms();
  while (!srv->stopping.load()) {
    wait_started = now_ms();
    int n = epoll_wait(ep, evs.data(), static_cast<int>(evs.size()), kTickMs);
    int64_t now = now_ms();
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == srv->listen_fd) {
        accept_some(now);
      } else if (fd == wake) {
        uint64_t v;
        (void)!::read(wake, &v, sizeof(v));
        adopt_inbox(now);
      } else {
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        // A connection the initiator reset (it gave up on its requests: Lane::abort_fd) is
        // closed without reading what is still queued on it: a WRITE it reported timed out must
        // not land after this process was stopped or stalled past that timeout.
        if (evs[i].events & (EPOLLERR | EPOLLHUP)) {
          srv->n_reset_dropped.fetch_add(1);
          close_conn(fd);
        } else if (!progress(*it->second, now)) {
          close_conn(fd);
        }
      }
    }
    if (now - last_scan >= kTickMs) {
      last_scan = now;
      reap(now);
      if (!listening && now >= paused_until && !srv->stopping.load()) listen_on();
    }
  }
  adopt_inbox(now_ms());
  std::vector<int> fds;
  for (auto& kv : conns) fds.push_back(kv.first);
  for (int fd : fds) close_conn(fd);
}

}  // namespace kvpool

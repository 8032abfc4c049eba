#include "engine.h"
#include "hmac.h"
#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <system_error>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

namespace kvpool {

namespace {

constexpr size_t kMaxGroup = 256;          // slices per pipelined group
constexpr uint64_t kGroupBytes = 8 << 20;  // bytes per pipelined group
constexpr uint64_t kInlineExtra = 64 << 10;  // transfer_sync: bytes beyond one slice still done inline
constexpr int kIovMax = 1024;

void set_timeouts(int fd, int ms) {
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Whole-frame deadline of the calling thread's client socket I/O (0: none). Socket timeouts
// bound one syscall; a peer that trickles one byte per syscall would restart them forever. Under a
// FrameDeadline, recv_all/writev_all fail with ST_TIMEOUT once it passed, and after a partial
// transfer shorten the socket's timeouts to the time left (restored when the frame ends).
thread_local int64_t t_deadline_ms = 0;
thread_local int t_shortened_fd = -1;
thread_local int t_full_ms = 0;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct FrameDeadline {
  FrameDeadline(int fd, int ms) {
    t_deadline_ms = now_ms() + ms;
    t_full_ms = ms;
    fd_ = fd;
  }
  ~FrameDeadline() {
    if (t_shortened_fd == fd_) set_timeouts(fd_, t_full_ms);
    t_shortened_fd = -1;
    t_deadline_ms = 0;
  }
  FrameDeadline(const FrameDeadline&) = delete;
  FrameDeadline& operator=(const FrameDeadline&) = delete;

 private:
  int fd_;
};

// After partial progress: ST_TIMEOUT when the frame's deadline passed, else the socket's timeouts
// now end with it.
int32_t frame_time_left(int fd) {
  if (t_deadline_ms == 0) return ST_OK;
  int64_t left = t_deadline_ms - now_ms();
  if (left <= 0) return ST_TIMEOUT;
  set_timeouts(fd, static_cast<int>(std::max<int64_t>(1, left)));
  t_shortened_fd = fd;
  return ST_OK;
}

// Error status for a failed syscall on a connected socket.
int32_t sock_err(ssize_t rc) {
  if (rc == 0) return ST_PEER_CLOSED;
  if (errno == EAGAIN || errno == EWOULDBLOCK) return ST_TIMEOUT;
  return ST_PEER_CLOSED;
}

// Reads exactly n bytes. Returns ST_OK or an error status.
int32_t recv_all(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_WAITALL);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      if (n > 0) {  // a partial frame: it must still end by the deadline
        int32_t st = frame_time_left(fd);
        if (st != ST_OK) return st;
      }
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return sock_err(r);
  }
  return ST_OK;
}

// Writes every iovec fully, handling partial writes. Modifies iov.
int32_t writev_all(int fd, iovec* iov, int cnt) {
  while (cnt > 0) {
    int n = std::min(cnt, kIovMax);
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return sock_err(w);
    }
    size_t left = static_cast<size_t>(w);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0 && left > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
    if (cnt > 0) {  // a partial write: the rest must still go by the deadline
      int32_t st = frame_time_left(fd);
      if (st != ST_OK) return st;
    }
  }
  return ST_OK;
}

int32_t send_all(int fd, const void* buf, size_t n) {
  iovec v{const_cast<void*>(buf), n};
  return writev_all(fd, &v, 1);
}

// Connects with a timeout. Returns fd or -1.
int dial(const std::string& host, uint16_t port, int timeout_ms) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(port);
  if (getaddrinfo(host.c_str(), ps.c_str(), &hints, &res) != 0 || !res) return -1;
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      rc = ::poll(&pfd, 1, timeout_ms);
      if (rc == 1) {
        int err = 0;
        socklen_t el = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        rc = err == 0 ? 0 : -1;
      } else {
        rc = -1;
      }
    }
    if (rc == 0) {
      int fl = fcntl(fd, F_GETFL);
      fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
      break;
    }
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    tune_socket(fd);
    set_timeouts(fd, timeout_ms);
  }
  return fd;
}

// Client side of the handshake (wire.h): answers the server's challenge with a proof of the secret
// and checks the server's proof. Returns ST_OK and the server incarnation.
int32_t hello_exchange(int fd, const std::string& secret, uint64_t* incarnation, int timeout_ms) {
  FrameDeadline dl(fd, timeout_ms);  // the whole handshake
  Challenge ch{};
  int32_t st = recv_all(fd, &ch, sizeof(ch));
  if (st != ST_OK) return st;  // closed at accept: over the server's connection bounds, or shutting down
  if (ch.magic == kBusyMagic) return ST_BUSY;
  if (ch.magic != kChallengeMagic) return ST_VERSION;
  Hello h{};
  h.hdr = HelloHdr{kHelloMagic, kProtoVersion, 0};
  fill_random(h.nonce, kNonce);
  if (!secret.empty()) {
    std::string proof = hello_mac(secret, true, ch.nonce, h.nonce);
    std::memcpy(h.proof, proof.data(), kMac);
  }
  st = send_all(fd, &h, sizeof(h));
  if (st != ST_OK) return st;
  HelloOk ok{};
  st = recv_all(fd, &ok, sizeof(ok));
  if (st != ST_OK) return st;
  if (ok.magic != kHelloOkMagic) return ST_BAD_FRAME;
  if (ok.status != ST_OK) return ok.status;
  uint8_t server_proof[kMac];
  st = recv_all(fd, server_proof, kMac);
  if (st != ST_OK) return st;
  if (!secret.empty()) {
    std::string want = hello_mac(secret, false, h.nonce, ch.nonce);
    if (!ct_equal(server_proof, kMac, want.data(), want.size())) return ST_PEER_UNPROVEN;
  }
  *incarnation = ok.incarnation;
  return ST_OK;
}

// The handshake, a stall in it reported as ST_HELLO_TIMEOUT, not ST_TIMEOUT: no request frame was
// sent on the connection, so nothing of the slices it fails can land later (ST_TIMEOUT tells the
// caller that a stalled target may still apply WRITEs it received, and callers then hold memory).
int32_t client_hello(int fd, const std::string& secret, uint64_t* incarnation, int timeout_ms) {
  int32_t st = hello_exchange(fd, secret, incarnation, timeout_ms);
  return st == ST_TIMEOUT ? ST_HELLO_TIMEOUT : st;
}

// Copy that bypasses the cache for big copies (the destination is not read back soon and a cold
// destination would otherwise be read before it is written).
void copy_bytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
  if (n >= (256u << 10)) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

int state_for(int32_t st) { return st == ST_TIMEOUT ? S_TIMEOUT : (st == ST_CANCELED ? S_CANCELED : S_FAILED); }

}  // namespace

// ---------------------------------------------------------------- wire helpers

std::string encode_hello(const std::string& secret, const std::string& challenge, uint16_t version) {
  Hello h{};
  h.hdr = HelloHdr{kHelloMagic, version, 0};
  fill_random(h.nonce, kNonce);
  if (challenge.size() == sizeof(Challenge) && !secret.empty()) {
    Challenge ch;
    std::memcpy(&ch, challenge.data(), sizeof(ch));
    std::string proof = hello_mac(secret, true, ch.nonce, h.nonce);
    std::memcpy(h.proof, proof.data(), kMac);
  }
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::string encode_request(uint8_t op, uint32_t id, uint64_t addr, uint64_t len) {
  ReqHdr h{kReqMagic, op, 0, 0, id, 0, addr, len};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::vector<ParsedFrame> decode_frames(const std::string& data, uint64_t max_frame) {
  std::vector<ParsedFrame> out;
  size_t pos = 0;
  while (data.size() - pos >= sizeof(ReqHdr)) {
    ReqHdr h;
    std::memcpy(&h, data.data() + pos, sizeof(h));
    pos += sizeof(h);
    bool fatal = false;
    int32_t st = validate_request(h, max_frame, &fatal);
    if (fatal) throw KvError(E_PROTOCOL, std::string("fatal frame: ") + status_text(st));
    out.push_back(ParsedFrame{h.op, h.id, h.addr, h.len, st});
    if (h.op == OP_WRITE) {
      if (data.size() - pos < h.len) break;  // incomplete payload: wait for more bytes
      pos += h.len;
    }
  }
  return out;
}

// ---------------------------------------------------------------- registry

std::tuple<int, uint64_t, uint32_t> Registry::add(uint64_t addr, uint64_t len, bool remote, bool read_only,
                                                   int device) {
  if (len == 0) throw KvError(E_INVALID, "cannot register zero bytes");
  if (addr + len < addr) throw KvError(E_INVALID, "address range wraps around");
  if (remote && read_only) throw KvError(E_INVALID, "read-only memory cannot be remote-accessible");
  auto st = std::make_shared<RegionState>();
  st->r = Region{addr, len, remote, read_only, device};
  std::unique_lock lk(mu_);
  auto it = regions_.upper_bound(addr);
  if (it != regions_.end() && it->first < addr + len)
    throw KvError(E_REGISTRATION, "range overlaps an existing registration; unregister it first");
  if (it != regions_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second->r.len > addr)
      throw KvError(E_REGISTRATION, "range overlaps an existing registration; unregister it first");
  }
  if (remote && device < 0 && fence_ != nullptr) st->fence_slot = fence_->claim(addr, len, &st->fence_gen);
  if (++next_id_ == 0) ++next_id_;
  st->id = next_id_;
  std::tuple<int, uint64_t, uint32_t> out{st->fence_slot, st->fence_gen, st->id};
  regions_[addr] = std::move(st);
  return out;
}

void Registry::remove(uint64_t addr) {
  std::shared_ptr<RegionState> st;
  {
    std::unique_lock lk(mu_);
    auto it = regions_.find(addr);
    if (it == regions_.end())
      throw KvError(E_NOT_REGISTERED, "no registration starts at this address");
    st = std::move(it->second);
    regions_.erase(it);
    st->dead.store(true);
  }
  // Accesses already inside one socket syscall finish (bounded by a syscall, not by the peer);
  // every later one sees `dead` and is refused.
  while (st->active.load() != 0) std::this_thread::yield();
  // Same-host initiators: no copy starts after this, and the ones inside a copy finish first.
  if (st->fence_slot >= 0 && fence_ != nullptr && !fence_->retire(st->fence_slot, retire_timeout_ms_))
    throw KvError(E_REGISTRATION,
                  "unregistered, but a same-host peer is stopped inside a copy into this buffer; no new "
                  "copy can start: do not free or reuse the memory until that peer continues or exits");
}

bool Registry::contains_locked(uint64_t addr, uint64_t len, bool need_remote, bool need_writable) const {
  if (len == 0 || addr + len < addr) return false;
  auto it = regions_.upper_bound(addr);
  if (it == regions_.begin()) return false;
  --it;
  const Region& r = it->second->r;
  if (need_remote && !r.remote) return false;
  if (!need_remote && r.device >= 0) return false;  // GPU memory: the server's staging only
  if (need_writable && r.read_only) return false;
  return addr >= r.addr && addr + len <= r.addr + r.len;
}

bool Registry::contains(uint64_t addr, uint64_t len, bool need_remote) const {
  std::shared_lock lk(mu_);
  return contains_locked(addr, len, need_remote);
}

std::shared_ptr<RegionState> Registry::pin(uint64_t addr, uint64_t len, bool need_remote) const {
  std::shared_lock lk(mu_);
  if (!contains_locked(addr, len, need_remote)) return nullptr;
  return std::prev(regions_.upper_bound(addr))->second;
}

std::vector<Region> Registry::list() const {
  std::shared_lock lk(mu_);
  std::vector<Region> out;
  for (auto& kv : regions_) out.push_back(kv.second->r);
  return out;
}

// ---------------------------------------------------------------- batch

void Batch::finish_slice(uint32_t idx, uint64_t nbytes, int32_t status) {
  Slot& s = slots[idx];
  if (status != ST_OK) {
    // The first failure names the slot's error, except that a timed-out slice wins over any other:
    // it may still land later, and the slot's state must say so (TIMEOUT, not FAILED).
    int cur = 0;
    while (!s.err.compare_exchange_weak(cur, status) && status == ST_TIMEOUT && cur != ST_TIMEOUT) {
    }
  } else {
    s.bytes.fetch_add(nbytes, std::memory_order_relaxed);
  }
  if (s.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    int err = s.err.load();
    s.state.store(err == 0 ? S_COMPLETED : state_for(err), std::memory_order_release);
    if (pending_slots.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lk(mu);
      cv.notify_all();
    }
  }
}

void Peer::unmap_all() {
  std::unique_lock lk(maps_mu);
  for (auto& m : maps) munmap(m.local, m.len);
  maps.clear();
  ++maps_gen;
}

Peer::~Peer() {
  if (pidfd >= 0) ::close(pidfd);
}

namespace {

// Mappings up to this size are populated when mapped; bigger ones in the background, so that
// the first same-host transfer to a big segment (1 GiB: ~100 ms of page-table setup) does not
// wait for all of it.
constexpr uint64_t kPopulateInline = 64ull << 20;
constexpr uint64_t kPopulateChunk = 16ull << 20;

// Map every page of [addr, addr + len) writable now. MAP_POPULATE would map a shared mapping's
// pages read-only, and every first write to a page would still fault (256 faults per MiB).
// Without MADV_POPULATE_WRITE (Linux < 5.14) one read per page maps them as MAP_POPULATE did.
void populate_write(char* addr, uint64_t len) {
  int rc = -1;
#ifdef MADV_POPULATE_WRITE
  while ((rc = madvise(addr, len, MADV_POPULATE_WRITE)) != 0 && errno == EINTR) {
  }
#endif
  if (rc != 0) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (uint64_t off = 0; off < len; off += page) (void)*static_cast<volatile char*>(addr + off);
  }
}

// Prefault ``p``'s mappings of generation ``gen`` chunk by chunk, under the shared maps lock
// (copies go on meanwhile); stops when they are replaced or unmapped, or where the kernel lacks
// MADV_POPULATE_WRITE (then pages fault in on first use, as any mapping's do).
void populate_maps(std::shared_ptr<Peer> p, uint64_t gen) {
#ifdef MADV_POPULATE_WRITE
  for (size_t i = 0;; ++i) {
    for (uint64_t off = 0;; off += kPopulateChunk) {
      std::shared_lock lk(p->maps_mu);
      if (p->maps_gen != gen || i >= p->maps.size()) return;
      const ShmMap& m = p->maps[i];
      if (off >= m.len) break;
      if (m.len <= kPopulateInline) break;  // populated when mapped
      uint64_t n = std::min(kPopulateChunk, m.len - off);
      if (madvise(m.local + off, n, MADV_POPULATE_WRITE) != 0 && errno != EINTR) return;
    }
  }
#else
  (void)p;
  (void)gen;
#endif
}

}  // namespace

bool Peer::remote_ok(uint64_t addr, uint64_t len, uint32_t* reg) {
  if (len == 0 || addr + len < addr) return false;
  std::lock_guard lk(regions_mu);
  for (auto& [a, l, id] : regions)
    if (addr >= a && addr + len <= a + l) {
      *reg = id;
      return true;
    }
  return false;
}

// ---------------------------------------------------------------- engine

Engine::Engine(const EngineOptions& opt) : opt_(opt) {
  std::random_device rd;
  incarnation_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                 static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  if (incarnation_ == 0) incarnation_ = 1;
  signal(SIGPIPE, SIG_IGN);
  fence_ = Fence::create();  // null without memfd: then same-host peers use TCP
  reg_.set_fence(fence_.get(), opt_.timeout_ms);
  server_ = std::make_unique<Server>(opt_, reg_, incarnation_);
  port_ = server_->port();
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  if (stopping_.exchange(true)) return;
  server_->stop();
  if (fence_) fence_->close_fd();  // no peer opens the table any more; slots keep working
  std::unordered_map<uint64_t, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard lk(peers_mu_);
    peers.swap(peers_);
  }
  for (auto& kv : peers) {
    Peer* p = kv.second.get();
    {
      std::lock_guard lk(p->qmu);
      p->stopping = true;
    }
    p->qcv.notify_all();
    p->qspace.notify_all();
    for (auto& l : p->lanes) l->shutdown_fd();  // a lane blocked in I/O returns at once
    for (auto& t : p->workers)
      if (t.joinable()) t.join();
    for (auto& l : p->lanes) l->close_fd();
    p->unmap_all();
  }
}

void Engine::set_descriptor(const std::string& blob) { server_->set_descriptor(blob); }

std::vector<std::pair<std::string, uint64_t>> Engine::server_stats() const { return server_->stats(); }

// ---------------------------------------------------------------- peers

uint64_t Engine::add_peer(const std::string& host, uint16_t port, uint64_t incarnation, int pid,
                          const PeerRegions& regions) {
  auto p = std::make_shared<Peer>();
  p->host = host;
  p->port = port;
  p->incarnation = incarnation;
  p->pid = pid;
  p->regions = regions;
  for (int i = 0; i < opt_.lanes; ++i) p->lanes.emplace_back(new Lane());
  {
    std::lock_guard lk(peers_mu_);
    if (stopping_) throw KvError(E_INVALID, "engine is shut down");
    p->id = next_peer_++;
    peers_[p->id] = p;
  }
  Peer* raw = p.get();
  try {
    for (int i = 0; i < opt_.lanes; ++i) p->workers.emplace_back([this, raw, i] { worker_loop(raw, i); });
  } catch (const std::system_error& e) {
    remove_peer(p->id);  // stops the workers that did start
    throw KvError(E_TRANSFER, std::string("cannot start a worker for segment ") + host + ":" +
                                  std::to_string(port) + ": " + e.what() +
                                  " (raise the thread limit, ulimit -u, or use fewer lanes)");
  }
  return p->id;
}

void Engine::update_peer(uint64_t id, uint64_t incarnation, int pid, const PeerRegions& regions) {
  auto p = get_peer(id);
  bool restarted = p->incarnation.exchange(incarnation) != incarnation;
  if (pid != p->pid.load() || restarted) {
    // The process same-host copies go to: polled before each copy (execute_same_host).
    int fd = -1;
    if (pid != 0) {
      fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
      if (fd < 0 && errno == ESRCH) pid = 0;  // exited already: TCP, where the owner decides
    }
    std::unique_lock lk(p->maps_mu);  // waits for copies in progress
    if (p->pidfd >= 0) ::close(p->pidfd);
    p->pidfd = fd;
    p->alive_at_ns = INT64_MIN / 2;  // ask the new one before the next copy
  }
  p->pid = pid;
  {
    std::lock_guard lk(p->regions_mu);
    p->regions = regions;
  }
  if (restarted) {
    // Old connections point at the previous process: drop them (idle lanes only; busy lanes
    // drop theirs when they next see the incarnation changed: execute).
    for (auto& l : p->lanes) {
      std::unique_lock lk(l->mu, std::try_to_lock);
      if (lk.owns_lock()) l->close_fd();
    }
  }
  p->stale = false;
}

void Engine::set_peer_address(uint64_t id, const std::string& host, uint16_t port) {
  auto p = get_peer(id);
  {
    std::lock_guard lk(p->addr_mu);
    if (p->host == host && p->port == port) return;
    p->host = host;
    p->port = port;
  }
  for (auto& l : p->lanes) {
    std::unique_lock lk(l->mu, std::try_to_lock);
    if (lk.owns_lock()) l->close_fd();
  }
}

int Engine::set_peer_shm(uint64_t id, int pid,
                         const std::vector<std::tuple<uint64_t, uint64_t, int>>& bufs) {
  auto p = get_peer(id);
  std::vector<ShmMap> maps;
  for (auto& [remote, len, fd] : bufs) {
    std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    int local_fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (local_fd < 0) continue;  // not allowed here: stay on process_vm / TCP
    struct stat st{};
    void* addr = MAP_FAILED;
    if (fstat(local_fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= len)
      addr = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, local_fd, 0);
    ::close(local_fd);
    if (addr == MAP_FAILED) continue;
    if (len <= kPopulateInline) populate_write(static_cast<char*>(addr), len);
    maps.push_back(ShmMap{remote, len, static_cast<char*>(addr)});
  }
  int n = static_cast<int>(maps.size());
  bool big = std::any_of(maps.begin(), maps.end(), [](const ShmMap& m) { return m.len > kPopulateInline; });
  uint64_t gen;
  {
    std::unique_lock lk(p->maps_mu);
    for (auto& m : p->maps) munmap(m.local, m.len);
    p->maps.swap(maps);
    gen = ++p->maps_gen;
  }
  if (big) std::thread(populate_maps, p, gen).detach();  // ends when done or when replaced
  return n;
}

int Engine::peer_shm_count(uint64_t id) {
  auto p = get_peer(id);
  std::shared_lock lk(p->maps_mu);
  return static_cast<int>(p->maps.size());
}

bool Engine::set_peer_fence(uint64_t id, int pid, int fd,
                            const std::vector<std::tuple<uint64_t, uint64_t, int, uint64_t>>& regions) {
  auto p = get_peer(id);
  std::unique_ptr<Fence> f = Fence::map(pid, fd);
  std::vector<FenceRegion> fr;
  for (auto& [a, l, slot, gen] : regions) fr.push_back(FenceRegion{a, l, slot, gen});
  std::unique_lock lk(p->maps_mu);  // waits for copies in progress
  p->fence = std::move(f);
  p->fregions.swap(fr);
  if (p->fence == nullptr && pid != 0) p->pid = 0;  // no fence, no same-host path: TCP from now on
  return p->fence != nullptr;
}

uint64_t Engine::peer_fence_refused(uint64_t id) { return get_peer(id)->fence_refused.load(); }

bool Engine::peer_stale(uint64_t id) { return get_peer(id)->stale.load(); }
bool Engine::peer_same_host(uint64_t id) { return get_peer(id)->pid.load() != 0; }

void Engine::remove_peer(uint64_t id) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lk(peers_mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) throw KvError(E_SEGMENT_NOT_FOUND, "unknown segment handle");
    p = it->second;
    peers_.erase(it);
  }
  {
    std::lock_guard lk(p->qmu);
    p->stopping = true;
  }
  p->qcv.notify_all();
  p->qspace.notify_all();
  for (auto& l : p->lanes) l->shutdown_fd();  // a lane blocked in I/O returns at once
  for (auto& t : p->workers)
    if (t.joinable()) t.join();
  for (auto& l : p->lanes) l->close_fd();
  p->unmap_all();
}

std::shared_ptr<Peer> Engine::get_peer(uint64_t id) {
  std::lock_guard lk(peers_mu_);
  auto it = peers_.find(id);
  if (it == peers_.end()) throw KvError(E_SEGMENT_NOT_FOUND, "unknown segment handle; call open_segment first");
  return it->second;
}

std::shared_ptr<Batch> Engine::get_batch(uint64_t id) {
  std::lock_guard lk(batches_mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) throw KvError(E_INVALID, "unknown batch id (already freed?)");
  return it->second;
}

// ---------------------------------------------------------------- batches

namespace {
// Takes the next lens.size() free slots of b (under mu, which guards b.used) as PENDING; each
// expects one completion per slice of slice_size bytes, or exactly one when slice_size is 0.
uint32_t take_slots(Batch& b, std::mutex& mu, const std::vector<uint64_t>& lens, uint64_t slice_size) {
  size_t n = lens.size();
  uint32_t base;
  {
    std::lock_guard lk(mu);
    if (b.used + n > b.capacity)
      throw KvError(E_INVALID, "batch is full: " + std::to_string(n) + " request(s) do not fit: " +
                                   std::to_string(b.capacity - b.used) + " of its " +
                                   std::to_string(b.capacity) + " slots are free; allocate_batch_id(" +
                                   std::to_string(b.used + n) + ") or more, or submit fewer");
    base = b.used;
    b.used += static_cast<uint32_t>(n);
  }
  // Relaxed stores and a release of the state: a slot's readers load its state first (acquire),
  // and the fetch_add below publishes the whole range (4,096 seq_cst stores cost ~0.1 ms).
  for (size_t i = 0; i < n; ++i) {
    Slot& s = b.slots[base + i];
    s.length = lens[i];
    s.bytes.store(0, std::memory_order_relaxed);
    s.err.store(0, std::memory_order_relaxed);
    s.remaining.store(slice_size ? static_cast<uint32_t>((lens[i] + slice_size - 1) / slice_size) : 1,
                      std::memory_order_relaxed);
    s.state.store(S_PENDING, std::memory_order_release);
  }
  b.pending_slots.fetch_add(static_cast<uint32_t>(n));
  return base;
}
}  // namespace

uint64_t Engine::alloc_batch(uint32_t n) {
  if (n == 0) throw KvError(E_INVALID, "batch_size must be at least 1");
  auto b = std::make_shared<Batch>(n);
  std::lock_guard lk(batches_mu_);
  uint64_t id = next_batch_++;
  batches_[id] = std::move(b);
  return id;
}

void Engine::free_batch(uint64_t id) {
  std::lock_guard lk(batches_mu_);
  auto it = batches_.find(id);
  if (it == batches_.end()) throw KvError(E_INVALID, "unknown batch id (already freed?)");
  if (it->second->pending_slots.load() != 0)
    throw KvError(E_BATCH_IN_FLIGHT, "batch has transfers in flight; wait for them before freeing it");
  batches_.erase(it);
}

void Engine::validate(const std::vector<uint8_t>& ops, const std::vector<uint64_t>& locals,
                      const std::vector<uint64_t>& peers, const std::vector<uint64_t>& remotes,
                      const std::vector<uint64_t>& lens, std::vector<std::shared_ptr<Peer>>* resolved,
                std::vector<uint32_t>* regs) {
  size_t n = ops.size();
  if (locals.size() != n || peers.size() != n || remotes.size() != n || lens.size() != n)
    throw KvError(E_INVALID, "request arrays differ in length");
  std::unordered_map<uint64_t, std::shared_ptr<Peer>> cache;
  resolved->resize(n);
  regs->resize(n);
  std::shared_lock lk(reg_.mutex());
  for (size_t i = 0; i < n; ++i) {
    auto at = [i] { return " (request " + std::to_string(i) + ")"; };  // only built for an error
    if (ops[i] != OP_WRITE && ops[i] != OP_READ) throw KvError(E_INVALID, "opcode must be READ or WRITE" + at());
    if (lens[i] == 0) throw KvError(E_INVALID, "length must be positive" + at());
    if (!reg_.contains_locked(locals[i], lens[i], false, ops[i] == OP_READ))
      throw KvError(E_NOT_REGISTERED,
                    reg_.contains_locked(locals[i], lens[i], false)
                        ? "local range is registered read-only: it cannot receive a READ" + at()
                        : "local range is not inside registered memory; call register_local_memory first" + at());
    std::shared_ptr<Peer> p;
    if (i > 0 && peers[i] == peers[i - 1]) {
      p = (*resolved)[i - 1];  // the common case, one segment: no lookup
    } else {
      auto& cached = cache[peers[i]];
      if (!cached) {
        std::lock_guard pk(peers_mu_);
        auto it = peers_.find(peers[i]);
        if (it == peers_.end()) throw KvError(E_SEGMENT_NOT_FOUND, "unknown segment handle" + at());
        cached = it->second;
      }
      p = cached;
    }
    if (!p->remote_ok(remotes[i], lens[i], &(*regs)[i]))
      throw KvError(E_REMOTE_ACCESS,
                    "remote range is outside the segment's remote-accessible buffers" + at());
    (*resolved)[i] = std::move(p);
  }
}

uint32_t Engine::submit(uint64_t batch_id, const std::vector<uint8_t>& ops, const std::vector<uint64_t>& locals,
                    const std::vector<uint64_t>& peers, const std::vector<uint64_t>& remotes,
                    const std::vector<uint64_t>& lens) {
  auto b = get_batch(batch_id);
  std::vector<std::shared_ptr<Peer>> resolved;
  std::vector<uint32_t> regs;
  validate(ops, locals, peers, remotes, lens, &resolved, &regs);
  size_t n = ops.size();
  const uint64_t ss = opt_.slice_size;
  uint32_t base = take_slots(*b, batches_mu_, lens, ss);
  // A run of requests to the same peer is queued under its queue lock and a worker is woken per
  // whole group queued (and at the end), so workers take the run as large groups (one
  // process_vm_readv/writev or one frame per group) instead of racing the submitter slice by slice.
  for (size_t i = 0; i < n;) {
    Peer* p = resolved[i].get();
    uint64_t inc = p->incarnation.load();
    std::unique_lock lk(p->qmu);
    for (; i < n && resolved[i].get() == p; ++i) {
      for (uint64_t off = 0; off < lens[i]; off += ss) {
        if (p->queue.size() >= opt_.max_queue && !p->stopping) {
          // Back-pressure: wake the workers and wait for room rather than reject a big batch.
          p->qcv.notify_all();
          p->qspace.wait(lk, [&] { return p->queue.size() < opt_.max_queue || p->stopping; });
        }
        if (p->stopping) {
          lk.unlock();
          b->finish_slice(base + i, 0, ST_CANCELED);
          lk.lock();
          continue;
        }
        p->queue.push_back(Slice{b, static_cast<uint32_t>(base + i), ops[i], locals[i] + off, remotes[i] + off,
                                 std::min(ss, lens[i] - off), inc, regs[i]});
        if (p->queue.size() % kMaxGroup == 0) {  // a whole group is ready: let a worker start on it
          lk.unlock();
          p->qcv.notify_one();
          lk.lock();
        }
      }
    }
    lk.unlock();
    p->qcv.notify_all();
  }
  return base;  // slot index of the first request (callers that track slots use it)
}

uint32_t Engine::reserve_slots(uint64_t batch_id, const std::vector<uint64_t>& lens) {
  return take_slots(*get_batch(batch_id), batches_mu_, lens, 0);
}

void Engine::finish_slot(uint64_t batch_id, uint32_t idx, uint64_t nbytes, int32_t status) {
  auto b = get_batch(batch_id);
  if (idx >= b->capacity) throw KvError(E_INVALID, "index out of range of the batch");
  Slot& s = b->slots[idx];
  uint32_t one = 1;
  // Only a reserved, unfinished slot (one completion left) may be finished, and only once.
  if (s.state.load() != S_PENDING || !s.remaining.compare_exchange_strong(one, 0))
    throw KvError(E_INVALID, "slot " + std::to_string(idx) + " is not a reserved pending slot");
  if (status != ST_OK) s.err.store(status);
  s.bytes.store(nbytes);  // a failed request may report the bytes it moved before failing
  s.state.store(status == ST_OK ? S_COMPLETED : state_for(status), std::memory_order_release);
  if (b->pending_slots.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::lock_guard lk(b->mu);
    b->cv.notify_all();
  }
}

void Engine::finish_range(uint64_t batch_id, uint32_t first, const std::vector<uint64_t>& lens, int32_t status) {
  auto b = get_batch(batch_id);
  if (static_cast<uint64_t>(first) + lens.size() > b->capacity) throw KvError(E_INVALID, "index out of range of the batch");
  uint32_t done = 0;
  // One locked instruction per slot (the claim); the other stores are published by the state's
  // release (readers load the state first), as in take_slots.
  for (size_t i = 0; i < lens.size(); ++i) {
    Slot& s = b->slots[first + i];
    uint32_t one = 1;
    if (s.state.load(std::memory_order_acquire) != S_PENDING ||
        !s.remaining.compare_exchange_strong(one, 0, std::memory_order_acq_rel, std::memory_order_relaxed))
      continue;  // finished already
    if (status != ST_OK) s.err.store(status, std::memory_order_relaxed);
    s.bytes.store(status == ST_OK ? lens[i] : 0, std::memory_order_relaxed);
    s.state.store(status == ST_OK ? S_COMPLETED : state_for(status), std::memory_order_release);
    ++done;
  }
  if (done != 0 && b->pending_slots.fetch_sub(done, std::memory_order_acq_rel) == done) {
    std::lock_guard lk(b->mu);
    b->cv.notify_all();
  }
}

std::pair<int, uint64_t> Engine::fence_claim(uint64_t addr, uint64_t len) {
  std::unique_lock lk(reg_.mutex());  // the registry claims slots under it too
  uint64_t gen = 0;
  int slot = fence_ ? fence_->claim(addr, len, &gen) : -1;
  return {slot, gen};
}

void Engine::fence_retire_begin(int slot) {
  if (slot >= 0 && static_cast<uint32_t>(slot) < kFenceSlots && fence_ != nullptr) fence_->retire_begin(slot);
}

bool Engine::fence_retire(int slot, int timeout_ms) {
  if (slot < 0 || static_cast<uint32_t>(slot) >= kFenceSlots || fence_ == nullptr) return true;
  return fence_->retire(slot, timeout_ms < 0 ? opt_.timeout_ms : timeout_ms);
}

std::pair<int, uint64_t> Engine::status(uint64_t batch, uint32_t idx) {
  auto b = get_batch(batch);
  if (idx >= b->capacity) throw KvError(E_INVALID, "index out of range of the batch");
  Slot& s = b->slots[idx];
  return {s.state.load(std::memory_order_acquire), s.bytes.load()};
}

int Engine::slot_error(uint64_t batch, uint32_t idx) {
  auto b = get_batch(batch);
  if (idx >= b->capacity) throw KvError(E_INVALID, "index out of range of the batch");
  return b->slots[idx].err.load();
}

std::pair<int, uint64_t> Engine::batch_status(uint64_t batch) {
  auto b = get_batch(batch);
  uint32_t used;
  {
    std::lock_guard lk(batches_mu_);
    used = b->used;
  }
  uint64_t bytes = 0;
  int worst = S_COMPLETED;
  bool pending = false;
  for (uint32_t i = 0; i < used; ++i) {
    int st = b->slots[i].state.load(std::memory_order_acquire);
    bytes += b->slots[i].bytes.load();
    if (st == S_PENDING) pending = true;
    else if (st == S_TIMEOUT) worst = S_TIMEOUT;  // may still land: wins over other failures
    else if (st != S_COMPLETED && worst == S_COMPLETED) worst = st;
  }
  if (used == 0) return {S_WAITING, 0};
  return {pending ? S_PENDING : worst, bytes};
}

int Engine::wait(uint64_t batch, int timeout_ms) {
  auto b = get_batch(batch);
  std::unique_lock lk(b->mu);
  auto done = [&] { return b->pending_slots.load() == 0; };
  if (timeout_ms < 0) b->cv.wait(lk, done);
  else b->cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), done);
  lk.unlock();
  return batch_status(batch).first;
}

int Engine::transfer_sync(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                          const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens) {
  const size_t n = lens.size();
  std::vector<std::shared_ptr<Peer>> resolved;
  std::vector<uint32_t> regs;
  validate(std::vector<uint8_t>(n, op), locals, std::vector<uint64_t>(n, peer), remotes, lens, &resolved, &regs);
  if (n == 0) return ST_OK;
  Peer* p = resolved[0].get();
  // The caller skipped its own freshness check (one call less per small transfer): a peer seen
  // gone or restarted since its descriptor was read is refreshed by the caller first.
  if (p->stale.load()) return ST_STALE;
  // About one slice's worth (a value and its header, a few small ranges): what one lane would
  // carry anyway. More is queued and spread over the lanes.
  uint64_t total = 0;
  bool small = n <= kMaxGroup;
  for (size_t i = 0; small && i < n; ++i) {
    total += lens[i];
    small = lens[i] <= opt_.slice_size && total <= opt_.slice_size + kInlineExtra;
  }
  if (small) {
    // Inline: do the I/O in this thread (one group: one frame exchange over TCP) on an idle
    // lane, no thread hand-off.
    auto b = std::make_shared<Batch>(static_cast<uint32_t>(n));
    std::vector<Slice> group;
    group.reserve(n);
    const uint64_t inc = p->incarnation.load();
    for (size_t i = 0; i < n; ++i) {
      b->slots[i].remaining = 1;
      b->slots[i].state = S_PENDING;
      group.push_back(Slice{b, static_cast<uint32_t>(i), op, locals[i], remotes[i], lens[i], inc, regs[i]});
    }
    b->pending_slots = static_cast<uint32_t>(n);
    bool done = false;
    if (p->pid.load() != 0) {
      size_t handled = execute_same_host(p, group);
      done = handled == n;
      if (!done) group.erase(group.begin(), group.begin() + static_cast<long>(handled));
    }
    for (size_t i = 0; !done && i < p->lanes.size(); ++i) {
      Lane* lane = p->lanes[i].get();
      std::unique_lock lk(lane->mu, std::try_to_lock);
      if (!lk.owns_lock()) continue;
      lk.unlock();
      execute(p, lane, group);
      done = true;
    }
    int first = ST_OK;  // a finished slice failed: a timeout (may still land) wins over the rest
    for (size_t i = 0; i < n; ++i) {
      int err = b->slots[i].err.load();
      if (err == ST_TIMEOUT) return err;
      if (first == ST_OK) first = err;
    }
    if (first != ST_OK) return first;
    if (done) return ST_OK;
    // Every lane busy: queue the slices not yet done behind the others' work.
    std::vector<uint64_t> l2, r2, n2;
    for (const Slice& s : group) {
      l2.push_back(s.local);
      r2.push_back(s.remote);
      n2.push_back(s.len);
    }
    return transfer_queued(op, l2, peer, r2, n2);
  }
  return transfer_queued(op, locals, peer, remotes, lens);
}

int Engine::transfer_sync_scratch(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                                  const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens,
                                  uint64_t scratch, uint64_t scratch_len, bool read_only) {
  reg_.add(scratch, scratch_len, false, read_only);
  // Unregistered on every way out; remove() waits for accesses still inside a syscall, as the
  // Python-side unregister would.
  struct Unregister {
    Registry& reg;
    uint64_t addr;
    ~Unregister() {
      try {
        reg.remove(addr);
      } catch (...) {  // local-only: no fence to retire, nothing that can fail after the erase
      }
    }
  } undo{reg_, scratch};
  return transfer_sync(op, locals, peer, remotes, lens);
}

int Engine::transfer_queued(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                            const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens) {
  const size_t n = lens.size();
  uint64_t id = alloc_batch(static_cast<uint32_t>(n));
  try {
    submit(id, std::vector<uint8_t>(n, op), locals, std::vector<uint64_t>(n, peer), remotes, lens);
    wait(id, -1);
  } catch (...) {
    free_batch(id);
    throw;
  }
  int err = ST_OK;  // the first failure, or a timeout (it may still land) if any slot timed out
  for (size_t i = 0; i < n && err != ST_TIMEOUT; ++i) {
    int e = slot_error(id, static_cast<uint32_t>(i));
    if (e == ST_TIMEOUT || err == ST_OK) err = e;
  }
  free_batch(id);
  return err;
}

// ---------------------------------------------------------------- data path

void Engine::worker_loop(Peer* p, int lane_idx) {
  Lane* lane = p->lanes[lane_idx].get();
  std::vector<Slice> group;
  group.reserve(kMaxGroup);
  for (;;) {
    group.clear();
    {
      std::unique_lock lk(p->qmu);
      p->qcv.wait(lk, [&] { return !p->queue.empty() || p->stopping; });
      if (p->queue.empty()) return;  // stopping
      if (p->stopping) {
        // Engine shutting down: cancel what is queued.
        while (!p->queue.empty()) {
          Slice s = std::move(p->queue.front());
          p->queue.pop_front();
          s.batch->finish_slice(s.slot, 0, ST_CANCELED);
        }
        p->qspace.notify_all();
        return;
      }
      // One group: one opcode and one incarnation of the peer (the one every slice was submitted
      // for: execute checks the connection against the group's first slice).
      const uint8_t op = p->queue.front().op;
      const uint64_t inc = p->queue.front().incarnation;
      uint64_t bytes = 0;
      while (!p->queue.empty() && group.size() < kMaxGroup && p->queue.front().op == op &&
             p->queue.front().incarnation == inc &&
             (group.empty() || bytes + p->queue.front().len <= kGroupBytes)) {
        bytes += p->queue.front().len;
        group.push_back(std::move(p->queue.front()));
        p->queue.pop_front();
      }
      if (!p->queue.empty()) p->qcv.notify_one();
    }
    p->qspace.notify_all();
    if (p->pid.load() != 0) {
      size_t handled = execute_same_host(p, group);
      if (handled == group.size()) continue;
      group.erase(group.begin(), group.begin() + static_cast<long>(handled));
    }
    execute(p, lane, group);
  }
}

// Same-host path: one kernel copy between the two address spaces (or a plain copy through a mapped
// shared buffer), each inside a pin of the target's fence slot (fence.h), so the target's
// unregister is never raced. Returns how many slices from the front of the group it finished; the
// caller sends the rest over TCP, where the target decides. When the kernel refuses (EPERM/ENOSYS,
// e.g. ptrace restrictions) the peer stays on TCP from then on.
constexpr int64_t kAliveCheckNs = 200000;  // same-host peers: how often their liveness is polled

size_t Engine::execute_same_host(Peer* p, std::vector<Slice>& group) {
  const int pid = p->pid.load();
  if (pid == 0) return 0;
  std::shared_lock mlk(p->maps_mu);
  Fence* fence = p->fence.get();
  if (fence == nullptr) return 0;
  if (p->pidfd >= 0) {
    // The target exited: its fence slots still read live and its mapped buffers still take
    // copies, with nobody there. Fail the group; the engine re-fetches the segment. Asked at
    // most every kAliveCheckNs (a poll costs ~0.4 us, a 4 KiB copy ~1.5 us): a copy in that
    // window is one that landed just before the exit, as a copy right after a check always was.
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    if (now - p->alive_at_ns.load(std::memory_order_relaxed) > kAliveCheckNs) {
      pollfd pf{p->pidfd, POLLIN, 0};
      if (::poll(&pf, 1, 0) > 0) {
        p->stale = true;
        for (auto& s : group) s.batch->finish_slice(s.slot, 0, ST_PEER_CLOSED);
        return group.size();
      }
      p->alive_at_ns.store(now, std::memory_order_relaxed);
    }
  }
  for (size_t i = 0; i < group.size(); ++i) {
    Slice& s = group[i];
    if (s.incarnation != p->incarnation.load()) {
      s.batch->finish_slice(s.slot, 0, ST_PEER_RESTARTED);
      continue;
    }
    const FenceRegion* fr = nullptr;
    for (auto& r : p->fregions)
      if (s.remote >= r.addr && s.remote + s.len <= r.addr + r.len && r.slot >= 0) fr = &r;
    if (fr == nullptr || !fence->pin(fr->slot, fr->gen)) {
      if (fr != nullptr) p->fence_refused.fetch_add(1);
      return i;  // unregistered or changed since the descriptor: TCP, where the target decides
    }
    const ShmMap* hit = nullptr;
    for (auto& m : p->maps)
      if (s.remote >= m.remote && s.remote + s.len <= m.remote + m.len) hit = &m;
    if (hit != nullptr) {
      char* mapped = hit->local + (s.remote - hit->remote);
      auto* local = reinterpret_cast<char*>(s.local);
      if (s.op == OP_WRITE) copy_bytes(mapped, local, s.len);
      else copy_bytes(local, mapped, s.len);
      fence->unpin(fr->slot);
      s.batch->finish_slice(s.slot, s.len, ST_OK);
      continue;
    }
    // Consecutive slices of the same op inside the same fenced region, not in a mapped buffer: one
    // process_vm_readv/writev instead of a system call per slice (the scattered head slices of a
    // resharded KV load are thousands of 8-32 KiB ranges). Slices adjacent on one side share an
    // iovec element there, so a gather from one contiguous remote run into scattered local blocks
    // pins the remote pages once per run, not once per slice. The bytes the kernel reports are
    // in slice order; slices it covered whole are done, the rest (and every error) is left to the
    // one-slice path below.
    {
      constexpr size_t kMaxIov = 1024;  // UIO_MAXIOV
      constexpr size_t kMaxSlices = 8192;
      iovec liov[kMaxIov], riov[kMaxIov];
      size_t nl = 0, nr = 0, j = i;
      while (j < group.size() && j - i < kMaxSlices) {
        const Slice& t = group[j];
        if (j > i) {
          if (t.op != s.op || t.incarnation != s.incarnation || t.remote < fr->addr ||
              t.remote + t.len > fr->addr + fr->len)
            break;
          bool mapped = false;
          for (auto& m : p->maps)
            if (t.remote >= m.remote && t.remote + t.len <= m.remote + m.len) mapped = true;
          if (mapped) break;
        }
        auto* lp = reinterpret_cast<char*>(t.local);
        auto* rp = reinterpret_cast<char*>(t.remote);
        bool lmerge = nl > 0 && static_cast<char*>(liov[nl - 1].iov_base) + liov[nl - 1].iov_len == lp;
        bool rmerge = nr > 0 && static_cast<char*>(riov[nr - 1].iov_base) + riov[nr - 1].iov_len == rp;
        if ((!lmerge && nl == kMaxIov) || (!rmerge && nr == kMaxIov)) break;
        if (lmerge) liov[nl - 1].iov_len += t.len;
        else liov[nl++] = iovec{lp, t.len};
        if (rmerge) riov[nr - 1].iov_len += t.len;
        else riov[nr++] = iovec{rp, t.len};
        ++j;
      }
      const size_t k = j - i;
      if (k >= 2) {
        ssize_t n;
        do {
          n = s.op == OP_WRITE ? process_vm_writev(pid, liov, nl, riov, nr, 0)
                               : process_vm_readv(pid, liov, nl, riov, nr, 0);
        } while (n < 0 && errno == EINTR);
        size_t whole = 0;
        uint64_t covered = 0;
        while (n > 0 && whole < k && covered + group[i + whole].len <= static_cast<uint64_t>(n))
          covered += group[i + whole++].len;
        if (whole > 0) {
          fence->unpin(fr->slot);
          for (size_t q = 0; q < whole; ++q) group[i + q].batch->finish_slice(group[i + q].slot, group[i + q].len, ST_OK);
          i += whole - 1;
          continue;
        }
      }
    }
    uint64_t done = 0;
    bool gone = false, refused = false;
    while (done < s.len) {
      iovec l{reinterpret_cast<void*>(s.local + done), s.len - done};
      iovec r{reinterpret_cast<void*>(s.remote + done), s.len - done};
      ssize_t n = s.op == OP_WRITE ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                                   : process_vm_readv(pid, &l, 1, &r, 1, 0);
      if (n > 0) {
        done += static_cast<uint64_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == ESRCH) gone = true;
      else refused = true;
      if (n < 0 && (errno == EPERM || errno == ENOSYS || errno == EACCES)) p->pid = 0;
      break;
    }
    fence->unpin(fr->slot);
    if (gone) {  // the process is gone
      p->stale = true;
      s.batch->finish_slice(s.slot, 0, ST_PEER_CLOSED);
      continue;
    }
    if (refused) return i;  // let TCP (and the target's own checks) handle this slice and the rest
    s.batch->finish_slice(s.slot, s.len, ST_OK);
  }
  return group.size();
}

int Engine::connect_lane(Peer* p, Lane* lane) {
  std::string host;
  uint16_t port;
  {
    std::lock_guard lk(p->addr_mu);
    host = p->host;
    port = p->port;
  }
  int fd = dial(host, port, opt_.connect_timeout_ms);
  if (fd < 0) return ST_CONNECT;
  uint64_t inc = 0;
  int32_t st = client_hello(fd, opt_.secret, &inc, opt_.connect_timeout_ms);
  if (st != ST_OK) {
    ::close(fd);
    return st;
  }
  set_timeouts(fd, opt_.timeout_ms);
  lane->incarnation = inc;
  lane->set_fd(fd);
  return ST_OK;
}

void Engine::execute(Peer* p, Lane* lane, std::vector<Slice>& group) {
  std::lock_guard lk(lane->mu);
  size_t done = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool fresh = false;
    // Connected to a previous process of the peer (it restarted since): connect again.
    if (lane->fd >= 0 && lane->incarnation != p->incarnation.load()) lane->close_fd();
    if (lane->fd < 0) {
      bool stopping;
      {
        std::lock_guard qlk(p->qmu);
        stopping = p->stopping;
      }
      if (stopping) {  // the engine is closing or the segment was closed: no new connection
        for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, ST_CANCELED);
        return;
      }
      int32_t st = connect_lane(p, lane);
      if (st != ST_OK) {
        p->stale = true;
        for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, st);
        return;
      }
      fresh = true;
    }
    if (lane->incarnation != p->incarnation.load() || lane->incarnation != group[done].incarnation) {
      // The process behind the address is not the one the descriptor described.
      p->stale = true;
      for (size_t i = done; i < group.size(); ++i)
        group[i].batch->finish_slice(group[i].slot, 0, ST_PEER_RESTARTED);
      return;
    }
    size_t before = done;
    int32_t st = tcp_io(p, lane, group, &done);
    if (st == ST_OK) return;
    lane->close_fd();
    // A pooled connection that broke before any reply may just be stale: retry once on a new one.
    if (!fresh && done == before && st == ST_PEER_CLOSED && attempt == 0) continue;
    p->stale = true;
    for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, st);
    return;
  }
}

// Pipelines a group of same-op slices over one connection. `done` counts slices finished.
int Engine::tcp_io(Peer* p, Lane* lane, std::vector<Slice>& group, size_t* done) {
  const int fd = lane->fd;
  FrameDeadline dl(fd, opt_.timeout_ms);  // every request and reply of the group, however it trickles
  const size_t start = *done;
  const size_t n = group.size() - start;
  const bool is_write = group[start].op == OP_WRITE;
  std::vector<ReqHdr> hdrs(n);
  std::vector<iovec> iov;
  iov.reserve(is_write ? 2 * n : n);
  for (size_t i = 0; i < n; ++i) {
    const Slice& s = group[start + i];
    hdrs[i] = ReqHdr{kReqMagic, s.op, 0, 0, static_cast<uint32_t>(i), s.reg, s.remote, s.len};
    iov.push_back({&hdrs[i], sizeof(ReqHdr)});
    if (is_write) iov.push_back({reinterpret_cast<void*>(s.local), s.len});
  }
  // Requests go out in one gather write; for READ the headers are tiny, for WRITE the replies are,
  // so neither side can block the other.
  int32_t st = writev_all(fd, iov.data(), static_cast<int>(iov.size()));
  if (st != ST_OK) return st;
  if (is_write) {
    std::vector<RespHdr> resp(n);
    st = recv_all(fd, resp.data(), n * sizeof(RespHdr));
    if (st != ST_OK) return st;
    for (size_t i = 0; i < n; ++i) {
      if (resp[i].magic != kRespMagic || resp[i].id != i) return ST_BAD_FRAME;
      Slice& s = group[start + i];
      if (resp[i].status == ST_REREGISTERED) p->stale = true;  // re-fetch the descriptor
      s.batch->finish_slice(s.slot, resp[i].status == ST_OK ? s.len : 0, resp[i].status);
      ++*done;
    }
    return ST_OK;
  }
  for (size_t i = 0; i < n; ++i) {
    RespHdr r{};
    st = recv_all(fd, &r, sizeof(r));
    if (st != ST_OK) return st;
    Slice& s = group[start + i];
    if (r.magic != kRespMagic || r.id != i) return ST_BAD_FRAME;
    if (r.status == ST_OK) {
      if (r.len != s.len) return ST_BAD_FRAME;
      st = recv_all(fd, reinterpret_cast<void*>(s.local), s.len);
      if (st != ST_OK) return st;
    }
    if (r.status == ST_REREGISTERED) p->stale = true;  // re-fetch the descriptor
    s.batch->finish_slice(s.slot, r.status == ST_OK ? s.len : 0, r.status);
    ++*done;
  }
  return ST_OK;
}

std::pair<uint64_t, std::string> Engine::fetch_descriptor(const std::string& host, uint16_t port,
                                                          const std::string& secret, int timeout_ms) {
  int fd = dial(host, port, timeout_ms);
  if (fd < 0)
    throw KvError(E_SEGMENT_NOT_FOUND, "cannot connect to segment " + host + ":" + std::to_string(port) +
                                           " (is its engine running and listening there?)");
  uint64_t inc = 0;
  int32_t st = client_hello(fd, secret, &inc, timeout_ms);
  if (st != ST_OK) {
    ::close(fd);
    if (st == ST_AUTH || st == ST_PEER_UNPROVEN) throw KvError(E_AUTH, status_text(st));
    throw KvError(E_SEGMENT_NOT_FOUND, std::string("handshake with ") + host + ":" + std::to_string(port) +
                                           " failed: " + status_text(st));
  }
  ReqHdr h{kReqMagic, OP_GET_DESC, 0, 0, 0, 0, 0, 0};
  RespHdr r{};
  std::string blob;
  {
  FrameDeadline dl(fd, timeout_ms);
  st = send_all(fd, &h, sizeof(h));
  if (st == ST_OK) st = recv_all(fd, &r, sizeof(r));
  if (st == ST_OK && (r.magic != kRespMagic || r.status != ST_OK || r.len > (64u << 20))) st = ST_BAD_FRAME;
  if (st == ST_OK) {
    blob.resize(r.len);
    st = recv_all(fd, blob.data(), r.len);
  }
  }
  ::close(fd);
  if (st != ST_OK)
    throw KvError(E_SEGMENT_NOT_FOUND, std::string("cannot read descriptor of ") + host + ":" +
                                           std::to_string(port) + ": " + status_text(st));
  return {inc, blob};
}

}  // namespace kvpool

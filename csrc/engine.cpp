// The transfer engine: the memory registry, the engine's lifecycle (its server, shutdown), the
// peers (segments opened) and the fence slots of its own registrations. The rest of the engine:
// engine_batch.cpp, engine_tcp.cpp, engine_samehost.cpp, engine_net.cpp (engine_internal.h).

#include "engine.h"
#include "server.h"

#include <errno.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <system_error>
#include <thread>

namespace kvpool {

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
  // A removed range a stopped same-host peer is still copying into: its copy would land here.
  bool busy = false;
  retiring_.erase(std::remove_if(retiring_.begin(), retiring_.end(),
                                 [&](const Retiring& r) {
                                   if (!still_pinned(r)) return true;  // done: forget it
                                   busy = busy || (r.addr < addr + len && addr < r.addr + r.len);
                                   return false;
                                 }),
                  retiring_.end());
  if (busy)
    throw KvError(E_REGISTRATION,
                  "a same-host peer is still inside a copy into this range (unregistered under it); it cannot be "
                  "registered again until that peer continues or exits");
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
    if (st->fence_slot >= 0 && fence_ != nullptr) {
      // No same-host copy starts from now on; the range stays reserved while one is inside.
      fence_->retire_begin(st->fence_slot);
      retiring_.push_back(Retiring{addr, st->r.len, st->fence_slot, st->fence_gen + 1});
    }
  }
  // Accesses already inside one socket syscall finish (bounded by a syscall, not by the peer);
  // every later one sees `dead` and is refused.
  while (st->active.load() != 0) std::this_thread::yield();
  // Same-host initiators: no copy starts after this, and the ones inside a copy finish first.
  if (st->fence_slot >= 0 && fence_ != nullptr && !fence_->retire(st->fence_slot, retire_timeout_ms_))
    throw KvError(E_REGISTRATION,
                  "unregistered, but a same-host peer is stopped inside a copy into this buffer; no new "
                  "copy can start: do not free or reuse the memory until that peer continues or exits");
  if (st->fence_slot >= 0 && fence_ != nullptr) {
    std::unique_lock lk(mu_);
    retiring_.erase(std::remove_if(retiring_.begin(), retiring_.end(),
                                   [&](const Retiring& r) {
                                     return r.slot == st->fence_slot && r.gen == st->fence_gen + 1;
                                   }),
                    retiring_.end());
  }
}

bool Registry::still_pinned(const Retiring& r) const {
  if (fence_ == nullptr) return false;
  // The slot taken again (a later registration): that is not this range's pin any more.
  if (__atomic_load_n(&fence_->slot(r.slot)->gen, __ATOMIC_SEQ_CST) != r.gen) return false;
  return fence_->pinned(r.slot);
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
  fence_ = Fence::create(incarnation_);  // null without memfd: then same-host peers use TCP
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

}  // namespace kvpool

// Native data path of the kvpool transfer engine: memory registry, TCP server, per-peer lanes,
// same-host copies, batches. No Python here; bindings live in module.cpp.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>

#include "fence.h"
#include "wire.h"

namespace kvpool {

// Error kinds mapped to kvpool.errors classes by the bindings.
enum ErrKind {
  E_INVALID = 1,
  E_NOT_REGISTERED,
  E_REGISTRATION,
  E_REMOTE_ACCESS,
  E_SEGMENT_NOT_FOUND,
  E_AUTH,
  E_TRANSFER,
  E_TIMEOUT,
  E_BATCH_IN_FLIGHT,
  E_PROTOCOL,
};

struct KvError : std::runtime_error {
  int kind;
  KvError(int k, const std::string& m) : std::runtime_error(m), kind(k) {}
};

enum State : int { S_WAITING = 0, S_PENDING, S_COMPLETED, S_FAILED, S_TIMEOUT, S_CANCELED, S_INVALID };

struct Region {
  uint64_t addr;
  uint64_t len;
  bool remote;
  bool read_only;  // local source only: never the destination of a READ
  int device = -1;  // CUDA device ordinal of GPU memory (served by staging copies), -1: host memory
};

// A live registration. The server touches its memory only inside a RegionAccess (one socket
// syscall at a time), never under the registry lock; unregistering marks it dead and waits for
// the accesses already inside a syscall (microseconds), so a slow or trickling peer cannot delay
// register/unregister and never lands a byte after unregister returns.
struct RegionState {
  Region r;
  uint32_t id = 0;  // registration id (published in the descriptor; requests naming another are refused)
  int fence_slot = -1;  // same-host fence slot (-1: reachable over TCP only)
  uint64_t fence_gen = 0;
  std::atomic<int> active{0};
  std::atomic<bool> dead{false};
};

// Scoped access to a pinned region; ok() is false once the region was unregistered.
class RegionAccess {
 public:
  // A null state is an access to nothing (always ok).
  explicit RegionAccess(RegionState* s) : s_(s), ok_(true) {
    if (!s_) return;
    s_->active.fetch_add(1);
    ok_ = !s_->dead.load();
    if (!ok_) s_->active.fetch_sub(1);
  }
  ~RegionAccess() {
    if (s_ && ok_) s_->active.fetch_sub(1);
  }
  RegionAccess(const RegionAccess&) = delete;
  RegionAccess& operator=(const RegionAccess&) = delete;
  bool ok() const { return ok_; }

 private:
  RegionState* s_;
  bool ok_;
};

// Registered memory. contains() is what submit (local access) checks against; pin() is the one
// place the server (and later GPU staging) looks a remote range up.
class Registry {
 public:
  // Returns the same-host fence (slot, generation) of a remote-accessible region; slot -1: none.
  // device >= 0: GPU memory of that CUDA device, reached by the server through staging copies only
  // (never a local source/destination of the native data path, no same-host fence slot).
  // Returns (fence slot, fence generation, registration id).
  std::tuple<int, uint64_t, uint32_t> add(uint64_t addr, uint64_t len, bool remote, bool read_only = false,
                                          int device = -1);
  void remove(uint64_t addr);
  void set_fence(Fence* f, int retire_timeout_ms) {
    fence_ = f;
    retire_timeout_ms_ = retire_timeout_ms;
  }
  bool contains(uint64_t addr, uint64_t len, bool need_remote) const;
  std::shared_mutex& mutex() const { return mu_; }
  bool contains_locked(uint64_t addr, uint64_t len, bool need_remote, bool need_writable = false) const;
  // The live registration holding [addr, addr+len), or null. Hold the pointer across frames;
  // touch memory only inside a RegionAccess on it.
  std::shared_ptr<RegionState> pin(uint64_t addr, uint64_t len, bool need_remote) const;
  std::vector<Region> list() const;

 private:
  mutable std::shared_mutex mu_;
  std::map<uint64_t, std::shared_ptr<RegionState>> regions_;
  Fence* fence_ = nullptr;
  int retire_timeout_ms_ = 30000;
  uint32_t next_id_ = 0;  // under mu_; ids are never 0
  // Under mu_: removed ranges whose fence slot was retired (generation `gen`) but may still be
  // pinned by a same-host peer inside a copy (remove waiting, or its retire timed out). add()
  // refuses an overlapping range while the pin is held: the peer's copy would land in it.
  struct Retiring {
    uint64_t addr, len;
    int slot;
    uint64_t gen;
  };
  std::vector<Retiring> retiring_;
  bool still_pinned(const Retiring& r) const;
};

struct Slot {
  std::atomic<int> state{S_WAITING};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint32_t> remaining{0};
  std::atomic<int> err{0};  // first error status
  uint64_t length = 0;
};

struct Batch {
  explicit Batch(uint32_t n) : capacity(n), slots(new Slot[n]) {}
  uint32_t capacity;
  uint32_t used = 0;  // guarded by Engine::batches_mu_ during submit
  std::unique_ptr<Slot[]> slots;
  std::atomic<uint32_t> pending_slots{0};
  std::mutex mu;
  std::condition_variable cv;
  void finish_slice(uint32_t idx, uint64_t nbytes, int32_t status);
};

struct Slice {
  std::shared_ptr<Batch> batch;
  uint32_t slot;
  uint8_t op;
  uint64_t local;
  uint64_t remote;
  uint64_t len;
  uint64_t incarnation;
  uint32_t reg = 0;  // the target's registration id of the remote range (0: unchecked)
};

struct Lane {
  std::mutex mu;  // held by the one thread using the lane, across its socket I/O
  // Guards changes of fd, never held across I/O: shutdown()/remove_peer() shut a busy lane's
  // socket down under it (the thread blocked in recv returns at once) without waiting for mu.
  std::mutex fd_mu;
  int fd = -1;
  uint64_t incarnation = 0;
  void set_fd(int f) {
    std::lock_guard lk(fd_mu);
    fd = f;
  }
  void close_fd() {
    std::lock_guard lk(fd_mu);
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  // Closes with a reset (SO_LINGER {1, 0}) instead of a FIN: what the kernel still holds of our
  // requests is dropped, not delivered, and the target sees the connection fail (EPOLLERR) before
  // it reads the frames already in its socket buffer — so a request we reported failed or timed
  // out does not land later (a target stopped or stalled while it sat there).
  void abort_fd() {
    std::lock_guard lk(fd_mu);
    if (fd >= 0) {
      linger lg{1, 0};
      (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
      ::close(fd);
    }
    fd = -1;
  }
  void shutdown_fd() {
    std::lock_guard lk(fd_mu);
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
};

class Engine;

// A remote shared-memory buffer mapped into this process (same-host peers only).
struct ShmMap {
  uint64_t remote;  // the buffer's address in the peer
  uint64_t len;
  char* local;      // where it is mapped here
};

// A remote registration as the initiator's descriptor names it, with its fence slot.
struct FenceRegion {
  uint64_t addr;
  uint64_t len;
  int slot;
  uint64_t gen;
};

struct Peer {
  uint64_t id;
  std::mutex addr_mu;  // host and port (a restarted segment may listen elsewhere)
  std::string host;
  uint16_t port;
  std::atomic<uint64_t> incarnation{0};
  std::atomic<int> pid{0};  // same-host target pid, 0 = not same host / disabled
  // pidfd of that process (under maps_mu; -1: none, or no pidfd_open here): polled before every
  // same-host copy, since a copy through a mapped buffer or into a live-looking fence slot of a
  // process that exited would "succeed" with nobody there.
  int pidfd = -1;
  std::atomic<int64_t> alive_at_ns{INT64_MIN / 2};  // when pidfd last showed the process alive
  std::atomic<bool> stale{false};
  std::mutex regions_mu;
  std::vector<std::tuple<uint64_t, uint64_t, uint32_t>> regions;  // remote-accessible buffers (addr, len, id)
  std::mutex qmu;
  std::condition_variable qcv;
  std::condition_variable qspace;
  std::deque<Slice> queue;
  bool stopping = false;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::vector<std::thread> workers;
  std::shared_mutex maps_mu;  // held shared while copying on the same-host path
  std::vector<ShmMap> maps;
  uint64_t maps_gen = 0;  // changed (under maps_mu) whenever maps are replaced or unmapped
  std::unique_ptr<Fence> fence;  // the target's fence table; no fence, no same-host path
  std::vector<FenceRegion> fregions;
  std::atomic<uint64_t> fence_refused{0};
  // Whether [addr, addr+len) lies in one remote-accessible buffer; *reg: that buffer's id.
  bool remote_ok(uint64_t addr, uint64_t len, uint32_t* reg);
  void unmap_all();
  ~Peer();
};

struct EngineOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string secret;
  int lanes = 2;
  uint64_t slice_size = 1 << 20;
  int timeout_ms = 30000;
  int connect_timeout_ms = 5000;
  uint64_t max_frame = 256ull << 20;
  size_t max_queue = 16384;
  // Server bounds (hostile peers): event-loop threads, open connections in total and per peer
  // address, idle time of an authenticated connection before it is closed. The handshake must
  // finish within connect_timeout_ms and every request frame within timeout_ms.
  int server_threads = 2;
  int max_connections = 16384;
  int max_connections_per_peer = 256;
  int idle_timeout_ms = 120000;
};

class Server;

class Engine {
 public:
  explicit Engine(const EngineOptions& opt);
  ~Engine();
  void shutdown();

  uint16_t port() const { return port_; }
  uint64_t incarnation() const { return incarnation_; }
  Registry& registry() { return reg_; }
  void set_descriptor(const std::string& blob);

  using PeerRegions = std::vector<std::tuple<uint64_t, uint64_t, uint32_t>>;  // (addr, len, registration id)
  uint64_t add_peer(const std::string& host, uint16_t port, uint64_t incarnation, int pid, const PeerRegions& regions);
  void update_peer(uint64_t id, uint64_t incarnation, int pid, const PeerRegions& regions);
  // The segment now listens at host:port (restarted elsewhere): idle connections are dropped, busy
  // ones when they next find the peer's incarnation changed.
  void set_peer_address(uint64_t id, const std::string& host, uint16_t port);
  // Maps the peer's shared-memory buffers (remote addr, len, fd in the peer) through /proc/<pid>/fd.
  // Returns how many could be mapped; the others keep using process_vm_readv/writev or TCP.
  int set_peer_shm(uint64_t id, int pid, const std::vector<std::tuple<uint64_t, uint64_t, int>>& bufs);
  int peer_shm_count(uint64_t id);
  // Maps the target's fence table (fd in the target) and records its registrations' slots. Without
  // it the same-host path is off for this peer (everything goes over TCP). Returns whether mapped.
  bool set_peer_fence(uint64_t id, int pid, int fd, const std::vector<std::tuple<uint64_t, uint64_t, int, uint64_t>>& regions);
  uint64_t peer_fence_refused(uint64_t id);
  int fence_fd() const { return fence_ ? fence_->fd() : -1; }
  bool peer_stale(uint64_t id);
  bool peer_same_host(uint64_t id);
  void remove_peer(uint64_t id);

  uint64_t alloc_batch(uint32_t n);
  void free_batch(uint64_t id);
  uint32_t submit(uint64_t batch, const std::vector<uint8_t>& ops, const std::vector<uint64_t>& locals,
              const std::vector<uint64_t>& peers, const std::vector<uint64_t>& remotes,
              const std::vector<uint64_t>& lens);
  std::pair<int, uint64_t> status(uint64_t batch, uint32_t idx);
  int slot_error(uint64_t batch, uint32_t idx);
  std::pair<int, uint64_t> batch_status(uint64_t batch);
  std::pair<int, uint64_t> wait(uint64_t batch, int timeout_ms);  // batch_status once none is pending, or at the timeout
  // A few requests of one opcode to one peer, done in the calling thread when a lane is free
  // (one group: one frame exchange over TCP, or same-host copies) and queued otherwise; waits.
  // Returns ST_OK or the first failed request's Status.
  int transfer_sync(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                    const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens);
  // transfer_sync with one more host range, [scratch, scratch+scratch_len), registered local-only
  // (read-only when asked) for the call's duration only: a fresh result buffer or a value being
  // put, without a registration round trip through Python. Registration errors (an overlap: the
  // same value is being put by another thread) raise before anything moves.
  int transfer_sync_scratch(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                            const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens,
                            uint64_t scratch, uint64_t scratch_len, bool read_only);
  // Slots completed outside the native data path (transports written in Python, wrappers):
  // reserve_slots takes the next lens.size() free slots of a batch as PENDING (one completion
  // each) and returns the first index; finish_slot completes one of them once (ST_OK or an error
  // status, e.g. ST_TRANSPORT when the caller keeps the reason itself).
  uint32_t reserve_slots(uint64_t batch, const std::vector<uint64_t>& lens);
  void finish_slot(uint64_t batch, uint32_t idx, uint64_t nbytes, int32_t status);
  // Completes slots first .. first+lens.size()-1 at once (each with its len on ST_OK, 0 otherwise).
  void finish_range(uint64_t batch, uint32_t first, const std::vector<uint64_t>& lens, int32_t status);
  // Fence slots for registrations the native registry does not hold (GPU memory reached through
  // CUDA IPC): claim returns (slot, generation), slot -1 when the table is full or absent;
  // retire_begin bumps the generation (every later pin fails) and returns at once; retire bumps it
  // too and waits for live pins up to timeout_ms (< 0: the engine's timeout), false when a stopped
  // peer still holds one. The caller that waited for something else since retire_begin passes
  // what is left of its deadline (CudaIpcTransport.unregister: one timeout in all).
  std::pair<int, uint64_t> fence_claim(uint64_t addr, uint64_t len);
  void fence_retire_begin(int slot);
  bool fence_retire(int slot, int timeout_ms = -1);

  // Counters of the server (accepted, refused, reaped, open...).
  std::vector<std::pair<std::string, uint64_t>> server_stats() const;

  // Fetches a peer's descriptor over its handshake port. Returns (incarnation, blob).
  static std::pair<uint64_t, std::string> fetch_descriptor(const std::string& host, uint16_t port,
                                                           const std::string& secret, int timeout_ms);

 private:
  friend struct Worker;
  void worker_loop(Peer* p, int lane_idx);
  void execute(Peer* p, Lane* lane, std::vector<Slice>& group);
  size_t execute_same_host(Peer* p, std::vector<Slice>& group);
  int tcp_io(Peer* p, Lane* lane, std::vector<Slice>& group, size_t* done);
  int connect_lane(Peer* p, Lane* lane);
  std::shared_ptr<Batch> get_batch(uint64_t id);
  std::shared_ptr<Peer> get_peer(uint64_t id);
  int transfer_queued(uint8_t op, const std::vector<uint64_t>& locals, uint64_t peer,
                      const std::vector<uint64_t>& remotes, const std::vector<uint64_t>& lens);
  void validate(const std::vector<uint8_t>& ops, const std::vector<uint64_t>& locals,
                const std::vector<uint64_t>& peers, const std::vector<uint64_t>& remotes,
                const std::vector<uint64_t>& lens, std::vector<std::shared_ptr<Peer>>* resolved,
                std::vector<uint32_t>* regs);

  EngineOptions opt_;
  uint64_t incarnation_;
  uint16_t port_ = 0;
  std::unique_ptr<Fence> fence_;  // declared before reg_: outlives it
  Registry reg_;
  std::atomic<bool> stopping_{false};
  std::unique_ptr<Server> server_;

  std::mutex batches_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Batch>> batches_;
  uint64_t next_batch_ = 1;

  std::mutex peers_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Peer>> peers_;
  uint64_t next_peer_ = 1;
};

// Parses a byte string as the server would parse a request stream (used by fuzz tests).
// Returns the number of complete frames; throws KvError(E_PROTOCOL) on a fatal frame.
struct ParsedFrame {
  uint8_t op;
  uint32_t id;
  uint64_t addr;
  uint64_t len;
  int32_t status;
};
std::vector<ParsedFrame> decode_frames(const std::string& data, uint64_t max_frame);
std::string encode_request(uint8_t op, uint32_t id, uint64_t addr, uint64_t len);
// The client's hello for a server challenge (tests craft raw connections with it).
std::string encode_hello(const std::string& secret, const std::string& challenge, uint16_t version);

}  // namespace kvpool

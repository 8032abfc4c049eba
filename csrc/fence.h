// Same-host fence: the target decides on the same-host path too (issue 12, deliverable 2).
//
// The target keeps a small shared-memory table (a memfd the initiator maps through
// /proc/<pid>/fd/<fd>) with one slot per remote-accessible registration: its generation (odd = live)
// and one pin counter per initiator lane. An initiator copying with process_vm_writev/readv or
// through a mapped shared buffer first pins the slot (counter += 1), then checks the generation
// its descriptor named, copies, and unpins. Unregistering bumps the generation (even = dead), then
// waits until no live initiator holds a pin. Both sides use sequentially consistent atomics, so
// either the initiator sees the new generation (and sends the request over TCP, where the target
// refuses it) or the target sees the pin and waits: an unregistered or shrunk (re-registered)
// region is never written through the same-host path. A pin left by a process that died is
// ignored (its lane pid is gone); one held by a live but stopped process makes unregister wait up
// to a bound and then fail, rather than free memory a peer may still write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kvpool {

constexpr uint32_t kFenceMagic = 0x4346564B;  // "KVFC"
constexpr int kFenceLanes = 64;
constexpr uint32_t kFenceSlots = 4096;

struct FenceSlot {
  uint64_t gen;  // odd: live registration; even: free or retired
  uint64_t addr;
  uint64_t len;
  uint32_t pins[kFenceLanes];
};

struct FenceHeader {
  uint32_t magic;
  uint32_t nslots;
  int32_t lanes[kFenceLanes];  // pid of the initiator holding each lane, 0 = free
  uint64_t owner;  // the engine's incarnation: a stale descriptor naming a reused fd is told apart
  uint64_t pad[30];
};

class Fence {
 public:
  ~Fence();
  // Target side: a fresh table in a memfd (null when memfd is unavailable), stamped with its
  // engine's incarnation.
  static std::unique_ptr<Fence> create(uint64_t owner);
  // Initiator side: the target's table, and a lane in it (null when it cannot be mapped, or when
  // `owner` is not 0 and the table is another engine's: the descriptor's engine shut down and the
  // fd number now names a later engine's table, whose slots and generations may match).
  static std::unique_ptr<Fence> map(int pid, int fd, uint64_t owner);

  int fd() const { return fd_; }
  // Target side, at shutdown: close the memfd peers open the table through (the mapping stays).
  void close_fd();
  int lane() const { return lane_; }

  // Target: a slot for a new registration; returns -1 when the table is full (then the region is
  // reachable over TCP only). *gen receives the live generation.
  int claim(uint64_t addr, uint64_t len, uint64_t* gen);
  // Target: retire a slot (bump its generation: every later pin fails) without waiting.
  void retire_begin(int slot);
  // Target: whether a live initiator still holds a pin on the slot (pins of exited lanes ignored).
  bool pinned(int slot);
  // Target: retire_begin, then wait until pinned() is false or timeout_ms passed (polled with a
  // backoff of 100 us doubling to 10 ms, never sleeping past the deadline). False: a live
  // initiator still holds a pin (the slot stays retired; no new copy can start). A caller that
  // waited for something else since retire_begin passes only what is left of its own deadline.
  bool retire(int slot, int timeout_ms);

  // Initiator: pin a slot if it still has generation `gen`.
  bool pin(int slot, uint64_t gen);
  void unpin(int slot);
  // Initiator: the pinned pid of the lane holder, for diagnostics.
  FenceSlot* slot(int i);

 private:
  Fence() = default;
  FenceHeader* hdr() { return reinterpret_cast<FenceHeader*>(base_); }
  int fd_ = -1;
  bool owner_ = false;
  char* base_ = nullptr;
  size_t size_ = 0;
  int lane_ = -1;
  uint32_t next_ = 0;
};

size_t fence_bytes();

}  // namespace kvpool

// The transfer engine's batches: slots, submit (slices queued to the peers' lanes), the
// completions, status and wait, and the synchronous transfers (inline on an idle lane when small).

#include "engine_internal.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_map>

namespace kvpool {

namespace {

constexpr uint64_t kInlineExtra = 64 << 10;  // transfer_sync: bytes beyond one slice still done inline

int state_for(int32_t st) { return st == ST_TIMEOUT ? S_TIMEOUT : (st == ST_CANCELED ? S_CANCELED : S_FAILED); }

}  // namespace

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

std::pair<int, uint64_t> Engine::wait(uint64_t batch, int timeout_ms) {
  auto b = get_batch(batch);
  std::unique_lock lk(b->mu);
  auto done = [&] { return b->pending_slots.load() == 0; };
  if (timeout_ms < 0) b->cv.wait(lk, done);
  else b->cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), done);
  lk.unlock();
  return batch_status(batch);
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

}  // namespace kvpool

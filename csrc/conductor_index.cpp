// kvpool._conductor: XXH64, the block hash chain, direct updates (add/remove/clear), the queries
// and the eviction under the cap of PrefixIndex (see conductor.h).

#include "conductor.h"

#include <thread>

namespace kvpool_conductor {

namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t rd64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian host (x86-64, aarch64)
}
inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t xround(uint64_t acc, uint64_t in) {
  acc += in * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}
inline uint64_t xmerge(uint64_t acc, uint64_t val) {
  acc ^= xround(0, val);
  return acc * P1 + P4;
}

}  // namespace

uint64_t xxh64(const uint8_t* p, size_t len, uint64_t seed) {
  const uint8_t* end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const uint8_t* limit = end - 32;
    do {
      v1 = xround(v1, rd64(p));
      v2 = xround(v2, rd64(p + 8));
      v3 = xround(v3, rd64(p + 16));
      v4 = xround(v4, rd64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = xmerge(h, v1);
    h = xmerge(h, v2);
    h = xmerge(h, v3);
    h = xmerge(h, v4);
  } else {
    h = seed + P5;
  }
  h += static_cast<uint64_t>(len);
  while (p + 8 <= end) {
    h ^= xround(0, rd64(p));
    h = rotl(h, 27) * P1 + P4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(rd32(p)) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  while (p < end) {
    h ^= (*p) * P5;
    h = rotl(h, 11) * P1;
    ++p;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

// -- hashing --------------------------------------------------------------------------------------

std::vector<uint64_t> PrefixIndex::chain(const uint32_t* tokens, size_t n,
                                         const std::vector<Span>& extra, uint64_t parent) const {
  std::vector<uint64_t> out;
  chain_into(tokens, n, extra, parent, out);
  return out;
}

void PrefixIndex::chain_into(const uint32_t* tokens, size_t n, const std::vector<Span>& extra,
                             uint64_t parent, std::vector<uint64_t>& out) const {
  size_t blocks = n / block_size_;
  out.clear();
  out.reserve(blocks);
  const size_t tok_bytes = block_size_ * 4;
  std::string buf;
  for (size_t i = 0; i < blocks; ++i) {
    const uint8_t* tp = reinterpret_cast<const uint8_t*>(tokens + i * block_size_);
    if (i < extra.size() && extra[i].n) {
      buf.assign(reinterpret_cast<const char*>(tp), tok_bytes);
      buf.append(reinterpret_cast<const char*>(extra[i].p), extra[i].n);
      parent = xxh64(reinterpret_cast<const uint8_t*>(buf.data()), buf.size(), parent);
    } else {
      parent = xxh64(tp, tok_bytes, parent);
    }
    out.push_back(parent);
  }
}

// -- direct updates (simulator, approximate mode, store tier) -------------------------------------

uint64_t PrefixIndex::add(int loc, const std::vector<uint64_t>& hashes, bool evict) {
  uint64_t bit = loc_bit(loc);
  std::unique_lock lk(mu_);
  Order& o = added_order_[loc];
  if (o.pool() + hashes.size() >= kNil) throw std::length_error("a location would hold 2^32 blocks");
  auto& amap = added_[loc];
  for (size_t i = hashes.size(); i-- > 0;) {
    uint64_t h = hashes[i];
    uint32_t& node = amap.at_or_zero(h).node;
    if (node != kNil) {  // added again: now the newest
      o.replace(node, kNil);
      o.release(node);
    }
    node = o.push(h, kNil);
    add_one(loc, bit, h);
  }
  IngestStats st;
  if (evict) evict_over_cap(lk, -1, -1, -1, st);
  return st.evicted;
}

void PrefixIndex::remove(int loc, const std::vector<uint64_t>& hashes) {
  uint64_t bit = loc_bit(loc);
  std::unique_lock lk(mu_);
  for (uint64_t h : hashes) {
    remove_one(loc, bit, h);
    forget_added(loc, h);
  }
}

void PrefixIndex::clear(int loc) {
  uint64_t bit = loc_bit(loc);
  std::unique_lock lk(mu_);
  clear_locked(loc, bit);
}

// Drop location `loc` from every block. The blocks its own events stored are reached through
// its engine map (O(its blocks)); the table is scanned only when some were added another way
// (add(): approximate mode, store tier) — a publisher repeating AllBlocksCleared must not hold
// the exclusive lock over the whole table each time.
void PrefixIndex::clear_locked(int loc, uint64_t bit) {
  size_t left = loc_count_[loc];
  engine_[loc].for_each([&](uint64_t, const EngineEntry& e) {
    uint64_t ours = e.ours;
    uint64_t* v = left ? blocks_.find(ours) : nullptr;
    if (!v || !(*v & bit)) return;
    *v &= ~bit;
    --left;
    if (!*v) blocks_.erase(ours);
  });
  if (left) {
    std::vector<uint64_t> gone;
    blocks_.for_each([&](uint64_t k, uint64_t v) {
      if (v & bit) gone.push_back(k);
    });
    for (uint64_t k : gone) {
      uint64_t* v = blocks_.find(k);
      *v &= ~bit;
      if (!*v) blocks_.erase(k);
    }
  }
  loc_count_[loc] = 0;
  engine_[loc].clear();
  order_[loc].clear();
  kept_[loc] = 0;
  added_[loc].clear();
  added_order_[loc].clear();
}

// -- queries --------------------------------------------------------------------------------------

std::vector<uint32_t> PrefixIndex::match(const uint64_t* hashes, size_t n, int n_locations) const {
  std::vector<uint32_t> out(static_cast<size_t>(n_locations), 0);
  uint64_t all = n_locations >= 64 ? ~0ULL : ((1ULL << n_locations) - 1);
  uint64_t alive = all;
  std::shared_lock lk(mu_);
  size_t i = 0;
  for (; i < n && alive; ++i) {
    const uint64_t* v = blocks_.find(hashes[i]);
    uint64_t m = v ? *v : 0;
    uint64_t dropped = alive & ~m;
    while (dropped) {
      int b = __builtin_ctzll(dropped);
      out[b] = static_cast<uint32_t>(i);
      dropped &= dropped - 1;
    }
    alive &= m;
  }
  while (alive) {
    int b = __builtin_ctzll(alive);
    out[b] = static_cast<uint32_t>(i);
    alive &= alive - 1;
  }
  return out;
}

uint64_t PrefixIndex::mask(uint64_t h) const {
  std::shared_lock lk(mu_);
  const uint64_t* v = blocks_.find(h);
  return v ? *v : 0;
}

size_t PrefixIndex::size() const {
  std::shared_lock lk(mu_);
  return blocks_.size();
}

size_t PrefixIndex::location_size(int loc) const {
  loc_bit(loc);
  std::shared_lock lk(mu_);
  return loc_count_[loc];
}

std::vector<uint64_t> PrefixIndex::hashes_at(int loc) const {
  uint64_t bit = loc_bit(loc);
  std::shared_lock lk(mu_);
  std::vector<uint64_t> out;
  out.reserve(loc_count_[loc]);
  blocks_.for_each([&](uint64_t k, uint64_t v) {
    if (v & bit) out.push_back(k);
  });
  return out;
}

// -- the cap (max_blocks_) ------------------------------------------------------------------------
//
// Each location fed by events keeps its engine map's entries as chains, their leaves in the order
// they were stored (Order). When an ingest leaves more than max_blocks_ blocks in the index, the
// oldest leaves of the location holding the most blocks are evicted (as if the engine had removed
// them), a chain from its tail to its head, until the index is ~1/64 under the cap, so one
// instance's churn evicts its own old blocks, not another's hot prefixes. A location whose engine
// map alone is over the cap (one block stored under many engine hashes), or with its removed
// entries' nodes kept for their children, is cut the same way. Work: O(1) per evicted entry, each
// entry evicted at most once per store, plus a scan of the 64 locations per kEvictPerPick
// evictions; the lock is let go every kEvictPerHold evictions.

// Evict an entry of location `loc`: of the longer of its lists (added entries, event-fed
// entries), the oldest; false when it has none.
bool PrefixIndex::evict_one(int loc, IngestStats& st) {
  if (added_order_[loc].head() != kNil &&
      (order_[loc].head() == kNil || added_[loc].size() >= engine_[loc].size())) {
    uint32_t i = added_order_[loc].head();
    uint64_t h = added_order_[loc][i].fp;
    remove_one(loc, 1ULL << loc, h);
    forget_added(loc, h);
    ++st.evicted;
    return true;
  }
  return evict_oldest(loc, st);
}

// Location `loc`'s entry of `h` made by add() goes (removed or evicted).
void PrefixIndex::forget_added(int loc, uint64_t h) {
  AddedEntry* e = added_[loc].find(h);
  if (!e) return;
  added_order_[loc].replace(e->node, kNil);
  added_order_[loc].release(e->node);
  added_[loc].erase(h);
}

// Evict location `loc`'s oldest leaf entry; false when it has none.
bool PrefixIndex::evict_oldest(int loc, IngestStats& st) {
  uint32_t i = order_[loc].head();
  if (i == kNil) return false;
  uint64_t fp = order_[loc][i].fp;
  auto& emap = engine_[loc];
  const EngineEntry* e = emap.find(fp);
  if (e) remove_one(loc, 1ULL << loc, e->ours);
  drop_node(loc, i);
  emap.erase(fp);
  ++st.evicted;
  return true;
}

// Location `loc`'s entry of node `i` goes (removed, evicted, or stored again): a leaf leaves the
// list, the nearest ancestor it leaves with no children taking its place (removed ancestors
// on the way are freed); a node with children stays, out of the list, until they go (counted in
// kept_, and by the cap). Called before the engine map entry is erased or repointed.
void PrefixIndex::drop_node(int loc, uint32_t i) {
  Order& o = order_[loc];
  if (o[i].kids) {
    o[i].prev = kKept;  // out of the list: prev is free to mark it
    ++kept_[loc];
    return;
  }
  uint32_t c = i, heir = kNil;
  for (;;) {
    uint32_t p = o[c].parent;
    if (c != i) {  // a removed entry's node whose last child went
      o.release(c);
      --kept_[loc];
    }
    if (p == kNil || --o[p].kids) break;
    if (o[p].prev != kKept) {  // an entry's node: now a leaf
      heir = p;
      break;
    }
    c = p;
  }
  o.replace(i, heir);
  o.release(i);
}

// Under the lock `lk` (held): see above; the index ends at most max_blocks_ - max_blocks_/64
// blocks when its event-fed entries allow. The lock is released and taken again every
// kEvictPerHold evictions so that readers (match) wait ~0.1 ms at most.
void PrefixIndex::evict_over_cap(std::unique_lock<std::shared_mutex>& lk, int loc_gpu,
                                 int loc_cpu, int loc_other, IngestStats& st) {
  if (!max_blocks_) return;
  const size_t target = max_blocks_ - max_blocks_ / 64;
  size_t done = 0;
  auto pause = [&] {
    if (++done % kEvictPerHold) return;
    lk.unlock();
    std::this_thread::yield();  // let the readers and writers waiting for the lock in
    lk.lock();
  };
  for (int loc : {loc_gpu, loc_cpu, loc_other}) {  // engine maps over the cap on their own
    if (loc < 0 || engine_[loc].size() + kept_[loc] <= max_blocks_) continue;
    while (engine_[loc].size() + kept_[loc] > target && evict_oldest(loc, st)) pause();
  }
  if (blocks_.size() <= max_blocks_) return;
  while (blocks_.size() > target) {
    int best = -1;
    for (int loc = 0; loc < kMaxLocations; ++loc)
      if ((order_[loc].head() != kNil || added_order_[loc].head() != kNil) &&
          (best < 0 || loc_count_[loc] > loc_count_[best]))
        best = loc;
    if (best < 0) break;  // nothing evictable left
    for (size_t i = 0; i < kEvictPerPick && blocks_.size() > target; ++i) {
      if (!evict_one(best, st)) break;
      pause();
    }
  }
}

}  // namespace kvpool_conductor

// kvpool._conductor: the conductor's prefix index (block hash -> locations holding it) and the
// ingest of vLLM KV events (msgpack KVEventBatch payloads), in C++ with the GIL released.
//
// Files: conductor.h (this: the index's tables and the PrefixIndex class), conductor_index.cpp
// (XXH64, the block hash chain, direct updates, queries, eviction under the cap),
// conductor_ingest.cpp (the msgpack reader and the KV-event ingest), conductor_module.cpp (the
// pybind11 bindings).
//
// Block hashes ("our" hashes) are chained XXH64 digests, the same on the request side
// (PrefixIndex.hash_tokens) and on the event side (PrefixIndex.ingest):
//
//   h[i] = XXH64(LE32(tokens[i*B:(i+1)*B]) ++ extra[i], seed = h[i-1])     h[-1] = root seed
//
// where extra[i] is the msgpack encoding of the block's extra keys as vLLM publishes them in
// BlockStored.extra_keys (LoRA name, (mm id, offset) pairs, cache_salt), or nothing. The engine's
// own hashes (sha256 / xxhash with a per-process seed) are only used to map BlockRemoved events and
// parent links back to ours, per location.
//
// Thread safety: one shared_mutex per index; ingest/add/remove/clear take it exclusively, match and
// the readers shared (an ingest that evicts under the cap lets it go every kEvictPerHold entries
// evicted, between consistent states). Locations are 0..63 (one bit each in a block's mask).

#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvpool_conductor {

// XXH64 (the published algorithm; checked against the xxhash package in the tests).
uint64_t xxh64(const uint8_t* p, size_t len, uint64_t seed);

struct IngestStats {
  uint64_t batches = 0, malformed = 0, stored = 0, removed = 0, cleared = 0, evicted = 0;
  uint64_t skipped_block_size = 0, skipped_orphan = 0, skipped_group = 0, skipped_medium = 0,
           skipped_shape = 0;
  int64_t last_bad_block_size = -1;
  double last_ts = 0.0;
};

struct Span {
  const uint8_t* p = nullptr;
  size_t n = 0;
};

// Open-addressing hash map uint64 -> V (linear probing, backward-shift deletion). Keys are
// hashes already; key 0 is the empty marker, so a key of 0 is stored as kZeroKey.
template <typename V>
class FlatMapT {
 public:
  static constexpr uint64_t kZeroKey = 0x9E3779B97F4A7C15ULL;

  FlatMapT() { rehash(16); }

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap * 7 / 10 < n) cap <<= 1;
    if (cap > keys_.size()) rehash(cap);
  }
  size_t size() const { return size_; }

  const V* find(uint64_t k) const {
    k = fix(k);
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == 0) return nullptr;
    }
  }
  V* find(uint64_t k) { return const_cast<V*>(static_cast<const FlatMapT*>(this)->find(k)); }

  V& at_or_zero(uint64_t k) {  // inserts V{} when missing
    if ((size_ + 1) * 10 > keys_.size() * 7) rehash(keys_.size() * 2);
    k = fix(k);
    size_t i = slot(k);
    for (;; i = (i + 1) & mask_) {
      if (keys_[i] == k) return vals_[i];
      if (keys_[i] == 0) break;
    }
    keys_[i] = k;
    vals_[i] = V{};
    ++size_;
    return vals_[i];
  }

  bool erase(uint64_t k) {
    k = fix(k);
    size_t i = slot(k);
    for (;; i = (i + 1) & mask_) {
      if (keys_[i] == 0) return false;
      if (keys_[i] == k) break;
    }
    // backward-shift deletion
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask_;
      if (keys_[j] == 0) break;
      size_t home = slot(keys_[j]);
      // move j into i when home is not cyclically in (i, j]
      bool in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (!in_range) {
        keys_[i] = keys_[j];
        vals_[i] = vals_[j];
        i = j;
      }
    }
    keys_[i] = 0;
    --size_;
    return true;
  }

  void clear() {  // O(1) when empty; a large table gives its memory back
    if (size_ == 0) return;
    if (keys_.size() > 1024) {
      keys_.assign(16, 0);
      vals_.assign(16, V{});
      mask_ = 15;
    } else {
      std::fill(keys_.begin(), keys_.end(), 0);
    }
    size_ = 0;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < keys_.size(); ++i)
      if (keys_[i]) f(keys_[i] == kZeroKey ? 0 : keys_[i], vals_[i]);
  }

 private:
  static uint64_t fix(uint64_t k) { return k ? k : kZeroKey; }
  size_t slot(uint64_t k) const { return static_cast<size_t>((k ^ (k >> 31)) * 0x9E3779B97F4A7C15ULL >> 7) & mask_; }

  void rehash(size_t cap) {
    std::vector<uint64_t> ok = std::move(keys_);
    std::vector<V> ov = std::move(vals_);
    keys_.assign(cap, 0);
    vals_.assign(cap, V{});
    mask_ = cap - 1;
    size_ = 0;
    for (size_t i = 0; i < ok.size(); ++i) {
      if (!ok[i]) continue;
      size_t s = slot(ok[i]);
      while (keys_[s]) s = (s + 1) & mask_;
      keys_[s] = ok[i];
      vals_[s] = ov[i];
      ++size_;
    }
  }

  std::vector<uint64_t> keys_;
  std::vector<V> vals_;
  size_t mask_ = 0, size_ = 0;
};

using FlatMap = FlatMapT<uint64_t>;

constexpr uint32_t kNil = 0xffffffffu;

// A location's engine map entry: our hash of the block and its node in the location's Order.
struct EngineEntry {
  uint64_t ours = 0;
  uint32_t node = kNil;
};

// A location's engine map entries as a forest (each block's node points to its parent's, the
// block its event chained it to) and, of those, the leaves in the order they were stored, oldest
// first: a doubly linked list over a pool of nodes (freed nodes reused). Eviction takes the oldest
// leaf, and a parent left with no children takes its place in the list: a chain goes from its tail
// to its head (a head evicted first left its tail in the index, never matched again, since a
// match counts leading blocks, but holding the capacity), and a prefix many chains share stays
// while any of them does. Store, removal and eviction are O(1) each (amortised: a parent freed
// with its last child).
class Order {
 public:
  struct Node {
    uint64_t fp;  // the engine hash fingerprint (its key in the engine map)
    uint32_t prev, next;  // the leaves' list (a node with children is out of it; prev: kKept
                          // for a removed entry's node kept for its children)
    uint32_t parent;      // kNil: a chain's first block
    uint32_t kids;        // nodes whose parent this is
  };

  uint32_t head() const { return head_; }
  size_t pool() const { return nodes_.size(); }
  const Node& operator[](uint32_t i) const { return nodes_[i]; }
  Node& operator[](uint32_t i) { return nodes_[i]; }

  // A new leaf, the newest, under `parent` (kNil: none); a parent that was a leaf leaves the list.
  uint32_t push(uint64_t fp, uint32_t parent) {
    uint32_t i;
    if (free_ != kNil) {
      i = free_;
      free_ = nodes_[i].next;
    } else {
      if (nodes_.size() >= kNil - 1) throw std::length_error("a location holds 2^32 blocks");
      i = static_cast<uint32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    nodes_[i] = Node{fp, tail_, kNil, parent, 0};
    if (tail_ != kNil) nodes_[tail_].next = i;
    else head_ = i;
    tail_ = i;
    if (parent != kNil && nodes_[parent].kids++ == 0) {
      unlink(parent);
      nodes_[parent].prev = kNil;
    }
    return i;
  }

  // Node `i` (in the list) leaves it; `heir` (kNil: none) takes its place.
  void replace(uint32_t i, uint32_t heir) {
    Node& n = nodes_[i];
    if (heir == kNil) {
      unlink(i);
      return;
    }
    nodes_[heir].prev = n.prev;
    nodes_[heir].next = n.next;
    if (n.prev != kNil) nodes_[n.prev].next = heir;
    else head_ = heir;
    if (n.next != kNil) nodes_[n.next].prev = heir;
    else tail_ = heir;
  }

  void release(uint32_t i) {  // back to the pool (out of the list, no children)
    nodes_[i].next = free_;
    free_ = i;
  }

  void clear() {
    nodes_.clear();
    nodes_.shrink_to_fit();
    head_ = tail_ = free_ = kNil;
  }

 private:
  void unlink(uint32_t i) {
    Node& n = nodes_[i];
    if (n.prev != kNil) nodes_[n.prev].next = n.next;
    else head_ = n.next;
    if (n.next != kNil) nodes_[n.next].prev = n.prev;
    else tail_ = n.prev;
  }

  std::deque<Node> nodes_;  // a deque: growing it never copies (no pause under the lock)
  uint32_t head_ = kNil, tail_ = kNil, free_ = kNil;
};

constexpr uint32_t kKept = 0xfffffffeu;

// A location's entry made by add(): its node in the location's added-entries Order.
struct AddedEntry {
  uint32_t node = kNil;
};

constexpr int kMaxLocations = 64;
// Eviction under the cap: entries evicted per hold of the exclusive lock (~0.1 ms), and per choice
// of the location holding the most blocks.
constexpr size_t kEvictPerHold = 1024;
constexpr size_t kEvictPerPick = 64;

struct Reader;  // the msgpack reader of the ingest (conductor_ingest.cpp)

class PrefixIndex {
 public:
  PrefixIndex(uint32_t block_size, uint64_t root_seed, size_t expected_blocks, size_t max_blocks)
      : block_size_(block_size), root_(root_seed), max_blocks_(max_blocks) {
    if (block_size == 0) throw std::invalid_argument("block_size must be > 0");
    if (expected_blocks) blocks_.reserve(expected_blocks);
  }

  uint32_t block_size() const { return block_size_; }
  uint64_t root_seed() const { return root_; }
  size_t max_blocks() const { return max_blocks_; }

  // -- hashing -----------------------------------------------------------------------------------

  // Chained hashes of the full blocks of `tokens` (uint32 little-endian, n tokens), extra[i] raw
  // msgpack bytes or empty, starting from `parent`.
  std::vector<uint64_t> chain(const uint32_t* tokens, size_t n, const std::vector<Span>& extra,
                              uint64_t parent) const;
  void chain_into(const uint32_t* tokens, size_t n, const std::vector<Span>& extra, uint64_t parent,
                  std::vector<uint64_t>& out) const;

  // -- direct updates (simulator, approximate mode, store tier) ----------------------------------

  // Location `loc` holds `hashes` (a chain's, head first, or a part of one): each becomes the
  // location's newest added entry, the chain's tail before its head, so that the cap evicts a
  // chain from its tail. With `evict`, an index left over the cap evicts as an ingest does; the
  // approximate mode's tracker trims its own entries instead. Returns the entries evicted.
  uint64_t add(int loc, const std::vector<uint64_t>& hashes, bool evict);
  void remove(int loc, const std::vector<uint64_t>& hashes);
  void clear(int loc);

  // -- KV events -----------------------------------------------------------------------------------

  // Apply one KVEventBatch payload published by the engine whose cache is location `loc_gpu`
  // (medium GPU or unset); `loc_cpu` takes medium "CPU" (-1: ignored), `loc_other` any other medium.
  void ingest(const uint8_t* data, size_t len, int loc_gpu, int loc_cpu, int loc_other,
              IngestStats& st);

  // -- queries ---------------------------------------------------------------------------------------

  // Per location (0..n_locations-1): how many leading blocks of `hashes` it holds.
  std::vector<uint32_t> match(const uint64_t* hashes, size_t n, int n_locations) const;
  uint64_t mask(uint64_t h) const;
  size_t size() const;
  size_t location_size(int loc) const;
  std::vector<uint64_t> hashes_at(int loc) const;

 private:
  static uint64_t loc_bit(int loc) {
    if (loc < 0 || loc >= kMaxLocations) throw std::out_of_range("location must be in 0..63");
    return 1ULL << loc;
  }

  void add_one(int loc, uint64_t bit, uint64_t h) {
    uint64_t& m = blocks_.at_or_zero(h);
    if (!(m & bit)) {
      m |= bit;
      ++loc_count_[loc];
    }
  }

  // Location `loc` no longer holds `h` (whichever way it went): its add() entry of `h`, if any,
  // goes too (a location fed by both add() and events kept it after its engine removed the block:
  // an entry of a block it no longer held, not bounded by the cap, that evicted the block when the
  // engine stored it again). An event-fed entry of `h` may stay until its engine removes it.
  void remove_one(int loc, uint64_t bit, uint64_t h) {
    uint64_t* v = blocks_.find(h);
    if (!v || !(*v & bit)) return;
    *v &= ~bit;
    --loc_count_[loc];
    if (!*v) blocks_.erase(h);
    if (added_[loc].size()) forget_added(loc, h);
  }

  void clear_locked(int loc, uint64_t bit);

  // The cap (max_blocks_), conductor_index.cpp.
  bool evict_one(int loc, IngestStats& st);
  void forget_added(int loc, uint64_t h);
  bool evict_oldest(int loc, IngestStats& st);
  void drop_node(int loc, uint32_t i);
  void evict_over_cap(std::unique_lock<std::shared_mutex>& lk, int loc_gpu, int loc_cpu,
                      int loc_other, IngestStats& st);

  // The KV events, conductor_ingest.cpp.
  bool read_tokens(Reader& r);
  void event(Reader& r, int loc_gpu, int loc_cpu, int loc_other, IngestStats& st);

  uint32_t block_size_;
  uint64_t root_;
  size_t max_blocks_;  // 0: no cap
  mutable std::shared_mutex mu_;
  FlatMap blocks_;  // our hash -> location mask
  FlatMapT<EngineEntry> engine_[kMaxLocations];  // per location: engine hash fingerprint -> ours
  size_t loc_count_[kMaxLocations] = {};
  Order order_[kMaxLocations];  // per location: its engine map's entries, leaves oldest first
  size_t kept_[kMaxLocations] = {};  // per location: removed entries' nodes kept for their children
  FlatMapT<AddedEntry> added_[kMaxLocations];  // per location: entries made by add(), our hash ->
  Order added_order_[kMaxLocations];           // their node here, oldest first (no parents)
  std::vector<uint32_t> tok_;  // scratch of ingest (under the exclusive lock)
  std::vector<uint64_t> fps_, ours_;
  std::vector<Span> extra_;
};

}  // namespace kvpool_conductor

// kvpool._conductor: the conductor's prefix index (block hash -> locations holding it) and the
// ingest of vLLM KV events (msgpack KVEventBatch payloads), in C++ with the GIL released.
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

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <algorithm>
#include <vector>

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------------------------
// XXH64 (the published algorithm; checked against the xxhash package in the tests)
// ---------------------------------------------------------------------------------------------

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

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: fingerprints of integer engine hashes
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

// ---------------------------------------------------------------------------------------------
// A bounds-checked msgpack reader (only what KVEventBatch payloads use)
// ---------------------------------------------------------------------------------------------

struct ParseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Reader {
  const uint8_t* p;
  const uint8_t* end;

  void need(size_t n) const {
    if (static_cast<size_t>(end - p) < n) throw ParseError("truncated msgpack");
  }
  uint8_t peek() const {
    need(1);
    return *p;
  }
  uint64_t be(size_t n) {
    need(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | p[i];
    p += n;
    return v;
  }
  bool nil() {
    if (peek() == 0xc0) {
      ++p;
      return true;
    }
    return false;
  }
  size_t array() {
    uint8_t t = peek();
    ++p;
    if ((t & 0xf0) == 0x90) return t & 0x0f;
    if (t == 0xdc) return be(2);
    if (t == 0xdd) return be(4);
    throw ParseError("expected an array");
  }
  size_t map() {
    uint8_t t = peek();
    ++p;
    if ((t & 0xf0) == 0x80) return t & 0x0f;
    if (t == 0xde) return be(2);
    if (t == 0xdf) return be(4);
    throw ParseError("expected a map");
  }
  // str -> (ptr, len)
  std::pair<const uint8_t*, size_t> str() {
    uint8_t t = peek();
    ++p;
    size_t n;
    if ((t & 0xe0) == 0xa0) n = t & 0x1f;
    else if (t == 0xd9) n = be(1);
    else if (t == 0xda) n = be(2);
    else if (t == 0xdb) n = be(4);
    else throw ParseError("expected a string");
    need(n);
    auto out = std::make_pair(p, n);
    p += n;
    return out;
  }
  bool is_int() const {
    uint8_t t = peek();
    return t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xcf) || (t >= 0xd0 && t <= 0xd3);
  }
  // Integer as (value, negative?)
  int64_t sint() {
    uint8_t t = peek();
    ++p;
    if (t <= 0x7f) return t;
    if (t >= 0xe0) return static_cast<int8_t>(t);
    switch (t) {
      case 0xcc: return static_cast<int64_t>(be(1));
      case 0xcd: return static_cast<int64_t>(be(2));
      case 0xce: return static_cast<int64_t>(be(4));
      case 0xcf: {
        uint64_t v = be(8);
        return static_cast<int64_t>(v);  // bit pattern; callers treat engine hashes as opaque
      }
      case 0xd0: return static_cast<int8_t>(be(1));
      case 0xd1: return static_cast<int16_t>(be(2));
      case 0xd2: return static_cast<int32_t>(be(4));
      case 0xd3: return static_cast<int64_t>(be(8));
      default: throw ParseError("expected an integer");
    }
  }
  // Engine block hash (bin or int) -> 64-bit fingerprint.
  uint64_t hash_fp() {
    uint8_t t = peek();
    if (t == 0xc4 || t == 0xc5 || t == 0xc6) {
      ++p;
      size_t n = be(t == 0xc4 ? 1 : t == 0xc5 ? 2 : 4);
      need(n);
      uint64_t fp = xxh64(p, n, 0x6b7670);
      p += n;
      return fp;
    }
    if (is_int()) return mix64(static_cast<uint64_t>(sint()));
    throw ParseError("block hash is neither bytes nor an integer");
  }
  void skip(int depth = 0) {
    if (depth > 32) throw ParseError("msgpack nested too deeply");
    uint8_t t = peek();
    ++p;
    size_t n = 0;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return;
    if ((t & 0xe0) == 0xa0) {
      n = t & 0x1f;
    } else if ((t & 0xf0) == 0x90 || (t & 0xf0) == 0x80) {
      size_t k = (t & 0x0f) * ((t & 0xf0) == 0x80 ? 2 : 1);
      for (size_t i = 0; i < k; ++i) skip(depth + 1);
      return;
    } else {
      switch (t) {
        case 0xcc: case 0xd0: n = 1; break;
        case 0xcd: case 0xd1: n = 2; break;
        case 0xce: case 0xd2: case 0xca: n = 4; break;
        case 0xcf: case 0xd3: case 0xcb: n = 8; break;
        case 0xd9: case 0xc4: n = be(1); break;
        case 0xda: case 0xc5: n = be(2); break;
        case 0xdb: case 0xc6: n = be(4); break;
        case 0xd4: n = 2; break;
        case 0xd5: n = 3; break;
        case 0xd6: n = 5; break;
        case 0xd7: n = 9; break;
        case 0xd8: n = 17; break;
        case 0xc7: n = be(1) + 1; break;
        case 0xc8: n = be(2) + 1; break;
        case 0xc9: n = be(4) + 1; break;
        case 0xdc: case 0xdd: case 0xde: case 0xdf: {
          size_t k = be(t == 0xdc || t == 0xde ? 2 : 4);
          if (t >= 0xde) k *= 2;
          for (size_t i = 0; i < k; ++i) skip(depth + 1);
          return;
        }
        default: throw ParseError("unknown msgpack type");
      }
    }
    need(n);
    p += n;
  }
};

inline bool eq(std::pair<const uint8_t*, size_t> s, const char* lit) {
  size_t n = std::strlen(lit);
  return s.second == n && std::memcmp(s.first, lit, n) == 0;
}

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

}  // namespace

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
                              uint64_t parent) const {
    std::vector<uint64_t> out;
    chain_into(tokens, n, extra, parent, out);
    return out;
  }

  void chain_into(const uint32_t* tokens, size_t n, const std::vector<Span>& extra, uint64_t parent,
                  std::vector<uint64_t>& out) const {
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

  // -- direct updates (simulator, approximate mode, store tier) ----------------------------------

  // Location `loc` holds `hashes` (a chain's, head first, or a part of one): each becomes the
  // location's newest added entry, the chain's tail before its head, so that the cap evicts a
  // chain from its tail. With `evict`, an index left over the cap evicts as an ingest does; the
  // approximate mode's tracker trims its own entries instead. Returns the entries evicted.
  uint64_t add(int loc, const std::vector<uint64_t>& hashes, bool evict) {
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

  void remove(int loc, const std::vector<uint64_t>& hashes) {
    uint64_t bit = loc_bit(loc);
    std::unique_lock lk(mu_);
    for (uint64_t h : hashes) {
      remove_one(loc, bit, h);
      forget_added(loc, h);
    }
  }

  void clear(int loc) {
    uint64_t bit = loc_bit(loc);
    std::unique_lock lk(mu_);
    clear_locked(loc, bit);
  }

  // -- KV events -----------------------------------------------------------------------------------

  // Apply one KVEventBatch payload published by the engine whose cache is location `loc_gpu`
  // (medium GPU or unset); `loc_cpu` takes medium "CPU" (-1: ignored), `loc_other` any other medium.
  void ingest(const uint8_t* data, size_t len, int loc_gpu, int loc_cpu, int loc_other,
              IngestStats& st) {
    loc_bit(loc_gpu);
    if (loc_cpu >= 0) loc_bit(loc_cpu);
    if (loc_other >= 0) loc_bit(loc_other);
    std::unique_lock lk(mu_);
    Reader r{data, data + len};
    ++st.batches;
    try {
      size_t top = r.array();
      if (top < 2) throw ParseError("event batch has fewer than 2 fields");
      uint8_t t = r.peek();
      if (t == 0xcb) {
        r.p++;
        uint64_t bits = r.be(8);
        double ts;
        std::memcpy(&ts, &bits, 8);
        st.last_ts = ts;
      } else if (t == 0xca) {
        r.p++;
        uint32_t bits = static_cast<uint32_t>(r.be(4));
        float ts;
        std::memcpy(&ts, &bits, 4);
        st.last_ts = ts;
      } else {
        r.skip();
      }
      size_t nev = r.array();
      for (size_t e = 0; e < nev; ++e) event(r, loc_gpu, loc_cpu, loc_other, st);
      for (size_t i = 2; i < top; ++i) r.skip();
    } catch (const ParseError&) {
      ++st.malformed;  // the part before the error is applied; the rest of the batch is dropped
    }
    evict_over_cap(lk, loc_gpu, loc_cpu, loc_other, st);
  }

  // -- queries ---------------------------------------------------------------------------------------

  // Per location (0..n_locations-1): how many leading blocks of `hashes` it holds.
  std::vector<uint32_t> match(const uint64_t* hashes, size_t n, int n_locations) const {
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

  uint64_t mask(uint64_t h) const {
    std::shared_lock lk(mu_);
    const uint64_t* v = blocks_.find(h);
    return v ? *v : 0;
  }

  size_t size() const {
    std::shared_lock lk(mu_);
    return blocks_.size();
  }

  size_t location_size(int loc) const {
    loc_bit(loc);
    std::shared_lock lk(mu_);
    return loc_count_[loc];
  }

  std::vector<uint64_t> hashes_at(int loc) const {
    uint64_t bit = loc_bit(loc);
    std::shared_lock lk(mu_);
    std::vector<uint64_t> out;
    out.reserve(loc_count_[loc]);
    blocks_.for_each([&](uint64_t k, uint64_t v) {
      if (v & bit) out.push_back(k);
    });
    return out;
  }

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

  void remove_one(int loc, uint64_t bit, uint64_t h) {
    uint64_t* v = blocks_.find(h);
    if (!v || !(*v & bit)) return;
    *v &= ~bit;
    --loc_count_[loc];
    if (!*v) blocks_.erase(h);
  }

  // Drop location `loc` from every block. The blocks its own events stored are reached through
  // its engine map (O(its blocks)); the table is scanned only when some were added another way
  // (add(): approximate mode, store tier) — a publisher repeating AllBlocksCleared must not hold
  // the exclusive lock over the whole table each time.
  void clear_locked(int loc, uint64_t bit) {
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

  // -- the cap (max_blocks_) -------------------------------------------------------------------------
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
  bool evict_one(int loc, IngestStats& st) {
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
  void forget_added(int loc, uint64_t h) {
    AddedEntry* e = added_[loc].find(h);
    if (!e) return;
    added_order_[loc].replace(e->node, kNil);
    added_order_[loc].release(e->node);
    added_[loc].erase(h);
  }

  // Evict location `loc`'s oldest leaf entry; false when it has none.
  bool evict_oldest(int loc, IngestStats& st) {
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
  void drop_node(int loc, uint32_t i) {
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
  void evict_over_cap(std::unique_lock<std::shared_mutex>& lk, int loc_gpu, int loc_cpu,
                      int loc_other, IngestStats& st) {
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

  // Token ids of a BlockStored event straight into tok_ (one pass; false if one is not a uint32).
  bool read_tokens(Reader& r) {
    size_t n = r.array();
    r.need(n);  // every element takes at least one byte
    tok_.resize(n);
    const uint8_t* p = r.p;
    const uint8_t* end = r.end;
    bool ok = true;
    for (size_t i = 0; i < n; ++i) {
      if (p >= end) throw ParseError("truncated msgpack");
      uint8_t t = *p;
      uint32_t v;
      if (t <= 0x7f) {
        v = t;
        p += 1;
      } else if (t == 0xcd && end - p >= 3) {
        v = (uint32_t(p[1]) << 8) | p[2];
        p += 3;
      } else if (t == 0xce && end - p >= 5) {
        v = (uint32_t(p[1]) << 24) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 8) | p[4];
        p += 5;
      } else if (t == 0xcc && end - p >= 2) {
        v = p[1];
        p += 2;
      } else {
        r.p = p;
        int64_t x = r.sint();
        p = r.p;
        if (x < 0 || x > 0xffffffffLL) ok = false;
        v = static_cast<uint32_t>(x);
      }
      tok_[i] = v;
    }
    r.p = p;
    return ok;
  }

  void event(Reader& r, int loc_gpu, int loc_cpu, int loc_other, IngestStats& st) {
    size_t fields = r.map();
    enum Kind { NONE, STORED, REMOVED, CLEARED, OTHER } kind = NONE;
    int64_t bsize = -1, group = 0;
    bool have_parent = false, have_hashes = false, have_tokens = false, tokens_ok = true;
    bool medium_set = false;
    uint64_t parent_fp = 0;
    std::string medium;
    fps_.clear();
    extra_.clear();
    for (size_t f = 0; f < fields; ++f) {
      auto key = r.str();
      if (eq(key, "type")) {
        auto v = r.str();
        kind = eq(v, "BlockStored") ? STORED
               : eq(v, "BlockRemoved") ? REMOVED
               : eq(v, "AllBlocksCleared") ? CLEARED
                                           : OTHER;
      } else if (eq(key, "medium")) {
        if (!r.nil()) {
          auto v = r.str();
          medium.assign(reinterpret_cast<const char*>(v.first), v.second);
          medium_set = true;
        }
      } else if (eq(key, "block_size")) {
        bsize = r.sint();
      } else if (eq(key, "group_idx")) {
        group = r.nil() ? 0 : r.sint();
      } else if (eq(key, "block_hashes")) {
        size_t n = r.array();
        r.need(n);
        fps_.reserve(n);
        for (size_t i = 0; i < n; ++i) fps_.push_back(r.hash_fp());
        have_hashes = true;
      } else if (eq(key, "parent_block_hash")) {
        if (!r.nil()) {
          parent_fp = r.hash_fp();
          have_parent = true;
        }
      } else if (eq(key, "token_ids")) {
        tokens_ok = read_tokens(r);
        have_tokens = true;
      } else if (eq(key, "extra_keys")) {
        if (!r.nil()) {
          size_t ne = r.array();
          r.need(ne);
          for (size_t i = 0; i < ne; ++i) {
            const uint8_t* s0 = r.p;
            if (r.nil()) {
              extra_.push_back(Span{});
              continue;
            }
            r.skip();
            extra_.push_back(Span{s0, static_cast<size_t>(r.p - s0)});
          }
        }
      } else {
        r.skip();
      }
    }
    int loc = loc_gpu;
    if (medium_set && medium != "GPU") loc = medium == "CPU" ? loc_cpu : loc_other;
    if (kind == CLEARED) {
      // AllBlocksCleared carries no medium: it clears the engine's own (GPU) cache.
      clear_locked(loc_gpu, 1ULL << loc_gpu);
      ++st.cleared;
      return;
    }
    if (kind != STORED && kind != REMOVED) return;
    if (!have_hashes) throw ParseError("block event without block_hashes");
    size_t n = fps_.size();
    if (loc < 0) {
      st.skipped_medium += n;
      return;
    }
    if (group != 0) {
      st.skipped_group += n;
      return;
    }
    uint64_t bit = 1ULL << loc;
    auto& emap = engine_[loc];
    if (kind == REMOVED) {
      for (uint64_t fp : fps_) {
        const EngineEntry* ent = emap.find(fp);
        if (!ent) continue;
        remove_one(loc, bit, ent->ours);
        drop_node(loc, ent->node);
        emap.erase(fp);
        ++st.removed;
      }
      return;
    }
    // BlockStored
    if (bsize != static_cast<int64_t>(block_size_)) {
      st.skipped_block_size += n;
      st.last_bad_block_size = bsize;
      return;
    }
    if (!have_tokens || !tokens_ok || tok_.size() != n * block_size_) {
      st.skipped_shape += n;
      return;
    }
    uint64_t seed = root_;
    uint32_t up = kNil;  // the node of the block each one is chained to
    if (have_parent) {
      const EngineEntry* ps = emap.find(parent_fp);
      if (!ps) {
        st.skipped_orphan += n;
        return;
      }
      seed = ps->ours;
      up = ps->node;
    }
    if (order_[loc].pool() + n >= kNil) throw ParseError("a location would hold 2^32 blocks");
    chain_into(tok_.data(), tok_.size(), extra_, seed, ours_);
    for (size_t i = 0; i < n; ++i) {
      // The new node first (its parent gains a child before any entry is dropped below, so that
      // it is never freed: an event may name one engine hash twice, or its parent's).
      uint32_t node = order_[loc].push(fps_[i], up);
      EngineEntry& ent = emap.at_or_zero(fps_[i]);
      if (ent.node != kNil) {  // stored again: now the newest
        // The engine hash named another block (a collision, or a lost BlockRemoved): that block
        // is removed as BlockRemoved would, not left in the index with no entry to evict it by.
        if (ent.ours != ours_[i]) remove_one(loc, bit, ent.ours);
        drop_node(loc, ent.node);
      }
      ent.ours = ours_[i];
      ent.node = up = node;
      add_one(loc, bit, ours_[i]);
      ++st.stored;
    }
  }

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

// ---------------------------------------------------------------------------------------------
// Python bindings
// ---------------------------------------------------------------------------------------------

namespace {

// A read-only view of a C-contiguous buffer of T, or a copy of a Python sequence of ints.
template <typename T>
struct IntView {
  std::vector<T> copy;
  const T* data = nullptr;
  size_t n = 0;
  py::object keep;

  explicit IntView(const py::object& obj) {
    if (PyObject_CheckBuffer(obj.ptr())) {
      py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
      if (info.ndim == 1 && info.itemsize == static_cast<py::ssize_t>(sizeof(T)) &&
          (info.strides.empty() || info.strides[0] == static_cast<py::ssize_t>(sizeof(T))) &&
          !info.format.empty() &&
          std::string("bBhHiIlLqQ").find(info.format.back()) != std::string::npos) {
        data = static_cast<const T*>(info.ptr);
        n = static_cast<size_t>(info.size);
        keep = obj;
        return;
      }
    }
    copy.reserve(static_cast<size_t>(py::len(obj)));
    for (py::handle h : obj) copy.push_back(h.cast<T>());
    data = copy.data();
    n = copy.size();
  }
};

py::dict stats_dict(const IngestStats& st) {
  py::dict d;
  d["batches"] = st.batches;
  d["malformed"] = st.malformed;
  d["stored"] = st.stored;
  d["removed"] = st.removed;
  d["cleared"] = st.cleared;
  d["evicted"] = st.evicted;
  d["skipped_block_size"] = st.skipped_block_size;
  d["skipped_orphan"] = st.skipped_orphan;
  d["skipped_group"] = st.skipped_group;
  d["skipped_medium"] = st.skipped_medium;
  d["skipped_shape"] = st.skipped_shape;
  d["last_bad_block_size"] = st.last_bad_block_size;
  d["last_ts"] = st.last_ts;
  return d;
}

}  // namespace

PYBIND11_MODULE(_conductor, m) {
  m.doc() = "kvpool conductor native core: prefix index and vLLM KV-event ingest";
  m.attr("MAX_LOCATIONS") = kMaxLocations;

  m.def(
      "xxh64",
      [](py::bytes data, uint64_t seed) {
        std::string_view s = data;
        return xxh64(reinterpret_cast<const uint8_t*>(s.data()), s.size(), seed);
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of bytes (the block hash primitive).");

  py::class_<PrefixIndex>(m, "PrefixIndex")
      .def(py::init<uint32_t, uint64_t, size_t, size_t>(), py::arg("block_size"),
           py::arg("root_seed") = 0, py::arg("expected_blocks") = 0, py::arg("max_blocks") = 0,
           "`max_blocks` (0: none): after an ingest or add that leaves more blocks than this, the "
           "oldest entries of the locations holding the most are evicted to ~1/64 under it.")
      .def_property_readonly("block_size", &PrefixIndex::block_size)
      .def_property_readonly("max_blocks", &PrefixIndex::max_blocks)
      .def_property_readonly("root_seed", &PrefixIndex::root_seed)
      .def(
          "hash_tokens",
          [](const PrefixIndex& self, const py::object& tokens, const py::object& extras,
             const py::object& parent) {
            IntView<uint32_t> tv(tokens);
            std::vector<std::string> keep;
            std::vector<bool> present;
            if (!extras.is_none()) {
              for (py::handle h : extras) {
                present.push_back(!h.is_none());
                keep.push_back(h.is_none() ? std::string() : h.cast<std::string>());
              }
            }
            std::vector<Span> ex(keep.size());
            for (size_t i = 0; i < keep.size(); ++i)
              if (present[i]) ex[i] = Span{reinterpret_cast<const uint8_t*>(keep[i].data()), keep[i].size()};
            uint64_t seed = parent.is_none() ? self.root_seed() : parent.cast<uint64_t>();
            std::vector<uint64_t> out;
            {
              py::gil_scoped_release nogil;
              out = self.chain(tv.data, tv.n, ex, seed);
            }
            return out;
          },
          py::arg("tokens"), py::arg("extras") = py::none(), py::arg("parent") = py::none(),
          "Chained hashes of the full blocks of `tokens` (list or uint32 buffer); `extras`: per "
          "block, msgpack bytes of its extra keys or None.")
      .def(
          "add",
          [](PrefixIndex& self, int loc, const py::object& hashes, bool evict) {
            IntView<uint64_t> hv(hashes);
            std::vector<uint64_t> v(hv.data, hv.data + hv.n);
            py::gil_scoped_release nogil;
            return self.add(loc, v, evict);
          },
          py::arg("location"), py::arg("hashes"), py::arg("evict") = true,
          "The location holds `hashes` (a chain's, head first: its tail is evicted first). With "
          "`evict`, an index left over `max_blocks` evicts as after an ingest; returns the entries "
          "evicted.")
      .def(
          "remove",
          [](PrefixIndex& self, int loc, const py::object& hashes) {
            IntView<uint64_t> hv(hashes);
            std::vector<uint64_t> v(hv.data, hv.data + hv.n);
            py::gil_scoped_release nogil;
            self.remove(loc, v);
          },
          py::arg("location"), py::arg("hashes"))
      .def("clear", &PrefixIndex::clear, py::arg("location"), py::call_guard<py::gil_scoped_release>())
      .def(
          "ingest",
          [](PrefixIndex& self, const py::bytes& payload, int loc_gpu, int loc_cpu, int loc_other) {
            std::string_view s = payload;
            IngestStats st;
            {
              py::gil_scoped_release nogil;
              self.ingest(reinterpret_cast<const uint8_t*>(s.data()), s.size(), loc_gpu, loc_cpu,
                          loc_other, st);
            }
            return stats_dict(st);
          },
          py::arg("payload"), py::arg("location"), py::arg("cpu_location") = -1,
          py::arg("other_location") = -1,
          "Apply one msgpack KVEventBatch payload from the engine at `location`; returns counters.")
      .def(
          "match",
          [](const PrefixIndex& self, const py::object& hashes, int n_locations) {
            if (n_locations < 0 || n_locations > kMaxLocations)
              throw std::out_of_range("n_locations must be in 0..64");
            IntView<uint64_t> hv(hashes);
            std::vector<uint32_t> out;
            {
              py::gil_scoped_release nogil;
              out = self.match(hv.data, hv.n, n_locations);
            }
            return out;
          },
          py::arg("hashes"), py::arg("n_locations"),
          "Per location, the number of leading blocks of `hashes` it holds.")
      .def("mask", &PrefixIndex::mask, py::arg("hash"))
      .def("location_size", &PrefixIndex::location_size, py::arg("location"))
      .def("hashes_at", &PrefixIndex::hashes_at, py::arg("location"))
      .def("__len__", &PrefixIndex::size);
}

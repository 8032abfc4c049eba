// kvpool._conductor: the ingest of vLLM KV events (msgpack KVEventBatch payloads) into
// PrefixIndex (see conductor.h), with a bounds-checked msgpack reader.

#include "conductor.h"

#include <utility>

namespace kvpool_conductor {

namespace {

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

}  // namespace

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

namespace {

inline bool eq(std::pair<const uint8_t*, size_t> s, const char* lit) {
  size_t n = std::strlen(lit);
  return s.second == n && std::memcmp(s.first, lit, n) == 0;
}

}  // namespace

void PrefixIndex::ingest(const uint8_t* data, size_t len, int loc_gpu, int loc_cpu,
                         int loc_other, IngestStats& st) {
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

// Token ids of a BlockStored event straight into tok_ (one pass; false if one is not a uint32).
bool PrefixIndex::read_tokens(Reader& r) {
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

void PrefixIndex::event(Reader& r, int loc_gpu, int loc_cpu, int loc_other, IngestStats& st) {
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

}  // namespace kvpool_conductor

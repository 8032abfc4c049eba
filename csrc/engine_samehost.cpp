// The transfer engine's same-host path: copies into a peer's registered memory through shared
// buffers mapped here or one process_vm_readv/writev, each inside a pin of the target's fence
// slot (fence.h), with the target's liveness polled through its pidfd.

#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

namespace kvpool {

namespace {

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

}  // namespace

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
  std::unique_ptr<Fence> f = Fence::map(pid, fd, p->incarnation.load());
  std::vector<FenceRegion> fr;
  for (auto& [a, l, slot, gen] : regions) fr.push_back(FenceRegion{a, l, slot, gen});
  std::unique_lock lk(p->maps_mu);  // waits for copies in progress
  p->fence = std::move(f);
  p->fregions.swap(fr);
  if (p->fence == nullptr && pid != 0) p->pid = 0;  // no fence, no same-host path: TCP from now on
  return p->fence != nullptr;
}

uint64_t Engine::peer_fence_refused(uint64_t id) { return get_peer(id)->fence_refused.load(); }

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

}  // namespace kvpool

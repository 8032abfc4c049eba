#include "fence.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace kvpool {

namespace {

constexpr int kSeq = __ATOMIC_SEQ_CST;

bool pid_alive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno != ESRCH); }

}  // namespace

size_t fence_bytes() { return sizeof(FenceHeader) + sizeof(FenceSlot) * kFenceSlots; }

Fence::~Fence() {
  if (!owner_ && lane_ >= 0 && base_ != nullptr) {
    int32_t me = static_cast<int32_t>(::getpid());
    __atomic_compare_exchange_n(&hdr()->lanes[lane_], &me, 0, false, kSeq, kSeq);
  }
  if (base_ != nullptr) munmap(base_, size_);
  if (fd_ >= 0 && owner_) ::close(fd_);
}

void Fence::close_fd() {
  if (fd_ >= 0 && owner_) ::close(fd_);
  fd_ = -1;
}

std::unique_ptr<Fence> Fence::create(uint64_t owner) {
  int fd = memfd_create("kvpool-fence", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  size_t n = fence_bytes();
  if (ftruncate(fd, static_cast<off_t>(n)) != 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::close(fd);
    return nullptr;
  }
  std::unique_ptr<Fence> f(new Fence());
  f->fd_ = fd;
  f->owner_ = true;
  f->base_ = static_cast<char*>(p);
  f->size_ = n;
  f->hdr()->nslots = kFenceSlots;
  f->hdr()->owner = owner;
  __atomic_store_n(&f->hdr()->magic, kFenceMagic, kSeq);
  return f;
}

std::unique_ptr<Fence> Fence::map(int pid, int fd, uint64_t owner) {
  if (pid <= 0 || fd < 0) return nullptr;
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int local = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) return nullptr;
  struct stat st{};
  size_t n = fence_bytes();
  void* p = MAP_FAILED;
  if (fstat(local, &st) == 0 && static_cast<size_t>(st.st_size) == n)
    p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  ::close(local);
  if (p == MAP_FAILED) return nullptr;
  std::unique_ptr<Fence> f(new Fence());
  f->base_ = static_cast<char*>(p);
  f->size_ = n;
  if (__atomic_load_n(&f->hdr()->magic, kSeq) != kFenceMagic || f->hdr()->nslots != kFenceSlots) return nullptr;
  if (owner != 0 && f->hdr()->owner != owner) return nullptr;  // another engine's table
  const int32_t me = static_cast<int32_t>(::getpid());
  for (int pass = 0; pass < 2 && f->lane_ < 0; ++pass) {
    for (int l = 0; l < kFenceLanes && f->lane_ < 0; ++l) {
      int32_t cur = __atomic_load_n(&f->hdr()->lanes[l], kSeq);
      if (pass == 0 ? cur != 0 : (cur == 0 || pid_alive(cur))) continue;
      if (__atomic_compare_exchange_n(&f->hdr()->lanes[l], &cur, me, false, kSeq, kSeq)) f->lane_ = l;
    }
  }
  if (f->lane_ < 0) return nullptr;  // all lanes held by live initiators: TCP only
  // A lane taken over from a dead process may carry its leaked pins: they are void.
  for (uint32_t i = 0; i < kFenceSlots; ++i) __atomic_store_n(&f->slot(i)->pins[f->lane_], 0, kSeq);
  return f;
}

FenceSlot* Fence::slot(int i) {
  return reinterpret_cast<FenceSlot*>(base_ + sizeof(FenceHeader)) + i;
}

int Fence::claim(uint64_t addr, uint64_t len, uint64_t* gen) {
  for (uint32_t k = 0; k < kFenceSlots; ++k) {
    uint32_t i = (next_ + k) % kFenceSlots;
    FenceSlot* s = slot(static_cast<int>(i));
    uint64_t g = __atomic_load_n(&s->gen, kSeq);
    if (g & 1) continue;  // live
    bool clean = true;
    for (int l = 0; l < kFenceLanes && clean; ++l) clean = __atomic_load_n(&s->pins[l], kSeq) == 0;
    if (!clean) continue;  // a retired slot someone stopped inside: never reuse it
    s->addr = addr;
    s->len = len;
    __atomic_store_n(&s->gen, g + 1, kSeq);
    next_ = i + 1;
    *gen = g + 1;
    return static_cast<int>(i);
  }
  return -1;
}

void Fence::retire_begin(int i) {
  FenceSlot* s = slot(i);
  uint64_t g = __atomic_load_n(&s->gen, kSeq);
  if (g & 1) __atomic_store_n(&s->gen, g + 1, kSeq);
}

bool Fence::pinned(int i) {
  FenceSlot* s = slot(i);
  for (int l = 0; l < kFenceLanes; ++l) {
    if (__atomic_load_n(&s->pins[l], kSeq) == 0) continue;
    int32_t pid = __atomic_load_n(&hdr()->lanes[l], kSeq);
    if (pid_alive(pid)) return true;  // a pin of a lane whose process died: it writes no more
  }
  return false;
}

bool Fence::retire(int i, int timeout_ms) {
  retire_begin(i);
  using clock = std::chrono::steady_clock;
  const auto until = clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  auto pause = std::chrono::microseconds(100);
  for (int spin = 0;; ++spin) {
    if (!pinned(i)) return true;
    const auto now = clock::now();
    if (now >= until) return false;
    if (spin < 16) {  // a copy about to end: a few yields before sleeping
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::min<clock::duration>(pause, until - now));
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

bool Fence::pin(int i, uint64_t gen) {
  if (i < 0 || static_cast<uint32_t>(i) >= kFenceSlots || lane_ < 0) return false;
  FenceSlot* s = slot(i);
  __atomic_fetch_add(&s->pins[lane_], 1, kSeq);
  if (__atomic_load_n(&s->gen, kSeq) == gen) return true;
  __atomic_fetch_sub(&s->pins[lane_], 1, kSeq);
  return false;
}

void Fence::unpin(int i) { __atomic_fetch_sub(&slot(i)->pins[lane_], 1, kSeq); }

}  // namespace kvpool

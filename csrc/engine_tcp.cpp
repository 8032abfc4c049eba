// The transfer engine's TCP path: a peer's lane workers, their connections (made on first use,
// re-made after errors and when the peer restarted), the pipelined exchange of a group of
// same-op slices, and fetch_descriptor.

#include "engine_internal.h"

#include <unistd.h>

#include <string>
#include <vector>

namespace kvpool {

namespace {

constexpr uint64_t kGroupBytes = 8 << 20;  // bytes per pipelined group

}  // namespace

// ---------------------------------------------------------------- data path

void Engine::worker_loop(Peer* p, int lane_idx) {
  Lane* lane = p->lanes[lane_idx].get();
  std::vector<Slice> group;
  group.reserve(kMaxGroup);
  for (;;) {
    group.clear();
    {
      std::unique_lock lk(p->qmu);
      p->qcv.wait(lk, [&] { return !p->queue.empty() || p->stopping; });
      if (p->queue.empty()) return;  // stopping
      if (p->stopping) {
        // Engine shutting down: cancel what is queued.
        while (!p->queue.empty()) {
          Slice s = std::move(p->queue.front());
          p->queue.pop_front();
          s.batch->finish_slice(s.slot, 0, ST_CANCELED);
        }
        p->qspace.notify_all();
        return;
      }
      // One group: one opcode and one incarnation of the peer (the one every slice was submitted
      // for: execute checks the connection against the group's first slice).
      const uint8_t op = p->queue.front().op;
      const uint64_t inc = p->queue.front().incarnation;
      uint64_t bytes = 0;
      while (!p->queue.empty() && group.size() < kMaxGroup && p->queue.front().op == op &&
             p->queue.front().incarnation == inc &&
             (group.empty() || bytes + p->queue.front().len <= kGroupBytes)) {
        bytes += p->queue.front().len;
        group.push_back(std::move(p->queue.front()));
        p->queue.pop_front();
      }
      if (!p->queue.empty()) p->qcv.notify_one();
    }
    p->qspace.notify_all();
    if (p->pid.load() != 0) {
      size_t handled = execute_same_host(p, group);
      if (handled == group.size()) continue;
      group.erase(group.begin(), group.begin() + static_cast<long>(handled));
    }
    execute(p, lane, group);
  }
}

int Engine::connect_lane(Peer* p, Lane* lane) {
  std::string host;
  uint16_t port;
  {
    std::lock_guard lk(p->addr_mu);
    host = p->host;
    port = p->port;
  }
  int fd = dial(host, port, opt_.connect_timeout_ms);
  if (fd < 0) return ST_CONNECT;
  uint64_t inc = 0;
  int32_t st = client_hello(fd, opt_.secret, &inc, opt_.connect_timeout_ms);
  if (st != ST_OK) {
    ::close(fd);
    return st;
  }
  set_timeouts(fd, opt_.timeout_ms);
  lane->incarnation = inc;
  lane->set_fd(fd);
  return ST_OK;
}

void Engine::execute(Peer* p, Lane* lane, std::vector<Slice>& group) {
  std::lock_guard lk(lane->mu);
  size_t done = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool fresh = false;
    // Connected to a previous process of the peer (it restarted since): connect again.
    if (lane->fd >= 0 && lane->incarnation != p->incarnation.load()) lane->close_fd();
    if (lane->fd < 0) {
      bool stopping;
      {
        std::lock_guard qlk(p->qmu);
        stopping = p->stopping;
      }
      if (stopping) {  // the engine is closing or the segment was closed: no new connection
        for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, ST_CANCELED);
        return;
      }
      int32_t st = connect_lane(p, lane);
      if (st != ST_OK) {
        p->stale = true;
        for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, st);
        return;
      }
      fresh = true;
    }
    if (lane->incarnation != p->incarnation.load() || lane->incarnation != group[done].incarnation) {
      // The process behind the address is not the one the descriptor described.
      p->stale = true;
      for (size_t i = done; i < group.size(); ++i)
        group[i].batch->finish_slice(group[i].slot, 0, ST_PEER_RESTARTED);
      return;
    }
    size_t before = done;
    int32_t st = tcp_io(p, lane, group, &done);
    if (st == ST_OK) return;
    lane->abort_fd();  // what it still holds of these requests must not reach the target later
    // A pooled connection that broke before any reply may just be stale: retry once on a new one.
    if (!fresh && done == before && st == ST_PEER_CLOSED && attempt == 0) continue;
    p->stale = true;
    for (size_t i = done; i < group.size(); ++i) group[i].batch->finish_slice(group[i].slot, 0, st);
    return;
  }
}

// Pipelines a group of same-op slices over one connection. `done` counts slices finished.
int Engine::tcp_io(Peer* p, Lane* lane, std::vector<Slice>& group, size_t* done) {
  const int fd = lane->fd;
  FrameDeadline dl(fd, opt_.timeout_ms);  // every request and reply of the group, however it trickles
  const size_t start = *done;
  const size_t n = group.size() - start;
  const bool is_write = group[start].op == OP_WRITE;
  std::vector<ReqHdr> hdrs(n);
  std::vector<iovec> iov;
  iov.reserve(is_write ? 2 * n : n);
  for (size_t i = 0; i < n; ++i) {
    const Slice& s = group[start + i];
    hdrs[i] = ReqHdr{kReqMagic, s.op, 0, 0, static_cast<uint32_t>(i), s.reg, s.remote, s.len};
    iov.push_back({&hdrs[i], sizeof(ReqHdr)});
    if (is_write) iov.push_back({reinterpret_cast<void*>(s.local), s.len});
  }
  // Requests go out in one gather write; for READ the headers are tiny, for WRITE the replies are,
  // so neither side can block the other.
  int32_t st = writev_all(fd, iov.data(), static_cast<int>(iov.size()));
  if (st != ST_OK) return st;
  if (is_write) {
    std::vector<RespHdr> resp(n);
    st = recv_all(fd, resp.data(), n * sizeof(RespHdr));
    if (st != ST_OK) return st;
    for (size_t i = 0; i < n; ++i) {
      if (resp[i].magic != kRespMagic || resp[i].id != i) return ST_BAD_FRAME;
      Slice& s = group[start + i];
      if (resp[i].status == ST_REREGISTERED) p->stale = true;  // re-fetch the descriptor
      s.batch->finish_slice(s.slot, resp[i].status == ST_OK ? s.len : 0, resp[i].status);
      ++*done;
    }
    return ST_OK;
  }
  for (size_t i = 0; i < n; ++i) {
    RespHdr r{};
    st = recv_all(fd, &r, sizeof(r));
    if (st != ST_OK) return st;
    Slice& s = group[start + i];
    if (r.magic != kRespMagic || r.id != i) return ST_BAD_FRAME;
    if (r.status == ST_OK) {
      if (r.len != s.len) return ST_BAD_FRAME;
      st = recv_all(fd, reinterpret_cast<void*>(s.local), s.len);
      if (st != ST_OK) return st;
    }
    if (r.status == ST_REREGISTERED) p->stale = true;  // re-fetch the descriptor
    s.batch->finish_slice(s.slot, r.status == ST_OK ? s.len : 0, r.status);
    ++*done;
  }
  return ST_OK;
}

std::pair<uint64_t, std::string> Engine::fetch_descriptor(const std::string& host, uint16_t port,
                                                          const std::string& secret, int timeout_ms) {
  int fd = dial(host, port, timeout_ms);
  if (fd < 0)
    throw KvError(E_SEGMENT_NOT_FOUND, "cannot connect to segment " + host + ":" + std::to_string(port) +
                                           " (is its engine running and listening there?)");
  uint64_t inc = 0;
  int32_t st = client_hello(fd, secret, &inc, timeout_ms);
  if (st != ST_OK) {
    ::close(fd);
    if (st == ST_AUTH || st == ST_PEER_UNPROVEN) throw KvError(E_AUTH, status_text(st));
    throw KvError(E_SEGMENT_NOT_FOUND, std::string("handshake with ") + host + ":" + std::to_string(port) +
                                           " failed: " + status_text(st));
  }
  ReqHdr h{kReqMagic, OP_GET_DESC, 0, 0, 0, 0, 0, 0};
  RespHdr r{};
  std::string blob;
  {
  FrameDeadline dl(fd, timeout_ms);
  st = send_all(fd, &h, sizeof(h));
  if (st == ST_OK) st = recv_all(fd, &r, sizeof(r));
  if (st == ST_OK && (r.magic != kRespMagic || r.status != ST_OK || r.len > (64u << 20))) st = ST_BAD_FRAME;
  if (st == ST_OK) {
    blob.resize(r.len);
    st = recv_all(fd, blob.data(), r.len);
  }
  }
  ::close(fd);
  if (st != ST_OK)
    throw KvError(E_SEGMENT_NOT_FOUND, std::string("cannot read descriptor of ") + host + ":" +
                                           std::to_string(port) + ": " + status_text(st));
  return {inc, blob};
}

}  // namespace kvpool

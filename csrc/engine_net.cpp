// The transfer engine's client-side socket I/O: reads and writes under whole-frame deadlines,
// dial, the handshake (wire.h), and the wire helpers the tests use to speak to a server.

#include "engine_internal.h"
#include "hmac.h"
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace kvpool {

namespace {

constexpr int kIovMax = 1024;

void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The calling thread's FrameDeadline (engine_internal.h).
thread_local int64_t t_deadline_ms = 0;
thread_local int t_shortened_fd = -1;
thread_local int t_full_ms = 0;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// After partial progress: ST_TIMEOUT when the frame's deadline passed, else the socket's timeouts
// now end with it.
int32_t frame_time_left(int fd) {
  if (t_deadline_ms == 0) return ST_OK;
  int64_t left = t_deadline_ms - now_ms();
  if (left <= 0) return ST_TIMEOUT;
  set_timeouts(fd, static_cast<int>(std::max<int64_t>(1, left)));
  t_shortened_fd = fd;
  return ST_OK;
}

// Error status for a failed syscall on a connected socket.
int32_t sock_err(ssize_t rc) {
  if (rc == 0) return ST_PEER_CLOSED;
  if (errno == EAGAIN || errno == EWOULDBLOCK) return ST_TIMEOUT;
  return ST_PEER_CLOSED;
}

}  // namespace

void set_timeouts(int fd, int ms) {
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

FrameDeadline::FrameDeadline(int fd, int ms) {
  t_deadline_ms = now_ms() + ms;
  t_full_ms = ms;
  fd_ = fd;
}

FrameDeadline::~FrameDeadline() {
  if (t_shortened_fd == fd_) set_timeouts(fd_, t_full_ms);
  t_shortened_fd = -1;
  t_deadline_ms = 0;
}

// Reads exactly n bytes. Returns ST_OK or an error status.
int32_t recv_all(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_WAITALL);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      if (n > 0) {  // a partial frame: it must still end by the deadline
        int32_t st = frame_time_left(fd);
        if (st != ST_OK) return st;
      }
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return sock_err(r);
  }
  return ST_OK;
}

// Writes every iovec fully, handling partial writes. Modifies iov.
int32_t writev_all(int fd, iovec* iov, int cnt) {
  while (cnt > 0) {
    int n = std::min(cnt, kIovMax);
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n);
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return sock_err(w);
    }
    size_t left = static_cast<size_t>(w);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0 && left > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
    if (cnt > 0) {  // a partial write: the rest must still go by the deadline
      int32_t st = frame_time_left(fd);
      if (st != ST_OK) return st;
    }
  }
  return ST_OK;
}

int32_t send_all(int fd, const void* buf, size_t n) {
  iovec v{const_cast<void*>(buf), n};
  return writev_all(fd, &v, 1);
}

// Connects with a timeout. Returns fd or -1.
int dial(const std::string& host, uint16_t port, int timeout_ms) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string ps = std::to_string(port);
  if (getaddrinfo(host.c_str(), ps.c_str(), &hints, &res) != 0 || !res) return -1;
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      rc = ::poll(&pfd, 1, timeout_ms);
      if (rc == 1) {
        int err = 0;
        socklen_t el = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        rc = err == 0 ? 0 : -1;
      } else {
        rc = -1;
      }
    }
    if (rc == 0) {
      int fl = fcntl(fd, F_GETFL);
      fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
      break;
    }
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    tune_socket(fd);
    set_timeouts(fd, timeout_ms);
  }
  return fd;
}

namespace {

// Client side of the handshake (wire.h): answers the server's challenge with a proof of the secret
// and checks the server's proof. Returns ST_OK and the server incarnation.
int32_t hello_exchange(int fd, const std::string& secret, uint64_t* incarnation, int timeout_ms) {
  FrameDeadline dl(fd, timeout_ms);  // the whole handshake
  Challenge ch{};
  int32_t st = recv_all(fd, &ch, sizeof(ch));
  if (st != ST_OK) return st;  // closed at accept: over the server's connection bounds, or shutting down
  if (ch.magic == kBusyMagic) return ST_BUSY;
  if (ch.magic != kChallengeMagic) return ST_VERSION;
  Hello h{};
  h.hdr = HelloHdr{kHelloMagic, kProtoVersion, 0};
  fill_random(h.nonce, kNonce);
  if (!secret.empty()) {
    std::string proof = hello_mac(secret, true, ch.nonce, h.nonce);
    std::memcpy(h.proof, proof.data(), kMac);
  }
  st = send_all(fd, &h, sizeof(h));
  if (st != ST_OK) return st;
  HelloOk ok{};
  st = recv_all(fd, &ok, sizeof(ok));
  if (st != ST_OK) return st;
  if (ok.magic != kHelloOkMagic) return ST_BAD_FRAME;
  if (ok.status != ST_OK) return ok.status;
  uint8_t server_proof[kMac];
  st = recv_all(fd, server_proof, kMac);
  if (st != ST_OK) return st;
  if (!secret.empty()) {
    std::string want = hello_mac(secret, false, h.nonce, ch.nonce);
    if (!ct_equal(server_proof, kMac, want.data(), want.size())) return ST_PEER_UNPROVEN;
  }
  *incarnation = ok.incarnation;
  return ST_OK;
}

}  // namespace

// The handshake, a stall in it reported as ST_HELLO_TIMEOUT, not ST_TIMEOUT: no request frame was
// sent on the connection, so nothing of the slices it fails can land later (ST_TIMEOUT tells the
// caller that a stalled target may still apply WRITEs it received, and callers then hold memory).
int32_t client_hello(int fd, const std::string& secret, uint64_t* incarnation, int timeout_ms) {
  int32_t st = hello_exchange(fd, secret, incarnation, timeout_ms);
  return st == ST_TIMEOUT ? ST_HELLO_TIMEOUT : st;
}

// ---------------------------------------------------------------- wire helpers

std::string encode_hello(const std::string& secret, const std::string& challenge, uint16_t version) {
  Hello h{};
  h.hdr = HelloHdr{kHelloMagic, version, 0};
  fill_random(h.nonce, kNonce);
  if (challenge.size() == sizeof(Challenge) && !secret.empty()) {
    Challenge ch;
    std::memcpy(&ch, challenge.data(), sizeof(ch));
    std::string proof = hello_mac(secret, true, ch.nonce, h.nonce);
    std::memcpy(h.proof, proof.data(), kMac);
  }
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::string encode_request(uint8_t op, uint32_t id, uint64_t addr, uint64_t len) {
  ReqHdr h{kReqMagic, op, 0, 0, id, 0, addr, len};
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::vector<ParsedFrame> decode_frames(const std::string& data, uint64_t max_frame) {
  std::vector<ParsedFrame> out;
  size_t pos = 0;
  while (data.size() - pos >= sizeof(ReqHdr)) {
    ReqHdr h;
    std::memcpy(&h, data.data() + pos, sizeof(h));
    pos += sizeof(h);
    bool fatal = false;
    int32_t st = validate_request(h, max_frame, &fatal);
    if (fatal) throw KvError(E_PROTOCOL, std::string("fatal frame: ") + status_text(st));
    out.push_back(ParsedFrame{h.op, h.id, h.addr, h.len, st});
    if (h.op == OP_WRITE) {
      if (data.size() - pos < h.len) break;  // incomplete payload: wait for more bytes
      pos += h.len;
    }
  }
  return out;
}

}  // namespace kvpool

// Declarations shared by the transfer engine's source files (engine*.cpp), not by the bindings:
// the group size of the TCP lanes and of the inline transfer_sync path, and the client side's
// socket helpers (engine_net.cpp).
//
// Files: engine.cpp (registry, engine lifecycle, peers, fence slots), engine_batch.cpp (batches,
// submit, status, wait, transfer_sync), engine_tcp.cpp (lane workers, connections, the pipelined
// TCP exchange, fetch_descriptor), engine_samehost.cpp (mapped buffers, process_vm_readv/writev,
// the target's liveness), engine_net.cpp (socket I/O under whole-frame deadlines, dial, the
// handshake, the wire helpers of the tests).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "engine.h"

namespace kvpool {

constexpr size_t kMaxGroup = 256;  // slices per pipelined group

void set_timeouts(int fd, int ms);

// Whole-frame deadline of the calling thread's client socket I/O (0: none). Socket timeouts
// bound one syscall; a peer that trickles one byte per syscall would restart them forever. Under a
// FrameDeadline, recv_all/writev_all fail with ST_TIMEOUT once it passed, and after a partial
// transfer shorten the socket's timeouts to the time left (restored when the frame ends).
struct FrameDeadline {
  FrameDeadline(int fd, int ms);
  ~FrameDeadline();
  FrameDeadline(const FrameDeadline&) = delete;
  FrameDeadline& operator=(const FrameDeadline&) = delete;

 private:
  int fd_;
};

// Reads exactly n bytes. Returns ST_OK or an error status.
int32_t recv_all(int fd, void* buf, size_t n);

// Writes every iovec fully, handling partial writes. Modifies iov.
int32_t writev_all(int fd, iovec* iov, int cnt);

int32_t send_all(int fd, const void* buf, size_t n);

// Connects with a timeout. Returns fd or -1.
int dial(const std::string& host, uint16_t port, int timeout_ms);

// The handshake, a stall in it reported as ST_HELLO_TIMEOUT, not ST_TIMEOUT: no request frame was
// sent on the connection, so nothing of the slices it fails can land later (ST_TIMEOUT tells the
// caller that a stalled target may still apply WRITEs it received, and callers then hold memory).
int32_t client_hello(int fd, const std::string& secret, uint64_t* incarnation, int timeout_ms);

}  // namespace kvpool

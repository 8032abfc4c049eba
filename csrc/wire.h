// kvpool wire format: fixed little-endian headers, one TCP stream per lane.
//
//   server -> client   Challenge {magic 'KVPN', auth_required, server nonce (32)}   on accept
//   client -> server   Hello     {magic 'KVPH', version, 0} + client nonce (32) + proof (32)
//   server -> client   HelloOk   {magic 'KVPO', status, incarnation} + server proof (32)
//
// proof = HMAC-SHA256(secret, "kvpool-engine-client" | server nonce | client nonce) and
// server proof = HMAC-SHA256(secret, "kvpool-engine-server" | client nonce | server nonce): the
// secret never travels, each side proves it holds it, and a refused hello carries status only
// (incarnation 0, zero proof). With no secret configured on the server any proof is accepted
// (trusted networks only); a client with a secret refuses a server that cannot prove it.
//   client -> server   Request {magic 'KVPR', op, id, addr, len} (+ len payload bytes for WRITE)
//   server -> client   Reply   {magic 'KVPA', status, id, len}   (+ len payload bytes for READ/DESC)
//
// The server answers requests of one connection in order. Every WRITE/READ is bounds-checked
// against memory registered as remote-accessible before any byte is touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvpool {

constexpr uint32_t kHelloMagic = 0x4850564B;  // "KVPH"
constexpr uint32_t kHelloOkMagic = 0x4F50564B;  // "KVPO"
constexpr uint32_t kReqMagic = 0x5250564B;  // "KVPR"
constexpr uint32_t kRespMagic = 0x4150564B;  // "KVPA"
constexpr uint32_t kChallengeMagic = 0x4E50564B;  // "KVPN"
constexpr uint32_t kBusyMagic = 0x4250564B;  // "KVPB": sent instead of a challenge when over a bound
constexpr uint16_t kProtoVersion = 2;
constexpr uint16_t kMaxSecret = 1024;
constexpr size_t kNonce = 32;
constexpr size_t kMac = 32;

enum Op : uint8_t { OP_WRITE = 1, OP_READ = 2, OP_GET_DESC = 3, OP_PING = 4 };

// Status codes carried in replies (and used as per-request error reasons).
enum Status : int32_t {
  ST_OK = 0,
  ST_REMOTE_BOUNDS = 1,   // range outside remote-accessible registered memory
  ST_BAD_FRAME = 2,       // malformed frame
  ST_AUTH = 3,            // wrong or missing secret
  ST_TOO_BIG = 4,         // frame larger than the server's max_frame
  ST_VERSION = 5,         // protocol version mismatch
  ST_BAD_OP = 6,          // unknown opcode
  // client-side reasons (never on the wire)
  ST_PEER_CLOSED = 100,   // connection reset / closed by peer
  ST_TIMEOUT = 101,       // no progress within timeout
  ST_CONNECT = 102,       // cannot connect to peer
  ST_PEER_RESTARTED = 103,  // peer's incarnation changed since the descriptor was read
  ST_CANCELED = 104,      // engine shut down
  ST_LOCAL_FAULT = 105,   // same-host copy faulted (memory unmapped)
  ST_TRANSPORT = 106,     // failed in a transport outside the native data path (reason kept by the caller)
  ST_PEER_UNPROVEN = 107,  // peer could not prove the shared secret (impostor or no secret)
  ST_BUSY = 108,          // target refused the connection: over its connection bounds
  ST_STALE = 109,         // local only: the peer's descriptor must be fetched again first (nothing moved)
  ST_REREGISTERED = 110,  // the target's registration of the range is not the one the request named
  ST_HELLO_TIMEOUT = 111,  // the peer accepted the connection but did not finish the handshake in time
};

#pragma pack(push, 1)
struct Challenge {
  uint32_t magic;
  uint32_t auth_required;
  uint8_t nonce[kNonce];
};
struct HelloHdr {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved;
};
struct Hello {
  HelloHdr hdr;
  uint8_t nonce[kNonce];
  uint8_t proof[kMac];
};
struct HelloOk {
  uint32_t magic;
  int32_t status;
  uint64_t incarnation;
};
struct ReqHdr {
  uint32_t magic;
  uint8_t op;
  uint8_t flags;
  uint16_t reserved;
  uint32_t id;
  uint32_t reg;  // READ/WRITE: the target's registration id of the range (0: any live registration)
  uint64_t addr;
  uint64_t len;
};
struct RespHdr {
  uint32_t magic;
  int32_t status;
  uint32_t id;
  uint32_t reserved;
  uint64_t len;
};
#pragma pack(pop)
static_assert(sizeof(ReqHdr) == 32, "ReqHdr layout");
static_assert(sizeof(RespHdr) == 24, "RespHdr layout");
static_assert(sizeof(HelloOk) == 16, "HelloOk layout");
static_assert(sizeof(Challenge) == 40, "Challenge layout");
static_assert(sizeof(Hello) == 72, "Hello layout");

// Validates a request header the way the server does. Returns ST_OK or the reject reason.
// `fatal` is set when the stream cannot continue (payload length untrustworthy).
inline int32_t validate_request(const ReqHdr& h, uint64_t max_frame, bool* fatal) {
  *fatal = false;
  if (h.magic != kReqMagic) {
    *fatal = true;
    return ST_BAD_FRAME;
  }
  switch (h.op) {
    case OP_WRITE:
      if (h.len == 0 || h.len > max_frame) {
        *fatal = true;  // cannot drain an untrustworthy payload
        return h.len == 0 ? ST_BAD_FRAME : ST_TOO_BIG;
      }
      return ST_OK;
    case OP_READ:
      if (h.len == 0) return ST_BAD_FRAME;
      if (h.len > max_frame) return ST_TOO_BIG;
      return ST_OK;
    case OP_GET_DESC:
    case OP_PING:
      return ST_OK;
    default:
      *fatal = true;
      return ST_BAD_OP;
  }
}

inline const char* status_text(int32_t st) {
  switch (st) {
    case ST_OK: return "ok";
    case ST_REMOTE_BOUNDS: return "remote range is outside the target's remote-accessible registered memory";
    case ST_BAD_FRAME: return "malformed frame";
    case ST_AUTH: return "peer refused the shared secret (set the same `secret` on both engines)";
    case ST_TOO_BIG: return "frame larger than the target's max_frame";
    case ST_VERSION: return "protocol version mismatch (upgrade both sides)";
    case ST_BAD_OP: return "unknown opcode";
    case ST_PEER_CLOSED: return "connection closed by peer (peer died or restarted)";
    case ST_TIMEOUT: return "peer made no progress within timeout_s";
    case ST_CONNECT: return "cannot connect to peer";
    case ST_PEER_RESTARTED: return "peer restarted since its descriptor was read; open the segment again";
    case ST_CANCELED: return "engine shut down";
    case ST_LOCAL_FAULT: return "same-host copy faulted (memory unmapped?)";
    case ST_TRANSPORT: return "failed in the transport";
    case ST_HELLO_TIMEOUT:
      return "peer accepted the connection but did not complete the handshake within connect_timeout_s "
             "(stopped or overloaded?); nothing was sent to it";
    case ST_STALE: return "the segment's descriptor is stale; open the segment again";
    case ST_REREGISTERED:
      return "the target unregistered this range and registered it again since its descriptor was read; "
             "nothing moved (open the segment again if the new registration is meant)";
    case ST_BUSY:
      return "target refused the connection: it is at its connection bound (max_connections or "
             "max_connections_per_peer); retry later, or close idle engines on this host";
    case ST_PEER_UNPROVEN:
      return "peer did not prove the shared secret: it is not an engine of this cluster (forged descriptor?) "
             "or it runs without a secret; set the same `secret` on both engines";
    default: return "unknown error";
  }
}

}  // namespace kvpool

"""Random-input drivers for the native code that parses what peers send (csrc/): the TCP server's
request frames, the TCP client's reply frames, and the conductor's msgpack KV-event ingest.

Each driver asserts what must hold whatever the input (no byte outside a registered range is
touched, a successful reply stays within bounds, the component still works afterwards) and returns
a summary. ``tests/test_fuzz_native.py`` runs them on the installed build and, in a subprocess, on
an AddressSanitizer + UBSan build of the same sources::

    python -m tests.fuzz_native {server,client,ingest,capped} SEED N
"""

from __future__ import annotations

import ctypes
import os
import random
import socket
import struct
import sys
import threading
import time
from typing import Any

import msgpack

from tests.wire_target import WireTarget

REQ, RESP, CHALLENGE, HELLO, HELLO_OK = 0x5250564B, 0x4150564B, 0x4E50564B, 0x4850564B, 0x4F50564B
KIB64 = 65536


_recv_exact = WireTarget.recv_exact


# ------------------------------------------------------------------------------------------ server
def fuzz_server(seed: int, n: int) -> dict[str, int]:
    """Hostile clients against a real engine (no secret: every frame reaches the parser) serving
    64 KiB in the middle of a 192 KiB buffer: random, truncated and bit-flipped request frames
    with edge addresses and lengths (wrap-around, one past the end, 2^63, unknown ops and
    registration ids). Asserts the bytes around the registration never change, that every
    successful READ/WRITE reply was for a range inside it, and that an honest WRITE still lands."""
    from kvpool import OpCode, TransferEngine

    rng = random.Random(seed)
    tgt = TransferEngine("127.0.0.1", "p2p", "tcp", timeout_s=1, idle_timeout_s=2)
    ini = None
    try:
        big = bytearray(i % 251 for i in range(3 * KIB64))
        base = ctypes.addressof(ctypes.c_char.from_buffer(big))
        lo, hi = base + KIB64, base + 2 * KIB64
        tgt.register_local_memory(memoryview(big)[KIB64 : 2 * KIB64], remote_accessible=True)
        guard = bytes(big[:KIB64]) + bytes(big[2 * KIB64 :])
        addrs = [lo, lo - 1, hi - 8, hi, base, 0, (1 << 64) - 8]
        lens = [0, 1, 8, 4096, KIB64, KIB64 + 1, (1 << 64) - 1, 1 << 63, 1 << 40]
        stats = {"conns": 0, "ok_replies": 0, "err_replies": 0}
        for _ in range(n):
            stats["conns"] += 1
            with socket.create_connection(("127.0.0.1", tgt.port), timeout=0.5) as s:
                if rng.random() < 0.1:  # garbage instead of a hello
                    s.sendall(rng.randbytes(rng.randrange(200)))
                    continue
                if _recv_exact(s, 40) is None:
                    continue
                s.sendall(struct.pack("<IHH", HELLO, 2, 0) + rng.randbytes(64))
                ok = _recv_exact(s, 48)
                if ok is None or struct.unpack("<Ii", ok[:8])[1] != 0:
                    continue
                sent: list[tuple[int, int, int]] = []  # the frames, in order: (op, addr, len)
                damaged = False
                wire = bytearray()
                for rid in range(rng.randrange(1, 6)):
                    op = rng.choice([1, 2, 2, 3, 4, 0, 5, 255])
                    addr = rng.choice(addrs + [lo + rng.randrange(KIB64), rng.randrange(1 << 64)])
                    ln = rng.choice(lens + [rng.randrange(1 << 17)])
                    reg = rng.choice([0, 0, 1, 2, rng.randrange(1 << 32)])
                    frame = bytearray(struct.pack("<IBBHIIQQ", REQ, op, 0, 0, rid, reg, addr, ln))
                    if op == 1:  # a WRITE's payload: whole, short, or none (a huge length)
                        k = (
                            ln
                            if ln < (1 << 17) and rng.random() < 0.8
                            else rng.randrange(min(ln, 1 << 17) + 1)
                        )
                        frame += b"\xab" * k
                        damaged |= k != ln  # the server takes the next frames as payload
                    if rng.random() < 0.1:
                        frame[rng.randrange(len(frame))] = rng.randrange(256)
                        damaged = True
                    elif rng.random() < 0.1:
                        frame = frame[: rng.randrange(len(frame) + 1)]
                        damaged = True
                    sent.append((op, addr, ln))
                    wire += frame
                try:
                    s.sendall(wire)
                except OSError:
                    continue
                if not damaged:  # (a damaged frame's reply, if any, answers what it became)
                    _check_replies(s, sent, lo, hi, stats)
            if stats["conns"] % 100 == 0:
                assert bytes(big[:KIB64]) + bytes(big[2 * KIB64 :]) == guard, (
                    "bytes outside the registration changed"
                )
        assert bytes(big[:KIB64]) + bytes(big[2 * KIB64 :]) == guard, "bytes outside the registration changed"
        ini = TransferEngine("127.0.0.1", "p2p", "tcp", timeout_s=2)
        src = bytearray(b"\x11" * 4096)
        ini.register_local_memory(src)
        ini.transfer_sync(
            tgt.segment_name, ctypes.addressof(ctypes.c_char.from_buffer(src)), lo, 4096, OpCode.WRITE
        )
        assert bytes(big[KIB64 : KIB64 + 4096]) == b"\x11" * 4096, (
            "the server no longer serves an honest WRITE"
        )
        return stats
    finally:
        if ini is not None:
            ini.close()
        tgt.close()


def _check_replies(s: socket.socket, sent: list[tuple[int, int, int]], lo: int, hi: int, stats: dict) -> None:
    """Read the replies to intact frames (the server answers in order; an error may end the
    connection, so stop at the first missing reply)."""
    for i, (op, addr, ln) in enumerate(sent):
        hdr = _recv_exact(s, 24)
        if hdr is None:
            return
        magic, status, rid, _r, rlen = struct.unpack("<IiIIQ", hdr)
        assert magic == RESP and rid == i, f"reply {i}: magic {magic:#x}, id {rid}"
        if status != 0:
            stats["err_replies"] += 1
            if rlen and op == 3 and _recv_exact(s, rlen) is None:
                return
            continue
        stats["ok_replies"] += 1
        if op in (1, 2):
            assert lo <= addr and addr + ln <= hi, (
                f"op {op} at {addr:#x}+{ln} answered OK outside [{lo:#x}, {hi:#x})"
            )
        if op == 2:
            assert rlen == ln
        if rlen and _recv_exact(s, rlen) is None:
            return


# ------------------------------------------------------------------------------------------ client
class _RandomTarget(WireTarget):
    """Speaks the handshake and serves a descriptor, then answers data requests with random,
    mutated reply frames (wrong ids, magics, statuses and lengths; short payloads; extra bytes)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        super().__init__(incarnation=7)

    def _pick(self, *choices: Any) -> Any:
        with self.lock:
            return self.rng.choice(choices)

    def _serve(self, c: socket.socket) -> None:
        try:
            c.settimeout(3)
            c.sendall(struct.pack("<II", CHALLENGE, 0) + os.urandom(32))
            if _recv_exact(c, 72) is None:
                return
            c.sendall(struct.pack("<IiQ", HELLO_OK, 0, 7) + bytes(32))
            while not self.stop:
                h = _recv_exact(c, 32)
                if h is None:
                    return
                _m, op, _f, _r, rid, _reg, _addr, n = struct.unpack("<IBBHIIQQ", h)
                if op == 3:
                    c.sendall(struct.pack("<IiIIQ", RESP, 0, rid, 0, len(self.blob)) + self.blob)
                    continue
                if op == 1 and n < (1 << 24) and _recv_exact(c, n) is None:
                    return
                magic = self._pick(RESP, RESP, RESP, REQ, 0)
                status = self._pick(0, 0, 0, 1, 2, 110, -1, 1 << 30)
                rrid = self._pick(rid, rid, rid, rid + 1, 0xFFFFFFFF)
                rlen = (
                    self._pick(n, n, n, 0, n + 1, max(n - 1, 0), 1 << 62)
                    if op == 2
                    else self._pick(0, 0, n, 1 << 40)
                )
                body = b""
                if op == 2 and status == 0 and rlen < (1 << 24):
                    body = b"\xcd" * self._pick(rlen, rlen, max(rlen - 3, 0))
                c.sendall(
                    struct.pack("<IiIIQ", magic, status, rrid, 0, rlen)
                    + body
                    + self._pick(b"", b"", b"\x00" * 7)
                )
        except OSError:
            pass
        finally:
            c.close()


def fuzz_client(seed: int, n: int) -> dict[str, int]:
    """Our engine reading from and writing to a target that answers with random reply frames.
    Asserts every call either succeeds or raises a kvpool error, and that nothing lands outside
    the local destination range (guards on both sides)."""
    from kvpool import OpCode, TransferEngine
    from kvpool.errors import KvpoolError

    rng = random.Random(seed)
    tgt = _RandomTarget(seed)
    eng = TransferEngine(protocol="tcp", timeout_s=0.5, connect_timeout_s=1)
    stats = {"ok": 0, "errors": 0}
    try:
        buf = bytearray(b"\x5a" * (3 * KIB64))
        eng.register_local_memory(buf)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        for _ in range(n):
            ln = rng.choice([1, 8, 4096, KIB64])
            batch = rng.choice([1, 1, 4, 40])
            op = rng.choice([OpCode.READ, OpCode.WRITE])
            local = [base + KIB64 + rng.randrange(KIB64 - ln + 1) for _ in range(batch)]
            remote = [0x7F00_0000_0000 + rng.randrange((1 << 20) - ln + 1) for _ in range(batch)]
            try:
                eng.batch_transfer_sync(tgt.name, local, remote, [ln] * batch, op)
                stats["ok"] += 1
            except KvpoolError:
                stats["errors"] += 1
            assert buf[:KIB64] == b"\x5a" * KIB64 and buf[2 * KIB64 :] == b"\x5a" * KIB64, (
                "bytes outside the range"
            )
        return stats
    finally:
        eng.close()
        tgt.close()


# ------------------------------------------------------------------------------------------ ingest
def _hash(rng: random.Random) -> Any:
    c = rng.random()
    if c < 0.4:
        return rng.randrange(-(1 << 63), 1 << 63)
    if c < 0.7:
        return rng.randbytes(rng.choice([0, 1, 8, 32, 33]))
    if c < 0.8:
        return rng.randrange(1 << 64)
    return rng.choice([None, "str", 1.5, [1, 2], {"a": 1}, True])


def _stored(hashes: list[Any], parent: Any, tokens: list[int], bs: Any, medium: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


def _event(rng: random.Random, prev: list[int], bs: int) -> Any:
    if rng.random() < 0.6:  # well formed, chained on blocks seen before
        k = rng.randrange(1, 6)
        hs = [rng.randrange(1 << 62) for _ in range(k)]
        parent = rng.choice(prev) if prev and rng.random() < 0.7 else None
        toks = [rng.randrange(50_000) for _ in range(bs * k)]
        ev: dict[str, Any] = _stored(hs, parent, toks, bs, rng.choice(["GPU", "CPU"]))
        prev.extend(hs)
        del prev[:-200]
        if rng.random() < 0.3:
            ev = {
                "type": "BlockRemoved",
                "block_hashes": rng.sample(prev, min(len(prev), 3)),
                "medium": "GPU",
            }
        elif rng.random() < 0.02:
            ev = {"type": "AllBlocksCleared"}
    else:
        k = rng.choice([0, 1, 2, 3, 10])
        n_toks = rng.choice([0, bs * k, bs * k + 1, 7])
        ev = _stored(
            [_hash(rng) for _ in range(k)],
            _hash(rng),
            [rng.choice([0, 7, 1 << 32, -1]) for _ in range(n_toks)],
            rng.choice([bs, 16, 0, -1, 1 << 40]),
            rng.choice(["GPU", "CPU", "DISK", None, 3]),
        )
        ev["type"] = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 5, None])
        ev["lora_id"] = rng.choice([None, 1, "x"])
        ev["lora_name"] = rng.choice([None, "sql", b"\0", 7])
        if rng.random() < 0.3:
            ev["extra_keys"] = rng.choice(
                [None, [["a"]] * k, [[1, 2]] * k, "bad", [None] * k, [[{"x": [1]}]] * k]
            )
    if rng.random() < 0.5:  # msgspec's array_like form
        return [ev["type"], *(v for key, v in ev.items() if key != "type")]
    return ev


def _payload(rng: random.Random, prev: list[int], bs: int) -> bytes:
    b = bytearray(msgpack.packb([time.time(), [_event(rng, prev, bs) for _ in range(rng.randrange(4))],
                                 rng.choice([None, 0, 1])]))  # fmt: skip
    r = rng.random()
    if r < 0.3:
        for _ in range(rng.randrange(1, 5)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif r < 0.45:
        b = b[: rng.randrange(len(b) + 1)]
    elif r < 0.55:
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 9))
    elif r < 0.6:
        b = bytearray(rng.randbytes(rng.randrange(64)))
    elif r < 0.62:
        b = bytearray(b"\xdd\xff\xff\xff\xff") + b  # an array header claiming 4G entries
    elif r < 0.63:
        b = bytearray(b"\x91" * 100_000)  # nesting far past any sane depth
    return bytes(b)


def fuzz_ingest(seed: int, n: int) -> dict[str, int]:
    """Random, truncated and mutated KV-event batches into the native prefix index. Asserts ingest
    returns counters or raises a Python exception (never crashes), and that the index still
    stores and matches an honest chain afterwards."""
    from kvpool import _conductor

    rng = random.Random(seed)
    bs = 32
    idx = _conductor.PrefixIndex(bs, 0, 0)
    prev: list[int] = []
    stats = {"payloads": 0, "stored": 0, "malformed": 0}
    for i in range(n):
        try:
            st = idx.ingest(
                _payload(rng, prev, bs), rng.randrange(4), rng.choice([-1, 5]), rng.choice([-1, 6])
            )
            stats["stored"] += int(st["stored"])
            stats["malformed"] += int(st["malformed"])
        except (ValueError, OverflowError, RuntimeError):
            pass
        stats["payloads"] += 1
        if i % 1000 == 999 and rng.random() < 0.3:
            idx.clear(rng.randrange(8))
    toks = list(range(3 * bs))
    idx.clear(9)
    st = idx.ingest(msgpack.packb([0.0, [_stored([11, 12, 13], None, toks, bs, "GPU")], None]), 9, -1, -1)
    assert st["stored"] == 3, st
    assert idx.match(idx.hash_tokens(toks, None, None), 10)[9] == 3, (
        "the index no longer matches an honest chain"
    )
    return stats


def fuzz_ingest_capped(seed: int, n: int) -> dict[str, int]:
    """The same payloads into indexes capped at a few blocks (``max_blocks`` 8-300), so that most
    ingests evict: four threads ingest at locations of their own (GPU, CPU) while a fifth
    matches, reads masks and sizes and clears or removes at random (``ingest`` and ``match``
    release the GIL: they run at once). Asserts the readers' answers stay in bounds, that an
    index ends at most at its cap once an ingest has run alone, and that it still stores and
    matches an honest chain; ``n``: payloads per ingest thread, over all caps."""
    from kvpool import _conductor

    bs = 16
    stats = {"payloads": 0, "stored": 0, "evicted": 0, "matches": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []
    for cap in (8, 37, 300):
        idx = _conductor.PrefixIndex(bs, 0, 0, cap)
        done = threading.Event()

        def ingest(t: int, idx: Any = idx, cap: int = cap) -> None:
            rng, prev = random.Random(seed * 1000 + t * 7 + cap), []
            try:
                for _ in range(n // 3):
                    try:
                        st = idx.ingest(_payload(rng, prev, bs), t, t + 8, rng.choice([-1, 16]))
                    except (ValueError, OverflowError, RuntimeError):
                        continue
                    with lock:
                        stats["payloads"] += 1
                        stats["stored"] += int(st["stored"])
                        stats["evicted"] += int(st["evicted"])
            except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
                errors.append(exc)

        def read(idx: Any = idx, cap: int = cap, done: threading.Event = done) -> None:
            rng, prev = random.Random(seed + cap), []
            try:
                while not done.is_set():
                    _payload(rng, prev, bs)  # its chains' hashes, for lookups
                    hs = rng.sample(prev, min(len(prev), rng.randrange(1, 40)))
                    got = idx.match(hs, 17)
                    assert len(got) == 17 and all(0 <= c <= len(hs) for c in got), (hs, got)
                    for h in hs[:4]:
                        assert idx.mask(h) >> 17 == 0, hex(idx.mask(h))
                    assert all(idx.location_size(loc) >= 0 for loc in range(17))
                    r = rng.random()
                    if r < 0.02:
                        idx.clear(rng.randrange(17))
                    elif r < 0.05:
                        idx.remove(rng.randrange(4), hs[:3])
                    with lock:
                        stats["matches"] += 1
            except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=ingest, args=(t,)) for t in range(4)]
        reader = threading.Thread(target=read)
        for th in [*threads, reader]:
            th.start()
        for th in threads:
            th.join()
        done.set()
        reader.join()
        if errors:
            raise errors[0]
        toks = list(range(3 * bs))
        chain = msgpack.packb([0.0, [_stored([11, 12, 13], None, toks, bs, "GPU")], None])
        st = idx.ingest(chain, 5, -1, -1)  # alone: the index ends at most at its cap (this chain's
        assert st["stored"] == 3 and len(idx) <= cap, (st, len(idx), cap)  # blocks may go too)
        for loc in range(17):
            idx.clear(loc)
        assert len(idx) == 0, len(idx)  # the counts stayed consistent through the churn
        st = idx.ingest(chain, 5, -1, -1)
        assert st["stored"] == 3 and st["evicted"] == 0 and len(idx) == 3, (st, len(idx))
        assert idx.match(idx.hash_tokens(toks, None, None), 6)[5] == 3, "the capped index lost a chain"
    return stats


if __name__ == "__main__":
    kind, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fn = {"server": fuzz_server, "client": fuzz_client, "ingest": fuzz_ingest, "capped": fuzz_ingest_capped}[
        kind
    ]
    print(kind, "ok", fn(seed, count), flush=True)

"""SGLang 0.5.23 P/D through the kvpool backend: plugin registration, a two-process
prefill->decode transfer with SGLang's own KVArgs/bootstrap server/Common* classes (every byte
verified), aborts, TP mismatch, control-message authentication, a prefill killed mid-transfer
and a bad bootstrap address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.child import free_port
from tests.sglang_support import ROOT, SGLANG_ENV, sglang_python

PROC = str(ROOT / "tests" / "sglang_pd_proc.py")
SUCCESS, TRANSFERRING, FAILED = 4, 3, 0


class Role:
    """One role process; JSON lines on stdout."""

    def __init__(self, role: str, port: int, scenario: str) -> None:
        env = dict(os.environ, **SGLANG_ENV)
        self.proc = subprocess.Popen(
            [sglang_python(), PROC, role, str(port), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []

    def wait_for(self, event: str, timeout: float = 120, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            if ev["event"] == event and all(ev.get(k) == v for k, v in match.items()):
                return ev
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(
                    f"{event!r} never came; process exited {self.proc.poll()}:\n{err[-3000:]}"
                )
            ev = json.loads(line)
            self.events.append(ev)
            if ev["event"] == event and all(ev.get(k) == v for k, v in match.items()):
                return ev
        raise AssertionError(f"{event!r} not within {timeout}s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def roles() -> Iterator[list[Role]]:
    started: list[Role] = []
    yield started
    for r in started:
        r.close()


def test_plugin_registers_backend_and_cli_choice() -> None:
    code = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.server_args import prepare_server_args
from sglang.srt.disaggregation import prefill, decode
args = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                            "--disaggregation-transfer-backend", "kvpool"])
b = TransferBackend("kvpool")
names = [get_kv_class(b, t).__name__ for t in KVClassType]
print(args.disaggregation_transfer_backend, b.name, *names, prefill.get_kv_class is get_kv_class)
"""
    env = dict(os.environ, **SGLANG_ENV)
    out = subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "kvpool",
        "KVPOOL",
        "KVArgs",
        "KvpoolKVManager",
        "KvpoolKVSender",
        "KvpoolKVReceiver",
        "KvpoolKVBootstrapServer",
        "True",
    ]


def test_prefill_to_decode_transfer_abort_tp_mismatch_and_short_destination(roles: list[Role]) -> None:
    port = free_port()
    p = Role("prefill", port, "main")
    roles.append(p)
    p.wait_for("ready")
    d = Role("decode", port, "main")
    roles.append(d)
    src = p.wait_for("src")
    # Room 4: the decode gave 12 destination pages for 16: the room fails on both sides with the
    # reason (a transfer of 12 pages reported as success left the decode computing without 4).
    d4, p4 = d.wait_for("done", room=4), p.wait_for("done", room=4)
    assert d4["status"] == FAILED and "too few for the prefill's chunk of 16 pages" in d4["reason"]
    assert p4["status"] == FAILED and "12 destination pages" in p4["reason"]
    got = d.wait_for("done", room=1)
    assert got["status"] == SUCCESS, got["reason"]
    # Every byte of every page of every layer's K and V buffer, and both aux rows, arrived.
    assert got["kv"] == src["kv"]["1"] and len(got["kv"]) == 8 and len(got["kv"][0]) == 40
    assert got["aux"] == src["aux"]
    done1 = p.wait_for("done", room=1)
    assert done1["status"] == SUCCESS and done1["calls"] == 3  # one batch per chunk, aux in the last
    # Room 2: the decode aborted; the prefill side gives the room up with the reason.
    assert d.wait_for("done", room=2)["status"] == FAILED
    p2 = p.wait_for("done", room=2)
    assert p2["status"] == FAILED and "Aborted by the decode instance" in p2["reason"]
    # Room 3: a decode with another attention TP size is refused with a clear reason on both sides.
    d3 = d.wait_for("done", room=3)
    assert d3["status"] == FAILED and "equal attention TP sizes" in d3["reason"]
    assert "equal attention TP sizes" in p.wait_for("done", room=3)["reason"]


@pytest.mark.parametrize("decode_then", ["resumes", "dies"])
def test_an_abort_is_acked_only_after_the_write_in_flight_finished(
    roles: list[Role], tmp_path: Any, monkeypatch: pytest.MonkeyPatch, decode_then: str
) -> None:
    """SGLang's deferred decode KV release: a decode that aborts a room keeps its pages until the
    prefill acks; the ack must wait for a WRITE of that room still in flight, or the write lands
    in pages already given to another request. The decode process is stopped (SIGSTOP) so the
    prefill's TCP WRITE cannot complete; the ABORT comes from this test once the prefill says the
    write runs, and the test also takes the ack.
    Then the decode process resumes (the write finishes), or dies (SIGKILL: the write fails with a
    TransferError, not a timeout, once nothing of it runs): either way the ack comes. Until
    2026-11-27 a write that failed so was never acked (an aborting decode rank waited out SGLang's
    release timeout, 30 s)."""
    import zmq

    go = tmp_path / "go"
    monkeypatch.setenv("KVPOOL_PROTOCOL", "tcp")
    monkeypatch.setenv("KVPOOL_TEST_GO", str(go))
    # The write may wait in the connect handshake with the stopped decode (the engine opens data
    # connections as a batch needs them): a stop longer than connect_timeout_s (5 s) would fail it.
    monkeypatch.setenv("KVPOOL_CONNECT_TIMEOUT_S", "60")
    port = free_port()
    p = Role("prefill", port, "abort-inflight")
    roles.append(p)
    rank_port = p.wait_for("ready")["rank_port"]
    d = Role("decode", port, "abort-inflight")
    roles.append(d)
    p.wait_for("waiting-go", room=1)
    os.kill(d.proc.pid, signal.SIGSTOP)
    ctx = zmq.Context()
    acks = ctx.socket(zmq.PULL)
    ack_port = acks.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{rank_port}")
    try:
        go.touch()  # the prefill writes room 1 into the stopped decode: the WRITE cannot finish
        p.wait_for("writing", room=1)  # room 1's chunk is in flight (its worker writes it)
        push.send_multipart([b"ABORT", b"1", b"127.0.0.1", str(ack_port).encode(), b"7"])
        assert acks.poll(2000) == 0  # no ack while the write is in flight
        os.kill(d.proc.pid, signal.SIGCONT if decode_then == "resumes" else signal.SIGKILL)
        assert acks.poll(20000) != 0
        # SGLang's AbortAck: room, this prefill rank, the decode's generation.
        assert acks.recv_multipart() == [b"ABORT_ACK", b"1", b"0", b"7"]
        got = p.wait_for("done", room=1)
        assert got["status"] == FAILED and "Aborted by the decode instance" in got["reason"]
    finally:
        if d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)
        push.close(0)
        acks.close(0)
        ctx.term()


def _auth_prefill(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secret: str, roles: list[Role]
) -> tuple[Path, int, Role]:
    """A prefill role in "auth" mode with ``secret`` in KVPOOL_SECRET (inherited by the roles
    started after it): (its go file, bootstrap port, role)."""
    go = tmp_path / "go"
    monkeypatch.setenv("KVPOOL_SECRET", secret)
    monkeypatch.setenv("KVPOOL_TEST_GO", str(go))
    port = free_port()
    p = Role("prefill", port, "auth")
    roles.append(p)
    return go, port, p


def test_control_messages_are_authenticated_with_a_secret(
    roles: list[Role], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KVPOOL_SECRET both managers sign every control message and drop what is unsigned,
    signed with another secret or replayed: a forged ABORT of a live room and a forged Failed
    status to the decode change nothing; the signed registration, metadata, status, an ABORT
    signed by this test and its ABORT_ACK work."""
    import zmq

    from kvpool.connectors.sglang.control_auth import ControlAuth, endpoint_id

    secret = "pd-control-secret"
    go, port, p = _auth_prefill(monkeypatch, tmp_path, secret, roles)
    src = p.wait_for("src")
    rank_port = p.wait_for("ready")["rank_port"]
    d = Role("decode", port, "auth")
    roles.append(d)
    decode_port = d.wait_for("dst")["rank_port"]
    p.wait_for("waiting-go", room=1)  # the decode's signed registration and metadata were accepted
    ctx = zmq.Context()
    acks = ctx.socket(zmq.PULL)
    ack_port = acks.bind_to_random_port("tcp://127.0.0.1")
    prefill_id = endpoint_id("127.0.0.1", rank_port)
    auth = ControlAuth(secret, receiver=endpoint_id("127.0.0.1", ack_port))  # the acks' receiver
    forger = ControlAuth("another secret")
    to_prefill, to_decode = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    to_prefill.connect(f"tcp://127.0.0.1:{rank_port}")
    to_decode.connect(f"tcp://127.0.0.1:{decode_port}")

    def abort(room: int, generation: int) -> list[bytes]:
        return [b"ABORT", str(room).encode(), b"127.0.0.1", str(ack_port).encode(), str(generation).encode()]

    try:
        to_prefill.send_multipart(abort(1, 1))  # unsigned
        to_prefill.send_multipart(forger.seal(abort(1, 2), prefill_id))  # signed with another secret
        # Signed with the secret for another manager's control endpoint (an ABORT captured on its
        # way there): not for this prefill rank.
        to_prefill.send_multipart(auth.seal(abort(1, 4), endpoint_id("127.0.0.1", decode_port)))
        to_decode.send_multipart([b"1", b"0", b"0", b"forged failure"])  # unsigned status: Failed
        signed = auth.seal(abort(99, 3), prefill_id)
        to_prefill.send_multipart(signed)
        assert acks.poll(20000) != 0
        # The first ack is the signed ABORT's (no forged one was acted on), and it is signed for
        # the ack endpoint.
        ack = acks.recv_multipart()
        assert auth.open(ack) == [b"ABORT_ACK", b"99", b"0", b"3"]
        assert ControlAuth(secret, receiver=endpoint_id("127.0.0.1", decode_port)).open(ack) is None
        to_prefill.send_multipart(signed)  # replayed
        assert acks.poll(2000) == 0
        # The prefill's real ack, captured on its way to the ack endpoint, sent to the decode: its
        # replay window has never seen it, but it was not sealed for the decode.
        to_decode.send_multipart(ack)
        go.touch()
        got = d.wait_for("done", room=1)
        assert got["status"] == SUCCESS, got["reason"]
        assert got["kv"] == src["kv"]["1"] and got["aux"] == src["aux"]
        assert got["dropped"] == {"unsigned": 1, "bad MAC": 1}
        done = p.wait_for("done", room=1)
        assert done["status"] == SUCCESS
        assert done["dropped"] == {"unsigned": 1, "bad MAC": 2, "replayed": 1}
    finally:
        for s in (to_prefill, to_decode, acks):
            s.close(0)
        ctx.term()


def _http(
    port: int, method: str, path: str, payload: Any = None, headers: dict | None = None
) -> tuple[int, Any]:
    """(status, JSON or text) of one request to the bootstrap server."""
    import urllib.error
    import urllib.request

    body = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def test_bootstrap_registrations_are_authenticated_with_a_secret(
    roles: list[Role], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With KVPOOL_SECRET the bootstrap server refuses rank and DP-rank registrations that are
    unsigned (401), signed with another secret, for another bootstrap server or replayed (403): a
    forged registration of the
    prefill's rank 0 pointing at this test's socket is not what decodes read, and the decode's
    room is served by the real rank (which registered signed); a registration signed with the
    secret is accepted."""
    import zmq

    from kvpool.connectors.sglang.bootstrap_auth import AUTH_HEADER, BootstrapAuth

    secret = "pd-bootstrap-secret"
    go, port, p = _auth_prefill(monkeypatch, tmp_path, secret, roles)
    rank_port = p.wait_for("ready")["rank_port"]
    rank0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    assert _http(port, "GET", rank0) == (200, {"rank_ip": "127.0.0.1", "rank_port": rank_port})
    status, info = _http(
        port, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    )
    assert status == 200
    ctx = zmq.Context()
    trap = ctx.socket(zmq.PULL)  # where the forged registrations point decodes to
    trap_port = trap.bind_to_random_port("tcp://127.0.0.1")
    row = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
           "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
           "rank_ip": "127.0.0.1", "rank_port": trap_port, "page_size": info["page_size"],
           "kv_cache_dtype": info["kv_cache_dtype"],
           "decode_allocation_policy": info["decode_allocation_policy"]}  # fmt: skip
    body = json.dumps(row).encode()

    good, forger = BootstrapAuth(secret), BootstrapAuth("another secret")
    url = f"http://127.0.0.1:{port}"
    try:
        assert _http(port, "PUT", "/route", body, {"Content-Type": "application/json"})[0] == 401
        assert _http(port, "PUT", "/route", body, forger.headers("PUT", url + "/route", body))[0] == 403
        assert _http(port, "PUT", "/route", body, {AUTH_HEADER: "zz"})[0] == 401
        # A signed registration's MAC covers the body: another rank_port under it is refused.
        other = json.dumps(dict(row, rank_port=trap_port + 1)).encode()
        nonce = good.server_nonce(url)  # this server's challenge
        assert len(nonce) == 16
        assert _http(port, "PUT", "/route", other, good.headers("PUT", url + "/route", body, nonce))[0] == 403
        assert _http(port, "GET", rank0) == (200, {"rank_ip": "127.0.0.1", "rank_port": rank_port})
        # A registration signed with the secret for another prefill instance's bootstrap server,
        # accepted there and captured on its way: not for this one, whose replay window never saw it.
        rank1 = json.dumps(dict(row, attn_tp_rank=1)).encode()
        other_port = free_port()
        b = Role("bootstrap", other_port, "auth")
        roles.append(b)
        b.wait_for("ready")
        there = f"http://127.0.0.1:{other_port}/route"
        elsewhere = good.headers("PUT", there, rank1, good.server_nonce(there))
        assert _http(other_port, "PUT", "/route", rank1, elsewhere) == (200, "OK")
        status, reason = _http(port, "PUT", "/route", rank1, elsewhere)
        assert status == 403 and "bad MAC" in reason
        # Signed with the secret: accepted (as rank 1's), once.
        headers = good.headers("PUT", url + "/route", rank1, nonce)
        assert _http(port, "PUT", "/route", rank1, headers) == (200, "OK")
        assert _http(port, "PUT", "/route", rank1, headers)[0] == 403  # replayed
        got = _http(port, "GET", rank0.replace("target_tp_rank=0", "target_tp_rank=1"))
        assert got == (200, {"rank_ip": "127.0.0.1", "rank_port": trap_port})
        # A room's DP rank: only the signed registration counts.
        dp77, dp78 = (
            json.dumps({"bootstrap_room": 77, "dp_rank": 0}),
            json.dumps({"bootstrap_room": 78, "dp_rank": 0}),
        )
        assert _http(port, "POST", "/register_dp_rank", dp78.encode())[0] == 401
        headers = good.headers("POST", url + "/register_dp_rank", dp77.encode(), nonce)
        assert _http(port, "POST", "/register_dp_rank", dp77.encode(), headers) == (200, "OK")
        assert _http(port, "POST", "/query_dp_ranks", {"bootstrap_rooms": [77, 78]}) == (200, {"77": 0})
        d = Role("decode", port, "auth")
        roles.append(d)
        p.wait_for("waiting-go", room=1)
        go.touch()
        got = d.wait_for("done", room=1)
        assert got["status"] == SUCCESS, got["reason"]
        done = p.wait_for("done", room=1)
        assert done["status"] == SUCCESS
        assert done["bootstrap_dropped"] == {"unsigned": 3, "bad MAC": 3, "replayed": 1}
        assert trap.poll(500) == 0  # no decode sent anything to the forged rank
    finally:
        trap.close(0)
        ctx.term()


def test_a_restarted_bootstrap_server_refuses_registrations_sealed_before(
    roles: list[Role], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration is sealed with the nonce the bootstrap server draws at each start: one
    captured before a restart is refused by the restarted server (whose replay window, kept in
    memory, never saw it; it was accepted once before); a signer whose kept nonce went stale
    fetches it again and is accepted."""
    from kvpool.connectors.sglang.bootstrap_auth import BootstrapAuth, send_json

    monkeypatch.setenv("KVPOOL_SECRET", "restart-secret")
    port = free_port()
    url = f"http://127.0.0.1:{port}/route"
    row = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
           "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
           "rank_ip": "127.0.0.1", "rank_port": 4242, "page_size": 16, "kv_cache_dtype": "bf16"}  # fmt: skip
    body, signer = json.dumps(row).encode(), BootstrapAuth("restart-secret")
    first = Role("bootstrap", port, "auth")
    roles.append(first)
    first.wait_for("ready")
    before = signer.server_nonce(url)
    captured = signer.headers("PUT", url, body, before)
    assert _http(port, "PUT", "/route", body, captured) == (200, "OK")
    assert _http(port, "PUT", "/route", body, captured)[0] == 403  # replayed
    first.kill()
    again = Role("bootstrap", port, "auth")
    roles.append(again)
    again.wait_for("ready")
    status, reason = _http(port, "PUT", "/route", body, captured)
    assert status == 403 and "bad MAC" in reason
    assert signer.server_nonce(url) == before  # kept: stale now
    r = send_json(signer, "PUT", url, row)  # refused with the stale nonce, sealed anew: accepted
    assert (r.status_code, r.text) == (200, "OK") and signer.server_nonce(url) not in (before, b"")


def test_bootstrap_auth_without_a_secret_signs_and_checks_nothing() -> None:
    from kvpool.connectors.sglang.bootstrap_auth import AUTH_HEADER, BootstrapAuth, server_id

    plain, signer = BootstrapAuth(None), BootstrapAuth("s")
    url, me = "http://10.0.0.1:8998/route", [b"10.0.0.1:8998"]
    assert plain.headers("PUT", url, b"{}") == {"Content-Type": "application/json"}
    assert plain.check("PUT", "/route", b"{}", None, me) is None
    checker = BootstrapAuth("s")  # a server: its nonce
    headers = signer.headers("PUT", url, b"{}", checker.nonce)
    assert len(headers[AUTH_HEADER]) == 2 * 56
    assert server_id(url) == me[0] and server_id("http://[::0:1]/x") == b"[::1]:80"
    assert BootstrapAuth("s").check("PUT", "/route", b"{}", headers[AUTH_HEADER], me)[0] == 403  # other nonce
    assert checker.check("PUT", "/route", b"{}", headers[AUTH_HEADER], me) is None
    assert checker.check("PUT", "/route", b"{}", headers[AUTH_HEADER], me)[1].endswith("(replayed)")
    headers = signer.headers("PUT", url, b"{}", checker.nonce)
    # Method and path are signed too.
    assert checker.check("POST", "/route", b"{}", headers[AUTH_HEADER], me)[0] == 403
    assert BootstrapAuth("s").check("PUT", "/route", b"{}", None, me)[0] == 401
    # Sealed for 10.0.0.1:8998: refused by a server of other names, whose reason names them when
    # the request was addressed to a name that is not its own.
    refused = checker.check("PUT", "/route", b"{}", headers[AUTH_HEADER], [b"10.0.0.2:8998"], me[0])
    assert refused is not None and refused[0] == 403
    assert (
        "addressed to 10.0.0.1:8998, which is not one of this server's names ['10.0.0.2:8998']" in refused[1]
    )
    two = [b"10.0.0.2:8998", b"10.0.0.1:8998"]
    assert checker.check("PUT", "/route", b"{}", headers[AUTH_HEADER], two) is None


def test_bootstrap_server_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names a bootstrap server accepts registrations sealed for: where the connection came in,
    its bind address unless a wildcard, and KVPOOL_SGLANG_BOOTSTRAP_NAMES."""
    from kvpool.connectors.sglang.bootstrap_auth import server_names

    monkeypatch.delenv("KVPOOL_SGLANG_BOOTSTRAP_NAMES", raising=False)
    assert server_names("0.0.0.0", 8998, ("127.0.0.1", 8998)) == [b"127.0.0.1:8998"]
    assert server_names("::", 8998, ("::ffff:10.0.0.5", 8998, 0, 0)) == [b"10.0.0.5:8998"]
    assert server_names("Prefill-A", 8998, ("10.0.0.5", 8998)) == [b"10.0.0.5:8998", b"prefill-a:8998"]
    monkeypatch.setenv("KVPOOL_SGLANG_BOOTSTRAP_NAMES", "svc.ns:30998, [::1]:9000 ,gw,")
    assert server_names("10.0.0.5", 8998, None) == [
        b"10.0.0.5:8998",
        b"svc.ns:30998",
        b"[::1]:9000",
        b"gw:8998",
    ]


def test_prefill_bounds_the_destinations_it_keeps(roles: list[Role], monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata beyond a room's decode ranks, beyond the room limit, and rooms no request claims
    within the TTL: refused (the decode rank gets Failed with the reason) or dropped, never kept;
    decode registrations beyond KVPOOL_SGLANG_MAX_PEERS evict the oldest; registrations the
    prefill cannot serve are refused, their session and reason kept, nothing more."""
    monkeypatch.setenv("KVPOOL_SGLANG_MAX_ROOMS", "4")
    monkeypatch.setenv("KVPOOL_SGLANG_ROOM_TTL_S", "2")
    monkeypatch.setenv("KVPOOL_SGLANG_MAX_PEERS", "3")
    p = Role("prefill-bounds", free_port(), "bounds")
    roles.append(p)
    got = p.wait_for("bounds")
    # Room 50 needs 2 decode ranks: a third and a fourth session are refused.
    assert got["room50"] == ["s0", "s1"]
    assert [s[:2] for s in got["sessions"]] == [[50, FAILED]] * 2
    assert all("room 50 already has its 2 decode destinations" in s[2] for s in got["sessions"])
    # At most 4 rooms: 103 and 104 refused.
    assert got["rooms"] == [50, 100, 101, 102]
    assert [s[:2] for s in got["rooms_refused"]] == [[103, FAILED], [104, FAILED]]
    assert all("KVPOOL_SGLANG_MAX_ROOMS" in s[2] for s in got["rooms_refused"])
    # After the TTL the rooms no request holds are dropped; room 100 (held by a request) stays.
    assert got["after_ttl"] == [100, 300]
    assert got["status_after_ttl"] == [100, 300]  # the status complete metadata gave them went too
    assert got["refused"] == 4 and got["evicted"] == 3
    # 5 decode ranks registered with at most 3 kept: the 2 registered first were evicted.
    assert got["peers"] == ["p2", "p3", "p4"] and got["peers_evicted"] == 2
    # Registrations the prefill cannot serve are refused at registration: only their session and
    # the reason are kept (the old code kept them whole, 200,000 addresses, and took another page
    # size), and a room of theirs fails on the decode's side with the reason.
    refused = got["refused_peers"]
    assert {s: r[:2] for s, r in refused.items()} == {"bad-page": [2, 0], "bad-tp": [2, 0], "bad-aux": [2, 0]}
    assert "page sizes differ: prefill 16 tokens per page, decode 32" in refused["bad-page"][2]
    assert "equal attention TP sizes" in refused["bad-tp"][2] and len(refused["bad-tp"][2]) <= 512
    assert "aux (metadata) buffer 1 differs: prefill rows of 64 bytes, decode 63" in refused["bad-aux"][2]
    assert [r[:2] for r in got["refused_room"]] == [[400, FAILED]]
    assert "page sizes differ" in got["refused_room"][0][2]
    # The prefill's request for that room, created after the refusal, fails at once with the reason
    # (the old code left it Bootstrapping until SGLang's bootstrap timeout).
    late_status, late_reason = got["refused_late_sender"]
    assert late_status == FAILED and "page sizes differ" in late_reason


def test_peer_table_evicts_the_registration_unused_longest() -> None:
    from kvpool.connectors.sglang.rooms import PeerTable

    t = PeerTable(max_peers=3)
    for s in ("a", "b", "c"):
        t.put(s, s.upper())
    assert t.get("a") == "A"  # a transfer to a: b is now the one unused longest
    t.put("d", "D")
    assert t.sessions() == ["c", "a", "d"] and t.get("b") is None and t.evicted == 1
    t.put("c", "C2")  # a decode registering again replaces its entry, evicts nothing
    assert t.sessions() == ["a", "d", "c"] and t.get("c") == "C2" and t.evicted == 1 and len(t) == 3


def test_control_auth_freshness_and_bounds() -> None:
    """The replay window (reordering passes, a repeat or a counter too far behind does not), the
    time window, the receiver bound into the MAC, the bounded sender table, and no checks without a
    secret."""
    from kvpool.connectors.sglang.control_auth import REPLAY_WINDOW, ControlAuth, endpoint_id, endpoint_of

    now = [1000.0]
    a = ControlAuth("s", window_s=10, clock=lambda: now[0])
    b = ControlAuth("s", window_s=10, clock=lambda: now[0], max_senders=2)
    msgs = [a.seal([b"T", str(i).encode()]) for i in range(REPLAY_WINDOW + 3)]
    assert b.open(msgs[2]) == [b"T", b"2"]
    assert b.open(msgs[0]) == [b"T", b"0"]  # reordered: still inside the window
    assert b.open(msgs[0]) is None and b.open(msgs[2]) is None  # replays
    assert b.open(msgs[-1]) is not None
    assert b.open(msgs[1]) is None  # more than REPLAY_WINDOW behind the highest counter
    tampered = list(msgs[5])
    tampered[1] = b"X"
    assert b.open(tampered) is None
    assert b.open(msgs[5][:-1]) is None  # trailer stripped
    now[0] += 11
    assert b.open(msgs[6]) is None  # stale
    assert b.dropped == {"replayed": 3, "bad MAC": 1, "unsigned": 1, "stale (clock skew or replay)": 1}
    # Sealed for another receiver than b's own id (b"", as a and b have): fails the MAC.
    assert b.open(a.seal([b"T", b"x"], b"127.0.0.1:5000")) is None and b.dropped["bad MAC"] == 2
    c = ControlAuth("s", window_s=10, clock=lambda: now[0], receiver=endpoint_id("::0:1", "5000"))
    assert c.receiver == b"[::1]:5000" == endpoint_of("tcp://[::1]:5000")
    assert c.open(a.seal([b"T"], endpoint_of("tcp://[::1]:5000"))) == [b"T"]
    assert c.open(a.seal([b"T"], b"[::1]:5001")) is None and c.open(a.seal([b"T"])) is None
    assert endpoint_id("Host-A", 7) == endpoint_of("tcp://host-a:7") == b"host-a:7"
    others = [ControlAuth("s", clock=lambda: now[0]) for _ in range(3)]
    for o in others:
        assert b.open(o.seal([b"T"])) == [b"T"]
    assert len(b._seen) == 2  # the longest silent sender was forgotten
    plain = ControlAuth(None)
    assert plain.seal([b"T"]) == [b"T"] and plain.open([b"T", b"x" * 56]) == [b"T", b"x" * 56]


def test_prefill_killed_mid_transfer_fails_decode_with_reason(roles: list[Role]) -> None:
    port = free_port()
    p = Role("prefill", port, "kill")
    roles.append(p)
    p.wait_for("ready")
    d = Role("decode", port, "kill")
    roles.append(d)
    p.wait_for("first-chunk-sent")
    p.kill()
    t0 = time.monotonic()
    got = d.wait_for("done", room=1, timeout=60)
    assert got["status"] == FAILED
    assert "Lost connection with prefill instance" in got["reason"]
    assert time.monotonic() - t0 < 20  # heartbeat every 2 s, 2 misses


def test_bad_bootstrap_address_fails_with_reason(roles: list[Role]) -> None:
    d = Role("decode-badaddr", free_port(), "main")
    roles.append(d)
    got = d.wait_for("done", room=9, timeout=120)
    assert got["status"] == FAILED and got["reason"]


def test_sglang_whose_interface_differs_is_refused() -> None:
    code = """
import sglang.srt.arg_groups.choices as c
del c.add_disagg_transfer_backend_choices
from kvpool.connectors.sglang.plugin import check_sglang
try:
    check_sglang()
except ImportError as e:
    print("refused:", e)
"""
    env = dict(os.environ, **SGLANG_ENV)
    out = subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert "refused:" in out.stdout, out.stderr[-2000:]
    assert "add_disagg_transfer_backend_choices" in out.stdout


def test_a_room_seen_again_does_not_keep_older_rooms_from_their_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's room table (no SGLang needed): a room whose destinations were popped (its
    last chunk went) gets late metadata again. It is the youngest room now, and an unclaimed
    room older than the TTL is still dropped at the next admission (the re-seen room kept its
    old place with a new time, and each sweep stopped at it)."""
    from kvpool.connectors.sglang import rooms

    now = [0.0]
    monkeypatch.setattr(rooms.time, "monotonic", lambda: now[0])
    infos: dict[int, dict[str, Any]] = {}
    table = rooms.RoomTable(infos, lambda r: infos.pop(r, None), max_rooms=100, max_sessions=4, ttl_s=10.0)

    def meta(room: int, at: float) -> None:
        now[0] = at
        assert table.admit(room, "s", 1) is None
        infos.setdefault(room, {})["s"] = object()

    meta(1, 0.0)
    meta(2, 1.0)
    meta(3, 2.0)
    infos.pop(2)  # its last chunk was written (the sender clears the room later)
    meta(2, 9.0)  # late metadata of room 2
    meta(4, 11.0)  # room 1 is 11 s old: dropped
    assert 1 not in infos
    meta(5, 12.5)  # room 3 is 10.5 s old, no request claimed it
    assert 3 not in infos and all(r in infos for r in (2, 4, 5))


def test_pipeline_stages_poll_a_room_whose_chunk_is_written_transferring() -> None:
    """With pipeline parallelism SGLang's sender polls the room's status over the stages
    (``poll_pp_consensus``: the lowest, through SGLang's PPConsensusStore, which replicates each
    stage's status to stage 0). A Failed room of which stage 0 still writes a chunk (an abort
    while its GPU copies run) reads Transferring, as ``poll`` does without PP, and so does one
    of which stage 1 alone writes a chunk (it says so in its store); Failed once the chunk
    ended; otherwise the stages' lowest status. The stores are SGLang's, two stages in one
    process (tests/sglang_pd_proc.py ``pp_consensus``)."""
    p = Role("pp-consensus", 0, "-")
    try:
        got = p.wait_for("pp", timeout=120)
    finally:
        p.close()
    assert got["aborted_in_flight"] == TRANSFERRING  # SGLang's own consensus: Failed
    assert got["stage1_failed_in_flight"] == TRANSFERRING
    assert got["aborted_drained"] == FAILED
    # stage 1 writes a chunk (stage 0 none): until 2026-11-27 stage 0 polled Failed meanwhile
    assert got["stage1_in_flight"] == TRANSFERRING and got["stage1_drained"] == FAILED
    assert got["both_transferring"] == TRANSFERRING
    assert got["waiting"] == 2  # WaitingForInput, the lower of the two
    assert got["success"] == SUCCESS


def test_late_rooms_end_each_parked_room_once_its_copies_settled() -> None:
    """A transfer worker's parked rooms (no SGLang needed): none parked, its queue get waits
    unbounded; parked, the wait starts at 10 ms and backs off to 0.5 s; a room ends (once) only
    when its batch settled, the others stay parked."""
    from kvpool.connectors.sglang.rooms import LateRooms

    settled: set[int] = set()
    late = LateRooms(lambda bid: bid in settled)
    assert late.wait_s() is None and late.ended() == []
    late.park(2, 20, "why 2")
    late.park(4, 40, "why 4")
    assert late.wait_s() == LateRooms.MIN_WAIT_S
    for _ in range(10):
        assert late.ended() == []
    assert late.wait_s() == LateRooms.MAX_WAIT_S and len(late) == 2
    settled.add(40)
    assert late.ended() == [(4, "why 4")] and late.ended() == [] and len(late) == 1
    late.park(6, 60, "why 6")  # a new room is looked at soon again
    assert late.wait_s() == LateRooms.MIN_WAIT_S
    settled.update((20, 60))
    assert sorted(late.ended()) == [(2, "why 2"), (6, "why 6")] and late.wait_s() is None


@pytest.mark.parametrize("policy", ["early", "prefill_complete"])
def test_a_chunk_whose_gpu_copies_outlive_the_timeout_concludes_its_room_once_they_ended(
    roles: list[Role], fake_driver: str, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """A prefill manager (SGLang's Common classes, kvpool's) whose KV buffers are fake-driver GPU
    memory WRITEs to a decode rank's GPU buffers in a peer process over CUDA IPC; the stream then
    stops: rooms 2 and 3 raise TransferTimeout with their copies queued, room 3 is aborted. While
    stopped, the decode hears nothing (no Failed status: it keeps its pages; no ABORT_ACK: it does
    not release them) and neither room 2's sender nor aborted room 3's polls Failed (the prefill
    keeps their pages: room 3 reads Transferring). Once the stream resumed, room 2's Failed and
    room 3's ack come, each after its batch settled, and room 3's sender polls Failed. The old
    worker failed room 2 at once and never acked room 3; until 2026-11-27 room 3's sender polled
    Failed at its abort (SGLang freed the pages its copies still read). Room 4 (a dummy
    destination), on room 2's transfer worker and sent while room 2's copies were stopped,
    succeeds meanwhile: until 2026-11-27 the worker waited for room 2's copies first. Room 3's
    copies end past the decode's release timeout (0.5 s here): SGLang's decode may have reused
    its pages by then, which kvpool cannot prevent; an error names the room (none did before).
    Room 3 has a second decode rank, never written (the first one's batch timed out first): its
    abort is acked while the stream is stopped (until 2026-11-27 only once the copies ended).

    With SGLang's ``prefill_complete`` allocation policy the decode's BOOTSTRAP registered its
    endpoint and was told WaitingForInput, and SGLang's own handling of the ABORT (before the
    backend's) marks room 3 Failed: still nothing reaches the decode while the copies run (SGLang
    discards that Failed notice; the sender's poll is held at Transferring)."""
    monkeypatch.setenv("KVPOOL_TIMEOUT_S", "0.5")
    monkeypatch.setenv("KVPOOL_SGLANG_WORKERS", "2")  # rooms 2 and 4 share a worker, room 3 not
    # The decode frees an aborted room's pages this long after its abort, acked or not.
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "0.5")
    p = Role("prefill-late", free_port(), "late-pc" if policy == "prefill_complete" else "late")
    roles.append(p)
    got = p.wait_for("late", timeout=180)
    if policy == "prefill_complete":  # each room's decode was told its prefill completed
        assert got["notified"] == [[r, 2] for r in (1, 2, 3, 4)]
    assert got["room1"] == [[1, SUCCESS, True]] and got["room1_bytes"]  # the setup moves bytes
    assert got["timed_out"] == {"2": "TransferTimeout", "3": "TransferTimeout"}
    assert got["while_stopped"] == [] and got["status2_while_stopped"] != FAILED
    assert got["status3_while_stopped"] == TRANSFERRING
    assert got["status4_while_stopped"] == SUCCESS  # room 4 did not wait behind room 2
    assert got["landed"] > 0
    after = sorted(got["after"], key=lambda m: (m[0], str(m[1])))
    # One Failed for room 2: until 2026-11-27, under prefill_complete, SGLang's bootstrap notice
    # "Prefill bootstrap failed" went first, then the backend's with the reason
    assert [m[:2] for m in after if m[0] == 2] == [[2, FAILED]]
    assert len(after) == 3, after  # room 2's Failed, room 3's Failed and its ack
    assert [3, "ack", True] in after  # the ack, once room 3's copies ended
    assert all(settled for _, _, settled in after), after
    assert got["status2"] == FAILED and got["status3"] == FAILED and got["deferred"] == 0
    if policy == "early":  # room 3's second decode rank, never written, is acked while stopped
        # (until 2026-11-27 only once the first rank's copies ended)
        assert got["b_while_stopped"] == [[3, "ack", 8]] and got["b_after"] == [[3, FAILED]]
    # Room 3's copies ended past the decode's release timeout: one error names it (none room 2).
    late = [e for e in got["errors"] if "deferred decode KV release timeout" in e]
    assert len(late) == 1 and "room 3 " in late[0] and "another request" in late[0], got["errors"]


def test_a_rooms_decode_ranks_that_no_timed_out_write_reaches_are_acked(
    roles: list[Role], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A room written to two decode ranks (MLA, decode attention TP 2 over prefill TP 1): B's
    WRITE completes, then the other rank's times out (stopped, TCP: it may still apply the frames
    it received, so its abort is never acked and it keeps its pages until SGLang's release
    timeout). B's abort is acked: when both ranks aborted room 1 while its chunk was written
    (A1 stopped), once the chunk ended; when both aborted room 2 after the prefill failed it (A2
    stopped; SGLang's decode aborts a room it sees fail), at once. Until 2026-11-27 the prefill
    acked neither rank of room 1 (B waited out the timeout, its bytes landed) and both of room 2
    (A2's pages could get the late WRITE after the decode gave them to another request)."""
    monkeypatch.setenv("KVPOOL_PROTOCOL", "tcp")
    monkeypatch.setenv("KVPOOL_TIMEOUT_S", "1")
    monkeypatch.setenv("KVPOOL_CONNECT_TIMEOUT_S", "60")
    p = Role("prefill-ranks", free_port(), "-")
    roles.append(p)
    got = p.wait_for("ranks", timeout=180)
    assert got["raised"] == {"1": "TransferTimeout", "2": "TransferTimeout"}  # A1's, A2's WRITE
    assert got["b_bytes"]  # B's pages of room 1 hold the prefill's bytes
    b, a1, a2 = (got["got"][r] for r in ("B", "A1", "A2"))
    assert [m for m in b if m[1] == "ack"] == [[1, "ack", 7], [2, "ack", 7]], b
    assert [m for m in a1 + a2 if m[1] == "ack"] == [], (a1, a2)
    for rank in (b, a2):  # the prefill failed room 2 on both its ranks, once
        assert [m[:2] for m in rank if m[0] == 2 and m[1] != "ack"] == [[2, FAILED]], rank
    assert [m[:2] for m in a1] == [[1, FAILED]] and not [m for m in a2 if m[0] == 1], (a1, a2)

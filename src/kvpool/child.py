"""Child processes for tests, benchmarks and the demo, started with a JSON ready line and stopped
by PID."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
from typing import Any

from kvpool import errors


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive TCP ports that were free a moment ago, below the kernel's
    ephemeral range, so that sockets bound to port 0 later (clients, servers on port 0) cannot take
    one of them: for servers that listen on ``base + rank`` (P/D side channels of TP ranks)."""
    if not isinstance(n, int) or not 1 <= n <= 1000:
        raise errors.InvalidArgument(f"free_port_range needs 1 to 1000 ports, not {n!r}")
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        base = random.randint(min(20000, low - 1000), low - n - 1)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise errors.KvpoolError(f"no {n} consecutive free ports below {low}")


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """Stop ``proc`` by PID: SIGTERM, then SIGKILL if it is still alive after ``grace_s`` seconds.

    A no-op if it has already exited; waits for it (reaps it) either way.
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli_flags(options: dict[str, Any]) -> list[str]:
    """Command-line flags for keyword options: ``{"lease_ttl_ms": 5, "hot": True}`` gives
    ``["--lease-ttl-ms", "5", "--hot"]``; None and False are left out, and so are ``secret`` and
    ``metadata`` (a URL that may hold a password): a command line is readable by every local user
    (``/proc/PID/cmdline``), so they go to the child in its environment (``KVPOOL_SECRET``,
    ``KVPOOL_METADATA``, see :class:`ChildProcess`)."""
    out: list[str] = []
    for k, v in options.items():
        if k in ("secret", "metadata"):
            continue
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            out.append(flag)
        elif v is not None and v is not False:
            out += [flag, str(v)]
    return out


def _write_stderr(text: str) -> None:
    if not text:
        return
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):  # our stderr is gone (closed pipe, replaced stream)
        pass


class ChildProcess:
    """A child that prints one JSON line (``self.info``) when ready.

    With ``stdin=True`` the child is asked to exit by closing its stdin (after writing
    ``exit_line`` if set); :meth:`close` then terminates and kills it if it is still there.
    """

    start_error: type[Exception] = RuntimeError
    exit_line: str | None = None

    def __init__(
        self, cmd: list[str], stdin: bool = True, secret: str | None = None, metadata: str | None = None
    ) -> None:
        env = dict(os.environ)  # secrets travel in the environment, never on the command line
        for var, value in (("KVPOOL_SECRET", secret), ("KVPOOL_METADATA", metadata)):
            env.pop(var, None)
            if value:
                env[var] = value
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        # The child's stderr is held back until it is ready (so a start failure is reported once,
        # as the child's own error), then passed through to ours.
        self._early_err: list[str] = []
        self._ready = threading.Event()
        self._err_lock = threading.Lock()
        self._err_thread = threading.Thread(target=self._pump_stderr, daemon=True)
        self._err_thread.start()
        while True:  # skip anything that is not our JSON line (e.g. build tool chatter)
            line = self.proc.stdout.readline()
            if line.startswith("{"):
                break
            if not line:
                stop_process(self.proc)
                self._err_thread.join(5)
                raise self._start_failure(cmd)
        self._release_stderr()
        self.info: dict[str, Any] = json.loads(line)
        self.pid: int = self.info.get("pid", self.proc.pid)

    def _pump_stderr(self) -> None:
        err = self.proc.stderr
        assert err is not None
        for line in err:
            with self._err_lock:
                if not self._ready.is_set():
                    self._early_err.append(line)
                    if len(self._early_err) > 200:
                        del self._early_err[:100]
                    continue
            _write_stderr(line)

    def _release_stderr(self) -> None:
        with self._err_lock:
            self._ready.set()
            _write_stderr("".join(self._early_err))
            self._early_err.clear()

    def _start_failure(self, cmd: list[str]) -> Exception:
        """The child's own error (its ``kvpool: Type: message`` line, or its last stderr line) as
        an exception: the same kvpool error type where it names one, else ``start_error``."""
        lines = [x.strip() for x in self._early_err if x.strip()]
        what = " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd[:4]))
        debug = os.environ.get("KVPOOL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
        if debug:
            sys.stderr.writelines(x + "\n" for x in lines)
        for x in reversed(lines):
            if x.startswith("kvpool: ") and x.count(": ") >= 2:
                _, name, msg = x.split(": ", 2)
                from kvpool import cli_errors

                typ = getattr(errors, name, None) or getattr(cli_errors, name, None)
                if isinstance(typ, type) and issubclass(typ, errors.KvpoolError):
                    return typ(msg)
                return self.start_error(f"{what} failed at start: {name}: {msg}")
        last = lines[-1] if lines else f"exit status {self.proc.returncode}, nothing on stderr"
        return self.start_error(f"{what} exited with {self.proc.returncode} before it was ready: {last}")

    def ask(self, line: str) -> dict[str, Any]:
        """Send one command line, read its one-line JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        """SIGKILL it."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Ask it to exit (stdin), give it 10 s, then terminate/kill; close the pipes."""
        stdin = self.proc.stdin
        if self.proc.poll() is None and stdin is not None:
            try:
                if self.exit_line is not None:
                    stdin.write(self.exit_line + "\n")
                stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process(self.proc)
        self._err_thread.join(1.0)
        for f in (self.proc.stdout, stdin):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

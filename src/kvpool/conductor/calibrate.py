"""``kvpool conductor calibrate``: fit a :class:`~kvpool.conductor.cost.CostModel` to real servers.

Probes one or more OpenAI-compatible servers (vLLM) with streaming ``/v1/completions`` whose
prompts are lists of random token ids (no accidental prefix-cache hits):

* prefill: time to first token with ``max_tokens=1`` for several new-token lengths, plus
  repeated-prefix probes (a prefix is sent once to warm the cache, then prefix + extra tokens) for
  the cached-context term. HTTP and scheduling overhead is *kept* in ``prefill_base_s`` (the router
  sees it too), not subtracted.
* decode: mean time per step with ``batch`` concurrent streams (``ignore_eos``) at a couple of
  context lengths — (last token of ``decode_tokens``-long streams − first token of one-token
  streams of the same shape) / (``decode_tokens`` − 1), immune to tokens streamed in one chunk —
  fitting ``decode_base_s``, ``decode_per_seq_s`` and ``decode_per_kv_token_s``.

Each probe runs ``repeats`` times and the median is used. Transfer terms are not measured: they
come from ``--transfer-gbps`` / ``--kv-bytes-per-token`` or stay at the defaults.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from datetime import datetime, timezone
from typing import Any

from kvpool.conductor.cost import CostModel, fit_linear
from kvpool.errors import ConfigError

__all__ = ["calibrate", "fit_prefill", "fit_decode", "run_calibrate"]


async def _stream(session: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Send one streaming completion; return arrival times (relative to send) of each token chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url.rstrip("/") + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise ConfigError(f"{url}: /v1/completions answered {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter() - t0)
    if not times:
        raise ConfigError(f"{url}: streaming completion returned no tokens")
    return times


async def _model_info(session: Any, url: str) -> tuple[str, int]:
    async with session.get(url.rstrip("/") + "/v1/models") as resp:
        if resp.status != 200:
            raise ConfigError(f"{url}: /v1/models answered {resp.status}")
        data = (await resp.json())["data"]
    if not data:
        raise ConfigError(f"{url}: /v1/models lists no model")
    return data[0]["id"], int(data[0].get("max_model_len") or 1 << 30)


def fit_prefill(rows: list[dict[str, float]]) -> dict[str, float]:
    """Fit prefill terms from ``{"new", "cached", "ttft_s"}`` rows (see the cost formula)."""
    x = [[1.0, r["new"], r["new"] * (r["cached"] + r["new"] / 2)] for r in rows]
    y = [r["ttft_s"] for r in rows]
    a, b, c = fit_linear(x, y)
    if b <= 0:  # the attention term took all the growth (short probes, noise): fit without it
        a, b = fit_linear([[1.0, r["new"]] for r in rows], y)
        c = 0.0
    if b <= 0:
        raise ConfigError("prefill time does not grow with prompt length; use longer --prefill-lengths")
    return {"prefill_base_s": a, "prefill_per_token_s": b,
            "prefill_attn_tokens": b / c if c > 0 else 1e12}  # fmt: skip


def fit_decode(rows: list[dict[str, float]]) -> dict[str, float]:
    """Fit decode terms from ``{"batch", "kv", "tbt_s"}`` rows."""
    x = [[1.0, r["batch"], r["kv"]] for r in rows]
    a, b, c = fit_linear(x, [r["tbt_s"] for r in rows])
    return {"decode_base_s": a, "decode_per_seq_s": b, "decode_per_kv_token_s": c}


async def calibrate(
    backends: list[str],
    model: str | None = None,
    prefill_lengths: tuple[int, ...] = (32, 128, 512, 1024, 2048),
    cached_lengths: tuple[int, ...] = (512, 1024),
    cached_extra: int = 128,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    decode_contexts: tuple[int, ...] = (64, 1024),
    decode_tokens: int = 32,
    repeats: int = 3,
    seed: int = 0,
    max_token_id: int = 30000,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Measure the servers and return ``{"cost_model": CostModel, "measurements", "errors", ...}``.

    Prompt ids are drawn below ``max_token_id`` (at most the vocabulary size)."""
    import aiohttp

    if not backends:
        raise ConfigError("calibrate needs at least one backend URL")
    if repeats < 1 or decode_tokens < 2:
        raise ConfigError("repeats must be >= 1 and decode tokens >= 2")
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(min(100, max_token_id // 2), max_token_id) for _ in range(n)]

    prefill_rows: list[dict[str, float]] = []
    decode_rows: list[dict[str, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        infos = [await _model_info(s, b) for b in backends]
        name = model or infos[0][0]
        limit = min(i[1] for i in infos) - decode_tokens - 1
        for url in backends:
            await _stream(s, url, name, ids(16), 2)  # warm-up (first request compiles/allocates)
            for n in prefill_lengths:
                if n > limit:
                    continue
                t = [(await _stream(s, url, name, ids(n), 1))[0] for _ in range(repeats)]
                prefill_rows.append({"backend": url, "new": n, "cached": 0, "ttft_s": statistics.median(t)})
            for c in cached_lengths:
                if c + cached_extra > limit:
                    continue
                t = []
                for _ in range(repeats):
                    prefix = ids(c)
                    await _stream(s, url, name, prefix, 1)
                    t.append((await _stream(s, url, name, prefix + ids(cached_extra), 1))[0])
                prefill_rows.append({"backend": url, "new": cached_extra, "cached": c,
                                     "ttft_s": statistics.median(t)})  # fmt: skip
            for ctx in decode_contexts:
                if ctx > limit:
                    continue
                for b in batches:
                    t = []
                    for _ in range(repeats):
                        # From end times, not from gaps between chunks: vLLM may stream several
                        # tokens in one chunk (a loaded API server can send a short stream's tokens
                        # all at once, gaps ~0), but a stream's last chunk comes when its last step
                        # is done. ignore_eos makes every stream exactly decode_tokens long; b
                        # one-token streams of the same shape give the time to the first token.
                        runs = await asyncio.gather(
                            *[_stream(s, url, name, ids(ctx), decode_tokens) for _ in range(b)]
                        )
                        ones = await asyncio.gather(*[_stream(s, url, name, ids(ctx), 1) for _ in range(b)])
                        steps = statistics.median(r[-1] for r in runs) - statistics.median(r[0] for r in ones)
                        if steps > 0:
                            t.append(steps / (decode_tokens - 1))
                    if t:
                        kv = b * (ctx + decode_tokens / 2)
                        decode_rows.append({"backend": url, "batch": b, "context": ctx, "kv": kv,
                                            "tbt_s": statistics.median(t)})  # fmt: skip
    params = {**fit_prefill(prefill_rows), **fit_decode(decode_rows)}
    cost = CostModel(name=f"calibrated:{name}", **params)
    errors = _errors(cost, prefill_rows, decode_rows)
    return {"cost_model": cost, "measurements": {"prefill": prefill_rows, "decode": decode_rows},
            "errors": errors, "backends": list(backends), "model": name,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}  # fmt: skip


def _errors(cost: CostModel, prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> dict[str, Any]:
    """Add ``predicted_s``/``rel_err`` to each row; return the mean and max relative error per phase."""
    out: dict[str, Any] = {}
    for phase, rows, key in (("prefill", prefill, "ttft_s"), ("decode", decode, "tbt_s")):
        for r in rows:
            p = (
                cost.prefill_s(r["new"], r["cached"])
                if phase == "prefill"
                else cost.tbt_s(r["batch"], r["kv"])
            )
            r["predicted_s"] = p
            r["rel_err"] = abs(p - r[key]) / r[key] if r[key] > 0 else 0.0
        errs = [r["rel_err"] for r in rows]
        out[phase] = {"mean_rel_err": statistics.fmean(errs) if errs else None,
                      "max_rel_err": max(errs) if errs else None}  # fmt: skip
    return out


def run_calibrate(args: Any) -> int:
    """Entry point of ``kvpool conductor calibrate`` (parsed arguments from :mod:`.cli`)."""
    import aiohttp

    try:
        report = _run(args)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ConfigError(f"cannot reach the backends {args.backends}: {exc!r}") from None
    cost: CostModel = report.pop("cost_model")
    return _finish(args, report, cost)


def _run(args: Any) -> dict[str, Any]:
    return asyncio.run(
        calibrate(
            args.backends, model=args.model, prefill_lengths=tuple(args.prefill_lengths),
            cached_lengths=tuple(args.cached_lengths), batches=tuple(args.batches),
            decode_contexts=tuple(args.decode_contexts), decode_tokens=args.decode_tokens,
            repeats=args.repeats, max_token_id=args.max_token_id,
        )
    )  # fmt: skip


def _finish(args: Any, report: dict[str, Any], cost: CostModel) -> int:
    upd = {k: getattr(args, k) for k in ("transfer_gbps", "kv_bytes_per_token") if getattr(args, k, None)}
    if upd:
        cost = cost.model_copy(update=upd)
    report["transfer_source"] = "flags" if upd else "defaults (not measured)"
    if args.out:
        cost.save(args.out, extra=report)
        e = report["errors"]
        print(f"saved {args.out}: prefill mean rel err {e['prefill']['mean_rel_err']:.1%}, "
              f"decode mean rel err {e['decode']['mean_rel_err']:.1%}")  # fmt: skip
    else:
        print(json.dumps({"cost_model": cost.model_dump(), **report}, indent=2))
    return 0

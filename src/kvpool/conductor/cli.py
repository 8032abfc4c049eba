"""``kvpool simulate`` (and the conductor's proxy flags): argument parsing and output.

:func:`add_commands` is called by :func:`kvpool.cli.build_parser`; keeping the flags here keeps
``kvpool/cli.py`` small.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvpool.cli_errors import UsageError, number_arg
from kvpool.conductor.policy import DEFAULT_BALANCING_THRESHOLD

__all__ = ["add_calibrate", "add_commands", "cmd_calibrate", "cmd_simulate"]

SIM_POLICIES = ("random", "round-robin", "load", "cache", "conductor")


def _file(option: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> str:
        if not Path(text).is_file():
            raise UsageError(f"{option}: no such file {text!r}; check the path")
        return text

    parse.__name__ = "file"
    return parse


def _policies(text: str) -> list[str]:
    names = list(SIM_POLICIES) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SIM_POLICIES]
    if bad or not names:
        raise UsageError(
            f"--policy: unknown policy {bad[0] if bad else text!r}; use {', '.join(SIM_POLICIES)} or all"
        )
    return names


def _modes(text: str) -> list[str]:
    modes = ["baseline", "early", "predict"] if text == "all" else [t.strip() for t in text.split(",")]
    bad = [m for m in modes if m not in ("none", "baseline", "early", "predict")]
    if bad:
        raise UsageError(f"--reject-mode: unknown mode {bad[0]!r}; use none, baseline, early, predict or all")
    return modes


def add_commands(sub: Any) -> None:
    """Add ``simulate`` to the ``kvpool`` subcommands."""
    pos = number_arg
    sm = sub.add_parser(
        "simulate", help="replay a Mooncake-format trace through a simulated P/D cluster per policy",
        description="Discrete-event replay of a Mooncake-format trace (timestamp ms, input_length, "
        "output_length, hash_ids of 512-token blocks) through prefill and decode instances, routed by "
        "the same policy code as 'kvpool proxy --policy'. Prints TTFT/TBT, rejections and hit rates "
        "per policy.",
    )  # fmt: skip
    sm.add_argument("--trace", type=_file("--trace"), default=None, metavar="FILE",
                    help="JSONL trace; default: shared/traces/conversation_trace.jsonl found from the "
                    "current "
                    "directory up, else a synthetic trace (the first line printed says which)")  # fmt: skip
    sm.add_argument(
        "--policy",
        type=_policies,
        default=list(SIM_POLICIES),
        metavar="LIST",
        help=f"comma-separated policies or 'all' ({', '.join(SIM_POLICIES)}; default all)",
    )
    sm.add_argument(
        "--prefill", type=pos("--prefill"), default=8, metavar="N", help="prefill instances (default 8)"
    )
    sm.add_argument(
        "--decode", type=pos("--decode"), default=8, metavar="M", help="decode instances (default 8)"
    )
    sm.add_argument("--cache-blocks", type=pos("--cache-blocks", minimum=0), default=10_000, metavar="N",
                    help="blocks each prefill instance caches (default 10000)")  # fmt: skip
    sm.add_argument(
        "--store-blocks",
        type=pos("--store-blocks", minimum=0),
        default=0,
        metavar="N",
        help="blocks of a shared store tier every instance can fetch from (default 0: none)",
    )
    sm.add_argument("--ttft-slo", type=pos("--ttft-slo", float), default=None, metavar="SECONDS",
                    help="TTFT SLO (default none)")  # fmt: skip
    sm.add_argument("--tbt-slo", type=pos("--tbt-slo", float), default=None, metavar="SECONDS",
                    help="time-between-tokens SLO (default none)")  # fmt: skip
    sm.add_argument("--reject-mode", type=_modes, default=None, metavar="LIST",
                    help="none, baseline, early, predict, a comma-separated list or all (default: predict "
                    "when an SLO is given, else none)")  # fmt: skip
    sm.add_argument("--speedup", type=pos("--speedup", float), default=1.0, metavar="X",
                    help="compress the trace's arrival times by X (default 1)")  # fmt: skip
    sm.add_argument("--max-requests", type=pos("--max-requests"), default=None, metavar="N",
                    help="replay only the first N requests")  # fmt: skip
    sm.add_argument(
        "--cost-model",
        type=_file("--cost-model"),
        default=None,
        metavar="FILE",
        help="cost model JSON (from 'kvpool conductor calibrate'; default: the paper-shaped model)",
    )
    sm.add_argument("--no-hot", action="store_true", help="no hot-prefix replication (conductor policy)")
    sm.add_argument("--balancing-threshold", type=pos("--balancing-threshold", float, minimum=1),
                    default=DEFAULT_BALANCING_THRESHOLD, metavar="X",
                    help="conductor: fetch a prefix only when it is more than X times what the best "
                    f"choice without fetching reuses (default {DEFAULT_BALANCING_THRESHOLD:g}: whenever "
                    "faster)")  # fmt: skip
    sm.add_argument(
        "--seed", type=pos("--seed", minimum=0), default=0, metavar="N", help="random seed (default 0)"
    )
    sm.add_argument(
        "--plot", default=None, metavar="DIR", help="write PNG plots (TTFT CDF, PD windows) into DIR"
    )
    sm.add_argument("--json", action="store_true", help="print the summaries as JSON")
    sm.set_defaults(func=cmd_simulate)
    add_calibrate(sub)


def add_calibrate(sub: Any) -> None:
    """Add ``conductor calibrate`` (fit a cost model against real OpenAI-compatible servers)."""
    pos = number_arg
    cd = sub.add_parser("conductor", help="conductor tools: calibrate")
    csub = cd.add_subparsers(dest="conductor", required=True, metavar="TOOL")
    cal = csub.add_parser(
        "calibrate", help="fit a cost model from streaming /v1/completions probes of real servers",
        description="Measures TTFT per prompt length (and with a cached prefix) and time between "
        "tokens per batch size and context, fits the CostModel terms and prints or saves the model "
        "with its measurements and relative errors. Load it with --cost-model.",
    )  # fmt: skip
    cal.add_argument("--backends", nargs="+", required=True, metavar="URL", help="server base URLs")
    cal.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    cal.add_argument("--prefill-lengths", nargs="+", type=pos("--prefill-lengths"),
                     default=[32, 128, 512, 1024, 2048], metavar="N", help="new-token lengths")  # fmt: skip
    cal.add_argument("--cached-lengths", nargs="+", type=pos("--cached-lengths"), default=[512, 1024],
                     metavar="N", help="cached-prefix lengths (128 new tokens after each)")  # fmt: skip
    cal.add_argument("--batches", nargs="+", type=pos("--batches"), default=[1, 2, 4, 8], metavar="N",
                     help="concurrent decode streams (default 1 2 4 8)")  # fmt: skip
    cal.add_argument("--decode-contexts", nargs="+", type=pos("--decode-contexts"), default=[64, 1024],
                     metavar="N", help="prompt lengths of the decode probes")  # fmt: skip
    cal.add_argument("--decode-tokens", type=pos("--decode-tokens", minimum=3), default=32, metavar="N",
                     help="tokens generated per decode stream (default 32)")  # fmt: skip
    cal.add_argument("--repeats", type=pos("--repeats"), default=3, metavar="N",
                     help="repeats per probe; the median is used (default 3)")  # fmt: skip
    cal.add_argument("--max-token-id", type=pos("--max-token-id", minimum=2), default=30000, metavar="N",
                     help="prompt ids are below N, at most the vocab size (default 30000)")  # fmt: skip
    cal.add_argument("--transfer-gbps", type=pos("--transfer-gbps", float), default=None, metavar="GBPS",
                     help="KV transfer rate (not measured; default: the CostModel default)")  # fmt: skip
    cal.add_argument("--kv-bytes-per-token", type=pos("--kv-bytes-per-token"), default=None, metavar="N",
                     help="KV bytes per token (not measured; default: the CostModel default)")  # fmt: skip
    cal.add_argument("--out", default=None, metavar="FILE", help="save the report here (default: print JSON)")
    cal.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run ``kvpool conductor calibrate``."""
    from kvpool.conductor.calibrate import run_calibrate

    return run_calibrate(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the simulation for each policy (and reject mode) and print the summaries."""
    from kvpool.conductor.cost import CostModel
    from kvpool.conductor.sim import SimConfig, load_requests, simulate, synthetic_requests
    from kvpool.store.trace import find_shared_trace

    path = args.trace or find_shared_trace()
    reqs = load_requests(path) if path else synthetic_requests(2000)
    if args.max_requests:
        reqs = reqs[: args.max_requests]
    if not reqs:
        raise UsageError("the trace holds no requests")
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel.paper()
    modes = args.reject_mode or (["predict"] if args.ttft_slo or args.tbt_slo else ["none"])
    print(f"trace: {path or 'synthetic'} ({len(reqs)} requests), {args.prefill} prefill + "
          f"{args.decode} decode, "
          f"cost model {cost.name}", file=sys.stderr, flush=True)  # fmt: skip
    results = []
    for policy in args.policy:
        for mode in modes:
            cfg = SimConfig(
                policy=policy, prefill=args.prefill, decode=args.decode, cache_blocks=args.cache_blocks,
                store_blocks=args.store_blocks, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                reject_mode=mode, speedup=args.speedup, hot=not args.no_hot, seed=args.seed,
                balancing_threshold=args.balancing_threshold,
            )  # fmt: skip
            results.append(simulate(reqs, cfg, cost, keep_samples=bool(args.plot)))
    if args.plot:
        plot_results(results, Path(args.plot))
    if args.json:
        for r in results:
            r.pop("samples", None)
        print(json.dumps(results if len(results) > 1 else results[0], indent=2, default=_json_default))
        return 0
    print("| policy | reject mode | mean TTFT s | P90 TTFT s | P99 TTFT s | mean TBT ms | rejected | SLO met "
          "| hit local | hit global | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t, b, h = r["ttft_s"], r["tbt_s"], r["hit_rate"]
        print(f"| {r['policy']} | {r['reject_mode']} | {t['mean']:.3f} | {t['p90']:.3f} | {t['p99']:.3f} "
              f"| {b['mean'] * 1000:.1f} | {r['rejected']['total']} | {r['slo_attainment']:.3f} "
              f"| {h['local']:.3f} "
              f"| {h['global']:.3f} | {r['wall_seconds']:.1f} |")  # fmt: skip
    pd = results[-1]["pd_ratio"]
    if pd["imbalance"] is not None:
        print(f"PD ratio (last run): prefill utilisation {pd['prefill_util']:.2f}, "
              f"decode {pd['decode_util']:.2f}; "
              f"suggested split {pd['suggested_prefill']}P:{pd['suggested_decode']}D")  # fmt: skip
    return 0


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def plot_results(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """TTFT CDF per run and the PD-ratio windows of the last run, as PNGs in ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvpool[plots]'") from None
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for r in results:
        xs = sorted(r.get("samples", {}).get("ttft_s", []))
        if xs:
            ax.plot(
                xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r['policy']} ({r['reject_mode']})"
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    w = results[-1]["pd_ratio"]["windows"]
    if w:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot([x["t_s"] for x in w], [x["prefill_util"] for x in w], label="prefill utilisation")
        ax.plot([x["t_s"] for x in w], [x["decode_util"] for x in w], label="decode load")
        ax.set_xlabel("simulated time (s)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "pd_ratio.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


PROXY_POLICIES = ("round-robin", "load", "cache", "conductor")


def add_proxy_options(px: argparse.ArgumentParser) -> None:
    """The routing flags of ``kvpool proxy`` (policy, aggregated backends, KV events, SLOs)."""
    g = px.add_argument_group("routing (kvpool.conductor)")
    g.add_argument(
        "--backends",
        nargs="+",
        default=None,
        metavar="URL",
        help="aggregated vLLM servers, each serving whole requests (instead of --prefill/--decode)",
    )
    g.add_argument("--policy", choices=PROXY_POLICIES, default="round-robin",
                   help="round-robin (default), load (shortest predicted queue), cache (longest cached "
                   "prefix vs queue), conductor (Mooncake Alg. 1 + hot-prefix spreading)")  # fmt: skip
    g.add_argument(
        "--block-size",
        type=number_arg("--block-size"),
        default=16,
        metavar="N",
        help="tokens per KV block; must equal the engines' --block-size (default 16)",
    )
    g.add_argument("--kv-events", default=None, metavar="LIST",
                   help="comma-separated ZMQ addresses of the instances' KV-event publishers, one per "
                   "instance in URL order (prefill ones in P/D mode), 'none' for an instance without "
                   "events (tracked approximately). vLLM binds its publisher only for "
                   "an endpoint tcp://*:PORT "
                   "(then give tcp://127.0.0.1:PORT here) or ipc://PATH (give the same); with a host it "
                   "connects instead",
                   )  # fmt: skip
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="publisher topic (default '')")
    g.add_argument("--approx-ttl-s", type=number_arg("--approx-ttl-s", float), default=120.0,
                   metavar="SECONDS",
                   help="without events, how long a routed prefix counts as cached (default 120)",
                   )  # fmt: skip
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenize locally with this (offline) tokenizer instead of the backends' /tokenize",
    )
    g.add_argument("--ttft-slo", type=number_arg("--ttft-slo", float), default=None, metavar="SECONDS",
                   help="refuse (429, before prefill) requests predicted to miss this TTFT")  # fmt: skip
    g.add_argument(
        "--tbt-slo",
        type=number_arg("--tbt-slo", float),
        default=None,
        metavar="SECONDS",
        help="refuse requests whose decode instance is predicted to miss this time between tokens",
    )
    g.add_argument(
        "--reject-mode",
        choices=["baseline", "early", "predict"],
        default="predict",
        help="when the decode load is judged (default predict: at the predicted prefill end)",
    )
    g.add_argument(
        "--cost-model",
        type=_file("--cost-model"),
        default=None,
        metavar="FILE",
        help="cost model JSON from 'kvpool conductor calibrate' (default: the paper-shaped model)",
    )
    g.add_argument("--no-hot", action="store_true", help="no hot-prefix spreading or copies")
    g.add_argument("--balancing-threshold", type=number_arg("--balancing-threshold", float, minimum=1),
                   default=DEFAULT_BALANCING_THRESHOLD, metavar="X",
                   help="conductor: fetch a prefix from another instance only when it is more than X "
                   f"times what the best choice without fetching reuses (default "
                   f"{DEFAULT_BALANCING_THRESHOLD:g})")  # fmt: skip
    g.add_argument("--store-master", default=None, metavar="HOST:PORT",
                   help="the kvpool store master the instances' KvpoolStoreConnector use: the router "
                   "follows its key feed and counts a prefix the store holds as loadable by every "
                   "instance (secret: $KVPOOL_SECRET)")  # fmt: skip


def router_config(args: argparse.Namespace, n_instances: int) -> Any:
    """The :class:`~kvpool.conductor.live.RouterConfig` of ``kvpool proxy`` flags, or None for the
    plain round-robin P/D proxy."""
    from kvpool.conductor.cost import CostModel
    from kvpool.conductor.live import RouterConfig

    backends = getattr(args, "backends", None)
    policy = getattr(args, "policy", "round-robin")
    if policy == "round-robin" and not backends and not getattr(args, "ttft_slo", None):
        return None
    events: list[str | None] = []
    if args.kv_events:
        events = [None if e.strip().lower() in ("", "none") else e.strip() for e in args.kv_events.split(",")]
        if len(events) != n_instances:
            raise UsageError(
                f"--kv-events names {len(events)} endpoints for {n_instances} instances; give one per "
                "instance in URL order ('none' for one without events)"
            )
    return RouterConfig(
        policy=policy, block_size=args.block_size, kv_events=events,
        kv_events_topic=args.kv_events_topic, approx_ttl_s=args.approx_ttl_s, ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo, reject_mode=args.reject_mode,
        cost_model=CostModel.load(args.cost_model) if args.cost_model else None,
        tokenizer=args.tokenizer, hot=not args.no_hot, balancing_threshold=args.balancing_threshold,
        store_master=args.store_master, store_secret=os.environ.get("KVPOOL_SECRET"),
    )  # fmt: skip

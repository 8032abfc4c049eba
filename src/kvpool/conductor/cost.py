"""Cost models: how long a prefill, a decode step and a KV transfer take.

One :class:`CostModel` serves the live router and the simulator. Two sources:

* :meth:`CostModel.paper` -- the documented default, shaped after the Mooncake paper's setting
  (a LLaMA2-70B-class model, tensor-parallel on one 8-GPU node, RDMA between nodes): prefill about
  8,000 tokens/s at short context with attention growing with context, decode steps of 15 ms plus
  per-sequence and per-KV-token terms, 320 KiB of KV per token moved at 100 GB/s.
* ``kvpool conductor calibrate`` (:mod:`kvpool.conductor.calibrate`) -- measured against real
  servers and saved as JSON (:meth:`CostModel.load`).

Formulas (seconds):

* prefill of ``new`` tokens after ``cached`` reused ones:
  ``prefill_base_s + new * prefill_per_token_s * (1 + (cached + new / 2) / prefill_attn_tokens)``
* one decode step (time between tokens) with ``batch`` sequences holding ``kv`` tokens:
  ``decode_base_s + decode_per_seq_s * batch + decode_per_kv_token_s * kv``
* moving the KV of ``tokens`` tokens between instances or from the store:
  ``transfer_base_s + tokens * kv_bytes_per_token / (transfer_gbps * 1e9)``
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from kvpool.config import _ConfigBase
from kvpool.errors import ConfigError

__all__ = ["CostModel", "fit_linear"]


class CostModel(_ConfigBase):
    """Prefill, decode and transfer times of one deployment (see the module docstring)."""

    name: str = "custom"
    prefill_base_s: float = Field(0.01, ge=0)
    prefill_per_token_s: float = Field(1 / 8000, gt=0)
    prefill_attn_tokens: float = Field(53_800.0, gt=0)
    decode_base_s: float = Field(0.015, ge=0)
    decode_per_seq_s: float = Field(0.0002, ge=0)
    decode_per_kv_token_s: float = Field(2e-8, ge=0)
    decode_max_kv_tokens: int = Field(1_000_000, gt=0)
    """KV tokens one decode instance holds (its cache capacity)."""
    decode_max_batch: int = Field(256, gt=0)
    kv_bytes_per_token: int = Field(327_680, gt=0)
    transfer_gbps: float = Field(100.0, gt=0)
    """Bytes per second (in GB/s) of a KV transfer between instances or from the store."""
    transfer_base_s: float = Field(0.002, ge=0)

    @classmethod
    def paper(cls) -> CostModel:
        """The documented default (LLaMA2-70B-class on 8 GPUs, as in the Mooncake paper)."""
        return cls(name="paper")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A model saved by :meth:`save` or ``kvpool conductor calibrate``."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read cost model {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"cost model file {path} must hold a JSON object")
        data = data.get("cost_model", data)  # a calibrate report embeds it
        return cls(**data)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"cost_model": self.model_dump()}
        body.update(extra or {})
        Path(path).write_text(json.dumps(body, indent=2) + "\n")

    # -- the three estimates ---------------------------------------------------------------------------

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` reused ones."""
        if new_tokens <= 0:
            return self.prefill_base_s
        ctx = cached_tokens + new_tokens / 2
        return self.prefill_base_s + new_tokens * self.prefill_per_token_s * (
            1 + ctx / self.prefill_attn_tokens
        )

    def tbt_s(self, batch: int, kv_tokens: float) -> float:
        """Seconds per decode step with ``batch`` sequences holding ``kv_tokens`` in total."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_kv_token_s * kv_tokens

    def transfer_s(self, tokens: float) -> float:
        """Seconds to move the KV of ``tokens`` tokens to another instance."""
        if tokens <= 0:
            return 0.0
        return self.transfer_base_s + tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9)

    def decode_fits(self, batch: int, kv_tokens: float) -> bool:
        """Whether a decode instance can hold ``batch`` sequences with ``kv_tokens`` in total."""
        return batch <= self.decode_max_batch and kv_tokens <= self.decode_max_kv_tokens


def fit_linear(rows: list[list[float]], ys: list[float], nonneg: bool = True) -> list[float]:
    """Least squares ``ys ≈ rows @ coef`` (normal equations, Gauss-Jordan; a few columns only).

    With ``nonneg`` a negative coefficient is clamped to 0 and the rest refitted (measurement noise
    on a busy machine can make a small term come out negative)."""
    k = len(rows[0]) if rows else 0
    if len(rows) < k or k == 0:
        raise ConfigError(f"need at least {k} measurements to fit {k} coefficients, have {len(rows)}")
    active = list(range(k))
    while True:
        coef = _solve([[r[j] for j in active] for r in rows], ys)
        full = [0.0] * k
        for j, c in zip(active, coef, strict=True):
            full[j] = c
        neg = [j for j, c in zip(active, coef, strict=True) if c < 0]
        if not nonneg or not neg:
            return full
        active = [j for j in active if j not in neg]
        if not active:
            return [0.0] * k


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    k = len(rows[0])
    a = []
    for i in range(k):
        row = [sum(r[i] * r[j] for r in rows) for j in range(k)]
        row.append(sum(r[i] * y for r, y in zip(rows, ys, strict=True)))
        a.append(row)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-30:
            raise ConfigError("measurements do not determine the cost model (vary the lengths/batches)")
        a[col], a[piv] = a[piv], a[col]
        p = a[col][col]
        a[col] = [v / p for v in a[col]]
        for r in range(k):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    out = [a[i][k] for i in range(k)]
    if any(math.isnan(v) for v in out):
        raise ConfigError("cost model fit failed (NaN)")
    return out

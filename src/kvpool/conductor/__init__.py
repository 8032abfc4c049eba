"""The conductor: KV-aware routing for prefill/decode serving (Mooncake's global scheduler).

* :mod:`~kvpool.conductor.index` -- the prefix index (block hash → instances and tiers), fed by vLLM
  KV events, the store, or what was routed (approximate mode).
* :mod:`~kvpool.conductor.policy` -- the policies (random, round-robin, load, local cache-aware,
  conductor = Mooncake Alg. 1) and the SLO gate (early / prediction-based rejection).
* :mod:`~kvpool.conductor.cost` -- prefill / decode / transfer cost models.
* :mod:`~kvpool.conductor.sim` -- the trace-driven simulator (``kvpool simulate``).
* :mod:`~kvpool.conductor.live` -- the live router behind ``kvpool proxy --policy ...``;
  :mod:`~kvpool.conductor.events` -- its KV-event subscriber (one thread per instance).
"""

from kvpool.conductor.cost import CostModel
from kvpool.conductor.index import ApproxTracker, BlockIndex, Location, Tier
from kvpool.conductor.policy import POLICIES, Decision, HotPrefixes, Policy, SloGate, make_policy
from kvpool.conductor.state import Cluster, Instance, RequestInfo

__all__ = [
    "POLICIES",
    "ApproxTracker",
    "BlockIndex",
    "Cluster",
    "CostModel",
    "Decision",
    "HotPrefixes",
    "Instance",
    "Location",
    "Policy",
    "RequestInfo",
    "SloGate",
    "Tier",
    "make_policy",
]

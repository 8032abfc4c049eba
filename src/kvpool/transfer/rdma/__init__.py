"""RDMA transport (pyverbs) behind the :class:`~kvpool.transfer.engine.TransferEngine` API.

Modules: :mod:`.verbs` (import shim: real pyverbs or the test double), :mod:`.topology` (NIC
topology matrix), :mod:`.endpoints` (SIEVE endpoint pool), :mod:`.transport` (slicing, spreading,
chained posting, batched polling, failover). Nothing here imports pyverbs until an engine asks for
``protocol="rdma"`` (or ``"auto"`` finds a device). See docs/rdma.md.
"""

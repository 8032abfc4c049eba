"""RDMA transport (pyverbs) behind the :class:`~kvpool.transfer.engine.TransferEngine` API.

Modules: :mod:`.verbs` (the verbs layer: real pyverbs, or an injected implementation),
:mod:`.nics` (opening NICs, queue pairs, memory regions), :mod:`.topology` (NIC topology matrix),
:mod:`.endpoints` (SIEVE endpoint pool), :mod:`.state` (requests, slices, endpoints, peers),
:mod:`.connections` (making, breaking and closing endpoints; the connect RPC),
:mod:`.passive` (the target's QP ends), :mod:`.transport`
(:class:`~kvpool.transfer.rdma.transport.RdmaTransport`: slicing, spreading, chained posting,
batched polling, failover). Nothing here imports pyverbs until an engine asks for
``protocol="rdma"`` (or ``"auto"`` finds a device). See docs/rdma.md.
"""

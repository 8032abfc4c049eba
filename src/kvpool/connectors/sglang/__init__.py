"""SGLang integration: a ``kvpool`` transfer backend for prefill/decode disaggregation
(``--disaggregation-transfer-backend kvpool``) and a HiCache L3 storage backend.

Installing kvpool registers the ``sglang.srt.plugins`` entry point
(:func:`kvpool.connectors.sglang.plugin.register`); nothing here imports SGLang until used.
"""

SUPPORTED_SGLANG = ("0.5.23",)

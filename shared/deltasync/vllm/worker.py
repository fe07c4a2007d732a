"""vLLM worker extension: write bf16 weights given in HF checkpoint coordinates into the live model, and read
them back in the same coordinates.

vLLM imports this module in its worker process
(`worker_extension_cls="deltasync.vllm.worker.PatchWorkerExtension"`); the server reaches the methods with
`collective_rpc`. A write is two RPCs, so that generation pauses only for the second:

- `deltasync_stage(path)` reads a file (a raw patch, or whole tensors), checks it against the model's layout
  and moves indices and values to the worker's device, in the destination dtype; nothing is written;
- `deltasync_commit(path)` makes the staged writes: indexed writes straight into the parameter views
  learned from vLLM's own loader (O(changed elements)), or vLLM's `load_checkpoint_weight_patches` for a
  tensor without one contiguous destination (or every tensor, when staged with `loader=True`).

RPCs return {"ok": False, "error": ...} instead of raising: a bad file must not disturb the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass
class _Staged:
    """A file read and checked, its indices and values on the worker's device, ready to write."""

    path: str
    direct: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]  # view, flat positions, values
    loader: list[CheckpointWeightPatch]
    changed: int


class PatchWorkerExtension:
    """RPC methods, prefixed so they never clash with the Worker's own attributes."""

    def deltasync_layout(self) -> dict[str, list[int]]:
        """HF name -> shape of every checkpoint tensor this model can write and read back (learned once)."""
        return {name: list(view.shape) for name, view in self._deltasync_views().items()}

    def deltasync_stage(self, path: str, sparse: bool, loader: bool = False) -> dict:
        """Read and check `path` and move it to the device, ready for `deltasync_commit`; writes nothing.

        `sparse`: a raw patch (`name/indices` I32 flat positions, `name/values` BF16 new values); else whole
        bf16 tensors in HF names and shapes. `loader`: write every tensor through vLLM's loader. Replaces
        whatever was staged before.
        """
        start = time.perf_counter()
        self._deltasync_staged = None
        try:
            staged = self._deltasync_read(path, sparse, loader)
        except (ValueError, OSError, SafetensorError) as e:
            return {"ok": False, "written": False, "error": f"{type(e).__name__}: {e}"}
        self._deltasync_staged = staged
        return {
            "ok": True,
            "changed": staged.changed,
            "paths": {"direct": len(staged.direct), "vllm": len(staged.loader)},
            "seconds": time.perf_counter() - start,
        }

    def deltasync_commit(self, path: str) -> dict:
        """Write what `deltasync_stage(path)` staged."""
        start = time.perf_counter()
        staged, self._deltasync_staged = getattr(self, "_deltasync_staged", None), None
        if staged is None or staged.path != path:
            return {"ok": False, "written": False, "error": f"{path} is not staged"}
        try:
            for view, positions, values in staged.direct:
                if positions is None:
                    view.copy_(values)
                else:
                    view.view(-1).index_put_((positions,), values)
            if staged.loader:
                load_checkpoint_weight_patches(self.model_runner.get_model(), staged.loader)
        except Exception as e:  # noqa: BLE001 (whatever failed here may have written part of the file)
            return {"ok": False, "written": True, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "seconds": time.perf_counter() - start}

    def deltasync_fingerprint(self, names: list[str] | None = None) -> dict:
        """The fingerprint of the weights the model really holds (`names`, default all), read back in HF
        coordinates."""
        start = time.perf_counter()
        views = self._deltasync_views()
        missing = sorted(set(names or views) - set(views))
        if missing:
            return {"ok": False, "error": f"cannot read back {missing[0]!r}"}
        fp = state_fingerprint((name, views[name].to(torch.bfloat16)) for name in names or views)
        return {"ok": True, "fingerprint": format_fingerprint(fp), "seconds": time.perf_counter() - start}

    def _deltasync_views(self) -> dict[str, torch.Tensor]:
        """Where each HF tensor lands: run the model's own loader once per name with `Tensor.copy_`
        intercepted, and keep the destination view it would write to. Writes are in place, so the views
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

    def _deltasync_read(self, path: str, sparse: bool, loader: bool) -> _Staged:
        """The file's tensors checked against the model's layout, on the device, split by write path: direct
        where the destination is one contiguous view, else vLLM's loader."""
        views = self._deltasync_views()
        device = next(iter(views.values())).device
        entries = load_file(path, device=str(device))
        shapes = {name: tuple(view.shape) for name, view in views.items()}
        if sparse:
            tensors = {name: (ch.indices, ch.values) for name, ch in raw_changes(entries, shapes).items()}
        else:
            for name, values in entries.items():
                if name not in shapes:
                    raise ValueError(f"unknown tensor {name!r}")
                if values.dtype != torch.bfloat16 or tuple(values.shape) != shapes[name]:
                    raise ValueError(
                        f"{name}: {values.dtype} {list(values.shape)}, expected bf16 {list(shapes[name])}"
                    )
            tensors = {name: (None, values) for name, values in entries.items()}
        staged = _Staged(path, [], [], sum(values.numel() for _, values in tensors.values()))
        for name, (positions, values) in tensors.items():
            view = views[name]
            if not loader and view.is_contiguous():
                staged.direct.append((view, positions, values.to(view.dtype)))
                continue
            if positions is not None and torch.isnan(values).any():  # the loader reads NaN as "unchanged"
                raise ValueError(f"{name}: NaN values cannot be patched through vLLM's loader")
            flat = None if positions is None else positions.to(torch.int32)
            staged.loader.append(
                CheckpointWeightPatch(name, shapes[name], torch.bfloat16, values.reshape(-1), flat)
            )
        return staged


def _checkpoint_shapes(hf_config) -> dict[str, torch.Size]:
    """The HF parameter names and shapes of this architecture (tied weights once), from a meta model."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    return {name: p.shape for name, p in hf_model.named_parameters()}

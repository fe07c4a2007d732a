"""The `deltasync` weight-transfer engine: vLLM's own weight-update routes apply verified deltasync steps in
place.

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --weight-transfer-config '{"backend":"deltasync"}'

(registered by the `vllm.general_plugins` entry point, `deltasync.vllm.plugin`). Each worker holds one
engine. `init_info` names the sync root; `update_info` names a step and the local file with its verified
weights (written by `deltasync follow` or the inference Space):

- `kind="delta"`: a raw patch (`name/indices` I32 flat HF positions, `name/values` BF16 new values). `base`
  is the fingerprint it applies to, `fingerprint` the one it leads to. Before writing anything, every worker
  reads the old values at its changed elements; the ranks' shares of how the fingerprint moves must sum to
  `fingerprint - base`, else the update is refused.
- `kind="stage"`: the checks and the plan of a delta (the same fields), nothing written: a `delta` update of
  the same step and file that follows it, on unchanged weights, only writes. Staging while generation runs
  keeps the pause to the writes.
- `kind="anchor"`: whole bf16 tensors (one file of several); with `fingerprint`, the whole state is read back
  after the write and must match.
- `kind="verify"`: writes nothing; the weights read back must have `fingerprint`.
- `kind="fingerprint"`: writes nothing; rank 0 saves the fingerprint of the weights read back to the file
  `path` as JSON (`{"step": ..., "fingerprint": ...}`: the step last written).
- `kind="readback"`: writes nothing; each rank saves the HF tensors it holds whole to
  `path/rank-<r>.safetensors`, with how each tensor is written (`Layout.paths`: direct, packed MoE experts,
  or through vLLM's loader) as JSON in its `paths` metadata.
- `kind="paths"`: writes nothing; each rank saves how each tensor it holds is written (`Layout.paths`) as
  JSON to `path/rank-<r>.json`.

MoE models work alike: on CPU their experts live in vLLM's prepacked layout, which the layout maps element
by element (`deltasync.vllm.experts`); `write="vllm"` is refused for them (vLLM's loader writes the
unpacked layout).

A refused update raises before any write (a ValueError naming the cause); vLLM's route reports it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)

from deltasync.codec.fingerprint import format_fingerprint
from deltasync.codec.patch import PatchError, raw_changes
from deltasync.vllm import compat
from deltasync.vllm.layout import Layout, sum_across

log = init_logger(__name__)  # vLLM's logger: configured in its worker processes
KINDS = ("delta", "stage", "anchor", "verify", "fingerprint", "readback", "paths")
WRITES = ("direct", "vllm")


@dataclass
class DeltasyncInitInfo(WeightTransferInitInfo):
    """`root`: the sync root this server follows (reported, never read by the workers). `write`: "direct"
    (indexed writes into the parameter views, O(changed elements)) or "vllm" (vLLM's own
    `load_checkpoint_weight_patches` and `load_weights` for every tensor: slower, for comparison)."""

    root: str
    write: str = "direct"


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):
    """One step to write (see the module docstring for `kind`)."""

    step: int
    kind: str = "delta"
    path: str | None = None
    base: str | None = None
    fingerprint: str | None = None


@dataclass
class _Plan:
    """A delta checked against the weights `base`, ready to write (`writes`: this rank's indexed writes)."""

    step: int
    path: str
    base: int
    new: int
    changes: dict
    writes: list

    def matches(self, info: DeltasyncUpdateInfo, held: int | None) -> bool:
        return (self.step, self.path, self.base) == (info.step, info.path, held) and info.fingerprint == (
            format_fingerprint(self.new)
        )


class DeltasyncEngine(WeightTransferEngine[DeltasyncInitInfo, DeltasyncUpdateInfo]):
    """Writes verified deltasync steps in place; start/finish are no-ops (nothing to stage or reload)."""

    init_info_cls = DeltasyncInitInfo
    update_info_cls = DeltasyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.root: str | None = None
        self.layout: Layout | None = None
        self.fingerprint: int | None = None  # of the whole state, as last verified or moved by a delta
        self.step: int | None = None
        self.write = "direct"
        self.staged: _Plan | None = None  # the last staged delta, written by the delta update after it

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        if self.layout is None:
            start = time.perf_counter()
            self.group = compat.model_group()
            self.layout = Layout.learn(self.model, self.model_config.hf_config, self.group)
            self.fingerprint = self._read_fingerprint()
            paths = list(self.layout.paths().values())
            log.info(
                "deltasync: %d tensors (%d direct, %d packed experts, %d through vLLM's loader), "
                "weights %s, learned in %.1f s",
                len(paths),
                paths.count("direct"),
                paths.count("packed"),
                paths.count("loader"),
                format_fingerprint(self.fingerprint),
                time.perf_counter() - start,
            )
        if init_info.write not in WRITES:
            raise ValueError(f"init_info write {init_info.write!r} is not one of {', '.join(WRITES)}")
        if init_info.write == "vllm" and "packed" in self._ready().paths().values():
            # vLLM's loader writes the unpacked layout: it would scramble prepacked experts
            raise ValueError("init_info write 'vllm' cannot reach this model's prepacked MoE experts")
        self.root, self.write = init_info.root, init_info.write

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def parse_update_info(self, update_dict: dict[str, Any]) -> DeltasyncUpdateInfo:
        info = super().parse_update_info(update_dict)
        if info.kind not in KINDS:
            raise ValueError(f"update_info kind {info.kind!r} is not one of {', '.join(KINDS)}")
        if info.kind != "verify" and not info.path:
            raise ValueError(f"update_info of kind {info.kind!r} needs a path")
        return info

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        if self.layout is None:
            raise ValueError("deltasync engine not initialized: POST /init_weight_transfer_engine first")
        try:
            self._receive(update_info)
        except ValueError:
            # Every rank reached the same verdict; one rank reports it (see compat.reports_errors).
            if compat.reports_errors(self.group):
                raise

    def _receive(self, info: DeltasyncUpdateInfo) -> None:
        if info.kind == "verify":
            return self._verify(self._read_fingerprint(), info)
        if info.path is None:  # parse_update_info refused it already
            raise ValueError(f"update_info of kind {info.kind!r} needs a path")
        if info.kind == "readback":
            return self._readback(Path(info.path))
        if info.kind == "fingerprint":
            held = {"step": self.step, "fingerprint": format_fingerprint(self._read_fingerprint())}
            if compat.rank(self.group) == 0:
                Path(info.path).write_text(json.dumps(held))
            return None
        if info.kind == "paths":
            folder = Path(info.path)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank-{compat.rank(self.group)}.json").write_text(json.dumps(self._ready().paths()))
            return None
        staged, self.staged = self.staged, None
        if info.kind == "delta" and staged is not None and staged.matches(info, self.fingerprint):
            return self._write_delta(staged, info)
        # Every rank checks the file before any writes, and all agree: one rank's refusal stops them all
        # before the collectives below (else the others would wait in them for ever).
        try:
            entries = load_file(info.path, device="cpu")
            checked = (
                self._check_anchor(entries, info)
                if info.kind == "anchor"
                else self._check_delta(entries, info)
            )
        except ValueError as e:
            self._agree(str(e))
            raise
        except (OSError, SafetensorError) as e:
            error = f"step {info.step}: cannot read {info.path}: {type(e).__name__}: {e}"
            self._agree(error)
            raise ValueError(error) from None
        self._agree(None)
        if info.kind == "anchor":
            return self._write_anchor(checked, info)
        plan = self._plan_delta(checked, info)
        if info.kind == "stage":
            self.staged = plan
        else:
            self._write_delta(plan, info)

    def _agree(self, error: str | None) -> None:
        """Raise on every rank, with the first rank's reason, if any rank refused."""
        if self.group is None:
            return
        errors: list[str | None] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None and error is None:
            raise ValueError(first)

    # ---------------------------------------------------------------------------------------------------

    def _ready(self) -> Layout:
        if self.layout is None:
            raise ValueError("deltasync engine not initialized: POST /init_weight_transfer_engine first")
        return self.layout

    def _check_delta(self, entries: dict[str, torch.Tensor], info: DeltasyncUpdateInfo) -> dict:
        layout = self._ready()
        if info.base is None or info.fingerprint is None:
            raise ValueError(f"step {info.step}: a delta needs its base and fingerprint")
        here = None if self.fingerprint is None else format_fingerprint(self.fingerprint)
        if info.base != here:
            raise ValueError(f"step {info.step} applies to weights {info.base}, this server holds {here}")
        try:
            changes = raw_changes(entries, layout.shapes)
        except PatchError as e:
            raise ValueError(f"step {info.step}: {e}") from None
        through_loader = sorted(set(changes) & set(layout.loader))
        if through_loader:  # its old values are not readable here, so the promise cannot be checked
            raise ValueError(f"step {info.step}: {through_loader[0]!r} cannot be patched in place")
        if self.write == "vllm" and any(torch.isnan(ch.values).any() for ch in changes.values()):
            raise ValueError(f"step {info.step}: NaN values cannot be patched through vLLM's loader")
        return changes

    def _plan_delta(self, changes: dict, info: DeltasyncUpdateInfo) -> _Plan:
        layout = self._ready()
        writes, moved = layout.plan_patch(changes)
        base = int(str(info.base), 16)  # the weights held: checked in _check_delta
        new = (base + sum_across(moved, self.group)) & ((1 << 64) - 1)
        if format_fingerprint(new) != info.fingerprint:
            raise ValueError(
                f"step {info.step} would lead to weights {format_fingerprint(new)}, it promises "
                f"{info.fingerprint}: refused, nothing written"
            )
        return _Plan(info.step, str(info.path), base, new, changes, writes)

    def _write_delta(self, plan: _Plan, info: DeltasyncUpdateInfo) -> None:
        layout = self._ready()
        with torch.no_grad():
            if self.write == "vllm":
                patches = [
                    CheckpointWeightPatch(
                        name, layout.shapes[name], torch.bfloat16, ch.values.to(self.device), ch.indices
                    )
                    for name, ch in plan.changes.items()
                ]
                load_checkpoint_weight_patches(self.model, patches)
            else:
                for dst, index, values in plan.writes:
                    dst.index_put_(index, values)
        self.fingerprint, self.step = plan.new, info.step

    def _check_anchor(self, entries: dict[str, torch.Tensor], info: DeltasyncUpdateInfo) -> dict:
        for name, values in entries.items():
            shape = self._ready().shapes.get(name)
            if shape is None:
                raise ValueError(f"step {info.step}: unknown tensor {name!r}")
            if values.dtype != torch.bfloat16 or tuple(values.shape) != shape:
                got = f"{values.dtype} {list(values.shape)}"
                raise ValueError(f"step {info.step}: {name} is {got}, expected bf16 {list(shape)}")
        return entries

    def _write_anchor(self, entries: dict[str, torch.Tensor], info: DeltasyncUpdateInfo) -> None:
        layout = self._ready()
        self.fingerprint = None  # from the first write until the read-back below, the state is mixed
        with torch.no_grad():
            loader = []
            for name, values in entries.items():
                if name in layout.loader or self.write == "vllm":
                    loader.append((name, values.to(self.device)))
                    continue
                for b in layout.blocks.get(name, []):
                    b.write(values.as_strided(b.size, b.stride, b.offset))
            if loader:
                self.model.load_weights(loader)  # type: ignore[operator]
        if info.fingerprint is not None:
            self.fingerprint = self._read_fingerprint()
            self._verify(self.fingerprint, info)
            self.step = info.step

    def _verify(self, actual: int, info: DeltasyncUpdateInfo) -> None:
        if info.fingerprint is None:
            raise ValueError("update_info of kind 'verify' needs a fingerprint")
        if format_fingerprint(actual) != info.fingerprint:
            held = format_fingerprint(actual)
            raise ValueError(f"the weights read back hold {held}, step {info.step} is {info.fingerprint}")

    def _read_fingerprint(self) -> int:
        return sum_across(self._ready().partial_fingerprint(), self.group)

    def _readback(self, folder: Path) -> None:
        tensors = {}
        layout = self._ready()
        for name, blocks in layout.blocks.items():
            shape = layout.shapes[name]
            full = torch.full(shape, float("nan"), dtype=torch.bfloat16)
            covered = 0
            for b in blocks:
                full.as_strided(b.size, b.stride, b.offset).copy_(b.read().cpu())
                covered += b.dst.numel()
            if covered == full.numel():
                tensors[name] = full
        folder.mkdir(parents=True, exist_ok=True)
        metadata = {"paths": json.dumps(layout.paths())}
        save_file(tensors, folder / f"rank-{compat.rank(self.group)}.safetensors", metadata)

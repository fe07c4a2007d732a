"""The `deltasync` weight-transfer engine: vLLM's own weight-update routes apply verified deltasync steps in
place.

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --weight-transfer-config '{"backend":"deltasync"}'

(registered by the `vllm.general_plugins` entry point, `deltasync.vllm.plugin`). Each worker holds one
engine. `init_info` names the sync root; `update_info` names a step and the local files of the sync root's
own step, as downloaded (by `deltasync follow` or the inference Space, which decode nothing and hold no
weights: each worker decodes against the weights it holds, on their device):

- `kind="delta"`: the step's patch files (`paths`: one, or one part per rank of a sharded publisher), in
  any encoding (compact: decoded against this rank's own parameters, tensor by tensor, by the codec's backend
  for their device, `deltasync.codec.backend`). `base` is the fingerprint it applies to, `fingerprint` the one
  it leads to. Before writing anything, every worker decodes and reads the old values at its changed
  elements; the ranks' shares of how the fingerprint moves must sum to `fingerprint - base`, else the update
  is refused.
- `kind="stage"`: the decoding, checks and plan of a delta (the same fields), nothing written: a `delta`
  update of the same step and files that follows it, on unchanged weights, only writes. Staging while
  generation runs keeps the pause to the writes.
- `kind="anchor"`: the shard files of an anchor (`paths`, plain or packed); every rank reads them tensor by
  tensor, the ranks check the whole state's fingerprint against `fingerprint` before writing anything, and
  read it back after the write.
- `kind="verify"`: writes nothing; the weights read back must have `fingerprint`.
- `kind="fingerprint"`: writes nothing; rank 0 saves the fingerprint of the weights read back to the file
  `path` as JSON (`{"step": ..., "fingerprint": ...}`: the step last written).
- `kind="readback"`: writes nothing; each rank saves the HF tensors it holds whole to
  `path/rank-<r>.safetensors`, with how each tensor is written (`Layout.paths`: direct, packed MoE experts,
  or through vLLM's loader) as JSON in its `paths` metadata.
- `kind="paths"`: writes nothing; each rank saves how each tensor it holds is written (`Layout.paths`) as
  JSON to `path/rank-<r>.json`.

Quantized replicas (`--quantization fp8_per_channel`, a root whose run.json names that recipe; see
docs/protocol.md, "Quantized replicas"): fingerprints are the replica's (the bf16 tensors the recipe leaves
alone plus the codes and scales, deltasync.quant.state); a delta's `paths` are its two files, the bf16 patch
of the tensors left alone and the quantized delta, both decoded and checked before anything is written, then
written in place (codes and scales in vLLM's own fp8 tensors, `Layout.quantized`); an anchor's tensors are
quantized by the recipe as vLLM quantizes at load. `init_info.quantization` (the root's recipe) must be the
server's.

MoE models work alike: on CPU their experts live in vLLM's prepacked layout, which the layout maps element
by element (`deltasync.vllm.experts`); `write="vllm"` is refused for them (vLLM's loader writes the
unpacked layout).

Every rank reaches the same verdict on every files update, whatever it raised: the ranks agree (one
collective) after the checks, after the writes and with each sum of fingerprint shares, so that no rank waits
alone in a collective while another has left (one gap is left: a rank that fails in the middle of decoding a
delta, between the per-tensor collectives of `deltasync.vllm.split` and `Layout.old_values`, leaves the
others waiting in the next of those). A refused update raises before any write (a ValueError naming
the cause); anything else one rank raised (out of memory, a bug) is logged there with its traceback and
raised as `RankFailed`. vLLM's route reports it. The reporting rank also writes what it means to the
update's `report` file as JSON: `{"refused": ...}` when the cause is the step's files themselves (corrupt,
or not the state they promise), so that the follower knows the files are bad, not the server; `{"torn":
...}` when the weights hold part of a write (a failure after the first write), so that generation stays
paused until an anchor loads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
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

from deltasync.codec import fingerprint
from deltasync.codec.backend import TensorChanges, backend_on
from deltasync.codec.fingerprint import format_fingerprint
from deltasync.codec.patch import (
    compact_decoder,
    decode_entry,
    merge_changes,
    read_entries,
    read_info,
    read_tables,
)
from deltasync.errors import PatchError, RankFailed, Refused
from deltasync.quant import delta as quant_delta
from deltasync.quant import state as quant_state
from deltasync.quant.recipe import RECIPES, Recipe
from deltasync.sync.anchor import anchor_tensors
from deltasync.vllm import compat
from deltasync.vllm.layout import Layout, sum_across
from deltasync.vllm.split import decode_held

log = init_logger(__name__)  # vLLM's logger: configured in its worker processes
KINDS = ("delta", "stage", "anchor", "verify", "fingerprint", "readback", "paths")
WRITES = ("direct", "vllm")
VERDICTS = ("refused", "bug", "failed")  # what a rank's failure is, the first named wins across ranks
T = TypeVar("T")


@dataclass
class DeltasyncInitInfo(WeightTransferInitInfo):
    """`root`: the sync root this server follows (reported, never read by the workers). `write`: "direct"
    (indexed writes into the parameter views, O(changed elements)) or "vllm" (vLLM's own
    `load_checkpoint_weight_patches` and `load_weights` for every tensor: slower, for comparison)."""

    root: str
    write: str = "direct"
    quantization: str | None = None  # the root's recipe (run.json): the server's --quantization, or refused


@dataclass
class DeltasyncUpdateInfo(WeightTransferUpdateInfo):
    """One step to write (see the module docstring for `kind`)."""

    step: int
    kind: str = "delta"
    path: str | None = None
    paths: list[str] | None = None
    base: str | None = None
    fingerprint: str | None = None
    report: str | None = None


@dataclass
class _Plan:
    """A delta checked against the weights `base`, ready to write (`writes`: this rank's indexed writes) and
    leading to the weights `new`."""

    step: int
    paths: list[str]
    base: int
    new: int
    changes: dict
    writes: list
    quantized: dict | None = None  # a quantized replica's: codes and scales to write (deltasync.quant.state)
    quantized_fp: int = 0  # the codes' and scales' fingerprint after them

    def matches(self, info: DeltasyncUpdateInfo, held: int | None) -> bool:
        return (self.step, self.paths, self.base) == (info.step, info.paths, held) and info.fingerprint == (
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
        self.recipe: Recipe | None = None  # the server's --quantization, where deltasync follows it
        self.quantized_fp = 0  # of the quantized tensors' codes and scales (a part of `fingerprint`)
        self.fingerprint: int | None = None  # of the whole state, as last verified or moved by a delta
        self.step: int | None = None
        self.write = "direct"
        self.staged: _Plan | None = None  # the last staged delta, written by the delta update after it
        self.backend = backend_on(device)  # the codec's, for the weights' device

    def init_transfer_engine(self, init_info: DeltasyncInitInfo) -> None:
        if self.layout is None:
            start = time.perf_counter()
            self.group = compat.model_group()
            self.recipe = RECIPES.get(getattr(self.model_config, "quantization", None) or "")
            self.layout = Layout.learn(self.model, self.model_config.hf_config, self.group, self.recipe)
            self.quantized_fp = quant_state.fingerprint(self.layout.quantized)
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
        served = self.recipe.name if self.recipe else None
        if init_info.quantization != served:
            raise ValueError(
                f"init_info names a {init_info.quantization or 'bf16'} root, this server serves "
                f"{served or 'bf16'}: a replica follows a root of its own --quantization (deltasync follow "
                "--quantization)"
            )
        if init_info.write == "vllm" and served:
            raise ValueError(
                "init_info write 'vllm' cannot reach quantized weights: vLLM's loader requantizes"
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
        files = info.kind in ("delta", "stage", "anchor")
        if info.kind != "verify" and not (info.paths if files else info.path):
            raise ValueError(f"update_info of kind {info.kind!r} needs {'paths' if files else 'a path'}")
        return info

    def receive_weights(self, update_info: DeltasyncUpdateInfo) -> None:
        if self.layout is None:
            raise ValueError(compat.NOT_INITIALIZED)
        try:
            self._receive(update_info)
        except (ValueError, RankFailed) as e:
            # Every rank reached the same verdict; one rank reports it (see compat.reports_errors).
            if compat.reports_errors(self.group):
                self._report(update_info, e)
                raise

    def _report(self, info: DeltasyncUpdateInfo, error: Exception) -> None:
        """What a failed files update means, for the follower (see the module docstring)."""
        if info.report is None or info.kind not in ("delta", "stage", "anchor"):
            return
        report = {"refused": str(error)} if isinstance(error, Refused) else {}
        if self.fingerprint is None:  # part of a write, or a write read back wrong: only an anchor helps
            report["torn"] = str(error)
        if report:
            Path(info.report).write_text(json.dumps(report))

    def _receive(self, info: DeltasyncUpdateInfo) -> None:
        if info.kind == "verify":
            return self._verify(self._read_fingerprint(), info)
        if info.kind in ("delta", "stage", "anchor"):
            return self._receive_files(info)
        if info.path is None:  # parse_update_info refused it already
            raise ValueError(f"update_info of kind {info.kind!r} needs a path")
        if info.kind == "readback":
            return self._readback(Path(info.path))
        if info.kind == "fingerprint":
            held = {"step": self.step, "fingerprint": format_fingerprint(self._read_fingerprint())}
            if compat.rank(self.group) == 0:
                Path(info.path).write_text(json.dumps(held))
            return None
        folder = Path(info.path)  # kind "paths"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{compat.rank(self.group)}.json").write_text(json.dumps(self._ready().paths()))
        return None

    def _receive_files(self, info: DeltasyncUpdateInfo) -> None:
        staged, self.staged = self.staged, None
        if info.kind == "anchor":
            return self._load_anchor(info)
        if info.kind == "delta" and staged is not None and staged.matches(info, self.fingerprint):
            plan = staged
        else:
            plan = self._plan_delta(info)
        if info.kind == "stage":
            self.staged = plan
            return None

        def write() -> tuple[None, int]:
            self._write_delta(plan)
            return None, 0

        self.fingerprint = None  # from the first write until the last, the state is mixed
        self._agreed(info, write)
        self.fingerprint, self.step = plan.new, info.step
        if plan.quantized is not None:
            self.quantized_fp = plan.quantized_fp
        return None

    def _agreed(self, info: DeltasyncUpdateInfo, work: Callable[[], tuple[T, int]]) -> tuple[T, int]:
        """`work()` -> (result, this rank's share of a sum) on every rank, then one collective: the result
        and the sum of the shares (mod 2^64) if every rank succeeded, else every rank raises the same
        error (else the others would wait for ever in the collectives that follow): a refusal of the files
        (PatchError) first, then a rank's bug (RankFailed, its traceback logged there), then a ValueError."""
        result, share, verdict = None, 0, None
        try:
            result, share = work()
        except Exception as e:
            verdict = self._verdict(info, e)
        everyone = [(verdict, share)]
        if self.group is not None:
            everyone = [(None, 0)] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(everyone, (verdict, share), group=self.group)
        failed = [(VERDICTS.index(v[0]), v[1]) for v, _ in everyone if v is not None]
        if failed:
            order, message = min(failed, key=lambda f: f[0])  # of its kind, the lowest rank's
            raise (PatchError, RankFailed, ValueError)[order](message)
        return result, sum(s for _, s in everyone) & fingerprint.MASK64  # type: ignore[return-value]

    def _verdict(self, info: DeltasyncUpdateInfo, error: Exception) -> tuple[str, str]:
        if isinstance(error, (OSError, SafetensorError)):
            return "failed", f"step {info.step}: cannot read its files: {type(error).__name__}: {error}"
        if isinstance(error, MemoryError):  # a local failure that may pass, not the files' fault nor a bug
            return "failed", f"step {info.step}: out of memory on rank {compat.rank(self.group)}"
        if isinstance(error, ValueError):
            return "refused" if isinstance(error, Refused) else "failed", str(error)
        rank = compat.rank(self.group)
        log.error("deltasync: step %d failed on rank %d on a bug", info.step, rank, exc_info=error)
        return "bug", f"step {info.step}: {type(error).__name__} on rank {rank}: {error} (traceback logged)"

    # ---------------------------------------------------------------------------------------------------

    def _ready(self) -> Layout:
        if self.layout is None:
            raise ValueError(compat.NOT_INITIALIZED)
        return self.layout

    def _decode_quantized(self, info: DeltasyncUpdateInfo) -> tuple[dict, int]:
        """A quantized replica's delta: the quantized delta (its second file) decoded and checked against the
        codes and scales held, and the fingerprint of the codes and scales it leads to."""
        layout = self._ready()
        assert self.recipe is not None  # a quantized server's
        if len(info.paths or ()) != 2:
            raise PatchError(f"step {info.step}: a quantized root's delta is two files, got {info.paths}")
        data = Path((info.paths or [])[1]).read_bytes()
        return quant_delta.decode(data, layout.quantized, self.recipe.name, self.quantized_fp)

    def _decode_delta(
        self, info: DeltasyncUpdateInfo, quantized_fp: tuple[int, int] | None = None
    ) -> dict[str, TensorChanges]:
        """The step's changes, decoded part by part against the weights held (every part applies to them:
        the parts of a sharded publisher cover disjoint elements). On a quantized replica `quantized_fp`
        holds the codes' and scales' fingerprints before and after (decoded first): the bf16 patch, the first
        file, covers the rest of the weights."""
        layout = self._ready()
        if info.base is None or info.fingerprint is None:
            raise ValueError(f"step {info.step}: a delta needs its base and fingerprint")
        here = None if self.fingerprint is None else format_fingerprint(self.fingerprint)
        if info.base != here:
            raise ValueError(f"step {info.step} applies to weights {info.base}, this server holds {here}")
        decoded, base, problems, gathered = [], int(info.base, 16), [], 0
        paths, target = list(info.paths or ()), info.fingerprint
        if quantized_fp is not None:
            paths, before, after = paths[:1], *quantized_fp
            base = (base - before) & fingerprint.MASK64
            target = format_fingerprint(int(info.fingerprint, 16) - after)
        start = time.perf_counter()
        for i, path in enumerate(paths):
            data = Path(path).read_bytes()
            where = f"step {info.step}, part {i + 1} of {len(info.paths or ())}"
            patch = read_info(data)
            if (patch.step, patch.base_fingerprint) != (info.step, base):
                was = format_fingerprint(patch.base_fingerprint)
                raise PatchError(
                    f"{where} is step {patch.step} from weights {was}, expected step {info.step} from "
                    f"{format_fingerprint(base)}"
                )
            unknown = sorted(
                set(patch.tensors) - set(layout.shapes) | set(patch.tensors) & set(layout.quantized)
            )
            if unknown:
                raise PatchError(f"{where}: unknown tensor {unknown[0]!r}")
            through_loader = sorted(set(patch.tensors) & set(layout.loader))
            if through_loader:  # its old values are not readable here, so the promise cannot be checked
                raise ValueError(f"{where}: {through_loader[0]!r} cannot be patched in place")
            entries = read_entries(data)
            tables = read_tables(patch) if patch.encoding == "compact" else None
            windows = {}
            for name in patch.tensors:
                numel = int(np.prod(layout.shapes[name]))
                lo, n = windows[name] = patch.windows.get(name, (0, numel))
                if lo + n > numel:
                    raise PatchError(f"{where}: {name}: window [{lo}, {lo + n}) is outside its {numel}")

            def old_values(name: str, layout: Layout = layout, windows: dict = windows) -> torch.Tensor:
                lo, n = windows[name]
                return layout.old_values(name).reshape(-1)[lo : lo + n]

            symbols = None
            if tables is not None and self.backend.decodes_whole_patches:  # every chunk's rANS stage at once
                compact = [k for k, t in patch.tensors.items() if t["mode"] == "compact"]
                whole = {k: windows[k] for k in compact if k not in layout.split}
                if whole:
                    symbols = compact_decoder(patch, entries, whole, tables, self.device, old_values)
            changes = {}
            for name in patch.tensors:  # in the patch's order on every rank: collectives run per tensor
                if name in layout.split:  # only this rank's part of it: its changes there
                    blocks = layout.blocks.get(name, [])
                    held = decode_held(patch, entries, name, windows[name][1], tables, blocks, self.group)
                    changes[name] = held[0]
                    problems.append(held[1])
                    gathered += held[2]
                else:
                    changes[name] = decode_entry(
                        patch, entries, name, old_values(name), tables, symbols=symbols
                    )
            decoded.append(changes)
            base = patch.fingerprint
        problem = next((p for p in problems if p), None)
        if problem:  # seen by this rank alone, after every collective: the ranks agree on it next
            raise PatchError(f"step {info.step}: {problem}")
        if format_fingerprint(base) != target:
            raise PatchError(f"step {info.step}: its files lead to {format_fingerprint(base)}, not {target}")
        changes = merge_changes(decoded)
        log.info(
            "deltasync: step %d decoded on rank %d in %.3f s: %d changes here, %d B of class counts gathered",
            info.step,
            compat.rank(self.group),
            time.perf_counter() - start,
            sum(len(c) for c in changes.values()),
            gathered,
        )
        if self.write == "vllm" and any(torch.isnan(ch.values).any() for ch in changes.values()):
            raise ValueError(f"step {info.step}: NaN values cannot be patched through vLLM's loader")
        return changes

    def _plan_delta(self, info: DeltasyncUpdateInfo) -> _Plan:
        """The delta decoded, checked and planned on every rank, nothing written."""

        def plan() -> tuple[_Plan, int]:
            quantized, reached, moved_quantized = None, 0, 0
            if self.recipe is not None:
                quantized, reached = self._decode_quantized(info)
                moved_quantized = reached - self.quantized_fp
                changes = self._decode_delta(info, (self.quantized_fp, reached))
            else:
                changes = self._decode_delta(info)
            writes, moved = self._ready().plan_patch(changes)
            base = int(str(info.base), 16)  # the weights held: checked in _decode_delta
            paths = list(info.paths or ())
            plan = _Plan(info.step, paths, base, 0, changes, writes, quantized, reached)
            return plan, (moved + moved_quantized) & fingerprint.MASK64

        planned, moved = self._agreed(info, plan)
        planned.new = (planned.base + moved) & fingerprint.MASK64
        if format_fingerprint(planned.new) != info.fingerprint:
            raise PatchError(
                f"step {info.step} would lead to weights {format_fingerprint(planned.new)}, it promises "
                f"{info.fingerprint}: refused, nothing written"
            )
        return planned

    def _write_delta(self, plan: _Plan) -> None:
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
            if plan.quantized is not None:  # codes at their positions, scales at their rows
                quant_state.apply(layout.quantized, plan.quantized)

    def _anchor(self, info: DeltasyncUpdateInfo):
        """The anchor's tensors, one at a time, checked against the served schema."""
        schema = {name: list(shape) for name, shape in self._ready().shapes.items()}
        return anchor_tensors([Path(p) for p in info.paths or ()], schema, info.step)

    def _load_anchor(self, info: DeltasyncUpdateInfo) -> None:
        """Check the anchor's fingerprint (each rank reading all of it, fingerprinting a share of its
        tensors) before writing anything, then write it and read the weights back."""
        if info.fingerprint is None:
            raise ValueError(f"step {info.step}: an anchor needs its fingerprint")
        _, total = self._agreed(info, lambda: (None, self._anchor_share(info)))
        if format_fingerprint(total) != info.fingerprint:
            raise PatchError(
                f"anchor of step {info.step} has fingerprint {format_fingerprint(total)}, it promises "
                f"{info.fingerprint}"
            )
        self.fingerprint = None  # from the first write until the read-back below, the state is mixed
        _, held = self._agreed(info, lambda: (None, self._write_anchor(info)))
        self._verify(held, info)
        self.fingerprint, self.step = held, info.step

    def _anchor_share(self, info: DeltasyncUpdateInfo) -> int:
        world = 1 if self.group is None else torch.distributed.get_world_size(self.group)
        rank, total, names = compat.rank(self.group), 0, set()
        layout = self._ready()
        for i, (name, values) in enumerate(self._anchor(info)):
            names.add(name)
            if i % world == rank and name in layout.quantized:  # the codes and scales it will hold
                assert self.recipe is not None  # a quantized server's
                quantized = {name: quant_state.Quantized(*self.recipe.quantize(values))}
                total += quant_state.fingerprint(quantized)
            elif i % world == rank:
                total += fingerprint.tensor_fingerprint(name, values)
        missing = sorted(set(self._ready().shapes) - names)
        if missing:
            raise PatchError(f"anchor of step {info.step} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
        return total

    def _write_anchor(self, info: DeltasyncUpdateInfo) -> int:
        """Write the anchor; this rank's share of the fingerprint of the weights read back."""
        layout = self._ready()
        with torch.no_grad():
            loader = []
            for name, values in self._anchor(info):
                if name in layout.quantized:  # as vLLM quantizes at load (deltasync.quant.recipe)
                    assert self.recipe is not None  # a quantized server's
                    codes, scales = self.recipe.quantize(values)
                    layout.quantized[name].codes.copy_(codes)
                    layout.quantized[name].scales.copy_(scales)
                    continue
                if name in layout.loader or self.write == "vllm":
                    loader.append((name, values.to(self.device)))
                    continue
                for b in layout.blocks.get(name, []):
                    b.write(values.as_strided(b.size, b.stride, b.offset).to(b.dst.device))
            if loader:
                self.model.load_weights(loader)  # type: ignore[operator]
        self.quantized_fp = quant_state.fingerprint(layout.quantized)
        return layout.partial_fingerprint()

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
        for name, q in layout.quantized.items():  # codes in their dtype, fp32 scales beside them
            tensors[name] = q.codes.clone()
            tensors[name + quant_state.SCALE] = q.scales.clone()
        folder.mkdir(parents=True, exist_ok=True)
        metadata = {"paths": json.dumps(layout.paths())}
        save_file(tensors, folder / f"rank-{compat.rank(self.group)}.safetensors", metadata)

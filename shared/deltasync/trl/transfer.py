"""`BucketWeightTransfer`: TRL's weight-transfer protocol, backed by the project's Publisher.

AsyncGRPOTrainer(weight_transfer=...) calls, on the main process only:
    init_weight_transfer()              once, at train begin
    pause(); send_weights(it); resume()  once before step 1 (cold sync), then after every `weight_sync_steps`
    destroy()                           when training ends, also on errors

`send_weights` gets the LIVE trainer parameters (HF names; fp32 or bf16; CPU or CUDA; tied embeddings sent
once, as `model.embed_tokens.weight`). It hands them to `Publisher.publish`, which copies them into a bf16
buffer (beside CUDA weights, or in host memory: `PublisherConfig.previous_copy`) and returns; change
detection, encoding and upload run in the publisher's thread while training goes on. For a model whose
parameters are not its checkpoint's tensors (MoE experts, fused in transformers), `use_model(model)` (called
by `stamp_rollouts`) makes it publish the checkpoint's names and layout, the ones vLLM loads
(`deltasync.trl.checkpoint`); dense models publish their parameters as handed.
`pause`/`resume` do nothing: replicas apply steps on their own schedule, and inference never waits for the
trainer.

Adapter mode (`lora_name` set, and `use_model` given a PEFT LoRA model): each sync publishes the adapter's
tensors (PEFT's saved names, `get_peft_model_state_dict`), not the merged weights TRL hands over, on the same
protocol; run.json marks the root as a LoRA root of `model_id` (`RunInfo.lora`: the adapter's name and its
adapter_config.json). Replicas serve step N as the adapter `{lora_name}-v{N}` (`deltasync.vllm.lora`), and a
rollout that names it is stamped with version N: so every step handed over is published, none folded into the
next when uploads lag (a sync waits for the last one's upload instead; an adapter's is small).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import encode, make_patch
from deltasync.storage import Storage
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.trl.checkpoint import Converter, Pairs, checkpoint_converter

log = logging.getLogger(__name__)


class BucketWeightTransfer:
    """Publishes each synced policy as the next step of the sync root `root`.

    info: called at each sync for the step's numbers (reward, staleness) that go into its telemetry record.
    guard: a context manager held around each publish, e.g. to defer Ctrl-C until the copy is whole.
    on_first_step: told the step of the cold sync, before rollouts start.
    lora_name: adapter mode's name (see the module docstring).
    model_revision: the revision of the Hub model `model_id` training starts from: the cold sync's weights, if
        exactly that model's, go out by reference to it instead of as an anchor (`deltasync.sync.base`).
    measure_merged: adapter mode only: also encode, at each sync, the delta TRL's merged path would publish
        (the merged weights TRL hands over, against the last sync's, as bf16) and put its size in the step's
        telemetry (`merged_payload_bytes`, `merged_changed`). Measured, never uploaded; it keeps a bf16 copy
        of the merged model, so it suits small models and benchmarks.
    """

    def __init__(
        self,
        root: str | Path | Storage,
        model_id: str = "",
        config: PublisherConfig | None = None,
        info: Callable[[], Mapping[str, float]] | None = None,
        guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        on_first_step: Callable[[int], None] | None = None,
        lora_name: str | None = None,
        measure_merged: bool = False,
        model_revision: str | None = None,
    ):
        self.root, self.model_id, self.config, self.lora_name = root, model_id, config, lora_name
        self.model_revision = model_revision
        self.measure_merged = measure_merged
        self.merged: dict[str, torch.Tensor] | None = None  # measure_merged: the last sync's, bf16
        self.info, self.guard, self.on_first_step = info, guard, on_first_step
        self.publisher: Publisher | None = None
        self.closed = False
        self.first_step: int | None = None  # the published step of the weights training started from
        self.last_step: int | None = None
        self.blocked_s: list[float] = []  # per sync: how long send_weights held the training loop
        self.sent: list[
            tuple[str, torch.Tensor]
        ] = []  # the last sync's tensors (live: the trainer's weights)
        self.shapes: dict[str, tuple[int, ...]] = {}  # published names and shapes
        self.to_checkpoint: Converter | None = None
        self.adapter: torch.nn.Module | None = None  # adapter mode: the PEFT model whose adapter is published
        self.lora: dict | None = None  # adapter mode: run.json's `lora`

    def use_model(self, model: torch.nn.Module) -> None:
        """Publish `model`'s parameters under its checkpoint's names and layout, or in adapter mode its
        adapter (see the module docstring)."""
        if not self.lora_name:
            self.to_checkpoint = checkpoint_converter(model)
        elif hasattr(model, "peft_config"):
            self.adapter, self.lora = model, lora_info(model, self.lora_name, self.model_id)
        else:
            raise ValueError(f"lora_name={self.lora_name!r} publishes a PEFT adapter: train with peft_config")

    def init_weight_transfer(self) -> None:
        if self.publisher is None:
            self.publisher = Publisher(
                self.root, self.model_id, self.config, self.lora, model_revision=self.model_revision
            )

    def pause(self) -> None:
        """Nothing to pause: replicas keep generating and apply the step when it lands."""

    def resume(self) -> None:
        """See `pause`."""

    @torch.no_grad()
    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        self.init_weight_transfer()
        assert self.publisher is not None  # opened by init_weight_transfer
        sent = list(iterator)  # the live tensors: publish() copies them before it returns
        # Adapter mode: TRL merged the adapter into the weights it hands over; its own tensors are unchanged.
        self.sent = adapter_tensors(self.adapter) if self.adapter is not None else sent
        merged = self._merged_delta(sent) if self.measure_merged and self.adapter is not None else {}
        params = self._checkpoint(self.sent)
        self.shapes = {name: tuple(t.shape) for name, t in params}
        if self.first_step is None and self._is_published_head(params):
            # Restarted on a run whose head holds exactly these weights: the cold sync has nothing to add,
            # and training continues the step numbering from the head.
            step = self.publisher.last_step
        else:
            if self.adapter is not None:
                # Never coalesced: rollouts name the adapter of the step handed here (exact weight versions),
                # so that step must be published, not folded into the next one when uploads lag.
                self.publisher.flush()
            info = {**(self.info() if self.info else {}), **merged}
            with self.guard():
                step = self.publisher.publish(params, info=info or None)
        if self.first_step is None:
            self.first_step = step
            if self.on_first_step:
                self.on_first_step(step)
        self.last_step = step
        self.blocked_s.append(time.perf_counter() - start)

    def destroy(self) -> None:
        """Publish what was handed over, then stop the publisher's thread. Idempotent (TRL's own finally
        calls it, then the trainer's), while Publisher.close() releases the writer lock each time."""
        if self.publisher is not None and not self.closed:
            self.closed = True
            self.publisher.close()

    @torch.no_grad()
    def fingerprint_now(self) -> int:
        """Fingerprint of the trainer's weights as bf16, recomputed from them (one pass over the model)."""
        return state_fingerprint((name, t.to(torch.bfloat16)) for name, t in self._checkpoint(self.sent))

    def _merged_delta(self, merged: Pairs) -> dict[str, float]:
        """See `measure_merged`; nothing at the first sync (the merged path's anchor: the whole model)."""
        new = {name: t.detach().to("cpu", torch.bfloat16, copy=True) for name, t in merged}
        old, self.merged = self.merged, new
        if old is None:
            return {}
        patch = make_patch(old, new, step=1, base_step=0)
        encoding = (self.config or PublisherConfig()).encoding
        return {"merged_changed": patch.changed, "merged_payload_bytes": len(encode(patch, old, encoding))}

    def _checkpoint(self, params: Pairs) -> Pairs:
        return self.to_checkpoint(params) if self.to_checkpoint else params

    def _is_published_head(self, params: list[tuple[str, torch.Tensor]]) -> bool:
        head = self.publisher.head if self.publisher else None
        if head is None:
            return False
        state = ((name, t.to(torch.bfloat16)) for name, t in params)  # one tensor at a time
        return format_fingerprint(state_fingerprint(state)) == head.fingerprint


def lora_info(model: torch.nn.Module, lora_name: str, base_model: str) -> dict:
    """run.json's `lora` for `model`'s active adapter, refused (ValueError, TRL's own checks) when vLLM could
    not serve it as a LoRA adapter; its adapter_config.json as PEFT writes it, naming `base_model`."""
    from trl.experimental.async_grpo.async_grpo_trainer import validate_lora_for_vllm_sync

    config = validate_lora_for_vllm_sync(model)  # type: ignore[arg-type]  # a PeftModel (use_model checks)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        adapter_config = json.loads((Path(folder) / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = base_model
    return {"name": lora_name, "adapter_config": adapter_config}


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The active adapter's tensors under the names PEFT saves them (live: the trainer's)."""
    from peft import get_peft_model_state_dict

    # vLLM serves no embedding LoRA (lora_info refuses it); the check would look the base model up online
    return list(get_peft_model_state_dict(model, save_embedding_layers=False).items())

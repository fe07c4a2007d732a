"""The local trainer: TRL's AsyncGRPOTrainer on Wordle, publishing every step to a sync root.

    python -m trainer --sync_root ROOT --inference_url URL [URL ...] --env_url URL [--model MODEL] [...]
    python -m trainer --config run.yaml [--max_steps 50]        # flags override the file
    python -m trainer --help

The flags are TRL's own `AsyncGRPOConfig` (any of them works unchanged: --learning_rate, --max_grad_norm,
--num_generations, --max_staleness, ...) plus `DeltaSyncArguments` (sync root, URLs, model, reward,
publisher), through TRL's `TrlParser`; `--a-b` spells `--a_b` too. The project's defaults for TRL's flags
are in `project_defaults()` (CPU: the tiny model, float32, small groups).

Built on deltasync.trl, as any TRL script can be (examples/grpo_bucket.py): rollouts come from TRL's
AsyncRolloutWorker, which asks the inference replicas (vLLM's OpenAI API) for completions, each rollout from
the replica with the fewest in flight, stamped with that replica's weight version (`stamp_rollouts`), and
plays them in the Wordle environment Space through `WordleEnv`. After every optimizer step the weights go to
`BucketWeightTransfer`, which hands them to the background publisher and returns: training never waits for
an upload, and replicas apply the step whenever it lands.

Before anything is published, preflight checks the sync root, the replicas and the environment; a failure is
one line and exit status 2. A failure later (a replica or the environment gone) ends the run with one line
and exit status 1, after the last step handed to the publisher is published (traceback in the output dir).

Secrets come from the environment only and are never logged: INFERENCE_API_TOKEN (bearer token of the
inference Space, if it has one) and HF_TOKEN (read by huggingface_hub for hf:// sync roots and Hub models).

Restarting on a sync root that already holds a run continues it: the model starts from the head's weights
(bf16; the optimizer state starts fresh) and the step numbers continue the chain. Ctrl-C (or SIGTERM)
finishes the current step, publishes it and stops; a second Ctrl-C aborts at once, but never in the middle of
a publish.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig

from appkit.units import format_bytes
from deltasync.codec.fingerprint import format_fingerprint
from deltasync.quant.recipe import RECIPES
from deltasync.storage import redact
from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.signing import SigningKey, Trust
from deltasync.trl import (
    BucketWeightTransfer,
    apply_cpu_shims,
    check_or_exit,
    rollouts_ahead,
    schema_of,
    stamp_rollouts,
)
from deltasync.trl.transfer import adapter_tensors
from trainer.task import CHAT_TEMPLATE_KWARGS, quit_early

log = logging.getLogger("deltasync.trainer")
TINY = "tiny"  # --model value: the warm-started tiny Qwen3, built locally and cached (trainer/tiny_model.py)
REAL_MODEL = "Qwen/Qwen3-0.6B"
LORA_NAME = "policy"  # with --lora_r, replicas serve step N as the adapter policy-vN


@dataclass
class DeltaSyncArguments:
    """What is ours beside TRL's AsyncGRPOConfig: where the run lives, the Spaces, the task, the publisher."""

    sync_root: str | None = field(
        default=None,
        metadata={
            "help": "Where steps are published: a folder, hf://buckets/<namespace>/<name>[/prefix], or "
            "any fsspec URL. An existing run there is continued. Required."
        },
    )
    inference_url: list[str] | None = field(
        default=None,
        metadata={
            "help": "Base URL of each inference replica following the sync root (vLLM's OpenAI API), e.g. "
            "https://<user>-<space>.hf.space; several (space- or comma-separated): each rollout goes to the "
            "one with the fewest rollouts in flight. Their bearer token, if any, comes from "
            "INFERENCE_API_TOKEN. Required.",
            "nargs": "+",
        },
    )
    env_url: str | None = field(
        default=None, metadata={"help": "Base URL of the Wordle environment Space (OpenEnv). Required."}
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": f"HF model id or local folder; '{TINY}' for the tiny Qwen3 built locally. Default: "
            f"{REAL_MODEL} with CUDA, else {TINY}. The inference Space must serve the same weights."
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "The model name the inference Space answers to (default: --model)."}
    )
    reward: str = field(
        default="wordle-partial",
        metadata={
            "help": "Rewards beside the environment's win reward (1.0 for a solved game): 'wordle-partial' "
            "what all the guesses found of the word (1/5 per green position, 1/10 per other letter "
            "found), so that groups that never win still differ; "
            "'wordle' none; 'short' shorter completions (a sanity reward the tiny model learns in a few "
            "dozen steps).",
            "choices": ["wordle", "wordle-partial", "short"],
        },
    )
    anchor_every: int = field(
        default=PublisherConfig.anchor_every,
        metadata={"help": "Steps between complete anchors in the sync root."},
    )
    keep_anchors: int = field(
        default=PublisherConfig.keep_anchors,
        metadata={"help": "Anchors (and the deltas after them) GC keeps."},
    )
    encoding: str = field(
        default=PublisherConfig.encoding,
        metadata={
            "help": "Patch encoding: compact (~1 B per changed element) or raw (int32 index + bf16).",
            "choices": ["compact", "raw"],
        },
    )
    previous_copy: str = field(
        default=PublisherConfig.previous_copy,
        metadata={
            "help": "Where the publisher keeps the last published bf16 weights and the step handed over: "
            "device (beside the weights: on a GPU, publish() blocks for a device copy and the GPU diffs; 4 B "
            "of GPU memory per parameter), host (pinned host memory: blocks for the copy to the host, the "
            "CPU diffs), auto (device on a GPU). See docs/benchmarks.md.",
            "choices": ["auto", "device", "host"],
        },
    )
    rollouts_ahead: float = field(
        default=0.5,
        metadata={
            "help": "Back-pressure: rollouts generated (or generating) but not yet trained, in optimizer "
            "steps' worth (per_device_train_batch_size x gradient_accumulation_steps x processes). A rollout "
            "trained k steps after its weights were published is k steps stale, so this bounds the staleness "
            "(about this plus the replica's lag) whatever the step time and the generation speed: when "
            "generation is faster it waits, when slower the trainer waits. Also sets TRL's "
            "max_inflight_tasks and queue_maxsize unless given. 0: TRL's own bounds only. TRL's data loader "
            "also holds the next step's batch: at 0.5, trained rollouts are about one step stale."
        },
    )
    mask_truncated_completions: bool = field(
        default=True,
        metadata={
            "help": "Leave out of the loss a rollout's last turn when max_completion_length cut it off (as "
            "TRL's GRPOTrainer flag of that name). Trained, the cut-off last turns of the best games teach "
            "the policy to ramble instead of guessing."
        },
    )
    lora_r: int = field(
        default=0,
        metadata={
            "help": "Train a LoRA adapter of this rank on every linear layer instead of all the weights "
            "(0: all the weights). Each step publishes the adapter alone; the replicas must serve a LoRA "
            "root (the inference Space: MAX_LORA_RANK, or a root whose run.json is one when it starts)."
        },
    )
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA's alpha (default: 2 x --lora_r)."})
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "Publish a quantized root: the recipe, as vLLM's --quantization names it, its replicas "
            "serve (the inference Space: QUANTIZATION, or a root whose run.json says so when it starts); "
            "their quantized weights follow the trainer's bf16 ones bit for bit. Unset: bf16.",
            "choices": list(RECIPES),
        },
    )
    signing_key: str | None = field(
        default=None,
        metadata={
            "help": "Sign run.json and every step with this private key file (`deltasync keygen`); replicas "
            "given its public key (the inference Space's TRUSTED_KEYS, deltasync follow/pull --trusted-key) "
            "apply only what it signed. The trainer also resumes only from a head it signed. Unset: unsigned."
        },
    )
    previous_signing_key: str | None = field(
        default=None,
        metadata={
            "help": "Rotation: the key that signed the run so far, which endorses --signing_key in run.json; "
            "replicas that trust either key follow."
        },
    )
    measure_merged: bool = field(
        default=False,
        metadata={
            "help": "With --lora_r: also measure, each step, the delta the merged path would publish "
            "(encoded, not uploaded; in the step's telemetry). Keeps a bf16 copy of the model."
        },
    )
    dataset_size: int = field(default=1000, metadata={"help": "Prompt rows (each game draws its own word)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar (else a log line per step)."})

    def lora(self):
        """PEFT's LoraConfig for --lora_r (every linear layer but the output head), None without it."""
        if not self.lora_r:
            return None
        from peft import LoraConfig  # only LoRA runs need peft

        alpha = self.lora_alpha or 2 * self.lora_r
        return LoraConfig(r=self.lora_r, lora_alpha=alpha, target_modules="all-linear", task_type="CAUSAL_LM")

    def publisher_config(self) -> PublisherConfig:
        return PublisherConfig(
            encoding=self.encoding,
            anchor_every=self.anchor_every,
            keep_anchors=self.keep_anchors,
            previous_copy=self.previous_copy,
            quantization=self.quantization,
            signing_key=self.signing_key,
            previous_signing_key=self.previous_signing_key,
        )

    def own_keys(self) -> Trust:
        """The trainer's own public keys (--signing_key, --previous_signing_key): whose heads it resumes from
        (none: any head)."""
        paths = [p for p in (self.signing_key, self.previous_signing_key) if p]
        return Trust([SigningKey.load(p).public for p in paths])

    def check(self) -> None:
        missing = [f"--{n}" for n in ("sync_root", "inference_url", "env_url") if not getattr(self, n)]
        if missing:
            raise SystemExit(f"missing {', '.join(missing)} (see --help)")
        if self.quantization and self.lora_r:
            raise SystemExit("--quantization and --lora_r: a LoRA root is never quantized")
        if self.previous_signing_key and not self.signing_key:
            raise SystemExit("--previous_signing_key rotates to a --signing_key: give both")
        urls = [self.inference_url] if isinstance(self.inference_url, str) else self.inference_url
        self.inference_url = [u.rstrip("/") for url in urls for u in url.split(",") if u.strip()]


def project_defaults(model: str | None, cuda: bool) -> dict[str, Any]:
    """Our defaults for TRL's own flags (a flag or the --config file still sets any of them)."""
    tiny = (model or (REAL_MODEL if cuda else TINY)) == TINY
    return {
        "output_dir": "runs/trainer",  # checkpoints (--save_steps with --save_strategy steps), log.jsonl
        "max_steps": 200,
        "report_to": "none",
        "learning_rate": 1e-5 if tiny else 1e-6,
        "use_cpu": not cuda,
        "bf16": cuda,  # autocast on GPU; the CPU runs float32
        "num_generations": 8 if cuda else 4,
        "per_device_train_batch_size": 32 if cuda else 8,
        "max_completion_length": 256 if cuda else 64,  # tokens per model turn
        "max_tool_calling_iterations": 3,  # executed guesses per rollout
        "gradient_checkpointing": False,  # TRL's default trades compute for memory; small models need none
        "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS),
        # Explicit: None would ask the server's /v1/models without our bearer token.
        "token_budget": 0,
        "save_strategy": "no",
        "disable_tqdm": True,  # our Progress callback replaces it
    }


def parse_args(argv: list[str] | None = None) -> tuple[DeltaSyncArguments, AsyncGRPOConfig]:
    """TRL's example-script convention: TrlParser over our arguments and TRL's own AsyncGRPOConfig, so every
    TRL flag works unchanged; `--config run.yaml` sets any of them (flags win)."""
    # A first pass finds --model (on the command line or in the file): the defaults depend on it.
    (ours, _) = TrlParser((DeltaSyncArguments,), add_help=False).parse_args_and_config(
        argv, return_remaining_strings=True
    )
    parser = TrlParser(
        (DeltaSyncArguments, AsyncGRPOConfig),
        prog="python -m trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of flags (snake_case keys; `env:` sets variables)")
    parser.set_defaults(**project_defaults(ours.model, torch.cuda.is_available()))
    # the file's values replace these defaults; the rest is the namespace of --config, which TrlParser read
    ours, args, *_ = parser.parse_args_and_config(argv)
    ours.check()
    ours.model = ours.model or (REAL_MODEL if torch.cuda.is_available() else TINY)
    return ours, args


class GracefulStop:
    """First Ctrl-C/SIGTERM: stop after the current step. Second: KeyboardInterrupt, deferred past publish."""

    def __init__(self) -> None:
        self.requested = False
        self._critical = 0
        self._deferred = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self.requested:
            self.requested = True
            log.warning("stopping after this step (again to abort now)")
        elif self._critical:
            self._deferred = True  # a half-copied state must never reach the publisher
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if self._deferred and not self._critical:
                self._deferred = False
                raise KeyboardInterrupt


class StopAtStepEnd(TrainerCallback):
    """Ends training after the step in progress once a stop was requested, on every process at once."""

    def __init__(self, stop: GracefulStop, trainer_ref: dict):
        self.stop, self.trainer_ref = stop, trainer_ref

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer_ref["trainer"].accelerator
        flag = torch.tensor(int(self.stop.requested), device=accelerator.device)
        if int(accelerator.reduce(flag, reduction="sum").item()):  # one rank's Ctrl-C stops them all
            control.should_training_stop = True


class Progress(TrainerCallback):
    """Progress bar (or one log line per step): published step, reward, share of bf16 elements changed and
    payload of the newest published step, upload lag (steps handed over but not yet in the head) and the
    staleness of the trained rollouts (replica lag as the inference Space's weight versions show it).
    Also appends every log record to <output_dir>/log.jsonl."""

    def __init__(self, output_dir: str, progress: bool, transfer: BucketWeightTransfer):
        self.progress, self.transfer = progress, transfer
        self.bar = None
        self.log_path = Path(output_dir) / "log.jsonl"

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, desc="training", unit="step", dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = logs or {}
        with self.log_path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, "time": time.time(), **logs}) + "\n")
        fields = {"step": self.transfer.last_step}
        if logs.get("reward") is not None:
            fields["reward"] = f"{logs['reward']:.3f}"
        publisher = self.transfer.publisher
        head = publisher.head if publisher else None
        if head is not None:
            newest = head.entry(head.step, "delta") or head.entry(head.step, "anchor")
            numel = sum(math.prod(s) for s in self.transfer.shapes.values())
            if newest.kind == "delta" and numel:
                fields["changed"] = f"{newest.changed / numel:.2%}"  # of the bf16 elements
            fields["payload"] = format_bytes(newest.bytes)
            fields["lag"] = publisher.last_step - head.step  # handed over, not uploaded yet
        if logs.get("sample/staleness_mean") is not None:
            fields["stale"] = f"{logs['sample/staleness_mean']:.1f}"
        if self.bar is not None:
            self.bar.n = state.global_step
            self.bar.set_postfix(fields, refresh=True)
        elif "loss" in logs or "reward" in logs:
            log.info("step %s", " ".join(f"{k}={v}" for k, v in fields.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def resolve_model(name: str) -> str:
    """A local folder or Hub id for `name`; builds (once) the tiny model for TINY."""
    if name != TINY:
        return name
    from trainer.tiny_model import default_model_dir, ensure_tiny_model

    return str(ensure_tiny_model(default_model_dir()))


def pinned_revision(model: str, args: AsyncGRPOConfig) -> str | None:
    """For a Hub model: its commit at the revision TRL would load (`--model_init_kwargs '{"revision": ...}'`,
    default the main branch), which TRL then loads, so that the run's step 0 can name it by reference
    (deltasync.sync.base). None for a local folder, or (said in one line) a model that cannot be named."""
    if model == TINY or Path(model).exists():
        return None
    from deltasync.errors import AnchorError, TransientStorageError
    from deltasync.sync.base import resolve

    kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}
    try:
        commit = resolve(model, kwargs.get("revision")).revision
    except (AnchorError, TransientStorageError) as e:
        log.warning("the first step goes out as an anchor: %s", e)
        return None
    args.model_init_kwargs = {**kwargs, "revision": commit}
    return commit


def continue_from_head(model: torch.nn.Module, root: str, adapter: bool, trust: Trust | None = None) -> None:
    """Load the newest published weights (with `adapter`, the adapter) into `model` if the sync root holds a
    run; `trust`: only from a head those keys signed (SyncError, one line, for another: a bucket writer's
    weights are never trained on and signed)."""
    from deltasync.storage import open_storage
    from deltasync.sync.protocol import HEAD_PATH
    from deltasync.sync.subscriber import Subscriber, TensorsApplier

    storage = open_storage(root)
    try:
        storage.read_bytes(HEAD_PATH)
    except FileNotFoundError:
        return
    live = adapter_tensors(model) if adapter else ((n, p.data) for n, p in model.named_parameters())
    Subscriber(storage, TensorsApplier(dict(live)), trust=trust).sync()


def model_without_weights(path: str, revision: str | None = None) -> torch.nn.Module:
    """The model at `path` built on the meta device: its parameters' names and shapes, no weights loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, revision=revision))


def build_trainer(
    ours: DeltaSyncArguments,
    args: AsyncGRPOConfig,
    stop: GracefulStop,
    model_path: str,
    model_id: str,
    revision: str | None = None,
):
    """The AsyncGRPOTrainer for `args`, wired to the sync root, the inference replicas and the Wordle Space
    (which preflight has checked); `revision`: the Hub model's commit (pinned_revision)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trainer.task import REWARDS, dataset_rows
    from wordle_env.client import WordleEnv

    apply_cpu_shims("cpu" if args.use_cpu or not torch.cuda.is_available() else "cuda")
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=revision)
    args.vllm_server_base_url = ours.inference_url[0]
    max_ahead = rollouts_ahead(args, ours.rollouts_ahead)
    transfer = BucketWeightTransfer(
        ours.sync_root,
        model_id=model_id,
        config=ours.publisher_config(),
        guard=stop.guard,
        lora_name=LORA_NAME if ours.lora_r else None,
        measure_merged=ours.measure_merged,
        model_revision=revision,
    )
    trainer_ref: dict = {"trainer": None}
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=REWARDS[ours.reward],
        args=args,
        train_dataset=Dataset.from_dict(dataset_rows(ours.dataset_size, args.seed)),
        processing_class=tokenizer,
        environment_factory=partial(WordleEnv, base_url=ours.env_url.rstrip("/")),
        weight_transfer=transfer,
        peft_config=ours.lora(),
        callbacks=[StopAtStepEnd(stop, trainer_ref), Progress(args.output_dir, ours.progress, transfer)],
    )
    trainer_ref["trainer"] = trainer
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    # Only the main process touches the sync root (TRL calls the transfer there alone too). Under DDP the
    # other ranks get the resumed weights when the model is wrapped, which broadcasts rank 0's.
    if trainer.accelerator.is_main_process:
        # the publisher logs the step it continues at
        continue_from_head(trainer.model, ours.sync_root, adapter=bool(ours.lora_r), trust=ours.own_keys())
    # the rollout worker's sampling seeds follow TRL's --seed: with the seeded games, runs are reproducible
    # up to the timing of the asynchronous pipeline (which weights answer which request)
    stamp_rollouts(
        trainer,
        transfer,
        replica_urls=ours.inference_url,
        model_name=ours.served_model_name,
        max_ahead=max_ahead,
        seed=args.seed,
        mask_truncated=ours.mask_truncated_completions,
        quit_early=quit_early,  # a turn that gives up the game is never reinforced
    )
    return trainer, transfer


def run_config(ours: DeltaSyncArguments, args: AsyncGRPOConfig) -> dict[str, Any]:
    """Both argument sets as JSON (TRL's `to_dict` masks its token fields; ours hold no secrets)."""
    return {"deltasync": asdict(ours), "trl": args.to_dict()}


def write_summary(
    ours: DeltaSyncArguments,
    args: AsyncGRPOConfig,
    trainer,
    transfer: BucketWeightTransfer,
    wall_s: float,
    error: str | None,
):
    """<output_dir>/summary.json: the published steps, the trainer's own bf16 fingerprint, timings."""
    head = transfer.publisher.head if transfer.publisher else None
    summary = {
        "config": run_config(ours, args),
        "optimizer_steps": trainer.state.global_step,
        "num_processes": trainer.accelerator.num_processes,
        "writer_pid": os.getpid(),  # the main process: the only one that publishes
        "first_step": transfer.first_step,
        "last_step": transfer.last_step,
        "head_step": head.step if head else None,
        "head_fingerprint": head.fingerprint if head else None,
        # recomputed from the trainer's weights, independently of the publisher's running fingerprint
        "fingerprint": format_fingerprint(transfer.fingerprint_now()) if transfer.sent else None,
        "blocked_s": transfer.blocked_s,
        "wall_s": wall_s,
        "stopped_early": error is None and trainer.state.global_step < args.max_steps,
        "error": error,
    }
    path = Path(args.output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ours, args = parse_args(argv)
    # Our own lines (deltasync.*: one per published step; trainer.*) at INFO, other libraries' warnings only.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("deltasync", "trainer"):
        logging.getLogger(name).setLevel(logging.INFO)
    model_path = resolve_model(ours.model)
    model_id = ours.model if ours.model != TINY else model_path
    revision = pinned_revision(model_path, args)
    # Preflight before the model loads or anything is written: a bad URL costs seconds and leaves no trace.
    # Only the main process checks (it alone publishes); torchrun and accelerate set RANK.
    if int(os.environ.get("RANK", "0")) == 0:
        served = ours.served_model_name or model_id
        lora, model = ours.lora(), model_without_weights(model_path, revision)
        if lora is not None:  # the adapter's tensors: PEFT builds them on the meta device too
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        schema = schema_of(model, adapter=lora is not None)
        check_or_exit(
            ours.sync_root,
            schema,
            served,
            ours.inference_url,
            ours.env_url,
            lora_rank=ours.lora_r,
            quantization=ours.quantization,
        )
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = GracefulStop()
    stop.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    trainer, transfer = build_trainer(ours, args, stop, model_path, model_id, revision)
    # as the trainer runs it; no secrets in it: tokens come from the environment, and TRL masks its own
    log.info("config %s", json.dumps(run_config(ours, args)))
    start, error = time.perf_counter(), None
    try:
        trainer.train()
    except KeyboardInterrupt:
        error = "interrupted"
        log.warning("aborted: every step handed to the publisher was published")
    except Exception as e:
        error = failure_line(e)
        trace = Path(args.output_dir) / "traceback.txt"
        trace.write_text("".join(traceback.format_exception(e)))
    finally:
        if trainer.accelerator.is_main_process:
            transfer.destroy()  # idempotent: TRL's own finally already closed it on a clean stop
            summary = write_summary(ours, args, trainer, transfer, time.perf_counter() - start, error)
            log.info(
                "published steps %s..%s to %s (head %s)",
                summary["first_step"],
                summary["last_step"],
                ours.sync_root,
                summary["head_fingerprint"],
            )
    if error is None:
        return 0
    if error == "interrupted":
        return 130
    print(f"training stopped: {error} (traceback in {trace})", file=sys.stderr, flush=True)
    return 1


def failure_line(e: BaseException) -> str:
    """One line naming the root cause: the innermost exception of the chain (a failed rollout worker's is its
    child's error, type and message)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return redact(text.splitlines()[0] if text else type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())

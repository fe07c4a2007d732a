"""What applying a step costs the inference server, and what it costs generation.

    python -m bench.apply                  # Qwen3-0.6B-shaped random model on this machine's vLLM
    python -m bench.apply --preset tiny    # the tests' tiny Qwen3 (a quick check of the bench itself)
    python -m bench.apply --tp 2           # tensor parallel: one rank per core (the whole machine's cores)
    python -m bench.apply --quantization fp8_per_channel --paths direct   # a quantized replica (apply only)

The server path exactly (spaces/inference/app.py): one AsyncLLM with the deltasync weight-transfer backend,
placed as the tests place it (`trainer.processes.placement()`: vLLM's worker on its own cores, this process
on the others), and the follower's EngineApplier writing synthetic steps through the engine client's
weight-update methods. Two tables:

1. Apply, per density and write path, while --apply-streams request streams (default 2) keep generating:
   "stage", the update that has the workers read the compact patch file, decode and check it against the
   weights they hold and plan the writes, outside the pause (each worker is busy with it between two forward
   steps: its calls wait for the step under way to end); "update", the engine's
   update and finish calls inside the pause (the writes and the RPC round trips); "paused", the whole window
   generation was paused (from the engine's pause acknowledgement to its resume acknowledgement); "floor",
   measured in the same run as the worker writes (generation paused, on the server's cores): a plain indexed
   copy of the same values into same-size bf16 tensors. Each step is read back in the worker and checked
   against the expected fingerprint. Medians over --repeat steps. With --quantization, vLLM serves the
   recipe (quantizing the anchor at load) and each step is a quantized root's two files, as its publisher
   writes them (deltasync.quant.root): the bf16 patch of the tensors the recipe leaves alone and the
   quantized delta of the rest; the read-back is of codes, scales and the bf16 rest; "floor" stays the plain
   bf16 copy of the step's values.
2. Throughput: --streams concurrent long generations while a step of --step-density lands every --every
   seconds, with KV_ON_UPDATE=keep, with recompute, and with no updates, in --rounds windows of --seconds
   each, the three taking turns. Generated tokens per
   second (tokens recomputed after a preemption are not counted), and vLLM's preemption count. Not with
   --quantization.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench import load_space_app
from deltasync.codec.changes import TensorChanges
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.patch import Patch, encode, fingerprint_after, read_entries, read_info
from deltasync.quant.recipe import RECIPES
from deltasync.quant.root import QuantizedRoot
from deltasync.sync.anchor import write_anchor
from deltasync.vllm import compat
from deltasync.vllm.follower import AsyncEngine, EngineApplier
from trainer.processes import Placement, placement
from trainer.tiny_model import build_tiny_model

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16)
QWEN3_06B |= dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def qwen3_06b_shaped(folder: Path) -> Path:
    """Random N(0, 0.02) bf16 weights in Qwen3-0.6B's shapes, written without materialising a torch model."""
    config = Qwen3Config(**QWEN3_06B, max_position_embeddings=4096, architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Qwen3ForCausalLM(config).named_parameters()}
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    save_file(weights, folder / "model.safetensors")
    return folder


def random_changes(state: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, TensorChanges]:
    """`density` of each tensor's elements, at random sorted positions, moved by about 1%: those whose bf16
    value moves (a patch never carries a value unchanged, and the compact codec fails on a tensor of none)."""
    g = torch.Generator().manual_seed(seed)
    changes = {}
    for name, t in state.items():
        k = max(1, round(density * t.numel()))
        idx = torch.randint(t.numel(), (k,), generator=g).unique()
        old = t.view(-1)[idx]
        new = (old.float() * (1 + 0.01 * torch.randn(idx.numel(), generator=g))).bfloat16()
        moved = new != old
        if moved.any():
            changes[name] = TensorChanges(idx[moved], new[moved])
    return changes


class After(Mapping[str, torch.Tensor]):
    """`state` with `changes` applied, each tensor copied when read: the quantized root's publisher reads
    only the tensors it quantizes, so the embedding (a quarter of Qwen3-0.6B) is never copied."""

    def __init__(self, state: dict[str, torch.Tensor], changes: dict[str, TensorChanges]) -> None:
        self.state, self.changes = state, changes

    def __getitem__(self, name: str) -> torch.Tensor:
        t, ch = self.state[name], self.changes.get(name)
        if ch is None:
            return t
        t = t.clone()
        t.view(-1)[ch.indices] = ch.values
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


class Steps:
    """Each step's files as a root publishes them and the fingerprints the replica goes from and to: a bf16
    patch, or with `quantization` a quantized root's two files (its publisher's deltasync.quant.root)."""

    def __init__(self, state: dict[str, torch.Tensor], quantization: str | None) -> None:
        self.bf16 = state_fingerprint(state)  # of the bf16 state the trainer holds
        self.quant = (
            QuantizedRoot(quantization, {n: t.shape for n, t in state.items()}) if quantization else None
        )
        if self.quant:
            self.quant.commit(self.quant.start(state))

    @property
    def fingerprint(self) -> int:
        """What the replica holds: on a quantized root, its codes', scales' and bf16 rest's fingerprint."""
        return self.quant.held.fingerprint if self.quant and self.quant.held else self.bf16

    def next(self, state: dict[str, torch.Tensor], changes: dict[str, TensorChanges], step: int):
        """(files, base, fingerprint) of `step`, `changes` to `state` (which the caller then writes)."""
        base, after = self.fingerprint, fingerprint_after(self.bf16, state, changes)
        numel = sum(t.numel() for t in state.values())
        patch = Patch(step, step - 1, numel, self.bf16, after, changes)
        self.bf16 = after
        if self.quant is None:
            return [encode(patch, state)], base, after
        rest, quantized, held = self.quant.delta(patch, state, After(state, changes), "compact", None)
        self.quant.commit(held)
        return [rest, quantized], base, held.fingerprint


def indexed_copy_s(state: dict[str, torch.Tensor], changes: dict[str, TensorChanges]) -> float:
    """The floor: the same values written at the same positions into same-size bf16 tensors (`state`)."""
    start = time.perf_counter()
    for name, ch in changes.items():
        state[name].view(-1).index_put_((ch.indices,), ch.values)
    return time.perf_counter() - start


async def generate(engine, stream: int, max_tokens: int, tokens: list[int], stop: asyncio.Event) -> None:
    """Back-to-back requests of `max_tokens` tokens; adds each token to `tokens[stream]` as it comes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    i = 0
    while not stop.is_set():
        prompt = TokensPrompt(prompt_token_ids=[5 + stream, 6, 7, 8])
        seen = 0
        async for out in engine.generate(prompt, params, request_id=f"bench-{stream}-{i}"):
            n = len(out.outputs[0].token_ids)
            tokens[stream] += n - seen
            seen = n
        assert out.finished and seen == max_tokens
        i += 1


async def floor_s(engine, cpus, state, changes) -> float:
    """The floor, measured as the worker writes: generation paused, on the server's cores."""
    await engine.pause_generation(mode="keep", clear_cache=False)
    os.sched_setaffinity(0, cpus.server)
    try:
        return indexed_copy_s(state, changes)
    finally:
        cpus.pin_self()
        await engine.resume_generation()


async def apply_table(engine, applier, cpus, state, steps, densities, paths, repeat) -> list[dict]:
    numel = sum(t.numel() for t in state.values())
    rows, step = [], 0
    for density in densities:
        for path in paths:
            if path != applier.write:
                await asyncio.to_thread(applier.use_write, path)
            samples = []
            for _ in range(repeat):
                step += 1
                changes = random_changes(state, density, step)
                parts, base, fp = steps.next(state, changes, step)
                changed = sum(len(c) for c in changes.values())
                await asyncio.to_thread(applier.patch_bytes, parts, step, base, fp)
                floor = await floor_s(engine, cpus, state, changes)  # writes the changes into `state`
                readback = await asyncio.to_thread(applier.fingerprint)
                assert readback == fp, f"readback after step {step}"
                w = applier.last_write
                assert w["write"] == path, w
                samples.append(
                    {
                        "changed": changed,
                        "share": changed / numel,
                        "patch MB": sum(map(len, parts)) / 1e6,
                        "stage ms": 1e3 * w["stage_s"],
                        "update ms": 1e3 * w["update_s"],
                        "paused ms": 1e3 * w["pause_s"],
                        "floor ms": 1e3 * floor,
                    }
                )
            medians = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            medians["update / floor"] = medians["update ms"] / medians["floor ms"]
            rows.append({"density": f"{100 * density:g}%", "write path": path, **medians})
    return rows


async def throughput_window(engine, applier, a, policy: str, pool: list, totals: dict) -> None:
    """Fresh long generations for a.seconds, a step landing every a.every seconds unless policy is "none";
    adds tokens, seconds, updates, preemptions and per-update costs to `totals`."""
    applier.kv_on_update = "keep" if policy == "none" else policy
    stop, tokens = asyncio.Event(), [0] * a.streams
    streams = [
        asyncio.create_task(generate(engine, s, a.long_tokens, tokens, stop)) for s in range(a.streams)
    ]
    await asyncio.sleep(a.every)  # every stream past its prefill
    preempted, counted, updates = totals["preemptions_fn"](), sum(tokens), 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < a.seconds:
        next_at = a.seconds if policy == "none" else min(a.every * (updates + 1), a.seconds)
        await asyncio.sleep(max(0.0, next_at - elapsed))
        if policy != "none" and time.perf_counter() - start < a.seconds:
            totals["step"] += 1
            data, base, fp = pool[(totals["step"] - 10_001) % len(pool)]  # in order: step, undo, ...
            data = renumbered(data, totals["step"])
            await asyncio.to_thread(applier.patch_bytes, [data], totals["step"], base, fp)
            totals[policy]["costs"].append((applier.last_write["update_s"], applier.last_write["pause_s"]))
            updates += 1
    row = totals[policy]
    row["seconds"] += time.perf_counter() - start
    row["tokens"] += sum(tokens) - counted
    row["updates"] += updates
    row["preemptions"] += totals["preemptions_fn"]() - preempted
    stop.set()
    for task in streams:
        task.cancel()  # aborts the request in flight
    await asyncio.gather(*streams, return_exceptions=True)


def renumbered(data: bytes, step: int) -> bytes:
    """Patch `data` as step `step` (its changes as they are)."""
    meta = read_info(data).metadata | {"step": str(step), "base_step": str(step - 1)}
    return save(read_entries(data), metadata=meta)


async def throughput_table(engine, applier, state, a, preemptions) -> list[dict]:
    """The policies take turns in a.rounds rounds of windows, so that a change in the machine's load (other
    jobs on these cores) falls on all of them alike."""
    # Steps cycle through a few change sets made beforehand: this process's CPU goes to the serving path
    # (patch file, stage, pause), as the subscriber's would, not to making random changes.
    # Each step is a fresh change set of the same state, written and then undone: (patch, base, fingerprint)
    # for the step and its undo alternate, so the engine's fingerprint checks hold throughout.
    here, numel = state_fingerprint(state), sum(t.numel() for t in state.values())
    pool = []
    for i in range(2):
        changes = random_changes(state, a.step_density, 10_000 + i)
        undo = {n: TensorChanges(ch.indices, state[n].view(-1)[ch.indices]) for n, ch in changes.items()}
        moved = fingerprint_after(here, state, changes)
        after = {n: t.clone() for n, t in state.items()}
        for n, ch in changes.items():
            after[n].view(-1)[ch.indices] = ch.values
        pool += [(encode(Patch(0, 0, numel, here, moved, changes), state), here, moved)]
        pool += [(encode(Patch(0, 0, numel, moved, here, undo), after), moved, here)]
    await asyncio.to_thread(applier.use_write, "direct")  # the default path (the apply table leaves the last)
    policies = ("none", "keep", "recompute")
    totals = {p: {"seconds": 0.0, "tokens": 0, "updates": 0, "preemptions": 0, "costs": []} for p in policies}
    totals |= {"step": 10_000, "preemptions_fn": preemptions}
    for _ in range(a.rounds):
        for policy in policies:
            await throughput_window(engine, applier, a, policy, pool, totals)
    rows = []
    for policy in policies:
        t, costs = totals[policy], totals[policy]["costs"]
        rows.append(
            {
                "KV_ON_UPDATE": "(no updates)" if policy == "none" else policy,
                "updates": t["updates"],
                "tokens": t["tokens"],
                "tokens/s": t["tokens"] / t["seconds"],
                "vs no updates": t["tokens"]
                / t["seconds"]
                / (totals["none"]["tokens"] / totals["none"]["seconds"]),
                "preemptions": t["preemptions"],
                "update ms": 1e3 * statistics.median(c[0] for c in costs) if costs else 0.0,
                "paused ms": 1e3 * statistics.median(c[1] for c in costs) if costs else 0.0,
            }
        )
    return rows


async def server_bench(model: Path, a, cpus) -> tuple[list[dict], list[dict]]:
    from safetensors.torch import load_file

    inference = load_space_app("inference")
    cfg = inference.Settings(
        model=str(model),
        sync_root="-",  # unused: the bench drives the applier itself
        replica_id="bench",
        engine_args=shlex.join(["--skip-tokenizer-init", *a.engine_args.split()]),
    )
    args = inference.server_args(cfg, quantization=a.quantization)
    async with compat.engine_client(args) as engine:
        cpus.pin_self()  # the engine's processes stay on the server's cores, as the app's do
        client = AsyncEngine(engine, asyncio.get_running_loop())
        applier = await asyncio.to_thread(EngineApplier, client, "-", quantization=a.quantization)
        state = {n: t.clone() for n, t in load_file(model / "model.safetensors").items()}  # paged in
        steps = Steps(state, a.quantization)
        with tempfile.TemporaryDirectory(prefix="deltasync-bench-") as tmp:
            files = [f for f, _ in write_anchor(state, 0, steps.bf16, Path(tmp))]
            await asyncio.to_thread(applier.load_files, files, 0, steps.fingerprint)
        assert await asyncio.to_thread(applier.fingerprint) == steps.fingerprint, "anchor readback"
        stop, tokens = asyncio.Event(), [0] * a.apply_streams
        streams = [asyncio.create_task(generate(engine, s, 32, tokens, stop)) for s in range(a.apply_streams)]
        await asyncio.sleep(2.0)
        apply_rows = await apply_table(engine, applier, cpus, state, steps, a.densities, a.paths, a.repeat)
        stop.set()
        await asyncio.gather(*streams)
        print(f"requests completed across the updates: {sum(tokens) // 32}, none failed", file=sys.stderr)
        if a.quantization:  # its steps would need a quantized pool of steps and undos: apply only
            return apply_rows, []
        throughput_rows = await throughput_table(engine, applier, state, a, inference.preemptions)
    return apply_rows, throughput_rows


def print_table(rows: list[dict]) -> None:
    def cell(key, value):
        if key == "share":
            return f"{value:.2%}"
        if key in ("changed", "tokens"):
            return f"{value:,.0f}"
        if " / " in key or key == "vs no updates":
            return f"{value:.2f}x"
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(cell(k, v) for k, v in row.items()) + " |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--densities", type=float, nargs="+", default=[1e-3, 1e-2, 3e-2])
    ap.add_argument("--paths", nargs="+", choices=["direct", "vllm"], default=["direct", "vllm"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--apply-streams", type=int, default=2, help="generations running while steps apply")
    ap.add_argument("--streams", type=int, default=4, help="concurrent long generations (throughput)")
    ap.add_argument("--long-tokens", type=int, default=1024, help="tokens per long generation")
    ap.add_argument("--seconds", type=float, default=15.0, help="throughput window (one policy, one round)")
    ap.add_argument("--rounds", type=int, default=3, help="windows per KV policy, taking turns")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between steps (throughput)")
    ap.add_argument("--step-density", type=float, default=1e-2, help="share changed per step (throughput)")
    ap.add_argument("--engine-args", default="--enforce-eager --max-model-len 2048 --max-num-seqs 8")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one core each (default 1)")
    ap.add_argument("--quantization", choices=list(RECIPES), help="serve a quantized root (the apply table)")
    a = ap.parse_args()
    if a.quantization and "vllm" in a.paths:
        ap.error("--quantization writes in place only (vLLM's loader requantizes): --paths direct")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: the engine's processes too
    cpus = placement()
    os.environ |= cpus.server_env()  # vLLM's worker binds its threads to the server's cores
    if a.tp > 1:  # one rank per core, on the first a.tp cores; this process shares them
        cores = tuple(sorted(os.sched_getaffinity(0))[: a.tp])
        cpus = Placement(cores, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
        a.engine_args += f" --tensor-parallel-size {a.tp}"
    torch.set_num_threads(len(cpus.server))  # the floor with as many threads as the worker has
    with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
        model = build_tiny_model(Path(tmp)) if a.preset == "tiny" else qwen3_06b_shaped(Path(tmp))
        os.sched_setaffinity(0, cpus.server)  # the engine's processes start here
        apply_rows, throughput_rows = asyncio.run(server_bench(model, a, cpus))
    for rows in (apply_rows, throughput_rows):
        if rows:
            print_table(rows)


if __name__ == "__main__":
    main()

"""What applying a step costs the inference server: generation paused and in-place write time vs changes.

    python -m bench.apply                  # Qwen3-0.6B-shaped random model on this machine's vLLM
    python -m bench.apply --preset tiny    # the tests' tiny Qwen3
    python -m bench.apply --kernel         # the apply kernel alone, in torch, on CPU and CUDA when present

The server path exactly (spaces/inference/app.py): one AsyncLLM with the Space's worker extension, and its
VllmApplier writing synthetic steps of growing density while two request streams keep generating. Per step:
the raw patch file is written while serving, then pause(keep) -> RPC in-place write -> reset prefix cache ->
weight version -> resume. Each step is read back from the worker and checked against the expected fingerprint.
Columns: changed elements (share of the model), raw patch bytes, file write (outside the pause), the worker's
in-place write, the pause window (generation paused), all medians over --repeat steps.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench import load_space_app
from deltasync.codec.changes import TensorChanges, apply_changes
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.patch import fingerprint_after
from deltasync.vllm.applier import VllmApplier
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
    """`density` of each tensor's elements, at random sorted positions, moved by about 1%."""
    g = torch.Generator().manual_seed(seed)
    changes = {}
    for name, t in state.items():
        k = max(1, round(density * t.numel()))
        idx = torch.randint(t.numel(), (k,), generator=g).unique()
        old = t.view(-1)[idx].float()
        new = old * (1 + 0.01 * torch.randn(idx.numel(), generator=g))
        changes[name] = TensorChanges(idx, new.bfloat16())
    return changes


async def generate_forever(engine, stop: asyncio.Event, stream: int, counts: list[int]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0)
    i = 0
    while not stop.is_set():
        prompt = TokensPrompt(prompt_token_ids=[5 + stream, 6, 7, 8])
        async for out in engine.generate(prompt, params, request_id=f"bench-{stream}-{i}"):
            final = out
        assert final.finished and len(final.outputs[0].token_ids) == 32
        counts[stream] += 1
        i += 1


async def server_bench(model: Path, densities: list[float], repeat: int, vllm_args: list[str]) -> list[dict]:
    from safetensors.torch import load_file

    inference = load_space_app("inference")
    cfg = inference.Settings(
        model=str(model),
        sync_root="-",  # unused: the bench drives the applier itself
        replica_id="bench",
        vllm_args=shlex.join(["--skip-tokenizer-init", *vllm_args]),
    )
    args = inference.engine_args(cfg)
    rows = []
    async with inference.build_async_engine_client(args) as engine:
        layout = (await engine.collective_rpc("deltasync_layout"))[0]
        applier = VllmApplier(engine, asyncio.get_running_loop(), layout)
        state = load_file(model / "model.safetensors")
        numel = sum(t.numel() for t in state.values())
        fp = state_fingerprint(state)
        stop, counts = asyncio.Event(), [0, 0]
        streams = [asyncio.create_task(generate_forever(engine, stop, s, counts)) for s in range(2)]
        await asyncio.sleep(2.0)
        start = time.perf_counter()
        await asyncio.to_thread(applier.load, state, 0)
        anchor = _timings(numel, numel, 2 * numel, time.perf_counter() - start, applier)
        rows.append({"step": "anchor (full load)", "write path": "vLLM dense", **anchor})
        assert await asyncio.to_thread(applier.fingerprint) == fp, "anchor readback"
        step = 0
        for density in densities:
            for applier.direct in (False, True):
                samples = []
                for _ in range(repeat):
                    step += 1
                    changes = random_changes(state, density, step)
                    fp = fingerprint_after(fp, state, changes)
                    apply_changes(state, changes)
                    changed = sum(len(c) for c in changes.values())
                    start = time.perf_counter()
                    await asyncio.to_thread(applier.patch, changes, step)
                    total_s = time.perf_counter() - start
                    assert await asyncio.to_thread(applier.fingerprint) == fp, f"readback after step {step}"
                    samples.append(_timings(changed, numel, 6 * changed, total_s, applier))
                path = "direct" if applier.direct else "vLLM sparse"
                medians = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
                rows.append({"step": f"{100 * density:g}%", "write path": path, **medians})
        stop.set()
        await asyncio.gather(*streams)
        print(f"requests completed across the updates: {sum(counts)}, none failed", file=sys.stderr)
    return rows


def _timings(changed: int, numel: int, raw_bytes: int, total_s: float, applier) -> dict:
    write = applier.last_write
    return {
        "changed": changed,
        "share": changed / numel,
        "raw MB": raw_bytes / 1e6,
        "file ms": 1e3 * (total_s - write["pause_s"]),
        "write ms": 1e3 * write["write_s"],
        "paused ms": 1e3 * write["pause_s"],
    }


def kernel_bench(densities: list[float], repeat: int) -> list[dict]:
    """vLLM's sparse write (NaN-filled staging tensor, index_copy_, torch.where into the parameter) against a
    plain index_put_, on one Qwen3-0.6B embedding-sized and one MLP-sized tensor."""
    rows = []
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    for device in devices:
        for shape in [(151936, 1024), (3072, 1024)]:
            param = (torch.randn(shape, device=device) * 0.02).bfloat16()
            for density in densities:
                k = max(1, round(density * param.numel()))
                idx = torch.randint(param.numel(), (k,), device=device).unique()
                values = torch.randn(idx.numel(), device=device).bfloat16()
                vllm_s = _timed(_nan_masked_write, (param, idx, values), repeat, device)
                put_s = _timed(_index_put, (param, idx, values), repeat, device)
                rows.append(
                    {"device": device, "tensor": "x".join(map(str, shape)), "share": density}
                    | {"changed": idx.numel(), "vLLM sparse ms": 1e3 * vllm_s, "index_put ms": 1e3 * put_s}
                )
    return rows


def _nan_masked_write(param: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    staging = torch.full((param.numel(),), float("nan"), dtype=param.dtype, device=param.device)
    staging.index_copy_(0, idx, values)
    torch.where(torch.isnan(staging.view(param.shape)), param, staging.view(param.shape), out=param)


def _index_put(param: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    param.view(-1).index_put_((idx,), values)


def _timed(fn, args: tuple, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat + 1):  # the first call warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def print_table(rows: list[dict]) -> None:
    def cell(key, value):
        if key == "share":
            return f"{value:.2%}"
        if key == "changed":
            return f"{value:,.0f}"
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(cell(k, v) for k, v in row.items()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    ap.add_argument("--densities", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2, 3e-2, 1e-1])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kernel", action="store_true", help="time only the torch apply kernel")
    ap.add_argument("--vllm-args", default="--enforce-eager --max-model-len 512 --max-num-seqs 4")
    a = ap.parse_args()
    if a.kernel:
        print_table(kernel_bench(a.densities, a.repeat))
        return
    with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
        model = build_tiny_model(Path(tmp)) if a.preset == "tiny" else qwen3_06b_shaped(Path(tmp))
        print_table(asyncio.run(server_bench(model, a.densities, a.repeat, a.vllm_args.split())))


if __name__ == "__main__":
    main()

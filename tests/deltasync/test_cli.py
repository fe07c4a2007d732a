"""`deltasync diff / apply / inspect` through the installed console script."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "deltasync.cli", *map(str, args)], capture_output=True, text=True
    )


def test_diff_apply_inspect(tmp_path):
    torch.manual_seed(0)
    old = {"model.w": torch.randn(64, 64), "model.b": torch.randn(64)}  # fp32: cast to bf16 by the CLI
    new = {n: t + 0.02 * torch.randn_like(t) * (torch.rand_like(t) < 0.2) for n, t in old.items()}
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    for encoding in ("compact", "raw"):
        patch = tmp_path / f"{encoding}.safetensors"
        out = tmp_path / f"out-{encoding}.safetensors"
        r = run(
            "diff",
            tmp_path / "old.safetensors",
            tmp_path / "new.safetensors",
            "-o",
            patch,
            "--encoding",
            encoding,
        )
        assert r.returncode == 0, r.stderr
        r = run("apply", tmp_path / "old.safetensors", patch, "-o", out)
        assert r.returncode == 0, r.stderr
        result = load_file(out)
        for name, t in new.items():
            assert result[name].dtype == torch.bfloat16
            assert torch.equal(result[name].view(torch.int16), t.bfloat16().view(torch.int16))
        info = json.loads(run("inspect", patch).stdout)
        changed = sum(int((t.bfloat16() != old[n].bfloat16()).sum()) for n, t in new.items())
        assert info["encoding"] == encoding and info["changed"] == changed and info["step"] == 1
        assert info["payload_bytes"] == patch.stat().st_size
        assert sum(t["changed"] for t in info["tensors"].values()) == changed


def test_errors_are_one_line_and_nonzero(tmp_path):
    save_file({"w": torch.zeros(4)}, tmp_path / "a.safetensors")
    save_file({"v": torch.zeros(4)}, tmp_path / "b.safetensors")
    r = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", tmp_path / "p")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "tensor sets differ" in r.stderr
    (tmp_path / "junk").write_bytes(b"\x00" * 3)
    r = run("inspect", tmp_path / "junk")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not a safetensors file" in r.stderr
    r = run("apply", tmp_path / "a.safetensors", tmp_path / "missing", "-o", tmp_path / "o")
    assert r.returncode == 1 and "No such file" in r.stderr


def test_push_ls_pull_gc(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "model"  # an HF model folder with two shards
    folder.mkdir()
    states = []
    root = tmp_path / "root"
    for step in range(4):
        state = {"a.weight": torch.randn(32, 64), "b.weight": torch.randn(16, 64)}
        if step:
            state = {n: t.clone() for n, t in states[-1].items()}
            state["a.weight"][step] += 1.0
        states.append(state)
        save_file({"a.weight": state["a.weight"]}, folder / "model-00001-of-00002.safetensors")
        save_file({"b.weight": state["b.weight"]}, folder / "model-00002-of-00002.safetensors")
        r = run("push", root, folder, "--anchor-every", "3")
        assert r.returncode == 0, r.stderr
        pushed = json.loads(r.stdout)
        kinds = {0: ["anchor"], 3: ["delta", "anchor"]}.get(step, ["delta"])  # anchor every 3 steps
        assert (pushed["step"], pushed["kinds"]) == (step, kinds)
    rows = [json.loads(line) for line in run("ls", root).stdout.splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [
        (0, "anchor"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (3, "anchor"),
    ]
    assert rows[1]["changed"] == 64 and all(r["bytes"] > 0 and r["published_at"] > 0 for r in rows)
    for step in (1, None):
        args = ["--step", step] if step is not None else []
        r = run("pull", root, "-o", tmp_path / f"out-{step}", *args)
        assert r.returncode == 0, r.stderr
        pulled = load_file(tmp_path / f"out-{step}" / "model.safetensors")
        expected = states[1 if step is not None else 3]
        for name, t in expected.items():
            assert torch.equal(pulled[name].view(torch.int16), t.bfloat16().view(torch.int16))
    (root / "anchors" / "step-00000002").mkdir()
    (root / "anchors" / "step-00000002" / "model.safetensors").write_bytes(b"orphan")
    (root / "deltas" / "notes.txt").write_bytes(b"not ours")  # only files named as a publisher names them
    deleted = ["anchors/step-00000002/model.safetensors"]
    assert json.loads(run("gc", root).stdout) == {"head": 3, "deleted": deleted}
    assert (root / "deltas" / "notes.txt").exists()
    r = run("pull", root, "-o", tmp_path / "o", "--step", "9")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "step 9 is not retained" in r.stderr

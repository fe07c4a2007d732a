"""`deltasync diff / apply / inspect` through the installed console script."""

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *map(str, args)], capture_output=True, text=True
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

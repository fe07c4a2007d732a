"""The README's commands beside a vLLM server, run as printed: the server command and `deltasync follow` (its
follow section), fed by `deltasync push` (its command-line section). This test's substitutions only: the tiny
Qwen3 for Qwen/Qwen3-0.6B, a local folder for the bucket, a free port for vLLM's 8000 (`--port`), and
`--enforce-eager --max-model-len 512` for a 2-core CPU. The server's weights, read back from vLLM's memory,
end bitwise equal to the last checkpoint pushed."""

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync import telemetry
from tests.deltasync.vllm.test_follow import CPUS, Server
from tests.helpers import REPO, assert_bitwise_equal, perturb, wait_for
from trainer.processes import free_port, start_process, stop_process, wait_healthy
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
MODEL, BUCKET, PORT = "Qwen/Qwen3-0.6B", "hf://buckets/NS/deltasync", "http://127.0.0.1:8000"


def section_commands(heading: str) -> list[list[str]]:
    """The commands of the first shell block under README's `heading`, continuation lines joined, comments
    dropped, each split as the shell would."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    block = FENCE.search(section).group(2).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def substituted(argv: list[str], table: dict[str, str]) -> str:
    return shlex.join(table.get(arg, arg) for arg in argv)


def test_readme_follow_commands_as_printed(tmp_path):
    install, serve, follow = section_commands("Beside your own vLLM server")
    push = next(c for c in section_commands("The command line") if c[:2] == ["deltasync", "push"])
    # The install line is what `make setup` ran here: the backend's entry point is registered.
    assert install == ["pip", "install", "-e", "."]
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "deltasync" in [p.name for p in plugins]

    model = build_tiny_model(tmp_path / "tiny-qwen3")
    root, port = tmp_path / "root", free_port()
    url = f"http://127.0.0.1:{port}"
    table = {MODEL: str(model), BUCKET: str(root), PORT: url, "ROOT": str(root)}
    extra = f" --port {port} --enforce-eager --max-model-len 512"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server_env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", **CPUS.server_env()}
    server_log, follower_log = tmp_path / "server.log", tmp_path / "follower.log"
    server = start_process(
        ["bash", "-c", substituted(serve, table) + extra], server_log, server_env, cpus=CPUS.server
    )
    follower = None
    try:
        wait_healthy(server, f"{url}/health", server_log, 600)
        follower = start_process(
            ["bash", "-c", substituted(follow, table)], follower_log, env, cpus=CPUS.others
        )
        state = {n: t.to(torch.bfloat16) for n, t in load_file(model / "model.safetensors").items()}
        for step in range(3):
            checkpoint = tmp_path / f"checkpoint-{step}"
            checkpoint.mkdir()
            save_file(state, checkpoint / "model.safetensors")
            command = substituted(push, {**table, "checkpoint/": str(checkpoint)})
            subprocess.run(["bash", "-c", command], env=env, cwd=tmp_path, check=True, capture_output=True)
            state = perturb(state, seed=step, big=False)
        last = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
        record = root / telemetry.REPLICAS_DIR / "my-replica" / "step-00000002.json"
        wait_for(record.exists, f"the follower's record of step 2; log {follower_log}", 180)
        assert telemetry.from_json(telemetry.ReplicaRecord, record.read_bytes()).verified
        vllm = Server(url, server_log, tmp_path)
        vllm.wait_version("2")
        assert_bitwise_equal(vllm.readback(), last)
    finally:
        if follower is not None:
            stop_process(follower, grace_s=30)
        stop_process(server, grace_s=30)

"""The README's commands, run as printed in a shell where `.venv` is activated (its bin first on PATH), as
the README's first quickstart says after `make setup`.

- Quickstart 1's order (setup, activation, demo) and its dashboard line, serving a root's run.
- Quickstart 2's dry-run deploy, with `NS` exported as it says.
- The vLLM server command and `deltasync follow` (the follow section), fed by `deltasync push` (the
  command-line section). Substitutions only: the tiny Qwen3 for Qwen/Qwen3-0.6B, a local folder for the
  bucket, a free port for vLLM's 8000 (`--port`), and `--enforce-eager` (no compilation: start-up time on 2
  cores, not memory). The server's weights, read back from vLLM's memory, end bitwise equal to the last
  checkpoint pushed.
"""

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from deltasync import telemetry
from deltasync.sync.publisher import Publisher
from tests.deltasync.vllm.test_follow import CPUS, Server
from tests.helpers import REPO, assert_bitwise_equal, perturb, wait_for
from trainer.processes import free_port, serving, start_process, stop_process, wait_healthy
from trainer.tiny_model import build_tiny_model

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
MODEL, BUCKET, PORT = "Qwen/Qwen3-0.6B", "hf://buckets/NS/deltasync", "http://127.0.0.1:8000"


def section_commands(heading: str) -> list[list[str]]:
    """The commands of the first shell block under README's `heading`, continuation lines joined, comments
    dropped, each split as the shell would."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    block = FENCE.search(section).group(2).replace("\\\n", " ")
    return [argv for line in block.splitlines() if (argv := shlex.split(line, comments=True))]


def activated() -> dict[str, str]:
    """The environment after `source .venv/bin/activate`: the venv's bin first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def substituted(argv: list[str], table: dict[str, str]) -> str:
    return shlex.join(table.get(arg, arg) for arg in argv)


def test_quickstarts_start_free_and_activate_once():
    """The free local path comes first; the venv is activated right after it is built, once for the whole
    README; `NS` says what it is where it first appears."""
    text = (REPO / "README.md").read_text()
    first = [shlex.join(argv) for argv in section_commands("Quickstart 1")]
    assert first[:3] == ["make setup", "source .venv/bin/activate", "make demo"]
    mention = re.search(r"\bNS\b", text)
    assert "your Hub namespace" in text[mention.start() : text.index("\n\n", mention.start())]


def test_readme_dashboard_line_as_printed(tmp_path):
    """Quickstart 1's dashboard line, from the repository root, serving the run of a root (the demo's root
    substituted; PORT: a free one)."""
    (line,) = [c for c in section_commands("Quickstart 1") if "spaces/dashboard/app.py" in c]
    model = build_tiny_model(tmp_path / "tiny-qwen3")
    with Publisher(str(tmp_path / "root"), model=str(model)) as publisher:
        publisher.publish(load_file(model / "model.safetensors"), 0)
    command = substituted(line, {"SYNC_ROOT=demo-run/sync-root": f"SYNC_ROOT={tmp_path / 'root'}"})
    argv, log = ["bash", "-c", command], tmp_path / "dashboard.log"
    with serving(argv, log, activated(), timeout=120, health="/api/summary", cwd=REPO, grace_s=10) as url:
        assert requests.get(f"{url}/api/summary", timeout=10).json()["steps"] == 1


def test_readme_dry_run_deploy_as_printed(tmp_path):
    """Quickstart 2's `export NS=...` and dry-run deploy, from the repository root (bundles/: in tmp_path)."""
    lines = section_commands("Quickstart 2")
    export = next(c for c in lines if c[0] == "export" and c[1].startswith("NS="))
    deploy = next(c for c in lines if "--dry-run" in c)
    out = tmp_path / "bundles"
    script = f"{shlex.join(export)}\n{substituted(deploy, {'bundles/': str(out)})}".replace("'$NS'", "$NS")
    subprocess.run(["bash", "-c", script], cwd=REPO, env=activated(), check=True, capture_output=True)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["namespace"] == export[1].removeprefix("NS=")
    assert sorted(p.name for p in out.iterdir()) == ["dashboard", "env", "inference", "plan.json"]


@pytest.mark.slow  # starts vLLM
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
    extra = f" --port {port} --enforce-eager"
    env = activated()
    server_env = {**env, **CPUS.server_env()}
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

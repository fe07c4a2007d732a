"""The inference Space's process lifecycle on CPU: `python spaces/inference/app.py` starts with no vLLM tuning
variables (its KV cache sized from free memory and the model), and SIGTERM or SIGINT sent to it alone stops
the whole server, vLLM's engine processes included."""

import os
import signal
import sys
import time

import psutil
import pytest
import requests
from safetensors.torch import load_file

from deltasync.sync.publisher import Publisher
from trainer.processes import free_port, start_process, stop_process, wait_healthy
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

APP = os.path.join(os.path.dirname(__file__), "..", "..", "spaces", "inference", "app.py")
STOP_WITHIN_S = 10


def group(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (zombies have ended: only their exit status is left)."""
    members = []
    for p in psutil.process_iter(["name", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(f"{p.pid} {p.info['name']}")
        except ProcessLookupError:
            pass
    return members


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_starts_without_tuning_variables_and_a_signal_stops_the_whole_server(sig, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "tiny-qwen3")
    with Publisher(str(tmp_path / "root"), model=str(model)) as publisher:
        publisher.publish(load_file(model / "model.safetensors"), 0)
    for name in [n for n in os.environ if n.startswith("VLLM_")]:  # a caller's VLLM_CPU_KVCACHE_SPACE too
        monkeypatch.delenv(name)
    port = free_port()
    env = {**os.environ, "MODEL": str(model), "SYNC_ROOT": str(tmp_path / "root"), "HOST": "127.0.0.1"}
    env |= {"PORT": str(port), "ENGINE_ARGS": "--enforce-eager"}
    log = tmp_path / "server.log"
    proc = start_process([sys.executable, APP], log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, f"{url}/health", log, timeout=600)
        deadline = time.monotonic() + 60
        while requests.get(f"{url}/weights", timeout=10).json()["step"] != 0:  # serving the run's weights
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert len(group(proc.pid)) >= 3, group(proc.pid)  # the app, vLLM's engine core and its worker
        os.kill(proc.pid, sig)  # to the app alone, as docker stop or kill sends it
        deadline = time.monotonic() + STOP_WITHIN_S
        while group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
            proc.poll()  # reap the app itself
        assert not group(proc.pid), f"left running {STOP_WITHIN_S} s after {sig.name}: {group(proc.pid)}"
    finally:
        stop_process(proc, grace_s=1)

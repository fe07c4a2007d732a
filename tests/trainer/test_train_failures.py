"""A failure before training (preflight) ends `python -m trainer` with one line before the model loads; a
failure after training started ends it with one line naming it, once the last step handed to the publisher is
whole in the sync root (there the environment answers preflight's health check but refuses games: no
WebSocket route, so TRL's rollout worker fails after the cold sync published step 0)."""

import subprocess
import sys

from fastapi import FastAPI

from deltasync.sync.subscriber import Subscriber
from tests.deltasync.trl.test_preflight import fake_replica
from tests.helpers import REPO
from trainer.processes import free_port, serving_in_thread
from trainer.tiny_model import default_model_dir, ensure_tiny_model


def test_env_gone_after_start_ends_with_one_line_and_a_whole_step(tmp_path):
    model = ensure_tiny_model(default_model_dir())
    root = tmp_path / "root"
    env = FastAPI()
    env.get("/health")(lambda: {"status": "healthy"})
    with serving_in_thread(env) as env_url, fake_replica(served=str(model)) as url:
        argv = [sys.executable, "-m", "trainer", "--sync_root", str(root), "--inference_url", url]
        argv += ["--env_url", env_url, "--model", str(model), "--output_dir", str(tmp_path / "out")]
        argv += ["--no_progress", "--max_steps", "3"]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("training stopped: ") and env_url.removeprefix("http://") in last, last
    reader = Subscriber(root)
    reader.sync()
    assert reader.step == 0 and reader.last_error is None  # the cold sync's step, whole and verified


def test_dead_urls_fail_preflight_before_the_model_loads_and_write_nothing(tmp_path):
    model = ensure_tiny_model(default_model_dir())
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = [sys.executable, "-m", "trainer", "--sync_root", str(tmp_path / "root"), "--inference_url", dead]
    argv += ["--env_url", dead, "--model", str(model), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) <= 5, proc.stderr
    assert lines[-1].startswith("preflight failed: ") and dead in lines[-1], lines
    assert list(tmp_path.iterdir()) == []  # no sync root, no output dir

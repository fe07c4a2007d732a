"""`python -m trainer --lora_r R`: TRL trains a PEFT LoRA and each step publishes the adapter alone, to a root
whose run.json says it is a LoRA root (the environment here refuses games, so the run ends after the cold
sync published step 0, as in test_train_failures); preflight refuses a root that holds a full-weight run in
one line that says so and what to do."""

import subprocess
import sys

from fastapi import FastAPI

from deltasync.sync.protocol import read_run
from deltasync.sync.subscriber import Subscriber
from tests.deltasync.trl.test_preflight import fake_replica
from tests.helpers import REPO
from trainer.processes import serving_in_thread
from trainer.tiny_model import default_model_dir, ensure_tiny_model


def run_trainer(root, out, *flags: str) -> subprocess.CompletedProcess:
    model = ensure_tiny_model(default_model_dir())
    env = FastAPI()
    env.get("/health")(lambda: {"status": "healthy"})
    with serving_in_thread(env) as env_url, fake_replica(served=str(model)) as url:
        argv = [sys.executable, "-m", "trainer", "--sync_root", str(root), "--inference_url", url]
        argv += ["--env_url", env_url, "--model", str(model), "--output_dir", str(out)]
        argv += ["--no_progress", "--max_steps", "3", *flags]
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def test_lora_run_publishes_the_adapter_and_preflight_refuses_a_full_weight_root(tmp_path):
    root = tmp_path / "root"
    proc = run_trainer(root, tmp_path / "out", "--lora_r", "8")
    assert proc.returncode == 1 and "training stopped: " in proc.stderr, proc.stderr[-3000:]
    lora = read_run(Subscriber(root).storage).lora
    assert lora["name"] == "policy" and lora["adapter_config"]["r"] == 8
    assert lora["adapter_config"]["lora_alpha"] == 16  # 2 x r by default
    reader = Subscriber(root)
    reader.sync()
    assert reader.step == 0 and reader.state and all(".lora_" in name for name in reader.state)

    full = tmp_path / "full"
    run_trainer(full, tmp_path / "out-full")  # a full-weight run on another root
    proc = run_trainer(full, tmp_path / "out-again", "--lora_r", "8")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("preflight failed: "), last
    assert "holds a full-weight run" in last and "without --lora_r" in last, last

"""`python -m trainer` with two vLLM replicas following one sync root: each rollout goes to the replica with
fewer rollouts in flight, and both apply and verify every step, ending bitwise equal to the trainer; the
dashboard shows a row for each.

Both replicas share vLLM's cores (the trainer and the env keep theirs)."""

import sys

import pytest

from deltasync import telemetry
from tests.helpers import REPO
from tests.trainer.test_train_e2e import (
    PLACEMENT,
    RESUME_STEPS,
    records,
    replica,
    run_trainer,
    wait_for_replica,
)
from trainer.processes import serving
from trainer.tiny_model import default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM twice


def test_trainer_with_two_replicas(tmp_path, dashboard):
    model = ensure_tiny_model(default_model_dir())
    root = tmp_path / "root"
    names = ("replica-a", "replica-b")
    env_app = [sys.executable, str(REPO / "spaces" / "env" / "app.py")]
    with (
        serving(env_app, tmp_path / "env.log", {}, 60, cpus=PLACEMENT.others) as env_url,
        replica(tmp_path, root, model, names[0]) as first,
        replica(tmp_path, root, model, names[1]) as second,
    ):
        summary = run_trainer(root, f"{first},{second}", env_url, model, tmp_path / "run", RESUME_STEPS)
        statuses = [wait_for_replica(url, RESUME_STEPS) for url in (first, second)]
    assert (summary["first_step"], summary["last_step"], summary["error"]) == (0, RESUME_STEPS, None)
    for status in statuses:  # read back from each vLLM's memory: bitwise the trainer's bf16 weights
        assert status["readback"]["fingerprint"] == summary["fingerprint"] == summary["head_fingerprint"]
    for name in names:
        applied = records(root, telemetry.ReplicaRecord, f"{telemetry.REPLICAS_DIR}/{name}")
        assert sorted(applied) == list(range(RESUME_STEPS + 1))
        assert all(r.verified and r.error is None for r in applied.values())
    board = dashboard.Board(str(root))
    board.refresh()
    rows = dashboard.replicas_frame(board.summary())
    assert sorted(rows["replica"]) == list(names) and set(rows["step"]) == {RESUME_STEPS}, rows
    assert set(rows["status"]) == {"ok"}, rows

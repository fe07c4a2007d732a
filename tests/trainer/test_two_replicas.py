"""`python -m trainer` with two vLLM replicas following one sync root: each rollout goes to the replica with
fewer rollouts in flight, and both apply and verify every step, ending bitwise equal to the trainer; the
dashboard shows a row for each.

The root is a folder, or a bucket on the fake Hub (tests/fakehub.py, served from this process): then the
trainer and each replica are processes of their own, each with huggingface_hub's real client and its own
Xet session, the replicas follow the bucket's change feed, and all of them share the user's token and its
free-tier quota, without one answer of 429.

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


@pytest.mark.parametrize("where", ["folder", "hub"])
def test_trainer_with_two_replicas(tmp_path, dashboard, request, where):
    model = ensure_tiny_model(default_model_dir())
    if where == "hub":
        hub = request.getfixturevalue("fake_hub")  # HF_ENDPOINT and HF_TOKEN, inherited by the processes
        root = "hf://buckets/user/sync/run"
    else:
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
    if where == "hub":
        assert hub.limited() == 0, hub.windows
        assert [p for p in hub.requests if p.endswith("/events")], "the replicas did not follow the feed"

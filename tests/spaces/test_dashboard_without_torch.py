"""The dashboard Space's image has no torch, numba or Triton (its Dockerfile installs the deltasync wheel
without its dependencies): its app and the telemetry reader import and read a root with the three blocked."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from deltasync.sync.publisher import Publisher

REPO = Path(__file__).parents[2]
BLOCKED = ("torch", "numba", "triton")

# Runs before anything else in the child: a finder that refuses the three, wherever an import comes from.
READ_WITHOUT_TORCH = """
import json, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the dashboard Space has no {name}")
        return None

sys.meta_path.insert(0, Blocked())

from bench import load_space_app
from deltasync.storage import open_storage
from deltasync.telemetry.reader import TelemetryReader

app = load_space_app("dashboard")
board = app.Board(ROOT)
board.refresh()
summary = board.summary()
reader = TelemetryReader(open_storage(ROOT))
reader.poll()
figures = app.build_figures(board.series(), board.lora)
print(json.dumps({
    "board": [summary["error"], summary["steps"], summary["latest_step"], board._run_read],
    "reader": reader.summary(0.0)["steps"],
    "plots": len(figures),
    "headline": 'data-key="steps"' in app.headline_html(summary),
    "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
}))
"""


def test_dashboard_reads_a_root_with_torch_numba_and_triton_blocked(tmp_path):
    params = {"model.w": torch.zeros(64, 32), "model.b": torch.zeros(32)}
    with Publisher(tmp_path, model="tiny") as publisher:
        for step in range(3):
            params["model.w"][step] += 1.0
            publisher.publish(params, step=step, info={"reward_mean": step / 10})
            publisher.flush()  # each step its own upload: none folded into the next
    code = f"BLOCKED = {BLOCKED!r}\nROOT = {str(tmp_path)!r}\n" + READ_WITHOUT_TORCH
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stderr[-3000:]
    read = json.loads(child.stdout.strip().splitlines()[-1])
    assert read == {
        "board": [None, 3, 2, True],  # run.json read too
        "reader": 3,
        "plots": 8,
        "headline": True,
        "loaded": [],
    }

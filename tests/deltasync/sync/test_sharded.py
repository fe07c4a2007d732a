"""ShardedPublisher under `torch.distributed.run --nproc_per_node 2`: a small FSDP2 training loop on the CPU
(gloo), each rank diffing and encoding its own shards into its own part of each step; a subscriber of the
root ends bitwise equal to the full model.

TRL's async trainer does not run FSDP on the CPU, so the loop is bench/fsdp.py's own. Its rank 0 writes the
final full weights (gathered once, for this check) beside the fingerprint the ranks' parts added up to.
"""

import math
import subprocess
import sys

from safetensors import safe_open
from safetensors.torch import load_file

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import read_info
from deltasync.sync.protocol import delta_paths, parse_data_path, read_head
from deltasync.sync.subscriber import Subscriber
from tests.helpers import REPO, assert_bitwise_equal

STEPS = 3


def test_fsdp_ranks_publish_their_own_parts_a_subscriber_follows_bitwise(tmp_path):
    root, final = tmp_path / "root", tmp_path / "final.safetensors"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += ["-m", "bench.fsdp", "--steps", str(STEPS), "--layers", "2", "--width", "256", "--lr", "1e-3"]
    argv += ["--root", str(root), "--check", str(final)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stdout and "rank 1 of 2" in proc.stdout

    expected = load_file(final)
    with safe_open(final, "pt") as f:
        parts_fingerprint = f.metadata()["fingerprint"]
    reader = Subscriber(root)
    reader.sync()
    head = read_head(reader.storage)
    assert reader.step == head.step == STEPS
    assert_bitwise_equal(reader.state, expected)
    assert head.fingerprint == parts_fingerprint == format_fingerprint(state_fingerprint(expected))

    # Each delta step is 2 part files, part r holding exactly rank r's rows of every tensor it changes.
    deltas = head.deltas
    assert deltas, "no step went out as a delta"
    for entry in deltas:
        tag = parse_data_path(entry.files[0])[2]
        assert entry.files == tuple(delta_paths(entry.step, 2, tag)), entry.files
        for rank, path in enumerate(entry.files):
            info = read_info((root / path).read_bytes())
            assert info.tensors and set(info.windows) == set(info.tensors)
            for name, window in info.windows.items():
                numel = math.prod(expected[name].shape)
                assert window == (rank * numel // 2, numel // 2), (path, name, window)

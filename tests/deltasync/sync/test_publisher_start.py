"""What a publisher does before its first publish(), so that the run's first steps cost what later ones do."""

import subprocess
import sys

import torch

from deltasync.sync.publisher import Publisher

# In a fresh process: any earlier test in this one may have run the codec's loops already.
CHECK = """
import sys, tempfile
import numba
from deltasync.sync.publisher import Publisher
with tempfile.TemporaryDirectory() as root:
    publisher = Publisher(root)
    publisher.flush()
    from deltasync.codec import kernels
    loaded = sorted(n for n, f in vars(kernels).items() if isinstance(f, numba.core.dispatcher.Dispatcher)
                    and f.signatures)
    publisher.close()
print(" ".join(loaded))
"""


def test_the_codecs_loops_are_loaded_before_the_first_publish():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    # the fingerprint, change detection, the compact coder and rANS, the packed anchor: the first steps' work
    first_steps = {"fingerprint_rows", "changed_positions", "encode_symbols", "ans_encode", "split_exponents"}
    assert first_steps <= loaded, out


def test_the_second_buffer_is_touched_beside_training(tmp_path):
    state = {"w": torch.randn(64, 32), "b": torch.ones(32)}
    with Publisher(tmp_path) as publisher:
        publisher.publish(state)
        publisher.flush()
        spare = publisher._spare  # the buffer step 1 copies into: allocated by the worker, not by publish()
        assert spare is not None and {n: t.shape for n, t in spare.items()} == {"w": (64, 32), "b": (32,)}
        publisher.publish({n: t + 1 for n, t in state.items()})
        publisher.flush()
        assert publisher._published is spare

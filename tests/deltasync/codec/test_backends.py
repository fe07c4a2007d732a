"""Every backend of the codec (deltasync.codec.backend) makes the pinned patch bytes of test_golden and
decodes, writes and fingerprints them back: the accelerator backend runs torch's ops on host tensors here,
the CUDA one runs on a GPU where there is one, else in Triton's interpreter."""

import pytest
import torch

from deltasync.codec import backend, bf16
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import apply_changes
from deltasync.codec.fingerprint import state_fingerprint
from tests.deltasync.codec.test_golden import GOLDEN, digest, states
from tests.helpers import DEVICE

CASES = [("compact", 0.002, 1000), ("compact", 0.02, 1000), ("raw", 0.02, 1 << 22)]  # few: interpreted


@pytest.fixture(params=["cpu", "accelerator", "cuda"])
def device(request, monkeypatch) -> str:
    """Where the test's tensors go, each backend in turn taking the tensors there."""
    if request.param == "accelerator":
        monkeypatch.setitem(backend.BACKENDS, "cpu", backend.BACKENDS["accelerator"])
    if request.param != "cuda":
        return "cpu"
    request.getfixturevalue("gpu")  # its kernels compiled, or interpreted
    if DEVICE == "cpu":
        monkeypatch.setattr(bf16, "on_gpu", lambda t: True)  # the kernels on host tensors
    return DEVICE


@pytest.mark.parametrize(("encoding", "density", "chunk"), CASES)
def test_every_backend_makes_and_reads_the_pinned_bytes(device, encoding, density, chunk):
    old, new = ({n: t.to(device) for n, t in s.items()} for s in states(density))
    patch = patches.make_patch(old, new, 7, 6, threads=2)
    data = patches.encode(patch, old, encoding, threads=2, chunk=chunk)
    assert digest(data) == GOLDEN[encoding, density, chunk]
    info, entries = patches.read_info(data), patches.read_entries(data)
    tables = patches.read_tables(info) if encoding == "compact" else None
    changes = {name: patches.decode_entry(info, entries, name, old[name], tables) for name in info.tensors}
    target = {n: t.clone() for n, t in old.items()}
    apply_changes(target, changes, threads=2)
    assert all(torch.equal(bits(target[n]), bits(new[n])) for n in new)
    assert state_fingerprint(target) == patch.fingerprint

"""Packed anchors: lossless, verified like plain ones, chosen per sync root; plain anchors still read."""

import errno
import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltasync.codec import packed
from deltasync.codec.bf16 import bits
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.storage import LocalStorage
from deltasync.sync import anchor
from deltasync.sync.anchor import AnchorError, anchor_encoding, read_anchor, write_anchor
from deltasync.sync.protocol import RunInfo, read_head, read_run
from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.subscriber import Subscriber, SyncError
from tests.helpers import bitwise_equal, run_steps

ALL_PATTERNS = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def weights(seed: int = 0, shape=(300, 200)) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()


@pytest.mark.parametrize("chunk", [1, 1000, packed.CHUNK])
def test_every_bf16_pattern_survives_packing_on_any_thread_count(chunk):
    t = ALL_PATTERNS.view(256, 256)
    data = packed.pack(t, threads=1, chunk=chunk)
    assert packed.pack(t, threads=2, chunk=chunk) == data
    for threads in (1, 2):
        assert torch.equal(bits(packed.unpack(data, [256, 256], threads, chunk)), bits(t))


def test_empty_and_one_element_tensors_pack():
    for t in (torch.zeros(0, 3, dtype=torch.bfloat16), torch.ones(1, dtype=torch.bfloat16)):
        assert torch.equal(bits(packed.unpack(packed.pack(t), list(t.shape))), bits(t))


def test_a_chunk_size_that_would_list_billions_of_chunks_is_refused_first():
    with pytest.raises(packed.PackedError, match="chunks of 1"):
        packed.unpack(b"\0" * 100, [1 << 40], chunk=1)


def test_packing_realistic_weights_saves_a_third():
    t = weights()
    assert len(packed.pack(t, chunk=7000)) <= 0.70 * t.nbytes


@pytest.mark.parametrize(
    "corrupt",
    [lambda d: d[:-1], lambda d: d + b"\0", lambda d: d[:8] + bytes([d[8] ^ 0xFF]) + d[9:], lambda d: b""],
    ids=["truncated", "longer", "frame byte", "empty"],
)
def test_corrupt_packed_tensors_are_refused(corrupt):
    t = weights(shape=(50, 40))
    with pytest.raises(packed.PackedError):
        packed.unpack(corrupt(packed.pack(t, chunk=1000)), [50, 40], chunk=1000)


def test_auto_packs_anchors_for_remote_roots_only():
    assert anchor_encoding("auto", local=True) == "plain"
    assert anchor_encoding("auto", local=False) == "packed"
    assert anchor_encoding("plain", local=False) == "plain"
    with pytest.raises(ValueError, match="anchor encoding"):
        anchor_encoding("zip", local=False)


def anchor_setup(tmp_path, encoding: str):
    state = {"a": weights(1), "b": weights(2, (7,)), "c": weights(3, (64, 64))}
    run = RunInfo(model="m", schema={n: list(t.shape) for n, t in state.items()})
    fp = f"{state_fingerprint(state):016x}"
    files = write_anchor(state, 5, int(fp, 16), tmp_path, shard_bytes=50_000, encoding=encoding)
    return state, run, fp, [local for local, _ in files]


@pytest.mark.parametrize("encoding", ["plain", "packed"])
def test_anchor_roundtrip_is_bitwise_in_shards(tmp_path, encoding):
    state, run, fp, files = anchor_setup(tmp_path, encoding)
    assert len(files) > 1
    assert bitwise_equal(read_anchor(files, run, 5, fp, threads=2), state)
    with safe_open(files[0], "pt") as f:
        assert (f.metadata().get("encoding") or "plain") == encoding


def test_a_packed_anchor_that_does_not_verify_is_refused(tmp_path):
    state, run, fp, files = anchor_setup(tmp_path, "packed")
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 1  # the last sign | mantissa byte: unpacks fine, to the wrong weights
    files[0].write_bytes(bytes(data))
    with pytest.raises(AnchorError, match="fingerprint"):
        read_anchor(files, run, 5, fp)


def test_a_packed_anchor_with_bad_metadata_is_refused(tmp_path):
    state, run, fp, files = anchor_setup(tmp_path, "packed")
    header = files[0].read_bytes()
    bad = header.replace(b'"encoding":"packed"', b'"encoding":"zipped"')
    assert bad != header
    files[0].write_bytes(bad)
    with pytest.raises(AnchorError, match="encoding"):
        read_anchor(files, run, 5, fp)


def test_subscriber_and_pull_read_packed_anchors(tmp_path):
    root = tmp_path / "root"
    states = run_steps(root, 3, PublisherConfig(anchor_every=2, anchor_encoding="packed"))
    anchors = sorted(root.glob("anchors/*/*.safetensors"))
    assert anchors
    with safe_open(anchors[0], "pt") as f:
        assert f.metadata()["encoding"] == "packed"
    sub = Subscriber(LocalStorage(root))
    sub.sync()
    assert bitwise_equal(sub.state, states[-1])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deltasync.cli", "pull", str(root), "-o", str(out), "--step", "2"]
    subprocess.run(cmd, check=True, capture_output=True)
    pulled = load_file(out / "model.safetensors")  # plain bf16, whatever the anchors are
    assert all(t.dtype == torch.bfloat16 for t in pulled.values())
    assert bitwise_equal(pulled, states[2])


def test_a_local_root_keeps_plain_anchors_that_any_reader_opens(tmp_path):
    root = tmp_path / "root"
    states = run_steps(root, 1)
    (anchor,) = root.glob("anchors/*/*.safetensors")
    with safe_open(anchor, "pt") as f:
        assert "encoding" not in f.metadata()
    assert bitwise_equal(load_file(anchor), states[0])


def rle_frame(size: int, declared: int | None) -> bytes:
    """A zstd frame of RLE blocks (4 bytes per 128 KiB of zeros) that decodes to `size` bytes, with content
    size `declared` in its header (None: none declared)."""
    blocks = []
    for lo in range(0, size, 128 << 10):
        n = min(128 << 10, size - lo)
        last = int(lo + n == size)
        blocks.append((last | 1 << 1 | n << 3).to_bytes(3, "little") + b"\0")  # 1 << 1: an RLE block
    magic = (0xFD2FB528).to_bytes(4, "little")
    if declared is None:  # no content size, not single-segment: a window descriptor (2**27) follows
        return magic + bytes([0, (27 - 10) << 3]) + b"".join(blocks)
    return magic + bytes([0b11100000]) + declared.to_bytes(8, "little") + b"".join(blocks)


def packed_with_frame(frame: bytes, numel: int) -> bytes:
    """A packed tensor of `numel` elements (one chunk) whose exponents are `frame`."""
    return len(frame).to_bytes(8, "little") + frame + bytes(numel)


def test_a_frame_that_expands_far_past_its_chunk_is_refused_before_allocating():
    data = packed_with_frame(rle_frame(256 << 20, 256 << 20), 1000)  # 8 KiB that decode to 256 MiB
    assert len(data) < 10_000
    tracemalloc.start()
    try:
        with pytest.raises(packed.PackedError, match="elements 0..1000"):
            packed.unpack(data, [1000])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "declared", [1 << 40, (1 << 64) - 3, None, 999], ids=["1 TiB", "2**64", "none", "less"]
)
def test_a_frame_declaring_another_size_than_its_chunk_is_refused(declared):
    with pytest.raises(packed.PackedError, match="declares"):
        packed.unpack(packed_with_frame(rle_frame(1000, declared), 1000), [1000])


@pytest.mark.parametrize("shape", [[0, -1], [-1, -1], [2, "2"], [True], "4", [1 << 70]])
def test_shapes_that_are_no_tensor_shape_are_refused(shape):
    with pytest.raises(packed.PackedError):
        packed.unpack(packed.pack(torch.zeros(0, dtype=torch.bfloat16)), shape)


def hostile_anchor(file: Path, name: str, entry: bytes, shape: list) -> None:
    """Rewrite the packed anchor shard `file` with `entry` and its listed `shape` for tensor `name`, padded to
    the shard's size (the head lists it), so that only decoding can tell."""
    size = file.stat().st_size
    with safe_open(file, "pt") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    meta["shapes"] = json.dumps({**json.loads(meta["shapes"]), name: shape})
    tensors[name] = torch.frombuffer(bytearray(entry), dtype=torch.uint8)
    save_file(tensors, file, metadata=meta)
    data = file.read_bytes()
    header = int.from_bytes(data[:8], "little")
    pad = size - len(data)
    assert pad >= 0
    file.write_bytes(
        (header + pad).to_bytes(8, "little") + data[8 : 8 + header] + b" " * pad + data[8 + header :]
    )


HOSTILE = {
    "frame declaring 1 TiB": lambda numel: (packed_with_frame(rle_frame(1 << 20, 1 << 40), numel), None),
    "frame expanding past its chunk": lambda numel: (
        packed_with_frame(rle_frame(64 << 20, 64 << 20), numel),
        None,
    ),
    "shape [0, -1]": lambda numel: (packed.pack(torch.zeros(0, dtype=torch.bfloat16)), [0, -1]),
    "not zstd": lambda numel: (packed_with_frame(b"\x28\xb5\x2f\xfd" + b"\xff" * 64, numel), None),
}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_hostile_packed_anchor_is_refused_for_good_and_the_replica_goes_around_it(tmp_path, hostile):
    root = tmp_path / "root"
    states = run_steps(root, 4, PublisherConfig(anchor_every=2, anchor_encoding="packed"))
    storage = LocalStorage(root)
    head = read_head(storage)
    newest = head.anchors[-1]
    assert [a.step for a in head.anchors] == [0, 2]
    name, shape = next(iter(read_run(storage).schema.items()))
    entry, listed = HOSTILE[hostile](math.prod(shape))
    hostile_anchor(root / newest.files[0], name, entry, listed or shape)
    sub = Subscriber(storage)
    with pytest.raises(SyncError, match=f"refused anchor of step 2: .*{name}"):
        sub.sync()  # the cheapest path starts at the hostile anchor
    assert sub.step is None
    sub.sync()  # refused for good: anchor 0 and the deltas after it
    assert sub.step == 3
    assert bitwise_equal(sub.state, states[3])


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.EMFILE, "Too many open files"), OSError(errno.EIO, "Input/output error"), MemoryError()],
    ids=["EMFILE", "EIO", "MemoryError"],
)
def test_a_local_failure_while_reading_an_anchor_is_no_fault_of_the_anchor(tmp_path, monkeypatch, failure):
    """The replica says it failed here, and loads the same anchor once the failure has passed: a finished run
    writes no newer anchor to wait for."""
    root = tmp_path / "root"
    states = run_steps(root, 1)
    failing = [failure]

    def open_once_failing(*args, **kwargs):
        if failing:
            raise failing.pop()
        return safe_open(*args, **kwargs)

    monkeypatch.setattr(anchor, "safe_open", open_once_failing)
    sub = Subscriber(LocalStorage(root))
    with pytest.raises(SyncError, match="local failure"):
        sub.sync()
    assert sub.step is None and sub.bugs == 0
    sub.sync()
    assert sub.step == 0 and sub.last_error is None
    assert bitwise_equal(sub.state, states[0])


def test_shapes_nested_too_deeply_refuse_a_packed_anchor(tmp_path):
    state, run, fp, files = anchor_setup(tmp_path, "packed")
    with safe_open(files[0], "pt") as f:
        meta, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    save_file(tensors, files[0], metadata=meta | {"shapes": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(AnchorError, match="nested too deeply"):
        read_anchor(files, run, 5, fp)

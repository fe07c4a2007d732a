"""ShardedPublisher under `torch.distributed.run --nproc_per_node 2`: a small FSDP2 training loop on the CPU
(gloo), each rank diffing and encoding its own shards into its own part of each step; a subscriber of the
root ends bitwise equal to the full model.

TRL's async trainer does not run FSDP on the CPU, so the loop is bench/fsdp.py's own. Its rank 0 writes the
final full weights (gathered once, for this check) beside the fingerprint the ranks' parts added up to.
"""

import json
import math
import subprocess
import sys

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import read_info
from deltasync.storage import LocalStorage
from deltasync.sync.gc import collect_garbage
from deltasync.sync.protocol import HEAD_PATH, Head, ManifestError, delta_paths, parse_data_path, read_head
from deltasync.sync.publisher import Publisher, PublisherConfig, StoredDelta
from deltasync.sync.subscriber import Subscriber, SyncError
from tests.helpers import (
    REPO,
    assert_bitwise_equal,
    bf16,
    make_params,
    train_step,
    window_parts,
)

STEPS = 3
SPANS = [(0, 6000), (6000, 1 << 20)]  # two ranks' windows of every tensor (lm.bias lies in the first)


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


def test_a_rank_that_cannot_store_its_part_stops_every_rank(tmp_path):
    """Parts cannot be stored (a file where the deltas folder goes): both ranks' publishers fail at step 1,
    with the cause, instead of one rank waiting for the other forever."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "deltas").write_bytes(b"not a folder")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += ["-m", "bench.fsdp", "--steps", "2", "--layers", "1", "--width", "64", "--root", str(root)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "a part of step 1 was not stored: rank 0" in output, output[-3000:]
    assert "the writer rank failed" in output, output[-3000:]  # rank 1, told by the writer
    assert not (root / "heads" / "latest.json").read_bytes().count(b'"kind": "delta"')


def test_a_rank_that_raises_anywhere_in_publish_stops_every_rank_or_none(tmp_path):
    """One rank raises at each point of publish() (its own checks and copy, the diff, the encoding, the
    part's upload, the writer's anchor rule, publish_stored and head write), at step 2, and the loop carries
    on: afterwards every rank was told the cause, or every retained step pulls back bit-exact equal to the
    model's state at the step it names. After every flush() the head names the step (sharded_faults.py)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += ["-m", "tests.deltasync.sync.sharded_faults", "--root", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith(("OK", "BAD"))]
    assert proc.returncode == 0 and len(verdicts) == 17, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(v.startswith("OK") for v in verdicts), "\n".join(verdicts)
    assert "OK none -1 published" in verdicts and "OK info 1 stopped" in verdicts


def publish_in_parts(publisher: Publisher, steps: int) -> list[dict]:
    """Step 0 published whole, then each step stored as 2 parts under the publisher's tag and published
    with publish_stored (an anchor beside it when one is due), as ShardedPublisher's ranks do; returns the
    bf16 state of every step."""
    params = make_params()
    states = [bf16(params)]
    publisher.publish(params, step=0)
    for step in range(1, steps):
        train_step(params, step, density=0.05)
        states.append(bf16(params))
        parts = window_parts(states[-2], states[-1], SPANS, step=step, base_step=step - 1)
        paths = delta_paths(step, 2, publisher.claim.tag)
        for path, data in zip(paths, parts, strict=True):
            publisher.storage.write_bytes(path, data)
        infos = [read_info(data) for data in parts]
        changed = sum(i.changed for i in infos)
        delta = StoredDelta(tuple(paths), sum(map(len, parts)), changed, infos[-1].fingerprint)
        publisher.flush()
        anchor = params if publisher.anchor_due(step, delta.bytes) else None
        publisher.publish_stored(delta, step, anchor, info={"reward_mean": 0.5})
    publisher.flush()
    return states


def test_steps_stored_in_parts_are_followed_and_collected(tmp_path):
    with Publisher(tmp_path, "tiny", PublisherConfig(anchor_every=4, keep_anchors=1)) as publisher:
        states = publish_in_parts(publisher, 10)
        with pytest.raises(ValueError, match="holds no state"):
            publisher.publish(make_params(), step=10)
        foreign = StoredDelta(tuple(delta_paths(10, 2, "e9-00000000")), 10, 1, 0)
        with pytest.raises(ValueError, match="not where this writer.s delta of step 10 lives"):
            publisher.publish_stored(foreign, 10)
    storage = LocalStorage(tmp_path)
    head = read_head(storage)
    assert [a.step for a in head.anchors] == [8] and [d.step for d in head.deltas] == [9]
    assert all(len(d.files) == 2 for d in head.deltas)
    assert set(storage.list("deltas") + storage.list("anchors")) == head.files()  # GC took the rest
    assert len(storage.list("telemetry/trainer")) == 10
    orphan, in_progress = delta_paths(5, 2, "e0-00000000")[1], delta_paths(10, 2, publisher.claim.tag)[0]
    for path in (orphan, in_progress):
        storage.write_bytes(path, b"parts")
    folder = orphan.rpartition("/")[0]  # emptied: removed with it
    assert collect_garbage(storage) == [orphan, folder]  # an upload after the head is not garbage
    reader = Subscriber(tmp_path)
    assert [a.kind for a in reader.sync()] == ["anchor", "delta"]
    assert_bitwise_equal(reader.state, states[-1])
    assert reader.fingerprint == state_fingerprint(states[-1])


def test_a_step_with_a_bad_part_is_refused_whole(tmp_path):
    with Publisher(tmp_path, "tiny") as publisher:
        states = publish_in_parts(publisher, 3)
    reader = Subscriber(tmp_path)
    reader.sync(1)
    part = read_head(reader.storage).deltas[-1].files[1]
    data = (tmp_path / part).read_bytes()
    promised = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]["fingerprint"]
    wrong = f"{int(promised, 16) ^ 1:016x}"
    (tmp_path / part).write_bytes(data.replace(promised.encode(), wrong.encode()))
    with pytest.raises(SyncError, match="part 2 of 2: fingerprint mismatch"):
        reader.sync()
    assert reader.step == 1
    assert_bitwise_equal(reader.state, states[1])
    assert {f for f, _ in reader._bad} == set(read_head(reader.storage).deltas[-1].files)


@pytest.mark.parametrize("grow", [0, 1])
def test_parts_are_read_within_the_size_the_head_lists(tmp_path, grow):
    """Each part is read at most up to what the entry's total leaves (a part that grew is refused unread);
    parts whose sizes still add up to the total are refused by their content."""
    with Publisher(tmp_path, "tiny") as publisher:
        publish_in_parts(publisher, 3)
    reader = Subscriber(tmp_path)
    reader.sync(1)
    entry = read_head(reader.storage).deltas[-1]
    first, second = (tmp_path / f for f in entry.files)
    if grow:
        first.write_bytes(first.read_bytes() + b"x")
    else:  # the sizes still add up to the total, split differently
        moved = second.read_bytes()[:1]
        first.write_bytes(first.read_bytes() + moved)
        second.write_bytes(second.read_bytes()[1:])
    problem = "more than the" if grow else "corrupt"
    with pytest.raises(SyncError, match=f"refused delta of step 2: .*{problem}"):
        reader.sync()
    assert reader.step == 1


@pytest.mark.parametrize(
    "path, parsed",
    [
        ("deltas/step-00000003-e1-1a2b3c4d/part-00002-of-00002.safetensors", ("delta", 3, "e1-1a2b3c4d", 2)),
        ("deltas/step-00000003/part-00001-of-00002.safetensors", ("delta", 3, "", 2)),
        ("deltas/step-00000003-e1-1a2b3c4d/part-00003-of-00002.safetensors", None),
        ("deltas/step-00000003-e1-1a2b3c4d/part-00000-of-00002.safetensors", None),
        ("deltas/step-00000003-e1-1a2b3c4d/part-00001-of-00001.safetensors", None),  # one part: one file
        ("deltas/step-00000003-e1-1a2b3c4d/part-1-of-2.safetensors", None),
        ("deltas/step-00000003-e1-1a2b3c4d/part-00001-of-00002.safetensors/x", None),
    ],
)
def test_part_names(path, parsed):
    assert parse_data_path(path) == parsed


def test_a_head_lists_every_part_of_a_step_in_order(tmp_path):
    with Publisher(tmp_path, "tiny") as publisher:
        publish_in_parts(publisher, 2)
    raw = json.loads((tmp_path / HEAD_PATH).read_bytes())
    entry = raw["entries"][-1]
    first, second = entry["files"]
    other_tag = second.replace(parse_data_path(second)[2], "e9-00000000")
    for files in ([second, first], [first], [first, first], [first, other_tag], [first, second, second]):
        entry["files"] = files
        with pytest.raises(ManifestError, match="are not where a delta of step 1 lives"):
            Head.from_json(json.dumps(raw).encode())


class Counted(bytes):
    """Bytes that count how often their length is asked for."""

    lengths = 0

    def __len__(self):
        Counted.lengths += 1
        return super().__len__()


def test_a_step_in_many_parts_is_read_in_time_linear_in_its_parts(tmp_path, monkeypatch):
    """The parts' lengths are added up once each, not once per part read (quadratic at thousands of parts),
    counted rather than timed."""
    spans = [(64 * i, 64 * (i + 1)) for i in range(256)]
    params = make_params()
    with Publisher(tmp_path, "tiny") as publisher:
        publisher.publish(params, step=0)
        old = bf16(params)
        train_step(params, 1, density=0.05)
        parts = window_parts(old, bf16(params), spans, step=1, base_step=0)
        paths = delta_paths(1, len(parts), publisher.claim.tag)
        for path, data in zip(paths, parts, strict=True):
            publisher.storage.write_bytes(path, data)
        changed = sum(read_info(data).changed for data in parts)
        fp = read_info(parts[-1]).fingerprint
        publisher.publish_stored(StoredDelta(tuple(paths), sum(map(len, parts)), changed, fp), 1)
    reader = Subscriber(tmp_path)
    reader.sync(0)
    read = reader.storage.read_bytes
    monkeypatch.setattr(reader.storage, "read_bytes", lambda *a, **k: Counted(read(*a, **k)))
    reader.sync()
    assert_bitwise_equal(reader.state, bf16(params))
    assert Counted.lengths < 20 * len(parts), Counted.lengths

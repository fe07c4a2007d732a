"""The patch codec: exact round trips, bit for bit, and refusal of anything it was not made for."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec import fingerprint
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import SchemaError, TensorChanges, apply_changes
from deltasync.errors import PatchError
from tests.helpers import assert_bitwise_equal, bf16_from_bits, random_state, step_state, window_parts

ENCODINGS = patches.ENCODINGS


def roundtrip(old: dict, new: dict, encoding: str) -> tuple[dict, bytes]:
    patch = patches.make_patch(old, new, step=2, base_step=1)
    data = patches.encode(patch, old, encoding)
    decoded = patches.decode(data, old)
    result = {n: t.clone() for n, t in old.items()}
    apply_changes(result, decoded.changes)
    return result, data


shapes_strategy = st.dictionaries(
    st.sampled_from(
        ["model.embed_tokens.weight", "layers.0.mlp.up_proj.weight", "layers.0.norm.weight", "bias"]
    ),
    st.lists(st.integers(1, 70), min_size=1, max_size=2).map(tuple),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_strategy,
    density=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**32 - 1),
    encoding=st.sampled_from(ENCODINGS),
)
def test_roundtrip_is_exact(shapes, density, seed, encoding):
    rng = np.random.default_rng(seed)
    old = random_state(rng, shapes)
    new = step_state(rng, old, density)
    result, data = roundtrip(old, new, encoding)
    assert_bitwise_equal(result, new)
    info = patches.read_info(data)
    assert info.changed == sum(int((bits(old[n]) != bits(new[n])).sum()) for n in old)
    assert info.fingerprint == fingerprint.state_fingerprint(new)


def test_roundtrip_on_a_large_tensor_uses_every_class():
    rng = np.random.default_rng(0)
    old = random_state(rng, {"w": (512, 1024), "b": (1024,)})
    new = step_state(rng, old, 0.01)
    result, data = roundtrip(old, new, "compact")
    assert_bitwise_equal(result, new)
    assert patches.read_info(data).tensors["w"]["mode"] == "compact"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_patches_of_weights_on_their_device_match_the_host(device):
    rng = np.random.default_rng(3)
    old = random_state(rng, {"w": (512, 1024), "b": (1024,), "n": (70,)})
    new = step_state(rng, old, 0.01)
    there = {n: t.to(device) for n, t in old.items()}
    patch = patches.make_patch(there, {n: t.to(device) for n, t in new.items()}, 2, 1)
    assert (
        patch.fingerprint
        == patches.make_patch(old, new, 2, 1).fingerprint
        == fingerprint.state_fingerprint(new)
    )
    for encoding in ENCODINGS:
        decoded = patches.decode(patches.encode(patch, there, encoding), there)
        assert decoded.fingerprint == patch.fingerprint
        result = {n: t.clone() for n, t in there.items()}
        apply_changes(result, decoded.changes)
        assert_bitwise_equal({n: t.cpu() for n, t in result.items()}, new)


def test_every_bf16_bit_pattern_survives():
    all_patterns = np.arange(-(1 << 15), 1 << 15)
    old = {"w": bf16_from_bits(all_patterns, (256, 256))}
    rolled = np.roll(all_patterns, 1)  # NaN payloads, +-inf, -0.0, subnormals all move to new values
    new = {"w": bf16_from_bits(rolled, (256, 256))}
    for encoding in ENCODINGS:
        result, _ = roundtrip(old, new, encoding)
        assert_bitwise_equal(result, new)


def test_negative_zero_and_nan_payloads_count_as_changes():
    old = {"w": torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)}
    new_bits = bits(old["w"]).clone()
    new_bits[0] = -(1 << 15)  # -0.0 == 0.0 as floats, but a different pattern
    new_bits[1] ^= 1  # another NaN payload
    new = {"w": new_bits.view(torch.bfloat16)}
    patch = patches.make_patch(old, new, 1, 0)
    assert patch.changed == 2


def test_empty_patch():
    rng = np.random.default_rng(1)
    old = random_state(rng, {"w": (10, 10)})
    for encoding in ENCODINGS:
        result, data = roundtrip(old, old, encoding)
        assert_bitwise_equal(result, old)
        assert patches.read_info(data).changed == 0


def test_dense_changes_cost_no_more_than_dense_bf16():
    rng = np.random.default_rng(2)
    old = random_state(rng, {"w": (256, 256)})
    new = {"w": bf16_from_bits(rng.integers(-(1 << 15), 1 << 15, size=65536), (256, 256))}
    _, data = roundtrip(old, new, "compact")
    header = patches.read_info(data)
    assert header.tensors["w"]["mode"] == "dense"
    assert len(data) <= 2 * 65536 + 1024  # the dense tensor plus its safetensors header


def test_tensors_that_appear_or_disappear_are_a_schema_error():
    rng = np.random.default_rng(3)
    old = random_state(rng, {"a": (4,), "b": (4,)})
    with pytest.raises(SchemaError, match="differ"):
        patches.make_patch(old, {"a": old["a"]}, 1, 0)
    with pytest.raises(SchemaError, match="differ"):
        patches.make_patch(old, {**old, "c": old["a"]}, 1, 0)
    with pytest.raises(SchemaError, match="shape"):
        patches.make_patch(old, {"a": old["a"], "b": torch.zeros(5, dtype=torch.bfloat16)}, 1, 0)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(4)
    old = random_state(rng, {"layers.0.w": (64, 128), "layers.0.b": (128,)})
    new = step_state(rng, old, 0.05)
    patch = patches.make_patch(old, new, 1, 0)
    return old, new, {enc: patches.encode(patch, old, enc) for enc in ENCODINGS}


def assert_rejected(data: bytes, base: dict, match: str | None = None) -> None:
    before = {n: t.clone() for n, t in base.items()}
    with pytest.raises(patches.PatchError, match=match):
        patches.decode(data, base)
    assert_bitwise_equal(base, before)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_truncated_patch_is_rejected(case, encoding):
    old, _, data = case
    for cut in (0, 7, 8, 100, len(data[encoding]) // 2, len(data[encoding]) - 1):
        assert_rejected(data[encoding][:cut], old)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_corrupt_payload_is_rejected_or_harmless(case, encoding):
    old, new, data = case
    blob = data[encoding]
    header_end = 8 + int.from_bytes(blob[:8], "little")
    rng = np.random.default_rng(5)
    rejected = 0
    for pos in rng.integers(header_end, len(blob), size=40):
        corrupt = bytearray(blob)
        corrupt[pos] ^= 1 << int(rng.integers(8))
        try:
            decoded = patches.decode(bytes(corrupt), old)
        except patches.PatchError:
            rejected += 1
            continue
        result = {n: t.clone() for n, t in old.items()}
        apply_changes(result, decoded.changes)
        assert_bitwise_equal(result, new)  # a flip that decodes must not change the outcome
    assert rejected >= 30


def test_patch_for_another_base_is_rejected(case):
    old, new, data = case
    assert_rejected(data["compact"], new, match="applies to state")
    other = {n: t.clone() for n, t in old.items()}
    bits(other["layers.0.b"])[0] ^= 1
    assert_rejected(data["raw"], other, match="applies to state")


def test_unknown_tensor_and_wrong_shape_are_rejected(case):
    old, _, data = case
    renamed = {("layers.9.w" if n == "layers.0.w" else n): t for n, t in old.items()}
    assert_rejected(data["raw"], renamed, match="unknown tensor")
    reshaped = {**old, "layers.0.w": old["layers.0.w"].reshape(128, 64)}
    assert_rejected(data["raw"], reshaped, match="schema")


def test_raw_positions_out_of_range_are_rejected():
    from safetensors.torch import save

    base = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    fp = fingerprint.state_fingerprint(base)
    meta = {
        "format": patches.FORMAT, "version": patches.VERSION, "encoding": "raw", "step": "1",
        "base_step": "0", "numel": "8", "changed": "1", "schema": patches.schema_hash({"w": [8]}),
        "fingerprint": f"{fp:016x}", "base_fingerprint": f"{fp:016x}",
    }  # fmt: skip
    for index in (8, -1):
        data = save(
            {
                "w/indices": torch.tensor([index], dtype=torch.int32),
                "w/values": torch.ones(1, dtype=torch.bfloat16),
            },
            metadata=meta,
        )
        assert_rejected(data, base, match="inside the tensor")


def test_not_a_patch_is_rejected():
    from safetensors.torch import save

    base = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    assert_rejected(save(base), base, match="not a deltasync patch")
    assert_rejected(b"\xff" * 64, base, match="truncated or corrupt")


@pytest.mark.parametrize("version", [b"1", b"3"])
def test_another_format_version_is_refused(case, version):
    old, _, data = case
    other = data["compact"].replace(b'"version":"2"', b'"version":"' + version + b'"')
    assert other != data["compact"]
    assert_rejected(other, old, match=f"patch format version '{version.decode()}'")


def test_class_counts_claiming_more_changes_than_elements_are_refused_before_decoding():
    """Each class may claim up to every element; together they must not claim more (else a patch of a few
    hundred bytes makes decoding allocate ~50 B per claimed change of several whole tensors)."""
    from deltasync.codec import compact

    models = compact.Models()
    models.q[:], models.v[:] = 1, 1
    numel = 1000
    header = compact._varints([4, 10, 20, 30, 400, 400, 400, 0, 0, 0, 0, 0, 0])  # 1200 claims, 0 words
    with pytest.raises(compact.CompactDecodeError, match="classes claim 1200 changes among 1000 elements"):
        compact.decode_chunk(header, np.zeros(numel, np.uint16), models.tables())


CUTS = [(0, 11), (11, 500), (500, 1073)]  # windows cross the 7-element chunk grid; "b" ends inside part 2


def parts_of(old: dict, new: dict, spans=CUTS, encoding: str = "compact") -> list[bytes]:
    return window_parts(old, new, spans, encoding=encoding, whole=("n",))


@pytest.fixture(scope="module")
def windowed():
    rng = np.random.default_rng(6)
    old = random_state(rng, {"w": (37, 29), "b": (29,), "n": (13,)})
    new = step_state(rng, old, 0.3)
    new["b"] = old["b"] + 1.0  # every element: stored dense
    return old, new


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_parts_over_windows_at_odd_offsets_round_trip_bitwise(windowed, encoding):
    old, new = windowed
    parts = parts_of(old, new, encoding=encoding)
    infos = [patches.read_info(p) for p in parts]
    assert infos[1].windows == {"w": (11, 489), "b": (11, 18)} and infos[2].windows == {"w": (500, 573)}
    assert "n" in infos[0].tensors and "n" not in infos[0].windows
    if encoding == "compact":
        assert infos[1].tensors["b"]["mode"] == "dense"
    step = patches.decode_parts(parts, old)
    assert step.fingerprint == fingerprint.state_fingerprint(new) == infos[-1].fingerprint
    result = {n: t.clone() for n, t in old.items()}
    apply_changes(result, step.changes)
    assert_bitwise_equal(result, new)
    assert_bitwise_equal(old, windowed[0])  # decoding wrote nothing


def test_a_patch_without_windows_has_no_windows_field(case):
    _, _, data = case
    for blob in data.values():
        assert "windows" not in patches.read_info(blob).metadata


def with_metadata(data: bytes, **changes: str) -> bytes:
    from safetensors.torch import load, save

    return save(load(data), metadata={**patches.read_info(data).metadata, **changes})


@pytest.mark.parametrize(
    "window, match",
    [
        ("[11,1063]", "outside"),  # past the end of the tensor
        ("[12,489]", "fingerprint|positions"),  # shifted: decodes elsewhere, refused
        ("[-1,489]", "not \\[start"),
        ("[11,0]", "not \\[start"),
        ("[11.0,489]", "not \\[start"),
        ("[true,489]", "not \\[start"),
        ('["11",489]', "not \\[start"),
        ("[11]", "not \\[start"),
        ('{"start":11}', "not \\[start"),
        ("[1e400,489]", "not \\[start"),
        ("[11,99999999999999999999999999999]", "outside"),
        ("[99999999999999999999999999999,1]", "outside"),
    ],
)
def test_hostile_windows_are_refused(windowed, window, match):
    """A window changed in the part's metadata (that of "w"; "b" keeps its own)."""
    assert_window_refused(windowed, f'{{"w":{window},"b":[11,18]}}', match)


@pytest.mark.parametrize(
    "windows, match",
    [
        ('{"w":[11,489],"b":[11,18],"n":[0,13]}', "does not change"),
        ("[[11,489]]", "JSON object"),
        ("not json", "bad patch metadata"),
        ("[" * 100_000, "windows"),
        ('{"b":[11,18]}', "chunks"),  # "w" read as the whole tensor: refused
    ],
)
def test_hostile_window_lists_are_refused(windowed, windows, match):
    assert_window_refused(windowed, windows, match)


def assert_window_refused(windowed, windows: str, match: str) -> None:
    old, new = windowed
    parts = parts_of(old, new)
    bad = with_metadata(parts[1], windows=windows)
    with pytest.raises(patches.PatchError, match=match):
        patches.decode(bad, old, patches.read_info(parts[1]).base_fingerprint)
    with pytest.raises(patches.PatchError, match="part 2 of 3"):
        patches.decode_parts([parts[0], bad, parts[2]], old)
    assert_bitwise_equal(old, windowed[0])


def test_parts_that_overlap_or_skip_a_part_are_refused(windowed):
    old, new = windowed
    parts = parts_of(old, new, encoding="raw")
    with pytest.raises(patches.PatchError, match="part 1 of 2: .*applies to state"):
        patches.decode_parts(parts[1:], old)  # part 1 missing: the chain does not start at the base
    with pytest.raises(patches.PatchError, match="part 2 of 3: .*applies to state"):
        patches.decode_parts([parts[0], parts[2], parts[1]], old)
    with pytest.raises(patches.PatchError, match="no parts"):
        patches.decode_parts([], old)
    backwards = parts_of(old, new, [(500, 1073), (0, 500)], "raw")  # parts listed out of order: merged
    assert patches.decode_parts(backwards, old).fingerprint == fingerprint.state_fingerprint(new)
    overlapping = parts_of(old, new, [(0, 500), (11, 1073)], "raw")  # each verifies, together they clash
    with pytest.raises(patches.PatchError, match="same element"):
        patches.decode_parts(overlapping, old)


def test_the_weight_dtype_is_recorded_and_only_bf16_is_read(case):
    old, _, data = case
    assert patches.read_info(data["compact"]).metadata["dtype"] == "bf16"
    assert_rejected(
        with_metadata(data["compact"], dtype="f8_e4m3"), old, "weights are 'f8_e4m3'; .* bf16 only"
    )


DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit, however it parses


@pytest.mark.parametrize("field", ["dense", "models", "windows"])
def test_metadata_nested_too_deeply_refuses_the_patch(case, field):
    old, _, data = case
    bad = with_metadata(data["compact"], **{field: DEEP})
    assert_rejected(bad, old, f"'{field}': JSON nested too deeply")


def test_a_local_failure_while_reading_entries_is_no_fault_of_the_patch(case, monkeypatch):
    old, _, data = case

    def out_of_memory(data: bytes) -> None:
        raise MemoryError

    monkeypatch.setattr(patches, "load_safetensors", out_of_memory)
    with pytest.raises(MemoryError):
        patches.decode(data["compact"], old)


def test_a_change_to_the_value_it_already_has_is_refused_in_one_line():
    """make_patch never makes one; a hand-made one gets a clear error, not a crash in the coder."""
    old = {"w": torch.ones(1000, dtype=torch.bfloat16)}
    same = TensorChanges(torch.arange(0, 64, 2), torch.ones(32, dtype=torch.bfloat16))
    with pytest.raises(PatchError, match="new bf16 pattern equals the old one"):
        patches.encode(patches.Patch(1, 0, 1000, 0, 0, {"w": same}), old, "compact")

"""The storage contract on all three backends: a local folder, fsspec `memory://`, and a Hub bucket served by
the in-process fake Hub (tests/fakehub.py) through the real huggingface_hub client."""

import importlib.util
import os
import tempfile
import threading
import uuid
from contextlib import nullcontext
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.storage import (
    TMP_MARK,
    FsspecStorage,
    HubBucketStorage,
    LocalStorage,
    TooLargeError,
    TransientStorageError,
    check_path,
    open_storage,
    redact,
)

UNSAFE_PATHS = [
    "",
    "/etc/passwd",
    "../x",
    "a/../../x",
    "a/..",
    "./a",
    "a//b",
    "a/",
    "a\\..\\b",
    "a\x00b",
    "a\nb",
    "a\x7fb",
    "a\u202eb",
    f"deltas/x{TMP_MARK}1",
]


@pytest.fixture(params=["local", "memory", "hub"])
def open_root(request, tmp_path):
    """Opens the sync root `name` in a fresh place on one backend."""
    if request.param == "hub":
        request.getfixturevalue("fake_hub")
    base = {"local": str(tmp_path), "memory": f"memory://{uuid.uuid4().hex}", "hub": "hf://buckets/user/sync"}
    return lambda name="run": open_storage(f"{base[request.param]}/{name}")


@pytest.fixture
def storage(open_root):
    return open_root()


def test_write_read_overwrite(storage):
    storage.write_bytes("heads/latest.json", b'{"step": 1}')
    assert storage.read_bytes("heads/latest.json") == b'{"step": 1}'
    storage.write_bytes("heads/latest.json", b'{"step": 2}')
    assert storage.read_bytes("heads/latest.json") == b'{"step": 2}'
    storage.write_bytes("empty", b"")
    assert storage.read_bytes("empty") == b""


def test_upload_download_file(storage, tmp_path):
    data = os.urandom(1 << 20)
    (tmp_path / "anchor.safetensors").write_bytes(data)
    storage.upload_file(tmp_path / "anchor.safetensors", "anchors/step-00000000/model.safetensors")
    dest = tmp_path / "out" / "nested" / "model.safetensors"
    storage.download_file("anchors/step-00000000/model.safetensors", dest)
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["model.safetensors"]  # no temporary file left behind


def test_missing_objects_raise_file_not_found(storage, tmp_path):
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("deltas/step-00000001.safetensors")
    with pytest.raises(FileNotFoundError):
        storage.download_file("deltas/step-00000001.safetensors", tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").write_bytes(b"kept")
    with pytest.raises(FileNotFoundError):
        storage.download_file("deltas/step-00000001.safetensors", tmp_path / "old")
    assert (tmp_path / "old").read_bytes() == b"kept"
    assert storage.list() == []


def test_sizes(storage):
    storage.write_bytes("deltas/step-00000001.safetensors", b"12345")
    storage.write_bytes("run.json", b"")
    paths = ["deltas/step-00000001.safetensors", "run.json", "deltas/step-00000002.safetensors", "deltas"]
    assert storage.sizes(paths) == {paths[0]: 5, paths[1]: 0, paths[2]: None, paths[3]: None}
    assert storage.sizes([]) == {}


def test_list_is_recursive_sorted_and_by_folder(storage):
    paths = [
        "run.json",
        "deltas/b",
        "deltas/a",
        "deltas-old/x",
        "anchors/step-0/m.safetensors",
        "anchors/step-00/x",
    ]
    for path in paths:
        storage.write_bytes(path, b"x")
    assert storage.list() == sorted(paths)
    assert storage.list("deltas") == ["deltas/a", "deltas/b"]  # not "deltas-old/x"
    assert storage.list("anchors/step-0") == ["anchors/step-0/m.safetensors"]
    assert storage.list("run.json") == []  # a file is not a folder
    assert storage.list("nothing/here") == []


def test_delete_is_idempotent(storage):
    storage.write_bytes("deltas/a", b"1")
    storage.write_bytes("deltas/b", b"2")
    storage.delete(["deltas/a", "deltas/never-written"])
    storage.delete(["deltas/a"])
    storage.delete([])
    assert storage.list() == ["deltas/b"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("deltas/a")


def test_prefix_isolation(open_root):
    run, run10 = open_root("run"), open_root("run10")  # "run" is a string prefix of "run10"
    run.write_bytes("heads/latest.json", b"run")
    run10.write_bytes("heads/latest.json", b"run10")
    run10.write_bytes("only-in-run10", b"x")
    assert run.list() == ["heads/latest.json"]
    assert run.read_bytes("heads/latest.json") == b"run"
    assert run.sizes(["only-in-run10"]) == {"only-in-run10": None}
    run.delete(["heads/latest.json", "only-in-run10"])
    assert run10.list() == ["heads/latest.json", "only-in-run10"]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_every_method_rejects_unsafe_paths(storage, tmp_path, path):
    calls = [
        lambda: storage.read_bytes(path),
        lambda: storage.write_bytes(path, b"x"),
        lambda: storage.upload_file(tmp_path / "f", path),
        lambda: storage.download_file(path, tmp_path / "f"),
        lambda: storage.sizes(["ok", path]),
        lambda: storage.list(path or "/"),
        lambda: storage.delete(["ok", path]),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="unsafe storage path"):
            call()
    assert storage.list() == []


def test_other_failures_are_transient(tmp_path, monkeypatch):
    storage = open_storage(f"memory://{uuid.uuid4().hex}")

    def timeout(*args, **kwargs):
        raise TimeoutError("backend too slow")

    def vanished(*args, **kwargs):
        raise FileNotFoundError("folder removed while writing")

    # fsspec caches filesystem instances: patch through monkeypatch so other tests get the real methods back.
    monkeypatch.setattr(storage.fs, "cat_file", timeout)
    monkeypatch.setattr(storage.fs, "info", timeout)
    monkeypatch.setattr(storage.fs, "pipe_file", vanished)  # only a read's FileNotFoundError means "absent"
    for call, cause in [
        (lambda: storage.read_bytes("a"), TimeoutError),
        (lambda: storage.sizes(["a"]), TimeoutError),
        (lambda: storage.write_bytes("a", b""), FileNotFoundError),
    ]:
        with pytest.raises(TransientStorageError, match="memory://") as err:
            call()
        assert isinstance(err.value.__cause__, cause)
    blocked = LocalStorage(tmp_path / "a-file")
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(TransientStorageError):
        blocked.write_bytes("x", b"1")


def test_local_write_is_atomic_for_concurrent_readers(tmp_path):
    storage = LocalStorage(tmp_path)
    versions = [bytes([i]) * (1 << 20) for i in range(2)]
    storage.write_bytes("heads/latest.json", versions[0])
    done = threading.Event()

    def writer():
        for i in range(60):
            storage.write_bytes("heads/latest.json", versions[i % 2])
        done.set()

    threading.Thread(target=writer).start()
    reads = 0
    while not done.is_set():
        assert storage.read_bytes("heads/latest.json") in versions
        assert storage.list() == ["heads/latest.json"]
        reads += 1
    assert reads > 5
    assert os.listdir(tmp_path / "heads") == ["latest.json"]


def test_local_list_hides_temporary_files(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.write_bytes("deltas/a", b"1")
    (tmp_path / "deltas" / f"b{TMP_MARK}0123").write_bytes(b"partial")
    assert storage.list() == ["deltas/a"]


def test_open_storage_dispatch(tmp_path, fake_hub):
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert open_storage(f"file://{tmp_path}").url == str(tmp_path)
    assert open_storage(f"file:{tmp_path}").url == str(tmp_path)  # RFC 8089's form, no "//"
    assert isinstance(open_storage("relative/dir"), LocalStorage)
    assert isinstance(open_storage("memory://x/y"), FsspecStorage)
    hub = open_storage("hf://buckets/user/sync/runs/a/")
    assert isinstance(hub, HubBucketStorage)
    assert (hub.bucket_id, hub.prefix, hub.url) == ("user/sync", "runs/a/", "hf://buckets/user/sync/runs/a")
    for bad in ("hf://buckets/user", "hf://buckets/", "hf://buckets/user/sync/../x", "hf://buckets/../sync"):
        with pytest.raises(ValueError):
            open_storage(bad)


def test_hub_poll_is_one_request(fake_hub):
    storage = open_storage("hf://buckets/user/sync/run")
    storage.write_bytes("heads/latest.json", b"{}")
    fake_hub.requests.clear()
    storage.sizes(["heads/latest.json", "deltas/step-00000002.safetensors", "telemetry/x.json"])
    assert fake_hub.requests == ["POST /api/buckets/user/sync/paths-info"]


def test_hub_bucket_created_private_on_first_write(fake_hub):
    storage = open_storage("hf://buckets/user/fresh")
    assert storage.sizes(["a"]) == {"a": None}  # reading never creates the bucket
    assert storage.list() == []
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("a")
    assert fake_hub.buckets == {}
    storage.write_bytes("a", b"1")
    storage.write_bytes("b", b"2")
    assert fake_hub.requests.count("POST /api/buckets/user/fresh") == 1
    assert sorted(fake_hub.buckets["user/fresh"]) == ["a", "b"]


def test_hub_token(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    storage = HubBucketStorage("user/sync", token=fake_hub.token)
    storage.write_bytes("a", b"1")  # the explicit token wins over HF_TOKEN
    assert fake_hub.token not in repr(storage)
    with pytest.raises(TransientStorageError):  # a rejected token is not "missing"
        open_storage("hf://buckets/user/sync").sizes(["a"])


@pytest.mark.parametrize("method", ["read_bytes", "download_file", "write_bytes", "sizes", "list", "delete"])
def test_hub_server_errors_are_transient(fake_hub, tmp_path, method):
    storage = open_storage("hf://buckets/user/sync")
    storage.write_bytes("a", b"1")
    fake_hub.fail_status = 403  # 429 and 5xx would do, after the client's own retries (about 23 s)
    args = {"read_bytes": ["a"], "download_file": ["a", tmp_path / "a"], "write_bytes": ["a", b"2"]}
    args |= {"sizes": [["a"]], "list": [], "delete": [["a"]]}
    with pytest.raises(TransientStorageError):
        getattr(storage, method)(*args[method])


# Path validation is the security boundary between untrusted manifests and the storage: property tests.

SEGMENTS = st.sampled_from(
    ["deltas", "step-1.safetensors", "é", "a b", "", ".", "..", "..a", "a\\b", "\x00", "\t"]
)


@given(st.lists(SEGMENTS, max_size=5), st.booleans())
def test_check_path_accepts_exactly_safe_paths(segments, absolute):
    path = "/" * absolute + "/".join(segments)
    safe = (
        segments
        and not absolute
        and all(s not in ("", ".", "..") and "\\" not in s and s.isprintable() for s in segments)
    )
    if safe:
        assert check_path(path) == path
    else:
        with pytest.raises(ValueError, match="unsafe storage path") as err:
            check_path(path)
        assert repr(path) in str(err.value)


@given(st.text(max_size=30))
def test_check_path_never_lets_a_path_escape(path):
    try:
        check_path(path)
    except ValueError as err:
        assert repr(path) in str(err)
        return
    assert os.path.normpath(os.path.join("/root", path)).startswith("/root/")
    assert "\\" not in path and path.isprintable()


SAFE_SEGMENT = st.text(
    st.characters(exclude_categories=["C", "Z"], exclude_characters="/\\"), min_size=1, max_size=20
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        SAFE_SEGMENT.filter(lambda s: s not in (".", "..") and TMP_MARK not in s), min_size=1, max_size=3
    )
)
def test_safe_paths_round_trip_inside_the_root(segments):
    path = "/".join(segments)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        storage = LocalStorage(root)
        storage.write_bytes(path, b"x")
        assert storage.read_bytes(path) == b"x"
        assert storage.list() == [path]
        assert (root / path).resolve().is_relative_to(root.resolve())


def test_reads_over_a_limit_are_refused(storage, tmp_path):
    storage.write_bytes("heads/latest.json", b"x" * 100)
    assert storage.read_bytes("heads/latest.json", limit=100) == b"x" * 100
    with pytest.raises(TooLargeError, match="100 bytes, more than"):
        storage.read_bytes("heads/latest.json", limit=99)
    with pytest.raises(TooLargeError):
        storage.download_file("heads/latest.json", tmp_path / "f", limit=99)
    assert not (tmp_path / "f").exists()
    with pytest.raises(FileNotFoundError, match="deltas/step-00000001.safetensors"):  # named, not "2"
        storage.read_bytes("deltas/step-00000001.safetensors", limit=99)


def test_downloads_over_a_limit_fetch_nothing(storage, tmp_path, monkeypatch):
    """The size is checked before the download on every backend (on the Hub a 1.5 GB head would otherwise be
    fetched on every poll); an object that grew after that check is still refused, and not left behind."""
    storage.write_bytes("heads/latest.json", b"x" * 100)
    fetched = []
    download = type(storage)._download_file
    monkeypatch.setattr(storage, "_download_file", lambda p, d: fetched.append(p) or download(storage, p, d))
    with pytest.raises(TooLargeError, match="100 bytes, more than the 99 expected"):
        storage.download_file("heads/latest.json", tmp_path / "f", limit=99)
    assert fetched == []

    monkeypatch.setattr(storage, "_download_size", lambda path: 50)  # it grows after the stat
    with pytest.raises(TooLargeError, match="100 bytes, more than the 99 expected"):
        storage.download_file("heads/latest.json", tmp_path / "f", limit=99)
    assert fetched == ["heads/latest.json"] and not (tmp_path / "f").exists()


def test_missing_fsspec_backends_and_credentials_are_one_clear_line():
    missing = importlib.util.find_spec("s3fs") is None
    with pytest.raises(ValueError, match="Install s3fs") if missing else nullcontext():
        open_storage("s3://bucket/root")
    storage = open_storage("memory://user:hunter2@x/root")
    assert "hunter2" not in storage.url and "hunter2" not in repr(storage)
    assert redact("GET http://a:b@h/x with hf_abcdefghijkl") == "GET http://***@h/x with hf_***"


def test_local_limited_read_refuses_a_fifo_without_blocking(tmp_path):
    (tmp_path / "heads").mkdir()
    os.mkfifo(tmp_path / "heads" / "latest.json")  # opening it for reading would wait for a writer
    with pytest.raises(TooLargeError, match="not a regular file"):
        LocalStorage(tmp_path).read_bytes("heads/latest.json", limit=1 << 20)


USERINFO = st.text(st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=20)  # no spaces


@given(user=USERINFO, password=USERINFO, scheme=st.sampled_from(["http", "https", "s3", "memory", "hf"]))
@settings(max_examples=300, deadline=None)
def test_redact_hides_userinfo_however_spelled(user, password, scheme):
    """Passwords holding "/", "@", ":" or quotes, as written or as repr() writes them in an error message."""
    url = f"{scheme}://{user}:S3cr{password}@bucket.example/root/heads"
    for shown in (redact(url), redact(f"read {url!r} failed: {url}"), redact(f"{url}\n")):
        assert "S3cr" not in shown and "***@" in shown


def test_redact_known_spellings():
    assert redact("http://user:pa/ss-secret@host/x") == "http://***@host/x"
    assert redact("s3://KEY:secret/with/slash@bucket/root") == "s3://***@bucket/root"
    assert redact("GET http://a:b@h/x with hf_abcdefghijkl") == "GET http://***@h/x with hf_***"

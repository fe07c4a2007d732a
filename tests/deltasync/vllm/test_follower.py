"""The follower's side of vLLM's weight-update protocol, against a stand-in engine that keeps the weights in a
dict (no vLLM): the order of the calls, what a refusal leaves behind, and the read-back answer."""

import contextlib
import http.server
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import decode_parts
from deltasync.storage import open_storage
from deltasync.sync.anchor import read_anchor
from deltasync.sync.protocol import read_run
from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.signing import SigningKey, Trust, short
from deltasync.sync.subscriber import Subscriber, SyncError
from deltasync.vllm.follower import EngineApplier, HttpEngine, WriteRefused, follow, path_summary
from tests.helpers import SHAPES, assert_bitwise_equal, run_steps, wait_for


class FakeEngine:
    """vLLM's protocol as the workers keep it: an update only between start and finish; a refusal (from
    `refuse`) ends the update; `tear` fails a write after part of it, as the workers report it; `fingerprint`
    and `paths` answer as the deltasync engine does (`paths`: what each rank reports)."""

    def __init__(self, paths: list[dict[str, str]] | None = None, root: Path | None = None):
        self.state: dict[str, torch.Tensor] = {}
        self.run = read_run(open_storage(root)) if root else None
        self.paths = paths or [{}]
        self.calls: list[str] = []
        self.active = self.paused = False
        self.version: str | None = None
        self.refuse: str | None = None
        self.tear: str | None = None
        self.initialized = False
        self.inits: list[dict] = []

    def init(self, init_info):
        self.calls.append("init")
        self.inits.append(init_info)
        self.initialized = True

    def restart(self):
        """A server started again: its model folder's weights, the engine not initialized."""
        self.state, self.initialized, self.active, self.paused = {}, False, False, False

    def pause(self):
        self.calls.append("pause")
        self.paused = True

    def resume(self):
        self.calls.append("resume")
        self.paused = False

    def start(self):
        self.calls.append("start")
        if self.active:
            raise WriteRefused("start_weight_update called while a weight update is already active")
        self.active = True

    def update(self, info):
        self.calls.append(f"update {info['kind']}")
        if not self.initialized:
            self.active = False
            raise WriteRefused("deltasync engine not initialized: POST /init_weight_transfer_engine first")
        if self.refuse:
            self.active = False
            if self.refuse.startswith("bad file") and info.get("report"):  # as the workers report it
                Path(info["report"]).write_text(json.dumps({"refused": self.refuse}))
            raise WriteRefused(self.refuse)
        if self.tear and info["kind"] in ("anchor", "delta"):
            self.active = False
            self.state[next(iter(self.state))].view(-1)[0] += 1  # part of the write
            Path(info["report"]).write_text(json.dumps({"torn": self.tear}))
            raise WriteRefused(self.tear)
        if info["kind"] == "fingerprint":
            held = format_fingerprint(state_fingerprint(self.state))
            Path(info["path"]).write_text(json.dumps({"step": 0, "fingerprint": held}))
            return
        if info["kind"] == "stage":  # the checks only
            return
        if info["kind"] == "paths":
            Path(info["path"]).mkdir(parents=True)
            for rank, paths in enumerate(self.paths):
                (Path(info["path"]) / f"rank-{rank}.json").write_text(json.dumps(paths))
            return
        if info["kind"] == "anchor":
            files = [Path(p) for p in info["paths"]]
            self.state = read_anchor(files, self.run, info["step"], info["fingerprint"])
            return
        assert info["base"] == format_fingerprint(state_fingerprint(self.state))
        parts = [Path(p).read_bytes() for p in info["paths"]]
        for name, ch in decode_parts(parts, self.state).changes.items():
            self.state[name].view(-1)[ch.indices] = ch.values

    def finish(self, version):
        self.calls.append("finish")
        if not self.active:
            raise WriteRefused("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        self.version = self.version if version is None else version  # None: the label stays, as in vLLM

    def recompute_running(self):
        self.calls.append("recompute")


@pytest.fixture
def followed(tmp_path):
    states = run_steps(tmp_path / "root", 3)
    engine = FakeEngine(root=tmp_path / "root")
    applier = EngineApplier(engine, str(tmp_path / "root"))
    subscriber = Subscriber(tmp_path / "root", applier, verify_every=1)
    yield states, engine, applier, subscriber
    applier.close()


def test_each_step_is_one_paused_update_then_a_read_back(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync()
    assert_bitwise_equal(engine.state, states[-1])
    assert engine.version == "2" and applier.version == "2" and not engine.paused and not engine.active
    delta = ["start", "update stage", "pause", "update delta", "finish", "resume"]
    delta += ["start", "update fingerprint", "finish"]
    # One update session: checked, then paused for the writes only; read back while generation goes on.
    assert engine.calls[-len(delta) :] == delta
    assert applier.readback["step"] == 2 and applier.last_write["kind"] == "delta"
    assert applier.last_write["bytes"] > 0 and applier.last_write["pause_s"] >= 0
    assert applier.last_write["stage_s"] >= 0


def test_refused_update_is_closed_before_pausing(followed, tmp_path):
    states, engine, applier, subscriber = followed
    subscriber.sync(1)
    engine.refuse = "step 2 applies to weights 0000000000000000, this server holds 1234"
    engine.calls.clear()
    with pytest.raises(SyncError, match="this server holds 1234"):
        subscriber.sync()
    # Refused while staging, before any pause; the update is closed (finish, which a worker that raised
    # refuses as vLLM does).
    assert engine.calls == ["start", "update stage", "finish"]
    assert not engine.paused and not engine.active and engine.version == "1"
    assert_bitwise_equal(engine.state, states[1])
    assert "this server holds 1234" in subscriber.last_error and not applier.stuck


def test_the_follower_hands_files_and_holds_no_weights(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync()
    assert_bitwise_equal(engine.state, states[-1])
    assert subscriber.state is None and subscriber.fingerprint == state_fingerprint(states[-1])


def test_files_the_workers_refuse_are_never_asked_for_again(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync(1)
    engine.refuse = "bad file: step 2 would lead to weights 0000000000000000"
    with pytest.raises(SyncError, match="would lead to weights"):
        subscriber.sync()
    engine.refuse = None  # the same file is not handed again: only a newer anchor can lead on
    engine.calls.clear()
    with pytest.raises(SyncError, match="waiting for a newer anchor"):
        subscriber.sync()
    assert "update stage" not in engine.calls and subscriber.step == 1
    assert_bitwise_equal(engine.state, states[1])


def test_a_write_left_in_part_keeps_generation_paused_until_an_anchor_loads(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync(1)
    engine.tear = "step 2: RuntimeError on rank 0: CUDA out of memory"
    engine.calls.clear()
    with pytest.raises(SyncError, match="CUDA out of memory"):
        subscriber.sync()
    # Mixed weights, still labelled step 1: no request may run on them.
    assert engine.calls[-3:] == ["pause", "update delta", "finish"] and "resume" not in engine.calls
    assert engine.paused and applier.stuck and engine.version == "1"
    engine.tear = None
    engine.calls.clear()
    subscriber.sync()  # from the anchor again
    assert engine.calls.index("update anchor") < engine.calls.index("resume")
    assert not engine.paused and not applier.stuck and engine.version == "2"
    assert_bitwise_equal(engine.state, states[-1])


def test_a_server_that_restarted_is_initialized_again_and_reloaded(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync(1)
    engine.restart()
    engine.calls.clear()
    with pytest.raises(SyncError, match="not initialized"):
        subscriber.sync()
    assert engine.calls[-1] == "init" and not applier.stuck
    subscriber.sync()  # from the anchor: the restarted server holds its model folder's weights
    assert "update anchor" in engine.calls and not engine.paused
    assert_bitwise_equal(engine.state, states[-1])


def test_a_quantized_replica_is_initialized_with_its_recipe_every_time(tmp_path):
    """The workers refuse an init without the recipe on a quantized server: a new write path and a restarted
    server's re-init name it too."""
    engine = FakeEngine()
    applier = EngineApplier(engine, str(tmp_path / "root"), quantization="fp8_per_channel")
    applier.use_write("loader")
    engine.restart()
    with pytest.raises(WriteRefused, match="not initialized"):
        applier._paused([{"kind": "anchor"}])
    assert len(engine.inits) == 3
    assert all(i["quantization"] == "fp8_per_channel" for i in engine.inits)
    assert [i["write"] for i in engine.inits] == ["direct", "loader", "loader"]
    applier.close()


def test_read_back_reports_what_the_workers_hold(followed):
    states, engine, applier, subscriber = followed
    subscriber.sync()
    name = next(iter(SHAPES))
    engine.state[name].view(-1)[0] += 1
    assert applier.fingerprint() == state_fingerprint(engine.state) != subscriber.fingerprint
    assert not engine.active


def test_reports_how_each_tensor_is_written(tmp_path):
    expert = "model.layers.{}.mlp.experts.{}.down_proj.weight"
    ranks = [
        {"model.embed_tokens.weight": "direct", expert.format(0, 7): "packed", expert.format(1, 0): "packed"},
        {"model.embed_tokens.weight": "loader", expert.format(0, 7): "direct", expert.format(1, 0): "packed"},
    ]
    engine = FakeEngine(paths=ranks)
    applier = EngineApplier(engine, str(tmp_path / "root"))
    # A tensor any rank writes other than directly is reported as such; read while generation goes on.
    assert applier.paths == {
        "model.embed_tokens.weight": "loader",
        expert.format(0, 7): "packed",
        expert.format(1, 0): "packed",
    }
    assert engine.calls == ["init", "start", "update paths", "finish"] and not list(applier.tmp.iterdir())
    assert path_summary(applier.paths) == {
        "counts": {"direct": 0, "packed": 2, "loader": 1},
        "other": {
            "loader": ["model.embed_tokens.weight"],
            "packed": ["model.layers.*.mlp.experts.*.down_proj.weight"],
        },
    }
    applier.close()


class Answers(http.server.BaseHTTPRequestHandler):
    """A stand-in server: every POST gets `status` and `body` (the class attributes of a subclass)."""

    status, body = 200, b"{}"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(self.status)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def answering(status: int, body: bytes):
    handler = type("Handler", (Answers,), {"status": status, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "status, body, problem",
    [
        (404, b'{"detail": "Not Found"}', "VLLM_SERVER_DEV_MODE=1"),  # a server without the RL routes
        (200, b"{}", "wrote no layout"),  # another backend: nothing written where the follower reads
        (200, b"x" * (3 << 20), "over 1048576 bytes"),  # an answer is read only up to a bound
    ],
)
def test_a_failed_start_says_what_to_do_and_leaves_no_folder(tmp_path, monkeypatch, status, body, problem):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with answering(status, body) as url, pytest.raises(WriteRefused, match=problem):
        EngineApplier(HttpEngine(url), str(tmp_path / "root"))
    assert not list(tmp_path.glob("deltasync-follow-*"))


def closed_port() -> int:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_does_not_answer_is_named_and_tried_again(tmp_path, caplog, monkeypatch):
    tries, urlopen = [], urllib.request.urlopen
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: tries.append(1) or urlopen(*a, **k))
    port, stop, failure = closed_port(), threading.Event(), []
    engine = HttpEngine(f"http://alice:secret@127.0.0.1:{port}/", stop=stop, retry_s=0.01)

    def start():
        try:
            EngineApplier(engine, str(tmp_path / "root"))
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=start)
    thread.start()
    try:
        wait_for(lambda: len(tries) >= 3, "three tries")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join()
    # One line while the answer stays the same, naming the server (never its credentials) and why.
    lines = [r.getMessage() for r in caplog.records if r.name == "deltasync.vllm.follower"]
    assert len(lines) == 1 and "secret" not in lines[0], lines
    assert lines[0].startswith(f"cannot reach the vLLM server at http://127.0.0.1:{port}: "), lines
    assert "refused" in lines[0], lines
    assert isinstance(failure[0], ConnectionError) and "stopped while waiting" in str(failure[0])


def test_each_change_of_why_the_server_does_not_answer_is_one_line(caplog, monkeypatch):
    answers = [ConnectionRefusedError(111, "Connection refused")] * 3 + [TimeoutError("timed out")] * 3
    real = urllib.request.urlopen

    def urlopen(*args, **kwargs):
        if answers:
            raise urllib.error.URLError(answers.pop(0))
        return real(*args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with answering(200, b"{}") as url, caplog.at_level("INFO", "deltasync.vllm.follower"):
        HttpEngine(url, retry_s=0.001).init({"root": "r"})
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot reach the vLLM server at {url}: [Errno 111] Connection refused: trying again every 0.001 s",
        f"cannot reach the vLLM server at {url}: timed out: trying again every 0.001 s",
        f"the vLLM server at {url} answers",
    ]


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://host:port", "http://:8000"])
def test_a_url_that_is_no_server_address_is_refused_in_a_line(url):
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        HttpEngine(url)


@pytest.mark.parametrize("poll_s", [float("nan"), float("inf"), -1.0, 0.0])
def test_follow_refuses_a_poll_interval_that_is_no_positive_number(tmp_path, poll_s):
    engine, stop = FakeEngine(), threading.Event()
    stop.set()  # a follower that took the interval would return at once
    with pytest.raises(ValueError, match="poll interval must be a positive number of seconds"):
        follow(str(tmp_path), engine, stop, poll_s=poll_s)
    assert engine.calls == []


def follow_command(root: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "deltasync.cli", "follow", str(root), *args]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)


def test_follow_refuses_a_bad_replica_before_calling_the_server(tmp_path):
    with socket.socket() as stalled:  # a server that would never answer: the refusal must not wait for it
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        proc = follow_command(tmp_path, "--vllm-url", url, "--replica", "no spaces")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--replica: 'no spaces' must match" in err


@pytest.mark.parametrize("server", ["starting", "stalled"])
def test_follow_stops_on_sigterm_while_the_server_starts_or_stalls(tmp_path, server):
    """Nothing listens yet (the follower waits for the server), or the server took the request and never
    answers: SIGTERM ends the follower all the same (the deadline below only turns a hang into a failure)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        if server == "stalled":
            sock.listen()  # connections complete in the kernel's backlog; nothing ever answers them
        else:
            sock.close()
        proc = follow_command(tmp_path, "--vllm-url", url)
        try:
            if server == "starting":
                line = ""
                while "cannot reach the vLLM server" not in line:
                    line = proc.stderr.readline()
                    assert line, "the follower ended before waiting for the server"
            else:
                sock.settimeout(120)
                connection, _ = sock.accept()  # the request is in flight: it is never answered
                connection.recv(1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_follow_imports_neither_torch_nor_numba(tmp_path):
    """`deltasync follow` hands the files to vLLM's workers, which decode them: its process imports neither
    torch nor numba (hundreds of MB it would hold for nothing). `python -X importtime` lists every module it
    imports, up to where it waits for the server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    argv = [sys.executable, "-X", "importtime", "-m", "deltasync.cli", "follow", str(tmp_path)]
    proc = subprocess.Popen([*argv, "--vllm-url", url], stderr=subprocess.PIPE, text=True)
    imported = set()
    try:
        while "cannot reach the vLLM server" not in (line := proc.stderr.readline()):
            assert line, "the follower ended before waiting for the server"
            if line.startswith("import time:"):
                imported.add(line.rsplit("|", 1)[1].strip())
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert {"deltasync.vllm.follower", "deltasync.sync.subscriber"} <= imported
    assert not {"torch", "numba"} & imported


def test_follow_with_a_trusted_key_applies_its_steps_and_refuses_another_keys(tmp_path, caplog):
    """`deltasync follow --trusted-key`: the signing trainer's steps reach the server bit for bit; a server
    trusting another key is never written to, and the log says what each one trusts."""
    keys = []
    for name in ("trainer", "other"):
        key = SigningKey.generate()
        key.save(tmp_path / f"{name}.key")
        keys.append(key.public)
    root = tmp_path / "root"
    states = run_steps(root, 3, PublisherConfig(signing_key=str(tmp_path / "trainer.key")))
    engines = {key: FakeEngine(root=root) for key in keys}
    stop = threading.Event()
    threads = [
        threading.Thread(target=follow, args=(str(root), engine, stop), kwargs={"trust": Trust([key])})
        for key, engine in engines.items()
    ]
    with caplog.at_level("INFO"):
        for thread in threads:
            thread.start()
        wait_for(lambda: engines[keys[0]].version == "2", "the trusting follower at step 2")
        wait_for(lambda: "key this replica trusts" in caplog.text, "the other follower's refusal")
        stop.set()
        for thread in threads:
            thread.join()
    assert_bitwise_equal(engines[keys[0]].state, states[-1])
    assert engines[keys[1]].state == {} and "update delta" not in engines[keys[1]].calls
    trusting = [r.getMessage() for r in caplog.records if "trusting" in r.getMessage()]
    assert sorted(trusting) == sorted(f"following {root}, trusting keys {short(k)}" for k in keys)

"""Helpers the tests share: small models, simulated optimizer steps, bitwise comparisons, waiting."""

import contextlib
import http.client
import os
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from deltasync import telemetry
from deltasync.codec.bf16 import bits
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.sync.protocol import HEAD_PATH, RUN_PATH, Head, step_of
from deltasync.sync.publisher import Publisher, PublisherConfig

REPO = Path(__file__).resolve().parents[1]
# Subprocesses given an environment of their own import the code under test (a work tree by PYTHONPATH)
CODE_UNDER_TEST = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where tests of the GPU codec put their tensors

# Big enough that a chain of 20 deltas weighs less than an anchor (else the publisher anchors earlier).
SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.mlp.up_proj.weight": (192, 64),
    "lm.bias": (7,),
}


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.05 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def train_step(params: dict[str, torch.Tensor], step: int, density: float = 0.01) -> None:
    """Moves about `density` of the elements by more than a bf16 rounding step, like an optimizer step."""
    g = torch.Generator().manual_seed(1000 + step)
    for t in params.values():
        mask = torch.rand(t.shape, generator=g) < density
        t += mask * t.abs().clamp_min(1e-3) * 0.05 * torch.randn(t.shape, generator=g).sign()


def bf16(params):
    return {n: t.to(torch.bfloat16) for n, t in params.items()}


def bitwise_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


def run_steps(root, steps: int, config: PublisherConfig | None = None, flush: bool = True):
    """Publishes `steps` states (each flushed, so none is coalesced); returns the bf16 state of every step."""
    params, states = make_params(), []
    with Publisher(root, model="tiny", config=config) as publisher:
        for step in range(steps):
            if step:
                train_step(params, step)
            publisher.publish(params, step=step, info={"reward_mean": step / 10})
            states.append(bf16(params))
            if flush:
                publisher.flush()
    return states


def bf16_from_bits(b: np.ndarray, shape) -> torch.Tensor:
    return torch.from_numpy(b.astype(np.int16)).view(torch.bfloat16).view(shape)


def random_state(rng: np.random.Generator, shapes: dict) -> dict:
    """Realistic weights: N(0, 0.02) plus a sprinkle of every kind of special bit pattern."""
    state = {}
    for name, shape in shapes.items():
        t = torch.from_numpy(rng.normal(0, 0.02, size=shape).astype(np.float32)).bfloat16()
        b = bits(t).numpy().copy()
        special = rng.random(b.size) < 0.01
        b[special] = rng.integers(-(1 << 15), 1 << 15, size=int(special.sum()))
        state[name] = bf16_from_bits(b, shape)
    return state


def step_state(rng: np.random.Generator, old: dict, density: float) -> dict:
    """Move a `density` share of elements: mostly +-1 ulp, some bigger jumps, some arbitrary patterns."""
    new = {}
    for name, t in old.items():
        b = bits(t).numpy().astype(np.int32)
        mask = rng.random(b.size) < density
        moves = rng.choice([-1, 1, -2, 2, 7, -300], size=b.size, p=[0.45, 0.45, 0.04, 0.04, 0.01, 0.01])
        arbitrary = rng.random(b.size) < 0.01
        b = np.where(mask, b + moves, b)
        b = np.where(mask & arbitrary, rng.integers(-(1 << 15), 1 << 15, size=b.size), b)
        b = ((b + (1 << 15)) % (1 << 16)) - (1 << 15)
        new[name] = bf16_from_bits(b, t.shape)
    return new


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(bits(a[name]), bits(b[name])), name


@contextlib.contextmanager
def following(subscriber, interval: float, timeout_s: float = 120.0):
    """Runs `subscriber.follow` on a thread for the block, then stops it and waits for it to end: a replica
    still writing (its telemetry, through the client's own retries of a 429) when its test ends would write
    into the next test's bucket on the session's fake Hub."""
    stop = threading.Event()
    thread = threading.Thread(target=subscriber.follow, args=(stop, interval), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout_s)
        assert not thread.is_alive(), f"the replica did not stop within {timeout_s} s"


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    """Wait for `condition()`; the deadline only turns a hang into a failure (no timing is asserted)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class ServedRun:
    """A stand-in training run for servers that follow a root: publishes successive states of a model folder's
    weights to a staging root with the project's Publisher and mirrors each step into the root the servers
    follow (data first, head last), optionally corrupting a delta on the way, as a broken upload would."""

    def __init__(self, tmp: Path, model_dir: Path, anchor_every: int, big_step: int | None = None):
        self.model_dir, self.staging, self.served = model_dir, tmp / "staging", tmp / "served"
        self.big_step = big_step
        self.state = load_file(model_dir / "model.safetensors")
        config = PublisherConfig(anchor_every=anchor_every)
        self.publisher = Publisher(str(self.staging), model=str(model_dir), config=config)
        self.fingerprints: dict[int, str] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def step(self, corrupt: bool = False) -> int:
        step = self.publisher.last_step + 1
        if step:
            self.state = perturb(self.state, step, big=step == self.big_step)
        self.publisher.publish(self.state, step)
        self.publisher.flush()
        self.fingerprints[step] = format_fingerprint(state_fingerprint(self.state))
        self.states[step] = self.state
        self.mirror(corrupt_step=step if corrupt else None)
        return step

    def head(self) -> Head:
        return Head.from_json((self.served / HEAD_PATH).read_bytes())

    def mirror(self, corrupt_step: int | None) -> None:
        head = Head.from_json((self.staging / HEAD_PATH).read_bytes())
        for path in [RUN_PATH, *sorted(head.files())]:
            if not (self.served / path).exists():
                data = (self.staging / path).read_bytes()
                if path.startswith("deltas/") and step_of(path) == corrupt_step:
                    data = data[:-64] + bytes(b ^ 0x5A for b in data[-64:])
                write_atomic(self.served / path, data)
        write_atomic(self.served / HEAD_PATH, (self.staging / HEAD_PATH).read_bytes())

    def replica_record(self, replica: str, step: int) -> telemetry.ReplicaRecord:
        path = self.served / f"{telemetry.REPLICAS_DIR}/{replica}/step-{step:08d}.json"
        return telemetry.from_json(telemetry.ReplicaRecord, path.read_bytes(), str(path))


def perturb(state: dict[str, torch.Tensor], seed: int, big: bool) -> dict[str, torch.Tensor]:
    """Like an optimizer step: ~3% of the bf16 weights move by about one ulp (`big`: all move by ~50%)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        moved = torch.rand(t.shape, generator=g) < (1.0 if big else 0.03)
        scale = 1 + (0.5 if big else 0.012) * torch.randn(t.shape, generator=g)
        out[name] = torch.where(moved, (t.float() * scale).to(torch.bfloat16), t)
    return out


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def post_with_length(url: str, path: str, length: str, body: bytes = b"{}") -> int:
    """The status of a POST to `url` + `path` that sends `body` under the Content-Length header `length`,
    whatever text that is (HTTP clients compute the header themselves)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", length)
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


def delta_file(root, step: int) -> Path:
    """The delta of `step` in the folder `root`, whichever writer's tag its name carries (exactly one)."""
    (path,) = Path(root).glob(f"deltas/step-{step:08d}*.safetensors")
    return path


def window_parts(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    spans: list[tuple[int, int]],
    step: int = 2,
    base_step: int = 1,
    encoding: str = "compact",
    chunk: int = 7,
    whole: tuple[str, ...] = (),
) -> list[bytes]:
    """The step from bf16 `old` to `new` as one patch per span, as the ranks of a sharded publisher write
    it: part i holds flat elements [lo, hi) of spans[i] of every tensor (capped at its size), but the tensors
    in `whole`, which part 0 holds whole."""
    from deltasync.codec import fingerprint
    from deltasync.codec import patch as patches

    shapes = {n: list(t.shape) for n, t in old.items()}
    numel = sum(t.numel() for t in old.values())
    fp, parts = state_fingerprint(old), []
    for i, (lo, hi) in enumerate(spans):
        windows = {
            n: (lo, min(hi, t.numel()) - lo) for n, t in old.items() if n not in whole and lo < t.numel()
        }
        part_old = {n: old[n].reshape(-1)[s : s + k] for n, (s, k) in windows.items()}
        part_new = {n: new[n].reshape(-1)[s : s + k] for n, (s, k) in windows.items()}
        for n in whole if i == 0 else ():
            part_old[n], part_new[n] = old[n], new[n]
        changes, moved = patches.window_changes(part_old, part_new, windows)
        patch = patches.Patch(step, base_step, numel, fp, (fp + moved) & fingerprint.MASK64, changes)
        parts.append(patches.encode(patch, part_old, encoding, chunk=chunk, windows=windows, shapes=shapes))
        fp = patch.fingerprint
    return parts

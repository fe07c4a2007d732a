"""Each Space bundle that `python -m trainer.deploy --dry-run` writes runs from its own folder alone.

The three apps start at once (vLLM's engine start dominates: ~20-60 s on 2 cores), each with cwd = its
bundle and a `sitecustomize` that takes the repo's editable install off the import system: `shared` can then
only come from the bundle (`trainer` not at all), and every process that imports `shared` (vLLM's engine
process too) writes where it found it to a log the test reads. The inference and dashboard apps follow a
local sync root holding one anchor of a tiny Qwen3: each shows it read the run through its bundle's `shared/`.
"""

import json
import os
import sys
import time
import urllib.request

import pytest
from safetensors.torch import load_file

from deltasync.sync.publisher import Publisher
from trainer import deploy
from trainer.processes import free_port, log_tail, start_process, stop_process, wait_healthy
from trainer.tiny_model import build_tiny_model

HEALTH = {"env": "/health", "inference": "/health", "dashboard": "/api/summary"}
ISOLATE = '''"""Test only: drop the repo's editable install from the import system; log imports of shared."""
import json
import os
import sys
from importlib.machinery import PathFinder

pytestmark = pytest.mark.slow  # starts vLLM

sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]


class _LogShared:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "shared":
            return None
        spec = PathFinder.find_spec(name, path)
        with open(os.environ["SHARED_IMPORT_LOG"], "a") as log:
            log.write(json.dumps({"pid": os.getpid(), "origin": spec and spec.origin}) + "\\n")
        return spec


sys.meta_path.insert(0, _LogShared)
'''


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """The deploy's dry-run bundles, an app started from each. Yields (bundles, logs, {app: url})."""
    tmp = tmp_path_factory.mktemp("bundles")
    bundles, logs, isolate = tmp / "bundles", tmp / "logs", tmp / "isolate"
    deploy.main(["--namespace", "test", "--dry-run", str(bundles)])
    isolate.mkdir()
    (isolate / "sitecustomize.py").write_text(ISOLATE)
    model = build_tiny_model(tmp / "tiny-qwen3")
    root = tmp / "sync-root"
    publisher = Publisher(str(root), model=str(model))
    publisher.publish(load_file(model / "model.safetensors"), 0)
    publisher.close()

    procs, urls = {}, {}
    try:
        for app in HEALTH:
            port = free_port()
            urls[app] = f"http://127.0.0.1:{port}"
            env = {
                **os.environ,
                "PYTHONPATH": str(isolate),  # replaces any PYTHONPATH that might lead to the repo
                "SHARED_IMPORT_LOG": str(logs / f"{app}.imports"),
                "HOST": "127.0.0.1",
                "PORT": str(port),
                "SYNC_ROOT": str(root),
                "MODEL": str(model),
                "POLL_S": "0.2",
                "VLLM_ARGS": "--enforce-eager",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            procs[app] = start_process(
                [sys.executable, "app.py"], logs / f"{app}.log", env, cwd=bundles / app
            )
        for app, proc in procs.items():
            wait_healthy(
                proc, urls[app] + HEALTH[app], logs / f"{app}.log", 600 if app == "inference" else 120
            )
        yield bundles, logs, urls
    finally:
        for proc in procs.values():
            stop_process(proc, grace_s=30)


def test_env_answers(apps):
    _, _, urls = apps
    assert get_json(urls["env"] + "/health")["status"] == "healthy"


def test_dashboard_reads_the_run(apps):
    _, _, urls = apps
    assert get_json(urls["dashboard"] + "/api/summary")["steps"] == 1  # the anchor


def test_inference_loads_the_anchor(apps):
    _, logs, urls = apps
    status = get_json(urls["inference"] + "/weights")
    for _ in range(120):
        if status["step"] == 0:
            break
        time.sleep(0.5)
        status = get_json(urls["inference"] + "/weights")
    assert status["step"] == 0 and status["last_error"] is None, (status, log_tail(logs / "inference.log"))


def test_shared_comes_from_each_bundle(apps):
    bundles, logs, _ = apps
    for app in HEALTH:
        imports = [json.loads(line) for line in (logs / f"{app}.imports").read_text().splitlines()]
        assert imports and all(
            i["origin"] == str(bundles / app / "shared" / "__init__.py") for i in imports
        ), (
            app,
            imports,
        )
    # vLLM's engine process imports shared too (the worker extension applies patches with it)
    assert (
        len({i["pid"] for i in map(json.loads, (logs / "inference.imports").read_text().splitlines())}) >= 2
    )

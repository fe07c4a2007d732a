import os

import pytest
import torch
from huggingface_hub import constants

if not torch.cuda.is_available():
    # Triton chooses between compiling and interpreting a kernel when it is defined, its own library's kernels
    # (tl.sum, ...) at its first import. Import it interpreted before any test module (or vLLM) does, so that
    # tests/deltasync/codec/test_gpu.py can run the GPU kernels on the CPU whatever was collected first; then
    # drop the variable, so that the processes the tests start do not inherit it.
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401

    del os.environ["TRITON_INTERPRET"]

import trainer  # noqa: F401  (the project's environment defaults, for the processes the tests start)
from bench import load_space_app
from tests.fakehub import FakeHub


@pytest.fixture(scope="session")
def _fake_hub_server(tmp_path_factory):
    hub = FakeHub(tmp_path_factory.mktemp("fake-hub-cas"))
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def fake_hub(_fake_hub_server, monkeypatch):
    """A fake Hub served from this process (empty for each test) that HfApi clients created in the test, and
    the processes it starts (HF_ENDPOINT and HF_TOKEN are in their environment), talk to.

    Yields the FakeHub: `.endpoint`, `.token` (also set as HF_TOKEN), `.client_cache` (HF_XET_CACHE),
    `.buckets`, `.requests`, `.fail_status`, and the Hub's terms (quotas, windows, pages, change feed, stale
    reads, lost responses: tests/fakehub.py).
    """
    hub = _fake_hub_server
    hub.reset()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    # huggingface_hub reads HF_ENDPOINT once, at import: point the already imported module at the fake too.
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    monkeypatch.setenv("HF_XET_CACHE", str(hub.client_cache))
    return hub


@pytest.fixture(scope="session")
def dashboard():
    """The dashboard Space's app.py, imported in this process."""
    return load_space_app("dashboard")

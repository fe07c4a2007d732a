import pytest
from huggingface_hub import constants

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
    """An in-process fake Hub (empty for each test) that HfApi clients created in the test talk to.

    Yields the FakeHub: `.endpoint`, `.token` (also set as HF_TOKEN), `.buckets`, `.requests`, `.fail_status`,
    and the Hub's terms (quotas, windows, pages, change feed, stale reads, lost responses: tests/fakehub.py).
    """
    hub = _fake_hub_server
    hub.reset()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    # huggingface_hub reads HF_ENDPOINT once, at import: point the already imported module at the fake too.
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    return hub


@pytest.fixture(scope="session")
def dashboard():
    """The dashboard Space's app.py, imported in this process."""
    return load_space_app("dashboard")

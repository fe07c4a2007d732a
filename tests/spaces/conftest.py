import pytest

from bench import load_space_app


@pytest.fixture(scope="session")
def dashboard():
    """The dashboard Space's app.py, imported in this process."""
    return load_space_app("dashboard")

"""Fixtures of the inference app's tests that start no engine: the app module (importing it imports vLLM) and
the tiny local model it is configured with."""

import pytest

from bench import load_space_app
from trainer.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def app():
    return load_space_app("inference")


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))

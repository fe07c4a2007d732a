import importlib
import sys

import pytest

from tests.helpers import DEVICE


@pytest.fixture(scope="module")
def gpu():
    """deltasync.codec.gpu, its kernels compiled for the GPU, or interpreted where there is none (the
    interpreter is chosen when the kernels are defined, so the module is imported afresh for these tests)."""
    if DEVICE == "cuda":
        yield importlib.import_module("deltasync.codec.gpu")
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        sys.modules.pop("deltasync.codec.gpu", None)
        yield importlib.import_module("deltasync.codec.gpu")
        sys.modules.pop("deltasync.codec.gpu", None)

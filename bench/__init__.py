"""Benchmarks: run from the repository root as modules, e.g. `python -m bench.codec`."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SPACES = Path(__file__).resolve().parents[1] / "spaces"


def load_space_app(space: str) -> ModuleType:
    """A Space's `app.py` as a module (the Spaces are applications, not packages)."""
    spec = importlib.util.spec_from_file_location(f"{space}_app", SPACES / space / "app.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the app's annotations through it
    spec.loader.exec_module(module)
    return module

"""The library as a user installs it: `import deltasync` from anywhere, nothing heavy behind it."""

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

LIBRARY = REPO / "shared" / "deltasync"
HEAVY = ("trl", "vllm", "openenv", "gradio")


def python_in(folder: Path, script: str) -> str:
    """What `script` prints, run by this interpreter in `folder` (outside the checkout); fails on an error."""
    out = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def core_modules() -> list[str]:
    """Every module of deltasync but its integrations (deltasync.vllm, deltasync.trl: they import those)."""
    names = []
    for path in sorted(LIBRARY.rglob("*.py")):
        parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
        if parts[1:2] not in (("vllm",), ("trl",)):
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_core_module_imports_from_outside_the_checkout_without_heavy_packages(tmp_path):
    modules = core_modules()
    assert "deltasync.codec.patch" in modules and "deltasync.sync.subscriber" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "import deltasync\n"
        f"print(json.dumps([deltasync.__file__, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
    )
    stdout = python_in(tmp_path, script)
    origin, heavy = json.loads(stdout.splitlines()[-1])
    assert Path(origin) == LIBRARY / "__init__.py" and heavy == []


def test_the_library_installs_no_generic_top_level_package(tmp_path):
    for name in ("shared", "trainer"):
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True)
        assert probe.returncode != 0, f"`import {name}` works outside the checkout"


def test_no_code_edits_the_import_path():
    edits = []
    for path in [*LIBRARY.rglob("*.py"), *(REPO / "trainer").rglob("*.py"), *(REPO / "spaces").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and getattr(node.value, "id", "") == "sys"
            ):
                edits.append(f"{path.relative_to(REPO)}:{node.lineno} sys.path")
            if isinstance(node, ast.Constant) and node.value == "PYTHONPATH":
                edits.append(f"{path.relative_to(REPO)}:{node.lineno} PYTHONPATH")
    assert edits == []


def test_the_public_api_imports_from_outside_the_checkout_and_loads_its_modules_on_use(tmp_path):
    script = (
        "import json, sys\n"
        "import deltasync\n"
        "light = sorted(m for m in ('torch', 'numba') if m in sys.modules)\n"
        "from deltasync import Publisher, Subscriber, open_storage\n"
        "names = {n: type(getattr(deltasync, n)).__name__ for n in deltasync.__all__}\n"
        "print(json.dumps([light, deltasync.__version__, Publisher.__module__, names]))\n"
    )
    stdout = python_in(tmp_path, script)
    light, version, module, names = json.loads(stdout.splitlines()[-1])
    assert light == []  # the dashboard's Space has no torch: `import deltasync` must not need it
    assert version == importlib.metadata.version("deltasync")
    assert module == "deltasync.sync.publisher"
    assert {"Publisher", "PublisherConfig", "TensorsApplier", "diff", "PatchError"} <= set(names)
    assert names["__version__"] == "str" and names["Publisher"] == "type" and names["diff"] == "function"


def test_the_codec_the_publisher_and_a_folder_root_load_no_hub_client(tmp_path):
    """GPU images carry older huggingface_hub releases: the Hub backend loads with the first Hub root."""
    script = (
        "import sys\n"
        "from deltasync import Publisher, Subscriber, telemetry\n"
        "from deltasync.codec import gpu, patch\n"
        "from deltasync.storage import open_storage\n"
        "open_storage('root')\n"
        "print('deltasync.storage.hub' in sys.modules)\n"
        "from deltasync.storage import HubBucketStorage\n"
        "print(HubBucketStorage.__module__)\n"
    )
    stdout = python_in(tmp_path, script)
    assert stdout.split() == ["False", "deltasync.storage.hub"]


def test_the_type_checkers_names_are_the_lazy_ones():
    """deltasync/__init__.py names each public object twice: lazily for Python (`_EXPORTS`, whose keys are
    `__all__`), and under TYPE_CHECKING for type checkers. Both must name the same object."""
    tree = ast.parse((LIBRARY / "__init__.py").read_text())
    (exports,) = (n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "_EXPORTS")
    pairs = zip(exports.keys, exports.values, strict=True)
    lazy = {k.value: (v.elts[0].value, v.elts[1].value) for k, v in pairs}
    (checking,) = (n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {a.asname or a.name: (i.module, a.name) for i in checking.body for a in i.names}
    assert typed == lazy


def test_importing_the_trl_integration_warns_nothing_of_trls(tmp_path):
    """TRL 1.16 warns on import that its API is experimental and that it was tested with vLLM <= 0.31: both
    known and harmless here, and not the user's to act on (deltasync.trl.compat)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXPERIMENTAL_SILENCE", "PYTHONWARNINGS")}
    out = subprocess.run(
        [sys.executable, "-c", "import deltasync.trl"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "TRL currently supports vLLM" not in out.stderr and "trl.experimental" not in out.stderr

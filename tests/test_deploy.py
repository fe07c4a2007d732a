"""`python -m trainer.deploy`: the bundles it writes (--dry-run), and a whole deploy through the real
huggingface_hub client against the fake Hub (tests/fakehub.py). The live Hub is not reached from here."""

import io
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from deltasync.sync.signing import SigningKey
from tests.helpers import REPO
from trainer import deploy

API_TOKEN = "api-token-never-printed"
SPACE_TOKEN = "hf_space_token_never_printed"


def tree(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `folder`."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def tracked(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file git tracks under `folder`: all a bundle may take from it."""
    git = ["git", "-C", str(REPO), "ls-files", "-z", "--", str(folder.relative_to(REPO))]
    names = subprocess.run(git, capture_output=True, check=True, text=True).stdout.split("\0")
    paths = [REPO / name for name in names if name and (REPO / name).is_file()]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in paths}


# Build leftovers, and a file git does not track: none may reach a bundle.
LEFTOVERS = (
    "zz-leftover.egg-info/PKG-INFO",
    ".venv/pyvenv.cfg",
    "__pycache__/app.cpython-311.pyc",
    "wordle_env/zz_leftover.pyc",
    "zz-untracked-notes.txt",
)
LEFTOVER = re.compile(r"(^|/)(\.venv|__pycache__|[^/]*\.egg-info)(/|$)|\.pyc$|zz-untracked")


@pytest.fixture
def env_leftovers():
    """LEFTOVERS written into spaces/env for the test, and removed after (files already there are kept)."""
    made: list[Path] = []  # the outermost path created for each leftover
    try:
        for name in LEFTOVERS:
            path = REPO / "spaces" / "env" / name
            if path.exists():
                continue
            top = path
            while not top.parent.exists():
                top = top.parent
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("left by a local build")
            made.append(top)
        yield
    finally:
        for top in reversed(made):
            if top.is_dir():
                shutil.rmtree(top)
            else:
                top.unlink(missing_ok=True)


def check_bundle(app: str, files: dict[str, bytes]) -> None:
    """The files git tracks in the app's folder, the apps' shared `appkit` package beside them, and for the
    apps that import deltasync the library wheel (exactly the package's tracked modules); the env none."""
    wheels = {p: files.pop(p) for p in list(files) if p.startswith("wheels/")}
    kit = {p.removeprefix("appkit/"): files.pop(p) for p in list(files) if p.startswith("appkit/")}
    assert files == tracked(REPO / "spaces" / app), app
    assert kit == tracked(REPO / "spaces" / "appkit" / "appkit"), app
    if app == "env":
        assert wheels == {}
        return
    ((name, wheel),) = wheels.items()
    assert name == "wheels/deltasync-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(wheel)) as z:
        modules = {
            n.removeprefix("deltasync/"): z.read(n) for n in z.namelist() if n.startswith("deltasync/")
        }
        requires = z.read("deltasync-0.1.0.dist-info/METADATA").decode()
    assert modules == tracked(REPO / "shared" / "deltasync"), app
    assert "pydantic-settings" not in requires  # the settings are the apps' (appkit), not the library's


def test_dry_run_writes_self_contained_bundles(tmp_path, capsys, monkeypatch, env_leftovers):
    monkeypatch.delenv("API_TOKEN", raising=False)
    out = tmp_path / "bundles"
    (out / "env").mkdir(parents=True)
    (out / "env" / "stale.py").write_text("a file from an earlier dry run")
    deploy.main(["--namespace", "alice", "--dry-run", str(out)])
    printed = capsys.readouterr().out
    for app in deploy.APPS:
        files = tree(out / app)
        assert not [p for p in files if LEFTOVER.search(p)], app
        check_bundle(app, files)
        assert deploy.front_matter(out / app / "README.md")["sdk"] == "docker"
    plan = json.loads((out / "plan.json").read_text())
    command = (
        "python -m trainer --sync_root hf://buckets/alice/deltasync"
        " --inference_url https://alice-deltasync-inference.hf.space"
        " --env_url https://alice-deltasync-env.hf.space --model Qwen/Qwen3-0.6B"
    )
    assert plan["trainer_command"] == command and command in printed
    inference, env, dashboard = plan["spaces"]
    assert inference == {
        "app": "inference",
        "repo_id": "alice/deltasync-inference",
        "sdk": "docker",
        "variables": {"SYNC_ROOT": "hf://buckets/alice/deltasync", "MODEL": "Qwen/Qwen3-0.6B"},
        "secrets": ["HF_TOKEN"],
        "hardware": "l4x1",
    }
    assert (env["variables"], env["secrets"], env["hardware"]) == ({}, [], None)
    assert (dashboard["variables"], dashboard["secrets"]) == (
        {"SYNC_ROOT": "hf://buckets/alice/deltasync"},
        ["HF_TOKEN"],
    )
    assert "nothing was sent to the Hub" in printed


def test_space_host():
    assert deploy.space_host("Alice_B/my.space") == "alice-b-my-space.hf.space"


def test_deploy_through_the_hub_client(fake_hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("API_TOKEN", API_TOKEN)
    monkeypatch.setenv("SPACE_HF_TOKEN", SPACE_TOKEN)
    key = tmp_path / "trainer.key"  # created by the first deploy, reused by the second
    argv = ["--namespace", "alice", "--private", "--hardware", "a10g-small", "--model", "org/policy"]
    argv += ["--signing-key", str(key)]
    deploy.main(argv)
    # A second deploy reuses what exists and mirrors the bundles: a file gone from a bundle leaves the Space.
    fake_hub.spaces["alice/deltasync-env"].files["stray.txt"] = b"left by hand"
    deploy.main(argv)
    printed = capsys.readouterr()

    assert "alice/deltasync" in fake_hub.buckets
    public = SigningKey.load(key).public
    assert (tmp_path / "trainer.key.pub").read_text() == public + "\n"
    assert printed.out.count(f"New signing key: {key} (private: keep it with the trainer)") == 1
    assert (
        f"--signing_key {key}" in printed.out
        and "Signed steps: the inference Space serves only" in printed.out
    )
    assert "PRIVATE KEY" not in printed.out + printed.err
    sync_root = {"SYNC_ROOT": "hf://buckets/alice/deltasync"}
    want = {
        "inference": (
            "docker",
            {**sync_root, "MODEL": "org/policy", "TRUSTED_KEYS": public},
            {"HF_TOKEN": SPACE_TOKEN, "API_TOKEN": API_TOKEN},
        ),
        "env": ("docker", {}, {}),
        "dashboard": ("docker", sync_root, {"HF_TOKEN": SPACE_TOKEN}),
    }
    for app, (sdk, variables, secrets) in want.items():
        space = fake_hub.spaces[f"alice/deltasync-{app}"]
        assert (space.sdk, space.private, space.variables, space.secrets) == (sdk, True, variables, secrets)
        check_bundle(app, dict(space.files))
        assert space.hardware == ("a10g-small" if app == "inference" else None)
        assert f"https://alice-deltasync-{app}.hf.space" in printed.out

    assert "--model org/policy" in printed.out and "API_TOKEN is set" in printed.out
    assert "are private" in printed.out
    for token in (API_TOKEN, SPACE_TOKEN, fake_hub.token):
        assert token not in printed.out + printed.err
        assert not any(token in request for request in fake_hub.requests)


def test_a_signing_key_that_is_no_key_stops_the_deploy_with_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a key")
    with pytest.raises(SystemExit, match="^--signing-key: .*notes.txt: not a private key file"):
        deploy.main(["--namespace", "alice", "--signing-key", str(tmp_path / "notes.txt")])


def test_deploy_without_a_token(monkeypatch):
    monkeypatch.setattr(deploy, "get_token", lambda: None)  # neither HF_TOKEN nor a login cache
    with pytest.raises(SystemExit, match="No Hugging Face token"):
        deploy.main(["--namespace", "alice"])


def test_bundle_outside_a_checkout_leaves_build_leftovers_out(tmp_path, monkeypatch):
    """An unpacked source archive (no git): the ignore rule keeps the leftovers out instead."""
    source = tmp_path / "unpacked" / "spaces" / "env"
    local_builds = shutil.ignore_patterns("*.egg-info", "__pycache__")  # this checkout's own
    shutil.copytree(REPO / "spaces" / "env", source, ignore=local_builds)
    for name in LEFTOVERS:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("left by a local build")
    monkeypatch.setattr(deploy, "REPO", tmp_path / "unpacked")
    deploy.copy_sources(source, tmp_path / "bundle")
    files = tree(tmp_path / "bundle")
    assert [p for p in files if LEFTOVER.search(p)] == ["zz-untracked-notes.txt"]
    assert set(files) - {"zz-untracked-notes.txt"} == set(tracked(REPO / "spaces" / "env"))


# What names a file or folder in a README: a relative path under one of these folders, or a file name with
# one of these suffixes. URLs, Hub ids (Qwen/Qwen3-0.6B), sync-root keys (heads/latest.json) and routes
# (/v1/models) are none of these.
FOLDERS = "shared|trainer|spaces|tests|bench|docs|examples|\\.venv|wheels|appkit|wordle_env"
PATH = re.compile(
    rf"(?<![\w/.:-])((?:{FOLDERS})/[\w./*-]*|[\w./*-]*[\w*]\.(?:py|md|toml|txt|whl|cfg|yaml))(?![\w/])"
)
LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")


def test_bundle_readmes_name_only_what_the_bundle_holds(tmp_path):
    """A Space's README is all its users see: every path and relative link in it is in the bundle."""
    deploy.build_bundles(deploy.make_plan("alice"), tmp_path)
    for app in deploy.APPS:
        bundle = tmp_path / app
        text = (bundle / "README.md").read_text()
        links = [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
        named = {p.rstrip(".") for p in PATH.findall(text)} | set(links)
        missing = sorted(p for p in named if not list(bundle.glob(p.rstrip("/"))))
        assert not missing, f"{app}: its README names {missing}, which its bundle lacks"

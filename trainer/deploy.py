"""Deploy the system to the Hugging Face Hub: one bucket (the sync root) and three Spaces.

    python -m trainer.deploy --namespace NS [--private] [--hardware l4x1] [--model Qwen/Qwen3-0.6B]
    python -m trainer.deploy --namespace NS --dry-run DIR      # write the bundles to DIR, contact nothing
    python -m trainer.deploy --namespace NS --signing-key trainer.key   # signed steps (below)

Creates (or reuses) the bucket `NS/<bucket>` and three Docker Spaces: `NS/<prefix>-inference` (vLLM on a
GPU), `NS/<prefix>-env` (Wordle, CPU) and `NS/<prefix>-dashboard` (CPU); uploads each Space's bundle (its
folder under `spaces/`, the apps' shared `appkit` package, and the deltasync wheel for the inference and
dashboard Spaces), sets the Space variables
(SYNC_ROOT, MODEL) and secrets, requests the inference Space's GPU, and prints the URLs and the trainer
command. Re-running updates everything in place; files dropped from a bundle leave its Space too.

--signing-key FILE: signed steps. The key pair is created if FILE does not exist (as `deltasync keygen`:
FILE readable by its owner only, FILE.pub the public line); the inference Space's TRUSTED_KEYS is set to its
public key, and the trainer command printed signs with it (--signing_key FILE). Keep FILE with the trainer:
whoever holds it can publish steps the replicas serve.

Tokens, read from the environment and never printed or logged:
    HF_TOKEN        authenticates this deploy (else the login cache of `hf auth login`); write access to NS
    SPACE_HF_TOKEN  the token the Spaces get as their HF_TOKEN secret (default: the deploying token). Better:
                    a fine-grained token with write access to the bucket only (the replica writes telemetry)
    API_TOKEN       optional: bearer token the inference Space demands on /v1/*; the trainer sends it when
                    run with INFERENCE_API_TOKEN set to the same value
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from huggingface_hub import HfApi, SpaceHardware, get_token

from deltasync.sync.signing import SigningKey, short

REPO = Path(__file__).resolve().parents[1]
APPS = ("inference", "env", "dashboard")
LIBRARY_APPS = ("inference", "dashboard")  # the apps that import deltasync (the env needs only appkit)
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
DEFAULT_HARDWARE = "l4x1"  # vLLM's bf16 needs compute capability >= 8.0: not T4
# Outside a git checkout, what never goes into a bundle: caches and what builds and local runs leave behind.
BUNDLE_IGNORE = shutil.ignore_patterns(
    "__pycache__", "*.pyc", "*.egg-info", ".venv", "build", "dist", ".pytest_cache", ".DS_Store"
)


@dataclass(frozen=True)
class SpacePlan:
    """One Space: which app, where, and how it is configured (secret names only, never values)."""

    app: str
    repo_id: str
    sdk: str
    variables: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    hardware: str | None = None  # requested after the upload; None keeps the free cpu-basic

    @property
    def url(self) -> str:
        """Where the running app answers (the Space's own host, not its page on the Hub)."""
        return f"https://{space_host(self.repo_id)}"


@dataclass(frozen=True)
class Plan:
    """Everything a deploy creates; `--dry-run` writes it as plan.json beside the bundles."""

    namespace: str
    bucket_id: str
    model: str
    private: bool
    spaces: tuple[SpacePlan, ...]
    signing_key: str | None = None  # the trainer's private key file (its public key is TRUSTED_KEYS)

    @property
    def sync_root(self) -> str:
        return f"hf://buckets/{self.bucket_id}"

    def space(self, app: str) -> SpacePlan:
        return next(s for s in self.spaces if s.app == app)

    def trainer_command(self) -> str:
        """The local trainer run that feeds this deployment."""
        argv = ["python", "-m", "trainer", "--sync_root", self.sync_root]
        argv += ["--inference_url", self.space("inference").url, "--env_url", self.space("env").url]
        argv += ["--model", self.model]
        return shlex.join([*argv, *(["--signing_key", self.signing_key] if self.signing_key else [])])


def space_host(repo_id: str) -> str:
    """The Space's subdomain on hf.space: `owner-name`, lower case, other characters turned into dashes."""
    return re.sub(r"[^a-z0-9]+", "-", repo_id.lower()).strip("-") + ".hf.space"


def front_matter(readme: Path) -> dict:
    """The YAML block at the top of a Space README (the Hub reads sdk, app_port, ... from it)."""
    text = readme.read_text()
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        raise ValueError(f"{readme}: no YAML front matter")
    meta = yaml.safe_load(text[4:].split("\n---\n", 1)[0])
    if not isinstance(meta, dict) or "sdk" not in meta:
        raise ValueError(f"{readme}: the front matter names no sdk")
    return meta


def make_plan(
    namespace: str,
    bucket: str = "deltasync",
    prefix: str = "deltasync",
    model: str = DEFAULT_MODEL,
    hardware: str = DEFAULT_HARDWARE,
    private: bool = False,
    api_token: bool = False,
    signing: tuple[str, str] | None = None,
) -> Plan:
    """What to create for `namespace`. `api_token`: whether the inference Space gets an API_TOKEN secret;
    `signing`: the trainer's private key file and its public key, which the inference Space trusts."""
    bucket_id = f"{namespace}/{bucket}"
    sync_root = f"hf://buckets/{bucket_id}"
    sdk = {app: front_matter(REPO / "spaces" / app / "README.md")["sdk"] for app in APPS}
    spaces = (
        SpacePlan(
            "inference",
            f"{namespace}/{prefix}-inference",
            sdk["inference"],
            {"SYNC_ROOT": sync_root, "MODEL": model, **({"TRUSTED_KEYS": signing[1]} if signing else {})},
            ("HF_TOKEN", "API_TOKEN") if api_token else ("HF_TOKEN",),
            hardware,
        ),
        SpacePlan("env", f"{namespace}/{prefix}-env", sdk["env"]),
        SpacePlan(
            "dashboard",
            f"{namespace}/{prefix}-dashboard",
            sdk["dashboard"],
            {"SYNC_ROOT": sync_root},
            ("HF_TOKEN",),
        ),
    )
    return Plan(namespace, bucket_id, model, private, spaces, signing[0] if signing else None)


def signing_key(path: str) -> tuple[str, str]:
    """The key file `path` and its public key: the key read if the file exists, else a new pair written (as
    `deltasync keygen`: `path` for its owner only, `path`.pub), said in a line. ValueError for a file that
    holds no private key."""
    if Path(path).exists():
        return path, SigningKey.load(path).public
    key = SigningKey.generate()
    key.save(path)
    print(
        f"New signing key: {path} (private: keep it with the trainer), public key in {path}.pub", flush=True
    )
    return path, key.public


def build_bundle(app: str, dest: Path) -> Path:
    """Write a self-contained Space bundle for `app` to `dest` (replaced if present): the app's folder
    (app.py, README.md with the Space front matter, Dockerfile, requirements.txt, ...), the `appkit` package
    beside app.py, and for LIBRARY_APPS the library's wheel in `wheels/`, which the Dockerfile installs."""
    source = REPO / "spaces" / app
    for needed in ("app.py", "README.md", "requirements.txt", "Dockerfile"):
        if not (source / needed).is_file():
            raise FileNotFoundError(f"{source / needed} is missing")
    front_matter(source / "README.md")
    if dest.exists():
        shutil.rmtree(dest)
    copy_sources(source, dest)
    copy_sources(REPO / "spaces" / "appkit" / "appkit", dest / "appkit")
    if app in LIBRARY_APPS:
        build_library_wheel(dest / "wheels")
    return dest


def build_library_wheel(out: Path) -> Path:
    """The deltasync wheel, built from a clean copy of its sources (a reused build/ keeps stale files)."""
    with tempfile.TemporaryDirectory(prefix="deltasync-wheel-") as tmp:
        src = Path(tmp) / "src"
        copy_sources(REPO / "shared" / "deltasync", src / "shared" / "deltasync")
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, src / name)
        pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        subprocess.run([*pip, "-w", str(out), str(src)], check=True, stdout=subprocess.DEVNULL)
    return next(out.glob("deltasync-*.whl"))


def copy_sources(source: Path, dest: Path) -> None:
    """Copy the sources under `source` to `dest`: in a git checkout the files git tracks there (never build
    leftovers or stray local files), else every file but BUNDLE_IGNORE's."""
    git = ["git", "-C", str(REPO), "ls-files", "-z", "--", str(source.relative_to(REPO))]
    try:
        listed = subprocess.run(git, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout: an unpacked source archive
        shutil.copytree(source, dest, ignore=BUNDLE_IGNORE)
        return
    for name in listed.decode().split("\0"):
        path = REPO / name
        if name and path.is_file():  # a tracked file deleted in the work tree is gone from the bundle too
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def build_bundles(plan: Plan, out: Path) -> dict[str, Path]:
    """All three bundles under `out/<app>`, and `out/plan.json` (no secret values in it)."""
    out.mkdir(parents=True, exist_ok=True)
    bundles = {s.app: build_bundle(s.app, out / s.app) for s in plan.spaces}
    plan_json = {**asdict(plan), "sync_root": plan.sync_root, "trainer_command": plan.trainer_command()}
    (out / "plan.json").write_text(json.dumps(plan_json, indent=2) + "\n")
    return bundles


def deploy(api: HfApi, plan: Plan, bundles: dict[str, Path], secrets: dict[str, str]) -> None:
    """Create or update the bucket and the Spaces. `secrets` maps secret names to values; a Space gets those
    its plan names. Variables and secrets go in before the upload, so the first build already has them."""
    api.create_bucket(plan.bucket_id, private=plan.private, exist_ok=True)
    for space in plan.spaces:
        api.create_repo(
            space.repo_id, repo_type="space", space_sdk=space.sdk, private=plan.private, exist_ok=True
        )
        for key, value in space.variables.items():
            api.add_space_variable(space.repo_id, key, value)
        for key in space.secrets:
            api.add_space_secret(space.repo_id, key, secrets[key])
        api.upload_folder(
            repo_id=space.repo_id,
            repo_type="space",
            folder_path=bundles[space.app],
            commit_message="deltasync deploy",
            delete_patterns="*",  # the Space mirrors the bundle: files dropped from it go away
        )
        if space.hardware:
            api.request_space_hardware(space.repo_id, SpaceHardware(space.hardware))
        print(f"  {space.app:<9} {api.endpoint}/spaces/{space.repo_id}", flush=True)


def report(plan: Plan, endpoint: str, dry_run: Path | None) -> str:
    """What was (or would be) deployed, and how to train against it. Holds no secret values."""
    lines = [
        f"bucket     {endpoint}/buckets/{plan.bucket_id}  (sync root {plan.sync_root})",
        *(
            f"{s.app:<10} {s.url}  ({s.sdk}, {s.hardware or 'cpu-basic'}; "
            f"variables {', '.join(s.variables) or '-'}; secrets {', '.join(s.secrets) or '-'})"
            for s in plan.spaces
        ),
        "",
        "Train against it (from the repo, after `make setup`; HF_TOKEN needs write access to the bucket):",
        f"  {plan.trainer_command()}",
    ]
    if plan.private:
        lines += [
            "",
            "The Spaces are private: their hosts answer only requests that carry an HF token, and the",
            "trainer sends none to them. Make the inference and env Spaces public (or add a proxy) to train.",
        ]
    if plan.signing_key:
        trusted = plan.space("inference").variables["TRUSTED_KEYS"]
        lines += [
            "",
            f"Signed steps: the inference Space serves only what {short(trusted)} signs (TRUSTED_KEYS);",
            f"the trainer signs with {plan.signing_key}: keep it secret (its holder can publish weights).",
        ]
    if "API_TOKEN" in plan.space("inference").secrets:
        lines += [
            "",
            "API_TOKEN is set: the inference Space answers /v1/* only with it as a bearer token. Run the",
            "trainer with INFERENCE_API_TOKEN set to the same value (it is read from the environment only).",
        ]
    if dry_run is not None:
        lines += ["", f"Dry run: bundles and plan.json written to {dry_run}; nothing was sent to the Hub."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True, help="user or organisation that owns everything")
    parser.add_argument("--bucket", default="deltasync", help="bucket name (default: %(default)s)")
    parser.add_argument(
        "--prefix", default="deltasync", help="Space names are PREFIX-inference, -env, -dashboard"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Hub id of the policy (default: %(default)s)")
    parser.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        choices=[h.value for h in SpaceHardware],
        metavar="FLAVOR",
        help="the inference Space's hardware: l4x1, a10g-small, l40sx1, a100-large, ... (default: l4x1)",
    )
    parser.add_argument("--private", action="store_true", help="make the bucket and the Spaces private")
    parser.add_argument(
        "--signing-key",
        metavar="FILE",
        help="sign the run: the trainer's private key file, created (with FILE.pub) if it does not exist; "
        "the inference Space trusts only its public key (TRUSTED_KEYS)",
    )
    parser.add_argument("--dry-run", type=Path, metavar="DIR", help="write the bundles to DIR and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    api_token = os.environ.get("API_TOKEN") or None
    try:
        signing = signing_key(args.signing_key) if args.signing_key else None
    except (OSError, ValueError) as e:
        sys.exit(f"--signing-key: {e}")
    plan = make_plan(
        args.namespace,
        args.bucket,
        args.prefix,
        args.model,
        args.hardware,
        args.private,
        api_token is not None,
        signing,
    )
    api = HfApi()
    if args.dry_run is not None:
        build_bundles(plan, args.dry_run)
        print(report(plan, api.endpoint, args.dry_run))
        return
    token = get_token()  # HF_TOKEN, else the login cache
    if not token:
        sys.exit(
            "No Hugging Face token: run `hf auth login` or set HF_TOKEN (write access to the namespace)."
        )
    secrets = {"HF_TOKEN": os.environ.get("SPACE_HF_TOKEN") or token}
    if api_token is not None:
        secrets["API_TOKEN"] = api_token
    with tempfile.TemporaryDirectory(prefix="deltasync-deploy-") as tmp:
        bundles = build_bundles(plan, Path(tmp))
        print(f"Deploying to {api.endpoint} as {args.namespace}:", flush=True)
        deploy(api, plan, bundles, secrets)
    print()
    print(report(plan, api.endpoint, None))


if __name__ == "__main__":
    main()

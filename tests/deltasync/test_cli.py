"""The `deltasync` command line, run as a user runs it (a process per command)."""

import argparse
import importlib.metadata
import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltasync import cli


def run(*args, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "deltasync.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_diff_apply_inspect(tmp_path):
    torch.manual_seed(0)
    old = {"model.w": torch.randn(64, 64), "model.b": torch.randn(64)}  # fp32: cast to bf16 by the CLI
    new = {n: t + 0.02 * torch.randn_like(t) * (torch.rand_like(t) < 0.2) for n, t in old.items()}
    save_file(old, tmp_path / "old.safetensors")
    save_file(new, tmp_path / "new.safetensors")
    for encoding in ("compact", "raw"):
        patch = tmp_path / f"{encoding}.safetensors"
        out = tmp_path / f"out-{encoding}.safetensors"
        r = run(
            "diff",
            tmp_path / "old.safetensors",
            tmp_path / "new.safetensors",
            "-o",
            patch,
            "--encoding",
            encoding,
        )
        assert r.returncode == 0, r.stderr
        r = run("apply", tmp_path / "old.safetensors", patch, "-o", out)
        assert r.returncode == 0, r.stderr
        result = load_file(out)
        for name, t in new.items():
            assert result[name].dtype == torch.bfloat16
            assert torch.equal(result[name].view(torch.int16), t.bfloat16().view(torch.int16))
        info = json.loads(run("inspect", patch).stdout)
        changed = sum(int((t.bfloat16() != old[n].bfloat16()).sum()) for n, t in new.items())
        assert info["encoding"] == encoding and info["changed"] == changed and info["step"] == 1
        assert info["payload_bytes"] == patch.stat().st_size
        assert sum(t["changed"] for t in info["tensors"].values()) == changed


def test_errors_are_one_line_and_nonzero(tmp_path):
    save_file({"w": torch.zeros(4)}, tmp_path / "a.safetensors")
    save_file({"v": torch.zeros(4)}, tmp_path / "b.safetensors")
    r = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "-o", tmp_path / "p")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "tensor sets differ: missing 1 (w), unexpected 1 (v)" in r.stderr
    (tmp_path / "junk").write_bytes(b"\x00" * 3)
    r = run("inspect", tmp_path / "junk")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert f"{tmp_path / 'junk'}: not a safetensors file" in r.stderr
    r = run("apply", tmp_path / "a.safetensors", tmp_path / "missing", "-o", tmp_path / "o")
    assert r.returncode == 1 and "No such file" in r.stderr


def test_push_ls_pull_gc(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "model"  # an HF model folder with two shards
    folder.mkdir()
    states = []
    root = tmp_path / "root"
    for step in range(4):
        state = {"a.weight": torch.randn(32, 64), "b.weight": torch.randn(16, 64)}
        if step:
            state = {n: t.clone() for n, t in states[-1].items()}
            state["a.weight"][step] += 1.0
        states.append(state)
        save_file({"a.weight": state["a.weight"]}, folder / "model-00001-of-00002.safetensors")
        save_file({"b.weight": state["b.weight"]}, folder / "model-00002-of-00002.safetensors")
        r = run("push", root, folder, "--anchor-every", "3")
        assert r.returncode == 0, r.stderr
        pushed = json.loads(r.stdout)
        kinds = {0: ["anchor"], 3: ["delta", "anchor"]}.get(step, ["delta"])  # anchor every 3 steps
        assert (pushed["step"], pushed["kinds"]) == (step, kinds)
        written = [*root.glob(f"deltas/step-{step:08d}-*"), *root.glob(f"anchors/step-{step:08d}-*/*")]
        assert pushed["payload_bytes"] == sum(f.stat().st_size for f in written)
    rows = [json.loads(line) for line in run("ls", root).stdout.splitlines()]
    assert [(r["step"], r["kind"]) for r in rows] == [
        (0, "anchor"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (3, "anchor"),
    ]
    assert rows[1]["changed"] == 64 and all(r["bytes"] > 0 and r["published_at"] > 0 for r in rows)
    for step in (1, None):
        args = ["--step", step] if step is not None else []
        r = run("pull", root, "-o", tmp_path / f"out-{step}", *args)
        assert r.returncode == 0, r.stderr
        pulled = load_file(tmp_path / f"out-{step}" / "model.safetensors")
        expected = states[1 if step is not None else 3]
        for name, t in expected.items():
            assert torch.equal(pulled[name].view(torch.int16), t.bfloat16().view(torch.int16))
    (root / "anchors" / "step-00000002").mkdir()
    (root / "anchors" / "step-00000002" / "model.safetensors").write_bytes(b"orphan")
    (root / "deltas" / "notes.txt").write_bytes(b"not ours")  # only files named as a publisher names them
    deleted = ["anchors/step-00000002/model.safetensors", "anchors/step-00000002"]  # the folder it emptied
    assert json.loads(run("gc", root).stdout) == {"head": 3, "deleted": deleted}
    assert (root / "deltas" / "notes.txt").exists()
    r = run("pull", root, "-o", tmp_path / "o", "--step", "9")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "step 9 is not retained" in r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"deltasync {importlib.metadata.version('deltasync')}"


def test_every_command_and_argument_explains_itself():
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == set(cli.EXAMPLES)
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"deltasync {name} {action.dest}: no help"
        text = sub.format_help()
        assert f"example:\n  deltasync {name} " in text  # the epilog keeps its lines
        if "ROOT" in sub.format_usage():
            assert "hf://buckets/NS/NAME[/prefix]" in text and "fsspec URL" in text and "a folder" in text
    top = run("--help").stdout
    assert "hf://buckets/NS/NAME[/prefix]" in top and all(example in top for example in cli.EXAMPLES.values())


def test_errors_name_the_file_and_the_tensors(tmp_path):
    save_file({"w": torch.zeros(4), "u": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"v": torch.zeros(4), "u": torch.zeros(2)}, tmp_path / "b.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10" + b"\x00" * 7 + b"{not a header}..")
    for args in (
        ["diff", bad, tmp_path / "a.safetensors", "-o", tmp_path / "p"],
        ["push", tmp_path / "r", bad],
    ):
        r = run(*args)
        assert r.returncode == 1 and r.stderr.count("\n") == 1
        assert f"{bad}: not a readable safetensors file (Error while deserializing header" in r.stderr
    assert run("push", tmp_path / "root", tmp_path / "a.safetensors").returncode == 0
    r = run("push", tmp_path / "root", tmp_path / "b.safetensors")  # another model than the run's
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "tensor sets differ from the first published state: missing 1 (w), unexpected 1 (v)" in r.stderr


def test_a_hub_url_without_buckets_gets_a_hint():
    r = run("ls", "hf://alice/run-1/prefix")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "did you mean hf://buckets/alice/run-1/prefix?" in r.stderr


def test_push_anchor_encoding(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    for setting, written in (
        ("auto", None),
        ("packed", "packed"),
        ("plain", None),
    ):  # auto: plain in a folder
        root = tmp_path / setting
        r = run("push", root, tmp_path / "model.safetensors", "--anchor-encoding", setting)
        assert r.returncode == 0, r.stderr
        (anchor,) = (root / "anchors").glob("*/model.safetensors")
        with safe_open(anchor, "pt") as f:
            assert f.metadata().get("encoding") == written, setting


def test_the_first_run_says_it_compiles_the_kernels(tmp_path):
    torch.manual_seed(0)
    old = {"w": torch.randn(32, 32)}
    save_file(old, tmp_path / "old.safetensors")
    save_file({"w": old["w"] + 1}, tmp_path / "new.safetensors")
    cache = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # an empty cache: as after an install
    args = [
        "diff",
        tmp_path / "old.safetensors",
        tmp_path / "new.safetensors",
        "-o",
        tmp_path / "p",
        "--encoding",
        "raw",
    ]
    first, second = run(*args, env=cache), run(*args, env=cache)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert (
        first.stderr == "deltasync: compiling the codec's kernels for this command (then cached, ~10 s)...\n"
    )
    assert second.stderr == ""


def test_a_tensor_in_two_checkpoint_files_is_refused_naming_both(tmp_path, capsys):
    """A stale model.safetensors beside the shards must not win silently (push, diff and apply read both)."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    save_file({"w": torch.ones(4)}, folder / "model-00001-of-00001.safetensors")
    assert cli.main(["push", str(tmp_path / "root"), str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        f"'w' is in both {folder / 'model-00001-of-00001.safetensors'} and {folder / 'model.safetensors'}"
        in err
    )
    assert not (tmp_path / "root" / "heads").exists()


def test_a_folder_where_a_file_belongs_is_named_and_refused(tmp_path, capsys):
    folder = tmp_path / "patch"
    folder.mkdir()
    assert cli.main(["inspect", str(folder)]) == 1
    assert capsys.readouterr().err == f"deltasync inspect: error: {folder} is not a regular file\n"
    root = tmp_path / "root"
    (root / "heads" / "latest.json").mkdir(parents=True)
    assert cli.main(["pull", str(root), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{root / 'heads' / 'latest.json'} is not a regular file" in err, err
    assert "storage keeps failing" not in err  # refused, not retried as a transient failure


def test_version_and_help_import_no_torch():
    """They answer at once: the commands import torch (seconds) only when they run."""
    check = (
        "import sys\nfrom deltasync.cli import main\n"
        "for argv in (['--version'], ['--help'], ['push', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print([m for m in ('torch', 'numpy', 'huggingface_hub') if m in sys.modules], file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert r.stderr.strip() == "[]", r.stderr


def test_pull_writes_the_safetensors_file_that_o_names(tmp_path):
    state = {"w": torch.randn(8, 8)}
    save_file(state, tmp_path / "model.safetensors")
    root = tmp_path / "root"
    assert run("push", root, tmp_path / "model.safetensors").returncode == 0
    for out in (tmp_path / "old.safetensors", tmp_path / "new" / "old.safetensors"):
        r = run("pull", root, "-o", out)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["output"] == str(out)
        assert torch.equal(load_file(out)["w"].view(torch.int16), state["w"].bfloat16().view(torch.int16))
    (tmp_path / "notes.txt").write_text("mine")
    r = run("pull", root, "-o", tmp_path / "notes.txt")
    assert (
        r.returncode == 1 and r.stderr.count("\n") == 1 and "-o takes a folder or a .safetensors" in r.stderr
    )
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_ls_and_gc_of_a_folder_without_a_run_say_so(tmp_path, capsys):
    for command in ("ls", "gc"):
        assert cli.main([command, str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err == f"deltasync {command}: error: no run published at {tmp_path} yet\n"


def test_follow_refuses_a_poll_interval_that_would_never_pause(capsys):
    for bad in ("-1", "0", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exit:
            cli.build_parser().parse_args(["follow", "root", "--vllm-url", "http://x", "--poll-s", bad])
        assert exit.value.code == 2
        assert f"argument --poll-s: {bad!r}" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["follow", "root", "--vllm-url", "http://x", "--poll-s", "0.5"])
    assert args.poll_s == 0.5


def test_a_patch_with_metadata_nested_too_deeply_is_one_line(tmp_path, capsys):
    from deltasync.codec import patch as patches
    from tests.deltasync.codec.test_patch import DEEP, with_metadata

    old = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    save_file(old, tmp_path / "old.safetensors")
    data = patches.encode(patches.make_patch(old, {"w": torch.ones(8)}, 1, 0), old)
    bad = tmp_path / "p"
    bad.write_bytes(with_metadata(data, dense=DEEP))
    for args in (["inspect", bad], ["apply", tmp_path / "old.safetensors", bad, "-o", tmp_path / "o"]):
        assert cli.main(list(map(str, args))) == 1
        err = capsys.readouterr().err
        said = f"{bad}: bad patch metadata 'dense': JSON nested too deeply"
        assert err == f"deltasync {args[0]}: error: {said}\n"
    assert not (tmp_path / "o").exists()


def test_keygen_writes_a_key_pair_for_its_owner_and_never_replaces_one(tmp_path):
    key = tmp_path / "trainer.key"
    r = run("keygen", "--out", key)
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout)
    public = (tmp_path / "trainer.key.pub").read_text()
    assert said == {
        "public_key": public.strip(),
        "private_key_file": str(key),
        "public_key_file": f"{key}.pub",
    }
    assert public.startswith("ed25519:") and public.count("\n") == 1
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    private = key.read_bytes()
    assert private.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert b"PRIVATE" not in (r.stdout + r.stderr).encode()  # never shown
    for existing in (key, tmp_path / "other.key.pub"):
        (tmp_path / "other.key.pub").write_text("mine\n")
        out = existing if existing == key else tmp_path / "other.key"
        r = run("keygen", "--out", out)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "exists: keygen never replaces a key" in r.stderr
    assert key.read_bytes() == private and (tmp_path / "other.key.pub").read_text() == "mine\n"
    assert not (tmp_path / "other.key").exists()


def test_pull_with_a_trusted_key_verifies_the_signed_root_and_refuses_any_other(tmp_path, capsys):
    """One line for an unsigned root, another key's root, a bad key; push signs with --signing-key, and a
    signed root takes no unsigned push."""
    paths = {}
    for name in ("trainer", "other"):
        assert cli.main(["keygen", "--out", str(tmp_path / f"{name}.key")]) == 0
        paths[name] = tmp_path / f"{name}.key"
    public = json.loads(capsys.readouterr().out.splitlines()[0])["public_key"]  # the trainer's
    states = [{"w": torch.randn(16, 16)}]
    states.append({"w": states[0]["w"] + (torch.rand(16, 16) < 0.3)})
    for name in ("signed", "unsigned"):
        for step, state in enumerate(states):
            save_file(state, tmp_path / f"step-{step}.safetensors")
            key = ["--signing-key", str(paths["trainer"])] if name == "signed" else []
            assert (
                cli.main(["push", str(tmp_path / name), str(tmp_path / f"step-{step}.safetensors"), *key])
                == 0
            )
    capsys.readouterr()
    signed, unsigned = str(tmp_path / "signed"), str(tmp_path / "unsigned")
    for trusted in (public, f"{paths['trainer']}.pub", f"{paths['other']}.pub,{public}"):
        out = tmp_path / "out.safetensors"
        assert cli.main(["pull", signed, "-o", str(out), "--trusted-key", trusted]) == 0
        pulled = json.loads(capsys.readouterr().out)
        assert pulled["step"] == 1 and pulled["trust"].startswith("keys ed25519:")
        assert torch.equal(load_file(out)["w"].view(torch.int16), states[1]["w"].bfloat16().view(torch.int16))
    refusals = [
        ([unsigned, "--trusted-key", public], "run.json: unsigned, and this replica trusts only signed runs"),
        ([signed, "--trusted-key", f"{paths['other']}.pub"], "key this replica trusts"),
        (["push", signed, str(tmp_path / "step-1.safetensors")], "the run is signed by ed25519:"),
    ]
    for args, said in refusals:
        argv = args if args[0] == "push" else ["pull", *args, "-o", str(tmp_path / "refused")]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "refused").exists()
    with pytest.raises(SystemExit) as exit:
        cli.main(["pull", signed, "-o", str(tmp_path / "o"), "--trusted-key", "ed25519:bm90IGEga2V5"])
    assert exit.value.code == 2 and "is not a public key" in capsys.readouterr().err
    assert cli.main(["pull", signed, "-o", str(tmp_path / "bucket.safetensors")]) == 0  # no key: as before
    assert json.loads(capsys.readouterr().out)["trust"].startswith("the bucket")

"""What is not what it claims to be, in a sync root or on the command line: refused before it is read.

A FIFO would block the reader until a writer comes; a symlink to /dev/zero would be read (and written to a
download) without end. The CLI runs under a file-size limit: a regression fails instead of filling the disk.
"""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync.storage import FsspecStorage, LocalStorage, TooLargeError
from deltasync.sync.protocol import read_head
from tests.helpers import run_steps

FILE_SIZE_LIMIT = 256 << 20


def make_special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


def deltasync(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in a process that may write at most FILE_SIZE_LIMIT bytes per file."""

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))

    cmd = [sys.executable, "-m", "deltasync.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=limit_file_size)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
@pytest.mark.parametrize("backend", ["folder", "fsspec"])
def test_downloading_what_is_not_a_regular_file_is_refused_before_reading(tmp_path, backend, kind):
    root = tmp_path / "root"
    (root / "deltas").mkdir(parents=True)
    make_special(root / "deltas" / "step-00000001.safetensors", kind)
    storage = LocalStorage(root) if backend == "folder" else FsspecStorage(f"local://{root}")
    for limit in (1000, None):
        with pytest.raises(TooLargeError, match="not a regular file"):
            storage.download_file("deltas/step-00000001.safetensors", tmp_path / "out", limit)
        assert not (tmp_path / "out").exists()


def test_pull_refuses_a_delta_that_is_not_a_regular_file(tmp_path):
    root = tmp_path / "root"
    run_steps(root, 2)
    (delta,) = read_head(LocalStorage(root)).deltas
    make_special(root / delta.files[0], "dev-zero")
    result = deltasync("pull", root, "-o", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.startswith("deltasync pull: error: refused delta of step 1")
    assert "not a regular file" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("command", ["inspect", "apply"])
def test_the_cli_refuses_a_fifo_as_patch_instead_of_waiting_for_a_writer(tmp_path, command):
    fifo = tmp_path / "patch"
    os.mkfifo(fifo)
    args = [fifo] if command == "inspect" else [tmp_path / "base.safetensors", fifo, "-o", tmp_path / "out"]
    if command == "apply":
        run_steps(tmp_path / "root", 1)
        (tmp_path / "base.safetensors").symlink_to(next((tmp_path / "root").glob("anchors/*/*.safetensors")))
    result = deltasync(command, *args)
    assert result.returncode == 1
    assert result.stderr == f"deltasync {command}: error: {fifo} is not a regular file\n"

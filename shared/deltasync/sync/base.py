"""Step 0 by reference: the base model's own Hub repository at a commit, instead of an anchor in the root.

A trainer that starts from a Hub model would first upload, as its first anchor, weights the Hub already
holds: the model's repository (16 GB at 8B). When the run's first published state is exactly that
repository's weights as bf16 (checked by fingerprint), the publisher uploads no anchor: run.json's `base`
names the repository, its commit (a branch or tag is resolved when publishing, so the reference never moves)
and the weight files, and the head's chain starts at an entry of kind "base" that names no file of the root
(GC has nothing of it to delete). A reader loads those files through huggingface_hub (its cache first: a
commit's files never change, so a cached model costs no request) and checks the fingerprint before applying
any delta; a vLLM server started with `--model REPO --revision COMMIT` already holds them, which a read-back
of its weights checks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import httpx
import torch
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError, safe_open

from deltasync.codec import fingerprint
from deltasync.errors import AnchorError, TransientStorageError
from deltasync.sync.protocol import RUN_PATH, ModelReference

WEIGHTS = "model.safetensors"  # a checkpoint in one file, or the index of its shards:
WEIGHTS_INDEX = "model.safetensors.index.json"
UNREACHABLE = (httpx.HTTPError, LocalEntryNotFoundError, OSError)  # no answer, and not in the cache


def resolve(repo: str, revision: str | None = None, endpoint: str | None = None) -> ModelReference:
    """`repo` at `revision` (a branch, tag or commit; default the main branch) pinned to its commit, with its
    weight files: one API call, and a read of the index for a sharded checkpoint. AnchorError if the
    repository or revision does not exist or holds no safetensors weights; TransientStorageError if the Hub
    cannot be reached."""
    with _hub_errors(f"{repo}@{revision or 'main'}"):
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision)
        names = {s.rfilename for s in info.siblings or ()}
        ref = ModelReference(repo, info.sha or "", ())
        if WEIGHTS_INDEX in names:
            files = _indexed(Path(_download(ref, WEIGHTS_INDEX, endpoint)), str(ref))
        elif WEIGHTS in names:
            files = (WEIGHTS,)
        else:
            raise AnchorError(f"{repo}@{revision or 'main'} holds no {WEIGHTS} (nor its index)")
    ref = ModelReference(repo, ref.revision, files)
    problem = ref.problem()  # what a reader of run.json would refuse is never written
    if problem:
        raise AnchorError(f"{repo}@{revision or 'main'} cannot be named in {RUN_PATH}: {problem}")
    return ref


def _indexed(index: Path, where: str) -> tuple[str, ...]:
    """The shards an index names (its weight map's values), sorted."""
    try:
        files = json.loads(index.read_text())["weight_map"].values()
        if all(isinstance(f, str) for f in files):
            return tuple(sorted(set(files)))
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise AnchorError(f"{where}: {WEIGHTS_INDEX} has no weight map of file names")


def reference_to(
    repo: str, revision: str | None, schema: Mapping[str, list[int]], fp: int
) -> tuple[ModelReference, int]:
    """`repo` at `revision` pinned to its commit, and its weights' size, if those weights are the state of
    `schema` with fingerprint `fp`; else AnchorError (other weights, no safetensors) or TransientStorageError
    (the repository cannot be reached). Read one tensor at a time, from the cache where they are."""
    ref = resolve(repo, revision)
    files = download(ref)
    held = state_fingerprint(files, schema, str(ref))
    if held != fp:
        have, want = (fingerprint.format_fingerprint(f) for f in (held, fp))
        raise AnchorError(f"{ref}: its weights have fingerprint {have}, the state's is {want}")
    return ref, state_bytes(files)


def download(ref: ModelReference, endpoint: str | None = None) -> list[Path]:
    """The local copies of `ref`'s files, from huggingface_hub's cache where they are (no request)."""
    with _hub_errors(str(ref)):
        return [Path(_download(ref, name, endpoint)) for name in ref.files]


def _download(ref: ModelReference, name: str, endpoint: str | None) -> str:
    return hf_hub_download(ref.repo, name, revision=ref.revision, endpoint=endpoint)


@contextlib.contextmanager
def _hub_errors(what: str) -> Iterator[None]:
    """Hub answers as deltasync's errors: gone for good (AnchorError), or not reachable now (transient)."""
    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError) as e:
        raise AnchorError(f"{what}: not on the Hub ({type(e).__name__})") from None
    except (HfHubHTTPError, *UNREACHABLE) as e:  # an outage, a rate limit, no network and no cached copy
        cause = e.__cause__ or e  # not in the cache: the request's own error says why
        line = (str(cause).splitlines() or [type(cause).__name__])[0]
        raise TransientStorageError(f"cannot reach the model repository {what}: {line}") from None


def state_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def read_state(files: list[Path], schema: Mapping[str, list[int]], where: str) -> dict[str, torch.Tensor]:
    """The tensors of `schema`, in its order, as bf16, read from a checkpoint's safetensors `files`;
    AnchorError naming `where` if one is missing, twice there, shaped otherwise or not a float."""
    found = dict(_tensors(files, schema, where))
    _check_complete(found.keys(), schema, where)
    return {name: found[name] for name in schema}


def state_fingerprint(files: list[Path], schema: Mapping[str, list[int]], where: str) -> int:
    """The fingerprint of what `read_state` returns, read one tensor at a time (no copy of the model)."""
    names, fp = set(), 0
    for name, t in _tensors(files, schema, where):
        names.add(name)
        fp += fingerprint.tensor_fingerprint(name, t)
    _check_complete(names, schema, where)
    return fp & fingerprint.MASK64


def _check_complete(names: Iterable[str], schema: Mapping[str, list[int]], where: str) -> None:
    missing = set(schema).difference(names)
    if missing:
        first = next(name for name in schema if name in missing)
        raise AnchorError(f"{where}: has no tensor {first!r} (and {len(missing) - 1} more missing)")


def _tensors(
    files: list[Path], schema: Mapping[str, list[int]], where: str
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in schema:
                        continue  # e.g. a tied lm_head the trainer publishes once, as the embedding
                    t = f.get_tensor(name)
                    if name in seen or not t.is_floating_point() or list(t.shape) != list(schema[name]):
                        twice = " a second time" if name in seen else ""
                        raise AnchorError(
                            f"{where}: {name} is {t.dtype} {list(t.shape)}{twice}, the run has bf16 "
                            f"{schema[name]}"
                        )
                    seen.add(name)
                    yield name, t.to(torch.bfloat16)
        except SafetensorError as e:
            raise AnchorError(f"{where}: {path.name} is no safetensors file: {e}") from None


def verify(state: Mapping[str, torch.Tensor], fp: str, where: str) -> None:
    """AnchorError (one line naming `where`) unless `state`'s fingerprint is `fp`."""
    actual = fingerprint.format_fingerprint(fingerprint.state_fingerprint(state.items()))
    if actual != fp:
        raise AnchorError(f"{where}: its weights have fingerprint {actual}, not {fp}")

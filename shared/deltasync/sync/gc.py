"""Garbage collection of a sync root: step files the head no longer names, and crashed writers' leftovers."""

from __future__ import annotations

import math
from collections.abc import Iterable

from deltasync.storage import Storage
from deltasync.sync.protocol import STEP_DIR, epoch_of_head, read_head, step_of

LEFTOVER_GRACE_S = 15 * 60.0  # a temporary file untouched this long belongs to a writer that crashed
STEP_KINDS = ("anchors", "deltas")  # where step folders live (an anchor's shards, a sharded delta's parts)


def collect_garbage(storage: Storage, grace_s: float = LEFTOVER_GRACE_S) -> list[str]:
    """Delete the step files (deltas/, anchors/) of steps up to the head that it does not name (whichever
    writer's tag they carry: a fenced writer's files are garbage), and what crashed writers left untouched for
    `grace_s` (temporary files, empty step folders); returns them. Call it as the root's writer
    (WriterClaim); the head is read again right before deleting, and only files named exactly as a publisher
    names them are touched."""
    head = read_head(storage)
    named = head.files()
    candidates = [
        path
        for path in storage.list("deltas") + storage.list("anchors")
        if (step := step_of(path)) is not None and step <= head.step and path not in named
    ]
    head = read_head(storage)
    named = head.files()
    garbage = [path for path in candidates if path not in named]
    # Heads under older epochs: their writers are fenced (read_head takes the newest epoch's)
    garbage += [p for p in storage.list("heads") if (e := epoch_of_head(p)) is not None and e < head.epoch]
    storage.delete(garbage)
    emptied = delete_emptied_folders(storage, garbage)
    empty = [  # an anchor's folder once its shards are gone, a sharded delta's once its parts are
        folder
        for kind in STEP_KINDS
        for folder in storage.delete_empty_folders(kind, grace_s, STEP_DIR.fullmatch)
    ]
    return garbage + sorted(storage.delete_leftovers(grace_s) + emptied + empty)


def delete_emptied_folders(storage: Storage, deleted: Iterable[str]) -> list[str]:
    """Delete the step folders that held the just deleted step files `deleted`, if that left them empty (at
    once: GC named their files, so they are a writer's, never anything else); returns them. Only backends
    with real folders have any."""
    folders: dict[str, set[str]] = {}
    for path in deleted:
        kind, _, rest = path.partition("/")
        folder, slash, _ = rest.partition("/")
        if kind in STEP_KINDS and slash and STEP_DIR.fullmatch(folder):
            folders.setdefault(kind, set()).add(folder)
    # -inf: however recently touched (the deletion itself just touched them)
    return [
        f
        for kind, names in folders.items()
        for f in storage.delete_empty_folders(kind, -math.inf, names.__contains__)
    ]

"""Garbage collection of a sync root: step files the head no longer names, and crashed writers' leftovers."""

from __future__ import annotations

from deltasync.storage import Storage
from deltasync.sync.protocol import STEP_DIR, epoch_of_head, read_head, step_of

LEFTOVER_GRACE_S = 15 * 60.0  # a temporary file untouched this long belongs to a writer that crashed


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
    empty = [  # an anchor's folder once its shards are gone, a sharded delta's once its parts are
        folder
        for kind in ("anchors", "deltas")
        for folder in storage.delete_empty_folders(kind, grace_s, STEP_DIR.fullmatch)
    ]
    return garbage + sorted(storage.delete_leftovers(grace_s) + empty)

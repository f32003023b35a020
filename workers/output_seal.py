"""The leader's step of script mode's output protocol (`workers.outputs`): once every node's part listing of a
checkpoint dir is in storage, merge them and write shunter's manifest last, which makes the dir a complete
checkpoint; then tell the caller (`on_checkpoint`)."""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections.abc import Callable
from typing import Any

from service.core.locations import uri_of
from workers.manifest import FORMAT, MANIFEST
from workers.output_store import OutputStore, _Dir
from workers.outputs import TRAINER_STATE, _listing, _read_json, step_of

log = logging.getLogger("workers.outputs")  # one logger for the feature: its messages read as one story


def seal(
    store: OutputStore,
    state: _Dir,
    *,
    node_rank: int,
    nodes: int,
    on_checkpoint: Callable[[str, int | None], None] | None,
) -> bool:
    """Seal a dir whose parts are all in storage; True when sealed or given up (then `state.dropped`)."""
    stored = store.stored(state.name, state.dirname)
    state.parts[node_rank] = state.uploaded
    missing = []
    for node in range(nodes):
        if node in state.parts:
            continue
        marker = store.marker(node)  # read before the part: a node writes all its parts before its marker
        part = _read_json(store.fs, store.part_path(state.name, state.dirname, node))
        if store.current(part):
            files = _listing(part.get("files"))
            if files is None:
                log.error("outputs: node %d's part of %s is malformed; not sealed", node, state.rel)
                state.dropped = True
                return True
            state.parts[node] = files
        elif marker is not None:
            if state.rel in marker.get("unfinished", ()):
                log.error("outputs: node %d could not upload its files of %s; not sealed", node, state.rel)
                state.dropped = True
                return True
            state.parts[node] = {}  # that node finished without any file in it
        else:
            missing.append(node)
    if missing:
        log.debug("outputs: %s waits for the parts of node(s) %s", state.rel, missing)
        return False
    merged: dict[str, dict[str, Any]] = {}
    for node, files in sorted(state.parts.items()):
        for rel, entry in files.items():
            if rel in merged and merged[rel]["sha256"] != entry["sha256"]:
                log.error(
                    "outputs: nodes wrote different contents to %s/%s (node %d's differs); not sealed",
                    state.rel,
                    rel,
                    node,
                )
                state.dropped = True
                return True
            merged[rel] = entry
    step = step_of(state.dirname)
    if step is None and TRAINER_STATE in merged:
        trainer_state = _read_json(store.fs, posixpath.join(stored, TRAINER_STATE))
        global_step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
        step = global_step if isinstance(global_step, int) else None
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "epoch": 0, "time": time.time(), "files": merged}
    if store.attempt is not None:
        manifest["attempt"] = store.attempt
    store.put(posixpath.join(stored, MANIFEST), json.dumps(manifest, indent=1).encode())
    state.sealed = True
    uri = uri_of(stored, store.fs)
    log.info("outputs: sealed %s (step %s, %d file(s))", uri, step, len(merged))
    if on_checkpoint is not None:
        try:
            on_checkpoint(uri, step)
        except Exception:
            log.exception("outputs: on_checkpoint(%s, %s) failed", uri, step)
    return True

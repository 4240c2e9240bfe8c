"""The names of stage's bookkeeping files in DEST, spelled once for stage, collective stage and clean.

On a node-private DEST there is one of each; on a shared DEST (BeeOND, mode ``shared``) every node
keeps its own lock and journal, suffixed ``.node<i>``, and announces its finished share with a done
marker. ``manifest.json`` and ``stager-receipt.json`` are named by :mod:`stager.manifest` and
:mod:`stager.receipt`; the receipt's ``files`` list names all of them, which is what ``stager clean``
removes.
"""

from __future__ import annotations

import re

# Every journal and lock name above, with or without ``.node<i>`` (what ``stager clean`` looks for).
JOURNAL_RE = re.compile(r"^\.stager-journal(?:\.node(\d+))?\.jsonl$")
LOCK_RE = re.compile(r"^\.stager-lock(?:\.node(\d+))?$")


def node_suffix(shared_node: int | None) -> str:
    """``.node<i>`` for node ``i``'s files on a shared DEST; ``""`` (None) on a node-private one."""
    return "" if shared_node is None else f".node{shared_node}"


def lock_name(shared_node: int | None = None) -> str:
    """The node lock (:class:`~stager.fs.lock.NodeLock`): ``.stager-lock[.node<i>]``."""
    return f".stager-lock{node_suffix(shared_node)}"


def journal_name(shared_node: int | None = None) -> str:
    """The resume journal (:class:`~stager.stage.journal.Journal`): ``.stager-journal[.node<i>].jsonl``."""
    return f".stager-journal{node_suffix(shared_node)}.jsonl"


def node_of(name: str) -> int | None:
    """The node of a journal or lock name (``.stager-journal.node3.jsonl`` -> 3), None for a node-private one."""
    m = JOURNAL_RE.match(name) or LOCK_RE.match(name)
    return int(m.group(1)) if m and m.group(1) is not None else None


def marker_name(node: int, num_nodes: int) -> str:
    """Node ``node``'s done marker on a shared DEST: ``.stager-done.node<i>-of-<n>.json``."""
    return f".stager-done.node{node}-of-{num_nodes}.json"

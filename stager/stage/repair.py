"""``stager stage --repair``: hash DEST's copies again and stage again what no longer matches.

A plain re-stage trusts a receipt that covers the plan (sizes only: the fast path) and a journal's
verified files, so a byte flipped in DEST after staging (a bad disk, a user's edit) survives it:
that is what keeps an ordinary re-stage of a good copy instant. ``--repair`` skips the fast path
and, with the node lock held, re-hashes every file the plan keeps in DEST (shards, companion files,
the sample index) against the manifest; each one that is missing, of the wrong size or hash, or not
a regular file of the user's is removed (relative to the DEST handle, :mod:`stager.fs.safe`), so the
rest of the run copies exactly those again and writes a fresh receipt. ``stager verify DEST`` names
this command when it finds a staged copy damaged.

Not covered: the unpacked tree (``--unpack``: it is re-written only for shards the journal does not
list), and a copy linked from a shard cache whose object is damaged (``stager cache verify DIR``
removes such objects first; the repair then fills them again). Symbolic links into a cache are left
to the cache's own verification.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

from stager.checksum import new_hasher
from stager.fs.safe import SafeDir, open_regular, problem
from stager.stage.plan import FileTask, StagePlan

_BLOCK = 8 << 20


def _hash_fd(fd: int, algo: str) -> tuple[int, str]:
    h = new_hasher(algo)
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    total = 0
    while True:
        n = os.readv(fd, [buf])
        if not n:
            return total, h.hexdigest()
        h.update(view[:n])
        total += n


def _damage(d: SafeDir, task: FileTask, algo: str) -> str | None:
    """Why DEST's copy of ``task`` does not match the manifest (None when it does, or is absent, or is a
    link the cache verifies)."""
    st = d.lstat(task.name)
    if st is None or stat.S_ISLNK(st.st_mode):
        return None
    why = problem(st)
    if why is not None:
        return why
    if st.st_size != task.bytes:
        return f"size {st.st_size} bytes, expected {task.bytes}"
    fd = open_regular(task.name, dir_fd=d.fd, follow=False)
    try:
        n, got = _hash_fd(fd, algo)
    finally:
        os.close(fd)
    if (n, got) != (task.bytes, task.hash):
        return f"{algo} checksum {got}, expected {task.hash}"
    return None


def remove_damaged(plan: StagePlan, threads: int) -> list[str]:
    """Hash every file of ``plan`` DEST holds on ``threads`` threads; remove each damaged one (call with the
    node lock held); return ``["<name>: <why>", ...]`` for what was removed, in plan order."""
    tasks = list(plan.tasks)
    if plan.index_task is not None:
        tasks.append(plan.index_task)
    algo = plan.manifest.hash_algo
    with SafeDir.open(plan.dest, what="staging destination") as d:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
            found = list(ex.map(lambda t: _damage(d, t, algo), tasks))
        bad = [(t.name, why) for t, why in zip(tasks, found, strict=True) if why is not None]
        for name, _ in bad:
            d.unlink(name)
    return [f"{name}: {why}" for name, why in bad]


__all__ = ["remove_damaged"]

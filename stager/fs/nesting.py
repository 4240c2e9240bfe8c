"""Whether two directories are one, or one lies inside the other: :func:`overlap`.

Strings are not enough: a symbolic link, a bind mount or ``..`` gives one directory many paths. Both
paths are resolved (:func:`os.path.realpath`) and compared, and so is the ``(st_dev, st_ino)``
identity of each one's nearest existing directory against every existing directory above the other,
which catches a bind mount of SRC seen under another path. A path that does not exist yet is judged
by its nearest existing ancestor.
"""

from __future__ import annotations

import os
import stat


def _identities(path: str) -> list[tuple[str, tuple[int, int]]]:
    """``(directory, (st_dev, st_ino))`` for each existing directory from ``path`` (real) up to ``/``."""
    out = []
    cur = path
    while True:
        try:
            st = os.stat(cur)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            out.append((cur, (st.st_dev, st.st_ino)))
        parent = os.path.dirname(cur)
        if parent == cur:
            return out
        cur = parent


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def overlap(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> str | None:
    """How directory ``b`` stands to directory ``a``: ``"is"`` (the same directory), ``"lies inside"``
    (``b`` is under ``a``), ``"contains"`` (``a`` is under ``b``), or None (apart)."""
    a_real, b_real = os.path.realpath(a), os.path.realpath(b)
    a_ids, b_ids = _identities(a_real), _identities(b_real)
    a_id = a_ids[0][1] if a_ids and a_ids[0][0] == a_real else None
    b_id = b_ids[0][1] if b_ids and b_ids[0][0] == b_real else None
    if a_real == b_real or (a_id is not None and a_id == b_id):
        return "is"
    if _within(b_real, a_real) or (a_id is not None and a_id in {i for _, i in b_ids}):
        return "lies inside"
    if _within(a_real, b_real) or (b_id is not None and b_id in {i for _, i in a_ids}):
        return "contains"
    return None


__all__ = ["overlap"]

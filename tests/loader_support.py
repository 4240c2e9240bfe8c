"""Helpers shared by the loader attack tests (tests/test_attack40.py, tests/test_attack_late.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def reference_and_loader(path: Path, make: str, workers: int) -> tuple[list[list[str]], Any]:
    """A raw-bytes loader over ``path`` (``make``: "numpy" for ``make_numpy_loader``, else ``make_loader``;
    batches of 4, seed 3, ``workers`` forked workers) and the keys of each batch of one whole epoch of an
    identical loader, read first and closed: what the loader's first pass must give."""
    from stager.loader import make_loader, make_numpy_loader

    build = make_numpy_loader if make == "numpy" else make_loader
    kw = {"seed": 3, "staged": False, "num_workers": workers, "multiprocessing_context": "fork", "decode": "raw"}
    ref = build(path, 4, **kw)
    whole = [list(b["key"]) for b in ref]
    ref.close()
    return whole, build(path, 4, **kw)

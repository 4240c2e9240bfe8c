"""Attacks on the loader's one-pass-at-a-time rule, the pack/index pool's lost-worker error and
``index -j``'s interrupt (brief attack-late): each test is a defect found by hand, failing before its fix.

- A replaced pass of a loader without persistent workers (``persistent_workers=False``: each pass starts
  its own DataLoader workers) kept those workers running for as long as the caller kept the replaced
  iterator (in a variable across epochs, say): ``iter()`` replacing it called only ``close()``, which
  stops persistent workers alone.
- ``set_epoch``, ``skip_to`` or ``load_state_dict`` while an iterator was mid-epoch, then that iterator
  advanced: ``RuntimeError: stager.loader: expected batch 0, worker sent 2`` (the round-robin check's
  message, about a worker) on both loaders, with and without workers, instead of one line saying what to do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import clean_env

ROOT = Path(__file__).resolve().parents[1]

KEPT_REPLACED = """
import os, sys
from stager.loader import make_loader
def children():  # this process' live children, from /proc (no timing: a joined worker is gone)
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.append(int(p))
    return out
ld = make_loader(sys.argv[1], 4, seed=3, staged=False, num_workers=2, persistent_workers=False,
                 multiprocessing_context="fork", decode="raw")
kept = iter(ld)
next(kept)
assert len(children()) == 2, children()
whole = [k for b in ld for k in b["key"]]  # the newer pass, complete: its own workers ended with it
print("children", len(children()), "samples", len(whole), len(set(whole)))
ld.close()
"""


def test_a_replaced_pass_without_persistent_workers_ends_its_workers_at_once(imagenet_tiny_tar: Path) -> None:
    """The replaced iterator is still held: its pass's workers must be gone once the newer pass ends."""
    r = subprocess.run([sys.executable, "-c", KEPT_REPLACED, str(imagenet_tiny_tar)], capture_output=True,
                       text=True, env=clean_env(), cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["children", "0", "samples", "24", "24"], r.stdout + r.stderr


@pytest.mark.parametrize("move", ["set_epoch", "skip_to", "load_state_dict"])
@pytest.mark.parametrize(("make", "workers"), [("torch", 0), ("torch", 2), ("numpy", 2)])
def test_moving_the_loader_mid_pass_is_one_line_for_the_open_iterator(
    imagenet_tiny_tar: Path, make: str, workers: int, move: str
) -> None:
    """The open iterator, advanced after the loader was moved under it, says so in one line; the next
    ``iter()`` is exactly the moved-to position's remaining batches."""
    from stager.errors import UsageError
    from stager.loader import make_loader, make_numpy_loader

    build = make_numpy_loader if make == "numpy" else make_loader
    kw = {"seed": 3, "staged": False, "num_workers": workers, "multiprocessing_context": "fork", "decode": "raw"}
    ref = build(imagenet_tiny_tar, 4, **kw)
    whole = [list(b["key"]) for b in ref]
    ref.close()
    ld = build(imagenet_tiny_tar, 4, **kw)
    try:
        it = iter(ld)
        head = [list(next(it)["key"]) for _ in range(2)]
        assert head == whole[:2]
        state = ld.state_dict()
        next(it)
        if move == "set_epoch":
            ld.set_epoch(0)
            expect = whole
        elif move == "skip_to":
            ld.skip_to(4)
            expect = whole[4:]
        else:
            ld.load_state_dict(state)
            expect = whole[2:]
        with pytest.raises(UsageError, match="mid-epoch") as e:
            next(it)
        assert "\n" not in str(e.value)
        del it
        assert [list(b["key"]) for b in ld] == expect
    finally:
        ld.close()

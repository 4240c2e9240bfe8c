"""Attacks on the stage-fast branch's surfaces and their neighbours (brief attack40): each test is a
defect found by hand, failing before its fix.

- A loader whose epoch was read to its last batch (without the iterator's ``StopIteration``: a
  training loop of ``len(loader)`` steps, or tf.data's ``from_generator`` which holds the generator)
  and then closed: when the suspended iterator was dropped afterwards, its clean-up waited for the
  closed workers' end markers and Python printed ``Exception ignored ... Queue ... is closed``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.cli_support import clean_env

ROOT = Path(__file__).resolve().parents[1]

LAST_BATCH_THEN_CLOSE = """
import gc, sys
from stager.loader import make_numpy_loader
ld = make_numpy_loader(sys.argv[1], 4, seed=3, staged=False, num_workers=2, multiprocessing_context="fork")
whole = [b["index"].tolist() for b in ld]
it = iter(ld)
head = [next(it)["index"].tolist() for _ in range(len(whole))]  # every batch; no StopIteration yet
ld.close()
del it
gc.collect()
again = [i for b in ld for i in b["index"].tolist()]  # the loader still works: the next epoch, complete
assert sorted(again) == sorted(i for b in whole for i in b), again
ld.close()
print("ok", len(head))
"""


def test_an_iterator_dropped_after_close_at_the_epochs_last_batch_is_quiet(imagenet_tiny_tar: Path) -> None:
    r = subprocess.run([sys.executable, "-c", LAST_BATCH_THEN_CLOSE, str(imagenet_tiny_tar)], capture_output=True,
                       text=True, env=clean_env(), cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0 and r.stdout.startswith("ok 6"), r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr

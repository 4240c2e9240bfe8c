"""Attacks on the stage-fast branch's surfaces and their neighbours (brief attack40): each test is a
defect found by hand, failing before its fix.

- A loader whose epoch was read to its last batch (without the iterator's ``StopIteration``: a
  training loop of ``len(loader)`` steps, or tf.data's ``from_generator`` which holds the generator)
  and then closed: when the suspended iterator was dropped afterwards, its clean-up waited for the
  closed workers' end markers and Python printed ``Exception ignored ... Queue ... is closed``; and a
  half-read epoch's iterator dropped only after close() and a new pass (tf.data finalizes its generator
  when it likes) closed the new pass's workers under it: ``ValueError: Queue ... is closed``.
- ``tf_dataset(loader).map(f)``: tf.data's default ``map_parallelization`` rewrote the user's plain
  (sequential) map into a parallel one that pulled 1-2 batches ahead of the model, so a
  ``loader.state_dict()`` saved at a step boundary skipped them on resume (as the injected prefetch did).
- Open (xfail): a second ``iter()`` of a loader while an iterator of it is still mid-epoch (two live
  ``iter(tf_dataset(loader))``, or ``it = iter(loader); next(it)`` then a ``for`` over the loader) fails
  with ``RuntimeError: expected batch 0, worker sent N`` (workers) or silently restarts the epoch and
  shares its batch count (``num_workers=0``), instead of a one-line error saying what to do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import clean_env
from tests.loader_support import reference_and_loader

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


LATE_DROP = """
import gc, sys
from stager.loader import make_numpy_loader
ld = make_numpy_loader(sys.argv[1], 4, seed=3, staged=False, num_workers=2, multiprocessing_context="fork")
n = len(ld)
old = iter(ld)
next(old)
ld.close()  # the half-read epoch abandoned
new = iter(ld)  # a new pass, on new workers
got = [next(new)["index"].tolist()]
del old  # the old iterator finalized only now
gc.collect()
got += [b["index"].tolist() for b in new]
ld.close()
print("ok", len(got) == n)
"""


def test_an_old_iterator_dropped_late_leaves_the_new_passs_workers_alone(imagenet_tiny_tar: Path) -> None:
    r = subprocess.run([sys.executable, "-c", LATE_DROP, str(imagenet_tiny_tar)], capture_output=True, text=True,
                       env=clean_env(), cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "ok True", r.stdout + r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr

def test_tf_resume_after_a_plain_map_continues_with_exactly_the_remaining_batches(imagenet_tiny_tar: Path) -> None:
    tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed here (pip install tensorflow-cpu)")
    from stager.loader import make_numpy_loader
    from stager.loader.tfdata import tf_dataset

    kw = {"seed": 3, "staged": False, "num_workers": 2, "multiprocessing_context": "fork"}

    def pipeline(loader: object) -> object:  # a user's preprocessing: a plain map, no num_parallel_calls
        return tf_dataset(loader, x="index", y="label").map(lambda x, y: (x + 1, tf.cast(y, tf.int32)))

    whole_loader = make_numpy_loader(imagenet_tiny_tar, 4, **kw)
    whole = [x.numpy().tolist() for x, _ in pipeline(whole_loader)]  # type: ignore[attr-defined]
    whole_loader.close()
    assert len(whole) == 6
    for step in range(1, len(whole)):  # a checkpoint at every step boundary inside the epoch
        loader = make_numpy_loader(imagenet_tiny_tar, 4, **kw)
        it = iter(pipeline(loader))  # type: ignore[call-overload]
        head = [next(it)[0].numpy().tolist() for _ in range(step)]
        state = loader.state_dict()
        del it
        loader.close()
        again = make_numpy_loader(imagenet_tiny_tar, 4, **kw)
        again.load_state_dict(state)
        rest = [x.numpy().tolist() for x, _ in pipeline(again)]  # type: ignore[attr-defined]
        again.close()
        assert head + rest == whole, (step, state["batches_done"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make", ["numpy", "torch"])
def test_a_newer_iterator_replaces_one_mid_epoch(imagenet_tiny_tar: Path, workers: int, make: str) -> None:
    """A second ``iter()`` while another is mid-epoch was a RuntimeError ('expected batch 0, worker sent
    N') with workers and, without, a silent restart that shared the position between both iterators.
    Now the newest pass wins (as a torch DataLoader's new iterator resets its persistent workers): it
    is the whole epoch, and the replaced iterator, advanced again, is one line."""
    from stager.errors import UsageError
    whole, ld = reference_and_loader(imagenet_tiny_tar, make, workers)
    try:
        first = iter(ld)
        assert list(next(first)["key"]) == whole[0]
        assert [list(b["key"]) for b in ld] == whole  # the newer pass: the epoch, from its start
        with pytest.raises(UsageError, match="replaced by a newer iter") as e:
            next(first)
        assert "\n" not in str(e.value)
        del first
        assert [list(b["key"]) for b in ld] != whole  # and the loader goes on: the next epoch
    finally:
        ld.close()


@pytest.mark.parametrize("argv", [
    ["stage", "--jsn", "a", "b"], ["stage", "--js", "a", "b"], ["stage"], ["stage", "--json"], ["stage", "a", "b", "c"],
    ["stage", "--help"], ["stage", "-h"], ["stage", "--hel"], ["stage", "--version"], ["stage", "--workers", "x", "a"],
    ["verify", "--jsn"], ["cache", "gc", "--help"], ["clean", "--help"], ["index", "--format", "zip", "x"],
])
def test_the_invoked_commands_parser_alone_answers_as_the_whole_parser(argv: list[str]) -> None:
    """``build_parser(argv)`` builds only the invoked command's parser (the CLI's start-up): every help
    text, usage error and suggestion must be what the parser of every command gives."""
    import contextlib
    import io

    from stager.cli import build_parser
    from stager.errors import UsageError

    def answer(parser: object) -> tuple[str, str, str]:
        out, err = io.StringIO(), io.StringIO()
        raised = ""
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                parser.parse_args(argv)  # type: ignore[attr-defined]
            except UsageError as exc:
                raised = f"{exc} [{getattr(exc, 'prog', '')}]"
            except SystemExit as exc:
                raised = f"exit {exc.code}"
        return out.getvalue(), err.getvalue(), raised

    assert answer(build_parser(argv)) == answer(build_parser())

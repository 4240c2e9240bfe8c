"""kill -9 at seeded random points during ``pack``, ``stage``, ``stage --unpack`` and training.

Each trial starts the real command, kills its whole process group at a random moment (a random
delay within a measured clean run, or when a progress condition is met: N shard or ``.partial``
files in OUT/DEST, N unpacked files, N training steps logged), reruns it without interference and
checks the result against a clean run: same shards and keys (pack), a verified copy and receipt
(stage), every sample unpacked exactly once with the right bytes (unpack), every training key seen
exactly once per epoch (train). Counted: kills that landed mid-run, reruns that failed, what the
kill left (``.partial`` files, a stale lock) and what was still there after the rerun (leftovers),
and samples lost or duplicated.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.faults import harness as h


@dataclass
class KillStats:
    """Counts over the trials of one command. ``kills`` = kills that landed while it ran."""

    command: str
    attempts: int = 0
    kills: int = 0
    rerun_ok: int = 0
    verified: int = 0
    failures: int = 0
    partials_after_kill: int = 0
    stale_locks_after_kill: int = 0
    leftovers: int = 0
    lost: int = 0
    duplicated: int = 0
    diverged: int = 0
    errors: list[str] = field(default_factory=list)
    points: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.failures += 1
        if len(self.errors) < 10:
            self.errors.append(msg)

    @property
    def handled(self) -> int:
        return self.verified

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "points"}


def _timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t = time.monotonic()
    r = h.run(argv, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"clean run failed: {' '.join(argv)}: {r.stderr[-2000:]}")
    return time.monotonic() - t


def _point(rng: np.random.Generator, i: int, clean_s: float, cond: Any, what: str) -> h.KillPoint:
    """Even trials: a progress condition; odd trials: a random delay within the clean run time."""
    if i % 2 == 0 and cond is not None:
        return h.KillPoint(condition=cond, after=float(rng.uniform(0, 0.02)), describe=what)
    d = float(rng.uniform(0.15, 1.0) * clean_s)
    return h.KillPoint(delay=d, describe=f"after {d:.2f}s")


# ---- pack -----------------------------------------------------------------------------------------------
def pack_trials(work: Path, n: int, *, seed: int = 0, fmt: str = "tar", images: int = 192,
                per_shard: int = 4) -> KillStats:
    """``n`` mid-run kills of ``stager pack`` (at most ``2n`` attempts)."""
    from stager.manifest import load_manifest

    st = KillStats(f"pack ({fmt})")
    rng = np.random.default_rng((seed, 101))
    src = h.cifar_source(work, n_train=images)
    args = ["--format", fmt, "--samples-per-shard", str(per_shard), "-q"]
    if fmt == "zarr":
        args += ["--resize", "32x32"]
    ref_dir = work / f"pack-ref-{fmt}"
    if ref_dir.exists():
        shutil.rmtree(ref_dir)
    clean_s = _timed(h.stager_argv("pack", str(src), str(ref_dir), *args))
    ref = load_manifest(ref_dir)
    ref_keys = [k for s in ref.shards for k in s.keys]
    ref_files = sorted(ref.files())
    nshards = len(ref.shards)
    for i in range(2 * n):
        if st.kills >= n:
            break
        out = work / f"pack-{fmt}-{i}"
        shutil.rmtree(out, ignore_errors=True)
        k = int(rng.integers(1, nshards))

        def cond(out: Path = out, k: int = k) -> bool:
            return out.is_dir() and sum(1 for e in os.scandir(out) if e.name.startswith("shard-")) >= k

        point = _point(rng, i, clean_s, cond, f"{k} shard files in OUT")
        st.attempts += 1
        proc = h.spawn(h.stager_argv("pack", str(src), str(out), *args))
        if not h.kill_at(proc, point):
            shutil.rmtree(out, ignore_errors=True)
            continue  # finished before the kill: not a kill point
        st.kills += 1
        st.points.append(point.describe)
        st.partials_after_kill += len(h.partials(out)) if out.exists() else 0
        r = h.run_stager("pack", str(src), str(out), *args)
        if r.returncode != 0:
            st.fail(f"pack rerun after kill ({point.describe}) exit {r.returncode}: {r.stderr.strip()[-400:]}")
            continue
        st.rerun_ok += 1
        # The CLI's exit code on the first trial, the same check in-process after that (faster).
        v_ok = (h.run_stager("verify", str(out), "-q").returncode == 0) if st.kills == 1 else h.verify_ok(out)[0]
        m = load_manifest(out)
        keys = [k for s in m.shards for k in s.keys]
        lost, dup = h.multiset_diff(ref_keys, keys)
        st.lost += lost
        st.duplicated += dup
        leftovers = len(h.partials(out)) + int((out / ".stager-pack").exists())
        st.leftovers += leftovers
        if not v_ok or sorted(m.files()) != ref_files or lost or dup or leftovers:
            st.fail(f"pack after kill ({point.describe}): verified {v_ok}, same files "
                    f"{sorted(m.files()) == ref_files}, lost {lost}, dup {dup}, leftovers {leftovers}")
            continue
        st.verified += 1
        shutil.rmtree(out, ignore_errors=True)
    return st


# ---- stage ----------------------------------------------------------------------------------------------
def staged_source(work: Path, images: int = 192, per_shard: int = 4, fmt: str = "tar") -> tuple[Path, Any]:
    """A packed ImageFolder set (JPEGs): CIFAR packs cannot be unpacked (keys share basenames)."""
    src = work / f"stage-src-{fmt}-{images}"
    m = h.packed(h.imagefolder_source(work, classes=4, per_class=images // 4), src, fmt, samples_per_shard=per_shard)
    return src, m


def expected_unpacked(src: Path, m: Any) -> dict[str, bytes]:
    """``class/<key basename>.<ext>`` -> payload bytes, for every sample of a tar pack."""
    from stager.formats import get_format
    from stager.formats.tar import split_member_name

    out: dict[str, bytes] = {}
    fmt = get_format(m.format)
    for info in m.shards:
        reader = fmt.open_reader(str(src / info.name), info, m)
        try:
            for s in reader.iter_samples():
                i = info.keys.index(s.key)
                cls = m.classes[int(info.labels[i])] if m.classes and int(info.labels[i]) >= 0 else "_unlabeled"
                key, _ = split_member_name(f"{s.key}.{s.ext}")
                out[f"{cls}/{key.rsplit('/', 1)[-1]}.{s.ext}"] = bytes(s.data)
        finally:
            reader.close()
    return out


def unpack_damage(root: Path, want: dict[str, bytes]) -> tuple[int, int]:
    """(lost, extra) of the unpacked tree ``root`` against ``want``; wrong bytes count as lost."""
    lost = 0
    for rel, data in want.items():
        p = root / rel
        try:
            if p.read_bytes() != data:
                lost += 1
        except OSError:
            lost += 1
    got = {str(p.relative_to(root)) for p in h.files_under(root)} if root.exists() else set()
    extra = len(got - set(want))
    return lost, extra


def stage_trials(work: Path, n: int, *, seed: int = 0, unpack: str | None = None, images: int = 192,
                 throttle_bps: int = 400_000, flags: tuple[str, ...] = ()) -> KillStats:
    """``n`` mid-run kills of ``stager stage [--unpack also|only] [flags]`` (at most ``2n`` attempts);
    the rerun uses the same flags (``--no-fsync``: a resume in the same boot).

    The copy streams are throttled (``$STAGER_TEST_THROTTLE_BPS``) so kills land mid-copy; with
    ``--unpack`` half of the progress conditions wait for N unpacked files instead.
    """
    from stager.manifest import MANIFEST_NAME

    label = "stage" + (f" --unpack {unpack}" if unpack else "") + "".join(f" {f}" for f in flags)
    st = KillStats(label)
    rng = np.random.default_rng((seed, 202, len(unpack or "")))
    src, m = staged_source(work, images=images)
    extra = (["--unpack", unpack] if unpack else []) + list(flags)
    env = {"STAGER_TEST_THROTTLE_BPS": str(throttle_bps)}
    want = expected_unpacked(src, m) if unpack else {}
    tag = f"{unpack}{''.join(flags)}"
    ref = work / f"stage-ref-{tag}"
    shutil.rmtree(ref, ignore_errors=True)
    clean_s = _timed(h.stager_argv("stage", str(src), str(ref), "--workers", "2", "-q", *extra), env)
    shutil.rmtree(ref, ignore_errors=True)
    nfiles = len(list(m.files()))
    for i in range(2 * n):
        if st.kills >= n:
            break
        dest = work / f"stage-{tag}-{i}"
        shutil.rmtree(dest, ignore_errors=True)
        cond: Any
        if unpack == "only" or (unpack and i % 4 == 0):
            k = int(rng.integers(1, m.num_samples))

            def cond(dest: Path = dest, k: int = k) -> bool:
                return h.count_files(dest / "unpacked") >= k

            what = f"{k} unpacked files"
        else:
            k = int(rng.integers(1, nfiles))

            def cond(dest: Path = dest, k: int = k) -> bool:
                return dest.is_dir() and sum(1 for e in os.scandir(dest) if e.name.startswith("shard-")) >= k

            what = f"{k} shard/.partial files in DEST"
        point = _point(rng, i, clean_s, cond, what)
        st.attempts += 1
        proc = h.spawn(h.stager_argv("stage", str(src), str(dest), "--workers", "2", "-q", *extra), env=env)
        if not h.kill_at(proc, point):
            shutil.rmtree(dest, ignore_errors=True)
            continue
        st.kills += 1
        st.points.append(point.describe)
        if dest.exists():
            st.partials_after_kill += len(h.partials(dest))
            st.stale_locks_after_kill += int((dest / ".stager-lock").exists())
        r = h.run_stager("stage", str(src), str(dest), "-q", "--timeout", "60", *extra)
        if r.returncode != 0:
            st.fail(f"{label} rerun after kill ({point.describe}) exit {r.returncode}: {r.stderr.strip()[-400:]}")
            continue
        st.rerun_ok += 1
        lost = dup = 0
        ok = True
        if unpack != "only":
            ok = (h.run_stager("verify", str(dest), "-q").returncode == 0) if st.kills == 1 else h.verify_ok(dest)[0]
            if not ok:
                lost += sum(s.samples for s in m.shards)  # unknown which: count all as at risk
        else:
            ok = (dest / MANIFEST_NAME).exists()
        if unpack:
            ul, ud = unpack_damage(dest / "unpacked", want)
            lost += ul
            dup += ud
        leftovers = len(h.partials(dest)) + int((dest / ".stager-lock").exists())
        st.leftovers += leftovers
        st.lost += lost
        st.duplicated += dup
        receipt = (dest / "stager-receipt.json").exists()
        if not ok or lost or dup or leftovers or not receipt:
            st.fail(f"{label} after kill ({point.describe}): verified {ok}, lost {lost}, extra {dup}, "
                    f"leftovers {leftovers}, receipt {receipt}")
            continue
        st.verified += 1
        shutil.rmtree(dest, ignore_errors=True)
    return st


# ---- stage --cache --------------------------------------------------------------------------------------
def cache_trials(work: Path, n: int, *, seed: int = 0, images: int = 192, throttle_bps: int = 400_000,
                 gc_every: int = 3) -> KillStats:
    """``n`` mid-run kills of ``stager stage SRC DEST --cache CACHE`` (at most ``2n`` attempts), each with
    a fresh cache, at the stage trials' kill points plus the cache's own: N objects or N partial files
    in the cache. Every ``gc_every``-th trial also kills a ``stager cache gc --max-bytes 0`` run
    against the killed cache (eviction's own kill point) before the rerun.

    Invariant per kill: the rerun completes and DEST verifies with a receipt; ``stager cache verify``
    passes; no partial file is left in the cache or DEST, no lock in DEST; and a second stage of the
    dataset into another DEST copies nothing (the cache holds every file, whole).
    """
    st = KillStats("stage --cache")
    rng = np.random.default_rng((seed, 404))
    src, m = staged_source(work, images=images)
    env = {"STAGER_TEST_THROTTLE_BPS": str(throttle_bps)}
    nfiles = len(list(m.files()))
    ref_cache, ref = work / "cache-ref-cache", work / "cache-ref"
    shutil.rmtree(ref_cache, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    clean_s = _timed(h.stager_argv("stage", str(src), str(ref), "--cache", str(ref_cache), "--workers", "2", "-q"),
                     env)
    shutil.rmtree(ref, ignore_errors=True)
    shutil.rmtree(ref_cache, ignore_errors=True)
    for i in range(2 * n):
        if st.kills >= n:
            break
        dest, cache = work / f"cache-dest-{i}", work / f"cache-{i}"
        for d in (dest, cache, work / f"cache-again-{i}"):
            shutil.rmtree(d, ignore_errors=True)
        k = int(rng.integers(1, nfiles))
        objects = cache / "objects"
        if i % 4 == 2:
            def cond(objects: Path = objects) -> bool:
                return objects.is_dir() and len(h.partials(objects)) >= 1

            what = "a partial file in the cache"
        else:
            def cond(objects: Path = objects, k: int = k) -> bool:
                if not objects.is_dir():
                    return False
                return sum(1 for p in h.files_under(objects) if not p.name.endswith(h.PARTIAL)) >= k

            what = f"{k} objects in the cache"
        point = _point(rng, i, clean_s, cond, what)
        argv = h.stager_argv("stage", str(src), str(dest), "--cache", str(cache), "--workers", "2", "-q")
        st.attempts += 1
        proc = h.spawn(argv, env=env)
        if not h.kill_at(proc, point):
            continue
        st.kills += 1
        st.points.append(point.describe)
        st.partials_after_kill += len(h.partials(cache)) if cache.exists() else 0
        if i % gc_every == gc_every - 1 and cache.exists():
            gc = h.spawn(h.stager_argv("cache", "gc", str(cache), "--max-bytes", "0", "-q"))
            h.kill_at(gc, h.KillPoint(delay=float(rng.uniform(0.0, 0.4)), describe="during gc"))
        r = h.run_stager("stage", str(src), str(dest), "--cache", str(cache), "-q", "--timeout", "60")
        if r.returncode != 0:
            st.fail(f"stage --cache rerun after kill ({point.describe}) exit {r.returncode}: {r.stderr.strip()[-400:]}")
            continue
        st.rerun_ok += 1
        ok = (h.run_stager("verify", str(dest), "-q").returncode == 0) if st.kills == 1 else h.verify_ok(dest)[0]
        cache_ok = h.run_stager("cache", "verify", str(cache), "--no-repair", "-q").returncode == 0
        again = h.run_stager("stage", str(src), str(work / f"cache-again-{i}"), "--cache", str(cache), "--json", "-q")
        copied = json.loads(again.stdout.strip().splitlines()[-1])["bytes_copied"] if again.returncode == 0 else -1
        leftovers = len(h.partials(cache)) + len(h.partials(dest)) + int((dest / ".stager-lock").exists())
        st.leftovers += leftovers
        if not ok:
            st.lost += sum(s.samples for s in m.shards)
        receipt = (dest / "stager-receipt.json").exists()
        if not ok or not cache_ok or copied != 0 or leftovers or not receipt:
            st.fail(f"stage --cache after kill ({point.describe}): verified {ok}, cache verified {cache_ok}, "
                    f"copied again {copied}, leftovers {leftovers}, receipt {receipt}")
            continue
        st.verified += 1
        for d in (dest, cache, work / f"cache-again-{i}"):
            shutil.rmtree(d, ignore_errors=True)
    return st


# ---- training -------------------------------------------------------------------------------------------
TRAIN_ARGS = ["--arch", "resnet18", "--width", "8", "--image-size", "32", "--batch-size", "8", "--epochs", "2",
              "--workers", "0", "--checkpoint-every", "2", "--eval-every", "0", "--holdout", "0",
              "--warmup-epochs", "0", "--threads", "1", "--device", "cpu", "--log-every", "0"]


def read_step_records(path: Path) -> list[dict[str, Any]]:
    """Records of ``--dump-keys`` in write order. A kill can tear the last line of a run; the next run
    appends to it, so a line may hold a torn prefix followed by a whole record."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        start = line.rfind('{"epoch"')
        if start < 0:
            continue
        try:
            out.append(json.loads(line[start:]))
        except ValueError:
            continue  # the torn tail of a killed run
    return out


def epoch_damage(records: list[dict[str, Any]], all_keys: list[str], steps_per_epoch: int, epochs: int
                 ) -> tuple[int, int, int, int]:
    """(lost, duplicated, diverged, missing steps) over ``epochs`` from step records.

    A step logged before a kill and again after the resume must carry the same keys (``diverged``
    counts those that do not); the last record of each global step counts. Per epoch, the keys of
    its steps must be exactly ``all_keys``.
    """
    by_step: dict[int, dict[str, Any]] = {}
    diverged = 0
    for r in records:
        prev = by_step.get(int(r["step"]))
        if prev is not None and (prev["keys"] != r["keys"] or prev["epoch"] != r["epoch"]):
            diverged += 1
        by_step[int(r["step"])] = r
    per_epoch: dict[int, list[str]] = defaultdict(list)
    for r in by_step.values():
        per_epoch[int(r["epoch"])] += r["keys"]
    lost = dup = 0
    for e in range(epochs):
        lo, du = h.multiset_diff(all_keys, per_epoch.get(e, []))
        lost += lo
        dup += du
    missing = sum(1 for s in range(1, steps_per_epoch * epochs + 1) if s not in by_step)
    return lost, dup, diverged, missing


def train_trials(work: Path, n: int, *, seed: int = 0, images: int = 64) -> KillStats:
    """``n`` mid-run kills of tools/train.py on a packed CIFAR-like set, each followed by ``--resume``."""
    st = KillStats("train (checkpoint + resume)")
    rng = np.random.default_rng((seed, 303))
    data = work / f"train-data-{images}"
    m = h.packed(h.cifar_source(work, n_train=images), data, "tar", samples_per_shard=8)
    all_keys = [k for s in m.shards for k in s.keys]
    batch, epochs = 8, 2
    steps_per_epoch = len(all_keys) // batch
    total = steps_per_epoch * epochs
    train_py = str(h.ROOT / "tools" / "train.py")

    def argv(out: Path) -> list[str]:
        import sys

        return [sys.executable, train_py, "--data", str(data), "--out", str(out / "run"),
                "--dump-keys", str(out / "keys"), *TRAIN_ARGS]

    for i in range(2 * n):
        if st.kills >= n:
            break
        out = work / f"train-{i}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        keys_file = out / "keys" / "keys-rank0.jsonl"
        k = int(rng.integers(1, total))

        def cond(keys_file: Path = keys_file, k: int = k) -> bool:
            return keys_file.exists() and keys_file.read_bytes().count(b"\n") >= k

        # Training starts after ~10 s of imports on a busy box: always a progress condition, then a
        # random extra delay of up to one step, which spreads kills over steps and checkpoint writes.
        point = h.KillPoint(condition=cond, after=float(rng.uniform(0, 0.08)), describe=f"after step {k}")
        st.attempts += 1
        proc = h.spawn(argv(out))
        if not h.kill_at(proc, point, timeout=300):
            continue
        st.kills += 1
        st.points.append(point.describe)
        st.partials_after_kill += len(h.partials(out / "run")) if (out / "run").exists() else 0
        r = h.run([*argv(out), "--resume"], timeout=600)
        if r.returncode != 0:
            st.fail(f"train resume after kill ({point.describe}) exit {r.returncode}: {r.stderr.strip()[-600:]}")
            continue
        st.rerun_ok += 1
        lost, dup, diverged, missing = epoch_damage(read_step_records(keys_file), all_keys, steps_per_epoch, epochs)
        leftovers = len(h.partials(out / "run"))
        st.lost += lost + missing * batch
        st.duplicated += dup
        st.diverged += diverged
        st.leftovers += leftovers
        if lost or dup or diverged or missing or leftovers:
            st.fail(f"train after kill ({point.describe}): lost {lost}, dup {dup}, diverged steps {diverged}, "
                    f"missing steps {missing}, leftovers {leftovers}")
            continue
        st.verified += 1
        shutil.rmtree(out, ignore_errors=True)
    return st

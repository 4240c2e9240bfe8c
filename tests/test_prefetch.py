"""Clairvoyant prefetch: the real loader reads DEST (local copies + symlinks into SRC) within a budget."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.loader import LoaderOptions, ShardedDataset, make_loader
from stager.manifest import load_manifest
from stager.pack import pack
from stager.prefetch import Prefetcher, prepare_dest, rank_reads, read_progress, report_progress

LOADER_KW = {"batch_size": 2, "world_size": 2, "num_workers": 0, "seed": 5, "decode": "raw", "shuffle_buffer": 2}

NODE = r'''
import json, sys
import numpy as np
from stager.loader import make_loader
from stager.prefetch import Prefetcher

src, dest, rank, budget, ahead = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
kw = json.loads(sys.argv[6])
out = {"epochs": []}
with Prefetcher(src, dest, budget=budget, ranks=[rank], loader_kwargs=kw) as pf:
    loader = make_loader(dest, rank=rank, staged=False, **kw)
    if ahead:
        assert pf.wait_ready(0, 0, timeout=120)
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids, payloads = [], []
        for j, batch in enumerate(loader):
            ids += batch["index"].tolist()
            if "data" in batch:  # raw payloads as one buffer + offsets
                data, offs = batch["data"].numpy(), batch["offsets"].numpy()
                payloads += [bytes(data[offs[k]:offs[k + 1]]).hex() for k in range(len(offs) - 1)]
            else:  # raw payloads as a list of bytes
                payloads += [bytes(x).hex() for x in batch["image"]]
            pf.advance(epoch, j + 1)
            assert pf.local_bytes() <= budget
            if ahead:  # compute time during which the prefetcher gets the next batch's shards
                nxt = (epoch, j + 1) if j + 1 < len(loader) else (epoch + 1, 0)
                assert pf.wait_ready(*nxt, timeout=120)
        out["epochs"].append({"ids": ids, "payloads": payloads})
    out["stats"] = pf.stats().to_json()
print(json.dumps(out))
'''


@pytest.fixture
def packed(imagenet_tiny_tar: Path) -> Path:
    """12 tar shards of 2 JPEGs: the session's pack (read-only)."""
    return imagenet_tiny_tar


def _payload(packed: Path, gid: int) -> bytes:
    m = load_manifest(packed)
    starts = m.sample_starts()
    s = int(np.searchsorted(starts, gid, side="right") - 1)
    sh = m.shards[s]
    k = gid - int(starts[s])
    with open(packed / sh.name, "rb") as f:
        f.seek(int(sh.offsets[k]))
        return f.read(int(sh.sizes[k]))


def test_schedule_matches_what_the_loader_reads(packed: Path, tmp_path: Path) -> None:
    """Through the real Loader: every shard holding a sample of batch j is read at or before batch j
    in the prefetch schedule, and the reads' bytes are the rank's samples' bytes."""
    dest = tmp_path / "dest"
    m = prepare_dest(packed, dest)
    starts = m.sample_starts()
    sizes = np.concatenate([s.sizes for s in m.shards])
    for rank in (0, 1):
        kw = dict(LOADER_KW)
        ds = ShardedDataset(str(dest), LoaderOptions(**kw, rank=rank, staged=False))
        loader = make_loader(str(dest), rank=rank, staged=False, **kw)
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            reads = rank_reads(ds, epoch)
            read_by: dict[int, set[int]] = {}
            for r in reads:
                for j in range(r.batch, len(loader)):
                    read_by.setdefault(j, set()).add(r.shard)
            seen: list[int] = []
            for j, batch in enumerate(loader):
                shards = set((np.searchsorted(starts, batch["index"].numpy(), side="right") - 1).tolist())
                assert shards <= read_by[j]
                seen += batch["index"].tolist()
            assert sum(r.bytes for r in reads) == int(sizes[seen].sum())
            # A worker opens a shard at its first read of the epoch; fewer held files, more opens.
            first: set[tuple[int, int]] = set()
            for r in rank_reads(ds, epoch, open_files=2):
                assert r.opens or (r.worker, r.shard) in first
                first.add((r.worker, r.shard))
            assert sum(r.opens for r in rank_reads(ds, epoch, open_files=2)) >= sum(r.opens for r in reads)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_loader_workers_open_the_files_the_schedule_says(
    imagenet_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, use_mmap: bool
) -> None:
    """Each worker's actual shard opens (os.open under ShardAccess), batch by batch, are the read
    schedule's opens: mapped and pread paths, runs and per-sample reads, 64 and 2 held files, from
    the epoch's start and resumed mid-epoch. So the prefetcher's 'only opens need a local copy' is
    what the loader does."""
    import types

    import stager.loader.shard_access as access_mod
    import stager.loader.torch_dataset as dataset_mod

    src = tmp_path / "src"
    pack(imagenet_tiny, src, samples_per_shard=4)  # longer worker streams over fewer, larger shards
    dest = tmp_path / "dest"
    m = prepare_dest(src, dest)
    names = {s.name: i for i, s in enumerate(m.shards)}
    opened: list[int] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        p = os.fspath(path)
        if os.path.dirname(p) == str(dest) and os.path.basename(p) in names:
            opened.append(names[os.path.basename(p)])
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    workers = 2
    kw = {**LOADER_KW, "num_workers": workers, "use_mmap": use_mmap, "staged": False}
    checked_reopen = False
    for open_files, shuffle, world in itertools.product((64, 2), (True, "random"), (1, 2)):
        monkeypatch.setattr(access_mod, "MAX_OPEN_FILES", open_files)
        for rank in range(world):
            ds = ShardedDataset(str(dest), LoaderOptions.from_kwargs(kw, rank=rank, world_size=world, shuffle=shuffle))
            for epoch, start in ((0, 0), (3, 0), (3, 3)):
                ds.set_epoch(epoch)
                ds.start_batch = start
                sched = ds.read_schedule(epoch, start_batch=start)
                for phys in range(workers):
                    info = types.SimpleNamespace(id=phys, num_workers=workers)
                    monkeypatch.setattr(dataset_mod, "get_worker_info", lambda info=info: info)
                    wr = sched.workers[(phys + start) % workers]
                    opens = wr.opens(open_files)
                    expect = [(b, s) for b, s, o in zip(wr.batch.tolist(), wr.shard.tolist(), opens.tolist(),
                                                        strict=True) if o]
                    checked_reopen |= len(expect) > len(set(s for _, s in expect))
                    got: list[tuple[int, int]] = []
                    opened.clear()
                    for batch in ds:
                        got += [(batch["_w"]["batch"], s) for s in opened]
                        opened.clear()
                        data, offs = batch["data"].numpy(), batch["offsets"]
                        for k, gid in enumerate(batch["index"].tolist()):
                            assert bytes(data[offs[k]:offs[k + 1]]) == _payload(src, gid)
                    assert got == expect
    assert checked_reopen  # the 2-file limit made some worker open a shard again


def test_dest_is_a_packed_dir_of_symlinks_and_progress_files(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    m = prepare_dest(packed, dest)
    for s in m.shards:
        assert (dest / s.name).is_symlink() and (dest / s.name).read_bytes() == (packed / s.name).read_bytes()
    # Another spelling of SRC (a rank may name it differently) keeps the links as they are.
    alias = tmp_path / "alias"
    alias.symlink_to(packed)
    before = {s.name: os.readlink(dest / s.name) for s in m.shards}
    prepare_dest(alias, dest)
    assert {s.name: os.readlink(dest / s.name) for s in m.shards} == before
    assert read_progress(dest, [0, 1]) is None
    report_progress(dest, 0, 1, 7)
    report_progress(dest, 1, 1, 3)
    assert read_progress(dest, [0, 1]) == (1, 3)


def test_prefetcher_respects_budget_and_evicts(packed: Path, tmp_path: Path) -> None:
    m = load_manifest(packed)
    budget = m.num_bytes // 3
    with Prefetcher(packed, tmp_path / "d", budget=budget, ranks=[0], loader_kwargs=LOADER_KW) as pf:
        bpe = pf.batches_per_epoch
        for j in range(bpe):
            assert pf.wait_ready(0, j, timeout=120)
            assert pf.local_bytes() <= budget
            pf.advance(0, j + 1)
        st = pf.stats()
    assert st.hit_rate == 1.0 and st.evicted_shards > 0 and st.peak_local_bytes <= budget
    local = [s for s in m.shards if not (tmp_path / "d" / s.name).is_symlink()]
    for s in local:  # what stayed local is a verified, complete copy
        assert (tmp_path / "d" / s.name).read_bytes() == (packed / s.name).read_bytes()


@pytest.mark.parametrize("ahead", [True, False])
def test_two_node_training_run_reads_each_sample_once(packed: Path, tmp_path: Path, ahead: bool) -> None:
    """Two real processes (one rank per node, own DEST, budget 1/3 of the data) train for 2 epochs."""
    m = load_manifest(packed)
    budget = m.num_bytes // 3
    env = dict(os.environ)
    procs = [
        subprocess.Popen([sys.executable, "-c", NODE, str(packed), str(tmp_path / f"dest{r}"), str(r), str(budget),
                          "1" if ahead else "0", json.dumps(LOADER_KW)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(2)
    ]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        outs.append(json.loads(so.splitlines()[-1]))
    n = m.num_samples
    for epoch in range(2):
        ids = outs[0]["epochs"][epoch]["ids"] + outs[1]["epochs"][epoch]["ids"]
        assert sorted(ids) == list(range(n))  # every sample exactly once per epoch across the 2 ranks
        for o in outs:
            e = o["epochs"][epoch]
            for gid, hexdata in zip(e["ids"][:6], e["payloads"][:6], strict=True):
                assert bytes.fromhex(hexdata) == _payload(packed, gid)
    for o in outs:
        st = o["stats"]
        assert st["peak_local_bytes"] <= budget
        assert st["hit_bytes"] + st["miss_bytes"] > 0 and 0.0 <= st["hit_rate"] <= 1.0
        if ahead:
            assert st["hit_rate"] == 1.0, st


# ---- stager stage --follow: a real follower process beside real training-like processes --------------

TRAINER = r'''
import json, os, sys, time
from stager.loader import make_loader
from stager.prefetch import ProgressReporter, prepare_dest

src, dest, rank, kw, gate = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
prepare_dest(src, dest)  # idempotent and safe beside the follower (it may not have started yet)
loader = make_loader(dest, rank=rank, staged=False, **kw)
out = {"epochs": []}
with ProgressReporter(dest, loader) as progress:
    while not os.path.exists(gate):  # the test opens the gate once the follower is fetching
        time.sleep(0.01)
    for epoch in range(2):
        loader.set_epoch(epoch)
        ids, payloads = [], []
        # Both ways of reporting: rank 0 calls update() after each step, rank 1 iterates through it.
        batches = enumerate(loader) if rank == 0 else enumerate(progress.iterate(loader))
        for j, batch in batches:
            ids += batch["index"].tolist()
            payloads += [bytes(x).hex() for x in batch["image"]]
            time.sleep(0.03)  # the training step: time in which the follower fetches ahead
            if rank == 0:
                progress.update(epoch, j + 1)
        out["epochs"].append({"ids": ids, "payloads": payloads})
print(json.dumps(out))
'''


def _local_bytes(dest: Path) -> int:
    """Bytes of regular files among DEST's shard entries, .partial files included (symlinks are 0)."""
    total = 0
    with os.scandir(dest) as it:
        for e in it:
            # The manifest and the sample index (or their .partial files), state: metadata, not the budget's.
            if e.name.startswith(("manifest.json", ".stager", "index-", "index.sidx")):
                continue
            try:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


def _sample_budget(dest: Path, stop: threading.Event, peaks: list[int]) -> None:
    while not stop.is_set():
        if dest.is_dir():
            peaks.append(_local_bytes(dest))
        time.sleep(0.002)


def _observed(dest: Path) -> list[int]:
    """The ranks whose position the follower has, from its status file (counted from there)."""
    try:
        return list(json.loads((dest / ".stager-progress" / "follower.json").read_text())["observed"])
    except (OSError, ValueError):
        return []


def _follower(packed: Path, dest: Path, budget: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stager", "stage", str(packed), str(dest), "--follow", "--budget", str(budget),
         "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond: Any, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("with_flags", [True, False])
def test_follow_beside_two_training_processes(packed: Path, tmp_path: Path, with_flags: bool) -> None:
    """One `stager stage --follow` process and 2 ranks on one node reading DEST: budget 1/3 of the data.

    with_flags: the follower is told the loader arguments and ranks; without: it learns both from
    the ranks' progress reports. Either way the ranks start their epochs once the follower has
    filled half the budget and seen both ranks (a test gate: the ranks' start-up time in a real job),
    so that its hit/miss account covers every read of both ranks.
    """
    m = load_manifest(packed)
    budget = m.num_bytes // 3
    # A 2-sample shuffle buffer spreads each worker's reads over the epoch (the default buffer holds
    # this whole tiny dataset, so every read would happen at the first batch).
    kw = {"batch_size": 2, "world_size": 2, "num_workers": 2, "seed": 7, "decode": "raw", "shuffle_buffer": 2}
    dest = tmp_path / "dest"
    flags = ["--batch-size", "2", "--world-size", "2", "--loader-workers", "2", "--seed", "7", "--ranks", "0-1",
             "--shuffle-buffer", "2"]
    fol = _follower(packed, dest, budget, *(flags if with_flags else []))
    stop, peaks = threading.Event(), []
    sampler = threading.Thread(target=_sample_budget, args=(dest, stop, peaks), daemon=True)
    sampler.start()
    try:
        gate = tmp_path / "gate"
        trainers = [subprocess.Popen([sys.executable, "-c", TRAINER, str(packed), str(dest), str(r), json.dumps(kw),
                                      str(gate)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for r in range(2)]
        _wait_for(lambda: _observed(dest) == [0, 1] and _local_bytes(dest) >= budget // 2, fol)
        gate.touch()
        outs = []
        for p in trainers:
            so, se = p.communicate(timeout=120)
            assert p.returncode == 0, se
            outs.append(json.loads(so.splitlines()[-1]))
        fso, fse = fol.communicate(timeout=60)  # exits by itself once both ranks finished
    finally:
        stop.set()
        sampler.join()
        if fol.poll() is None:
            fol.kill()
    assert fol.returncode == 0, fse
    rep = json.loads(fso)
    assert rep["stopped"] == "finished" and rep["ranks"] == [0, 1]
    n = m.num_samples
    sizes = np.concatenate([s.sizes for s in m.shards])
    read = 0
    for epoch in range(2):
        ids = outs[0]["epochs"][epoch]["ids"] + outs[1]["epochs"][epoch]["ids"]
        assert sorted(ids) == list(range(n))  # every sample exactly once per epoch across the 2 ranks
        read += int(sizes[ids].sum())
        for o in outs:  # the bytes the loader got over DEST (local copy or symlink) are SRC's
            e = o["epochs"][epoch]
            for gid, hexdata in zip(e["ids"], e["payloads"], strict=True):
                assert bytes.fromhex(hexdata) == _payload(packed, gid)
    assert peaks and max(peaks) <= budget  # sampled every ~2 ms, .partial files included
    assert rep["peak_local_bytes"] <= budget and rep["budget"] == budget
    # The follower accounted every read of both ranks' 2 epochs, as a hit or a miss.
    assert rep["hit_bytes"] + rep["miss_bytes"] == read, rep
    assert 0.0 < rep["hit_rate"] <= 1.0 and rep["fetched_bytes"] > 0, rep
    assert not [p for p in os.listdir(dest) if p.endswith(".partial")]
    for s in m.shards:  # every shard entry is a verified local copy or a symlink into SRC
        p = dest / s.name
        assert p.is_symlink() or p.read_bytes() == (packed / s.name).read_bytes()


GATED_TRAINER = r'''
import json, os, sys, time
from stager.loader import make_loader
from stager.prefetch import ProgressReporter, prepare_dest

src, dest, rank, kw, gates = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
prepare_dest(src, dest)
loader = make_loader(dest, rank=rank, staged=False, **kw)
out = {"epochs": []}
with ProgressReporter(dest, loader) as progress:
    for epoch in range(2):
        open(os.path.join(gates, f"waiting-{rank}-{epoch}"), "w").close()
        while not os.path.exists(os.path.join(gates, f"open-{epoch}")):
            time.sleep(0.01)
        loader.set_epoch(epoch)
        ids = []
        for batch in progress.iterate(loader):
            ids += batch["index"].tolist()
        out["epochs"].append({"ids": ids})
    open(os.path.join(gates, f"waiting-{rank}-2"), "w").close()  # done reading, not yet finished
    while not os.path.exists(os.path.join(gates, "open-2")):
        time.sleep(0.01)
print(json.dumps(out))
'''


@pytest.mark.parametrize("late", [1, 2])
def test_follow_started_late_accounts_every_read(packed: Path, tmp_path: Path, late: int) -> None:
    """A follower that first sees the ranks long after they began (slow to start on a busy node, or
    started by hand mid-run) still accounts every read of the run exactly once: the reports say
    where each rank began, and the reads before the follower's first look count by DEST as it found
    it (nothing fetched yet: misses). The ranks are held at gates, so the interleaving is forced,
    not left to the scheduler: the follower starts when both ranks wait before epoch 1 (late=1)
    or have read both epochs and not yet finished (late=2)."""
    m = load_manifest(packed)
    kw = {"batch_size": 2, "world_size": 2, "num_workers": 2, "seed": 3, "decode": "raw", "shuffle_buffer": 2}
    dest, gates = tmp_path / "dest", tmp_path / "gates"
    gates.mkdir()
    for g in range(late):
        (gates / f"open-{g}").touch()
    trainers = [subprocess.Popen([sys.executable, "-c", GATED_TRAINER, str(packed), str(dest), str(r), json.dumps(kw),
                                  str(gates)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
    fol = None
    try:
        deadline = time.monotonic() + 120
        while not all((gates / f"waiting-{r}-{late}").exists() for r in range(2)):
            assert all(p.poll() is None for p in trainers), [p.communicate() for p in trainers]
            assert time.monotonic() < deadline, "trainers hung"
            time.sleep(0.01)
        fol = _follower(packed, dest, m.num_bytes // 3)
        _wait_for(lambda: _observed(dest) == [0, 1], fol)
        for g in range(late, 3):
            (gates / f"open-{g}").touch()
        outs = [p.communicate(timeout=120) for p in trainers]
        fso, fse = fol.communicate(timeout=60)
    finally:
        for p in [*trainers, *([fol] if fol else [])]:
            if p.poll() is None:
                p.kill()
    for p, (_, se) in zip(trainers, outs, strict=True):
        assert p.returncode == 0, se
    assert fol.returncode == 0, fse
    rep = json.loads(fso)
    assert rep["stopped"] == "finished", rep
    sizes = np.concatenate([s.sizes for s in m.shards])
    runs = [json.loads(so.splitlines()[-1]) for so, _ in outs]
    per_epoch = []
    for epoch in range(2):
        ids = runs[0]["epochs"][epoch]["ids"] + runs[1]["epochs"][epoch]["ids"]
        assert sorted(ids) == list(range(m.num_samples))
        per_epoch.append(int(sizes[ids].sum()))
    assert rep["hit_bytes"] + rep["miss_bytes"] == sum(per_epoch), rep
    # The epochs read before the follower's first look were all misses (nothing was local then).
    for epoch in range(late):
        assert rep["per_epoch"][str(epoch)] == {"hit_bytes": 0, "miss_bytes": per_epoch[epoch]}, rep


def _partials(dest: Path) -> list[str]:
    return [p for p in os.listdir(dest) if p.endswith(".partial")]


def _is_stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _freeze_mid_fetch(proc: subprocess.Popen[str], dest: Path, timeout: float = 30) -> bool:
    """SIGSTOP the follower at a moment when a fetch's .partial file exists; True if that happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if dest.is_dir() and _partials(dest):
            os.kill(proc.pid, signal.SIGSTOP)
            while not _is_stopped(proc.pid):
                time.sleep(0.0005)
            if _partials(dest):
                return True
            os.kill(proc.pid, signal.SIGCONT)
    return False


def test_follow_sigterm_mid_fetch_leaves_no_partial(packed: Path, tmp_path: Path) -> None:
    """SIGTERM while a shard is half copied: the follower exits 0 with its figures, no .partial stays.

    A SIGUSR1 sent before it (what the job scripts' `--signal=USR1@300` delivers) does not stop it.
    """
    m = load_manifest(packed)
    caught = False
    for attempt in range(3):  # a fetch must be caught in flight; tiny chunks make fetches slow
        dest = tmp_path / f"dest{attempt}"
        fol = _follower(packed, dest, m.num_bytes, "--batch-size", "2", "--world-size", "2", "--ranks", "0",
                        "--chunk-size", "64")
        try:
            caught = _freeze_mid_fetch(fol, dest)
            # SIGUSR1 (Slurm's --signal=USR1@... to every task: training's checkpoint request) is ignored
            os.kill(fol.pid, signal.SIGUSR1)
            os.kill(fol.pid, signal.SIGTERM)
            os.kill(fol.pid, signal.SIGCONT)
            so, se = fol.communicate(timeout=60)
        finally:
            if fol.poll() is None:
                fol.kill()
        assert fol.returncode == 0, se
        rep = json.loads(so)
        assert rep["stopped"] == "signal" and rep["budget"] == m.num_bytes
        assert _partials(dest) == []
        for s in m.shards:  # what is local is a complete verified copy; the rest are symlinks into SRC
            p = dest / s.name
            assert p.is_symlink() or p.read_bytes() == (packed / s.name).read_bytes()
        if caught:
            break
    assert caught, "no fetch was caught in flight in 3 attempts"


def test_follow_stop_conditions_and_one_follower_per_dest(packed: Path, tmp_path: Path) -> None:
    """In-process follow(): done marker, a rank that dies without finishing, a watched pid, the lock."""
    from stager.errors import StagerTimeoutError
    from stager.prefetch import mark_done
    from stager.prefetch.follow import follow

    m = load_manifest(packed)
    kw = {k: v for k, v in LOADER_KW.items() if k != "decode"}

    def run_bg(dest: Path, **extra: Any) -> tuple[threading.Thread, dict[str, Any]]:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["res"] = follow(packed, dest, budget=m.num_bytes // 2, poll=0.01, **extra)
            except BaseException as exc:  # handed to the test thread
                box["exc"] = exc

        t = threading.Thread(target=target, daemon=True)
        t.start()
        return t, box

    def wait_dest(dest: Path) -> None:
        deadline = time.monotonic() + 120
        while not (dest / ".stager-progress" / "follower.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    # done marker; a second follower on the same DEST is refused while the first runs
    dest = tmp_path / "a"
    (dest).mkdir()
    stale = dest / f"{m.shards[0].name}.0123456789ab.partial"
    stale.write_bytes(b"left by a killed fetcher")
    t, box = run_bg(dest, loader_kwargs=kw, ranks=[0])
    wait_dest(dest)
    with pytest.raises(StagerTimeoutError, match="locked"):
        follow(packed, dest, budget=1, loader_kwargs=kw, ranks=[0])
    mark_done(dest)
    t.join(30)
    assert "exc" not in box, box.get("exc")
    assert box["res"].reason == "done" and box["res"].removed_partials == [stale.name] and not stale.exists()

    # a rank process that reports, then dies without finishing: the follower stops ("ranks-gone")
    dest = tmp_path / "b"
    t, box = run_bg(dest)
    wait_dest(dest)
    code = ("import sys; from stager.prefetch import report_progress; "
            "report_progress(sys.argv[1], 0, 0, 0)")
    subprocess.run([sys.executable, "-c", code, str(dest)], check=True)
    t.join(30)
    assert box["res"].reason == "ranks-gone"

    # a watched pid that goes away
    dest = tmp_path / "c"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    t, box = run_bg(dest, loader_kwargs=kw, ranks=[0], watch_pid=sleeper.pid)
    wait_dest(dest)
    sleeper.kill()
    sleeper.wait()
    t.join(30)
    assert box["res"].reason == "pid-gone"


def test_follow_replans_when_the_ranks_report_other_loader_arguments(packed: Path, tmp_path: Path) -> None:
    """Command-line loader flags that differ from the ranks' loader: the ranks' arguments win."""
    from stager.prefetch import ProgressReporter
    from stager.prefetch.follow import follow

    m = load_manifest(packed)
    dest = tmp_path / "d"
    wrong = {k: v for k, v in LOADER_KW.items() if k != "decode"} | {"seed": 99}
    stop = threading.Event()
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(res=follow(packed, dest, budget=m.num_bytes // 3, poll=0.01,
                                                              loader_kwargs=wrong, ranks=[0, 1], stop=stop)))
    t.start()
    try:
        deadline = time.monotonic() + 120
        while _local_bytes(dest) == 0 if dest.is_dir() else True:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        loaders = [make_loader(str(dest), rank=r, staged=False, **LOADER_KW) for r in (0, 1)]
        reporters = [ProgressReporter(dest, ld) for ld in loaders]
        deadline = time.monotonic() + 120
        while not (dest / ".stager-progress" / "follower.json").exists() or \
                json.loads((dest / ".stager-progress" / "follower.json").read_text())["observed"] != [0, 1]:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        for rp in reporters:
            rp.update(0, 2)
            rp.finish()
        t.join(30)  # the follower stops by itself once both ranks finished
    finally:
        stop.set()  # no-op unless the test failed above
        t.join(30)
    res = box["res"]
    assert res.reason == "finished" and res.replans == 1 and res.loader_kwargs["seed"] == LOADER_KW["seed"]
    assert any("differ" in w for w in res.warnings)


@pytest.mark.parametrize("world_size", [2, 3])
def test_prefetch_plans_the_batches_prepare_deals_to_each_rank(packed: Path, tmp_path: Path, world_size: int) -> None:
    """A ``shuffle=False`` loader under Accelerate deals the epoch's batches to the ranks in turn
    (``deal_batches_in_turn``, what ``prepare()`` asks). A rank's reported plan arguments carry it, and the
    prefetcher planning from them prefetches exactly the shards that rank reads, in the order it reads
    them; it used to plan contiguous slices (other shards) since the arguments left the dealing out."""
    from stager.prefetch import loader_config

    dest = tmp_path / "dest"
    m = prepare_dest(packed, dest)
    starts = m.sample_starts()
    kw = {**LOADER_KW, "shuffle": "none", "world_size": world_size, "batch_size": 3}
    for rank in range(world_size):
        loader = make_loader(str(dest), rank=rank, staged=False, **kw)
        assert loader.dataset.deal_batches_in_turn()  # as prepare() does
        cfg = loader_config(loader)
        assert cfg["deal_batches"] is True
        pf = Prefetcher(packed, tmp_path / f"pf{rank}", budget=1 << 30, ranks=[rank], loader_kwargs=cfg)
        assert pf.config() == cfg
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            read: list[int] = []  # the shards of the samples the rank gets, in order, each run once
            for batch in loader:
                for s in (np.searchsorted(starts, batch["index"].numpy(), side="right") - 1).tolist():
                    if not read or read[-1] != s:
                        read.append(s)
            planned = [r.shard for r in rank_reads(pf._datasets[0], epoch)]
            assert [s for i, s in enumerate(planned) if i == 0 or planned[i - 1] != s] == read, (rank, epoch)


def test_next_uses_per_rank_positions(packed: Path, tmp_path: Path) -> None:
    """Each shard's next use is the earliest open of any rank at or after that rank's own position."""
    kw = {k: v for k, v in LOADER_KW.items() if k != "decode"}
    pf = Prefetcher(packed, tmp_path / "d", budget=1 << 30, ranks=[0, 1], loader_kwargs=kw, lookahead_epochs=1)
    bpe = pf.batches_per_epoch
    for pos in ([(0, 0), (0, 0)], [(0, 3), (0, 1)], [(1, 2), (0, bpe - 1)]):
        expect = np.full(len(pf.manifest.shards), np.iinfo(np.int64).max)
        for i, (e0, d0) in enumerate(pos):
            for e in range(e0, e0 + 2):
                for r in rank_reads(pf._datasets[i], e):
                    t = e * bpe + r.batch
                    if r.opens and t >= e0 * bpe + d0:  # reads through a held file need no local copy
                        expect[r.shard] = min(expect[r.shard], t)
        assert (pf.next_uses(pos) == expect).all()


def test_follow_cli_usage_errors(packed: Path, tmp_path: Path) -> None:
    for extra, msg in ((["--follow"], "--budget"),
                       (["--follow", "--budget", "1M", "--batch-size", "2"], "--world-size"),
                       (["--follow", "--budget", "1M", "--partition"], "cannot be combined"),
                       (["--follow", "--budget", "1M", "--no-fsync"], "cannot be combined"),
                       (["--collective", "--direct"], "cannot be combined")):
        p = subprocess.run([sys.executable, "-m", "stager", "stage", str(packed), str(tmp_path / "d"), *extra],
                           check=False, capture_output=True, text=True)
        assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_follow_cli_budget_below_a_shard_warns_and_watched_pid(packed: Path, tmp_path: Path) -> None:
    """A budget no shard fits in is a warning on stderr; a --pid that is gone stops the follower."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)
    p = subprocess.run([sys.executable, "-m", "stager", "stage", str(packed), str(tmp_path / "d"), "--follow",
                        "--budget", "1", "--pid", gone.stdout.strip(), "--json"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["stopped"] == "pid-gone" and rep["fetched_bytes"] == 0
    assert "below the largest shard" in p.stderr and rep["warnings"]


def test_follow_stops_when_its_parent_is_gone(packed: Path, tmp_path: Path) -> None:
    """Started in the background by a shell that then exits: the orphaned follower stops by itself."""
    out = tmp_path / "out.json"
    script = (f'"{sys.executable}" -m stager stage "{packed}" "{tmp_path / "d"}" --follow --budget 1M --json '
              f'--poll 0.01 > "{out}" 2>/dev/null & '
              # exit only once the follower runs (it has recorded this shell as its parent by then)
              f'while [ ! -d "{tmp_path / "d" / ".stager-progress"}" ]; do sleep 0.02; done')
    subprocess.run(["bash", "-c", script], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the orphaned follower did not stop"
        time.sleep(0.05)
    assert json.loads(out.read_text())["stopped"] == "parent-gone"


def test_progress_reporter_iterate_follows_the_loaders_epochs_and_resume(packed: Path, tmp_path: Path) -> None:
    from stager.prefetch import ProgressReporter, read_reports

    dest = tmp_path / "d"
    prepare_dest(packed, dest)
    kw = dict(LOADER_KW)
    loader = make_loader(str(dest), rank=1, staged=False, **kw)
    n = len(loader)
    with ProgressReporter(dest, loader, min_interval=0) as progress:
        assert read_reports(dest)[1]["config"]["seed"] == kw["seed"] and read_reports(dest)[1]["done"] == 0
        for j, _ in enumerate(progress.iterate(loader)):
            assert (read_reports(dest)[1]["epoch"], read_reports(dest)[1]["done"]) == (0, j)
        assert (read_reports(dest)[1]["epoch"], read_reports(dest)[1]["done"]) == (0, n)
        it = progress.iterate(loader)  # no set_epoch: the loader moves on to epoch 1
        next(it)
        next(it)
        state = loader.state_dict()
        assert (read_reports(dest)[1]["epoch"], read_reports(dest)[1]["done"]) == (1, 1) == (state["epoch"], 1)
    assert read_reports(dest)[1]["finished"]
    resumed = make_loader(str(dest), rank=1, staged=False, **kw)
    resumed.load_state_dict(state)  # 2 batches of epoch 1 handed out
    with ProgressReporter(dest, resumed, min_interval=0) as progress:
        assert (read_reports(dest)[1]["epoch"], read_reports(dest)[1]["done"]) == (1, 2)
        assert sum(1 for _ in progress.iterate(resumed)) == n - 2
        assert (read_reports(dest)[1]["epoch"], read_reports(dest)[1]["done"]) == (1, n)


def test_prefetched_copies_never_grant_more_than_the_source(packed: Path, tmp_path: Path) -> None:
    """A fetched shard gets what stage gives its copies (fs/access.py): a group-only dataset stays
    group-only (world-readable 0644 less the umask, before)."""
    src = tmp_path / "src"
    shutil.copytree(packed, src)
    for p in src.iterdir():
        p.chmod(0o640)
    old = os.umask(0o022)
    try:
        with Prefetcher(src, tmp_path / "d", budget=load_manifest(src).num_bytes, ranks=[0],
                        loader_kwargs=LOADER_KW) as pf:
            assert pf.wait_ready(0, 0, timeout=120)
    finally:
        os.umask(old)
    local = [p for p in (tmp_path / "d").iterdir() if p.is_file() and not p.is_symlink() and p.suffix == ".tar"]
    assert local and {stat.S_IMODE(p.stat().st_mode) for p in local} == {0o640}

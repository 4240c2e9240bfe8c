"""Several stagers and loaders on one node at once.

A round starts ``stagers`` ``stager stage SRC DEST`` processes on one DEST (copies throttled so they
overlap) and ``loaders`` reader processes, half started with the stagers and half once staging is
under way; each reader iterates one epoch of ``make_loader(SRC, staged="auto")`` in raw mode and
reports an xxh3 digest per key and where it read from. Checked: every stager exits 0, exactly one
of them copies (the copied file counts sum to the dataset's files: no double copies), DEST
verifies with no ``.partial`` or lock left, and every reader saw every key exactly once with the
source's bytes (no torn reads), whether it read SRC or the staged copy.

Run as ``python -m tools.faults.concurrency read SRC ROOT`` it is that reader.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.faults import harness as h
from tools.faults.kill import staged_source


@dataclass
class ConcurrencyStats:
    rounds: int = 0
    stagers: int = 0
    stager_ok: int = 0
    copiers_per_round: list[int] = field(default_factory=list)
    double_copies: int = 0
    loaders: int = 0
    loaders_exact: int = 0
    read_staged: int = 0
    torn_reads: int = 0
    lost: int = 0
    leftovers: int = 0
    holders_killed: int = 0
    takeovers: int = 0
    errors: list[str] = field(default_factory=list)


def expected_digests(src: Path) -> dict[str, str]:
    import xxhash

    from stager.formats import get_format
    from stager.manifest import load_manifest

    m = load_manifest(src)
    out = {}
    for info in m.shards:
        r = get_format(m.format).open_reader(str(src / info.name), info, m)
        try:
            for k, data in zip(info.keys, r.read(range(info.samples)), strict=True):
                out[k] = xxhash.xxh3_64_hexdigest(bytes(data))
        finally:
            r.close()
    return out


def read_epoch(src: str, root: str) -> dict[str, Any]:
    """One epoch of raw payloads from ``src`` (preferring a staged copy under ``root``)."""
    import xxhash

    from stager.loader import make_loader

    loader = make_loader(src, 4, staged="auto", staging_roots=(root,), decode="raw", seed=1)
    pairs: list[tuple[str, str]] = []
    for b in loader:
        # docs/loader.md: with decode="raw", ``image`` holds each sample's encoded bytes (memoryviews).
        for k, payload in zip(b["key"], b["image"], strict=True):
            pairs.append((k, xxhash.xxh3_64_hexdigest(bytes(payload))))
    s = loader.stats()
    return {"pairs": pairs, "reading_from": s["reading_from"], "staged": s["staged"]}


def _reader(src: Path, root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tools.faults.concurrency", "read", str(src), str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.child_env(),
                            cwd=str(h.ROOT))


def _kill_holder(dest: Path, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str] | None:
    """SIGKILL the stager that holds DEST's node lock (its pid is in the lock record)."""
    import os
    import signal

    try:
        pid = int(json.loads((dest / ".stager-lock").read_bytes())["pid"])
    except (OSError, ValueError, KeyError):
        return None
    for p in procs:
        if p.pid == pid and p.poll() is None:
            os.kill(pid, signal.SIGKILL)
            return p
    return None


def rounds(work: Path, n_rounds: int, *, stagers: int = 4, loaders: int = 4, throttle_bps: int = 60_000,
           kill_holder: bool = False) -> ConcurrencyStats:
    """``n_rounds`` rounds (see the module docstring); with ``kill_holder`` the stager holding the lock
    is killed mid-copy and a waiter must take over and finish."""
    from stager.manifest import load_manifest

    st = ConcurrencyStats()
    src, m = staged_source(work)
    want = expected_digests(src)
    nfiles = len(list(m.files()))
    for r in range(n_rounds):
        root = work / f"conc-{r}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        dest = root / "ds"
        env = {"STAGER_TEST_THROTTLE_BPS": str(throttle_bps)}
        procs = [subprocess.Popen(h.stager_argv("stage", str(src), str(dest), "--json", "-q", "--timeout", "120",
                                                "--workers", "2"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=h.child_env(env))
                 for _ in range(stagers)]
        readers = [_reader(src, root) for _ in range(loaders // 2)]
        time.sleep(0.5)
        readers += [_reader(src, root) for _ in range(loaders - loaders // 2)]
        st.rounds += 1
        killed = None
        if kill_holder:
            deadline = time.monotonic() + 60
            while killed is None and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                if h.count_files(dest) > 3:
                    killed = _kill_holder(dest, procs)
                time.sleep(0.05)
            st.holders_killed += int(killed is not None)
        copied = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p is killed:
                continue
            st.stagers += 1
            if p.returncode == 0:
                st.stager_ok += 1
                res = json.loads(out.strip().splitlines()[-1])
                copied.append(int(res["files_copied"]))
                st.takeovers += int(bool(res.get("lock_takeover")))
            else:
                st.errors.append(f"stager exit {p.returncode}: {err.strip()[-300:]}")
        copiers = sum(1 for c in copied if c > 0)
        st.copiers_per_round.append(copiers)
        st.double_copies += max(0, sum(copied) - nfiles)
        # One more reader after staging finished: it must find and use the staged copy.
        readers.append(_reader(src, root))
        for p in readers:
            out, err = p.communicate(timeout=300)
            st.loaders += 1
            if p.returncode != 0:
                st.errors.append(f"reader exit {p.returncode}: {err.strip()[-300:]}")
                st.lost += len(want)
                continue
            res = json.loads(out.strip().splitlines()[-1])
            got = dict(res["pairs"])
            lost, dup = h.multiset_diff(list(want), [k for k, _ in res["pairs"]])
            torn = sum(1 for k, d in got.items() if want.get(k) != d)
            st.torn_reads += torn
            st.lost += lost + dup
            st.read_staged += int(bool(res["staged"]))
            if not lost and not dup and not torn:
                st.loaders_exact += 1
        ok, bad = h.verify_ok(dest)
        leftovers = len(h.partials(dest)) + int((dest / ".stager-lock").exists())
        st.leftovers += leftovers
        if not ok or load_manifest(dest).digest != m.digest:
            st.errors.append(f"round {r}: staged copy does not verify: {bad}")
        shutil.rmtree(root, ignore_errors=True)
    return st


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "read":
        print("usage: python -m tools.faults.concurrency read SRC ROOT", file=sys.stderr)
        return 2
    print(json.dumps(read_epoch(args[1], args[2])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

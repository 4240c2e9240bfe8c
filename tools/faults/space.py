"""Out of space: a real file-size limit (RLIMIT_FSIZE) and a real full file system (a small tmpfs).

RLIMIT_FSIZE is set in the child (``preexec_fn``) to a seeded random size, so some shard (or the
manifest, or an unpacked file) cannot be written. Expected: exit 4, exactly one error line naming a
path, no file under a final name that is not complete and correct, no ``.partial`` file left, and a
rerun without the limit that completes and verifies. The SIGXFSZ disposition is left at its default:
the command itself must turn the limit into an error (stage and pack ignore the signal).

The tmpfs trials mount ``tmpfs -o size=N`` (root only; skipped elsewhere), run the command into it
until ENOSPC, then remount it larger and rerun.
"""

from __future__ import annotations

import contextlib
import resource
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.faults import harness as h
from tools.faults.kill import expected_unpacked, staged_source, unpack_damage


@dataclass
class SpaceStats:
    command: str
    trials: int = 0  # runs that hit the limit
    no_fault: int = 0  # the random limit was above every file: the run just succeeded
    clean_errors: int = 0  # exit 4 with one error line naming a path
    torn_final: int = 0  # files under a final name with wrong content
    leftovers: int = 0  # .partial files after the failed run
    rerun_ok: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        if len(self.errors) < 10:
            self.errors.append(msg)

    @property
    def handled(self) -> int:
        return min(self.clean_errors, self.rerun_ok)


def fsize_limit(limit: int) -> Callable[[], None]:
    def pre() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


def _final_files_ok(root: Path, expected: dict[str, tuple[int, str]], algo: str) -> int:
    """Count files under ``root`` with a final (manifest) name whose size or hash is wrong."""
    from stager.checksum import hash_file

    bad = 0
    for name, (nbytes, digest) in expected.items():
        p = root / name
        if p.exists() and hash_file(p, algo) != (nbytes, digest):
            bad += 1
    return bad


def torn_unpacked(root: Path, want: dict[str, bytes]) -> int:
    """Files of an unpacked tree that exist with content other than the sample's bytes."""
    torn = 0
    for p in h.files_under(root) if root.exists() else []:
        if p.read_bytes() != want.get(str(p.relative_to(root))):
            torn += 1
    return torn


def _check_error(st: SpaceStats, r: subprocess.CompletedProcess[str], what: str) -> None:
    line = h.one_line_error(r.stderr)
    if r.returncode == 4 and line and "/" in line:
        st.clean_errors += 1
    else:
        st.fail(f"{what}: exit {r.returncode}, stderr {r.stderr.strip()[-300:]!r}")


def _limits(rng: np.random.Generator, lo: int, hi: int, n: int) -> list[int]:
    """``n`` log-uniform random limits in [lo, hi)."""
    return [int(np.exp(rng.uniform(np.log(lo), np.log(hi)))) for _ in range(n)]


# ---- RLIMIT_FSIZE ---------------------------------------------------------------------------------------
def pack_fsize_trials(work: Path, n: int, *, seed: int = 0, fmt: str = "tar") -> SpaceStats:
    from stager.manifest import load_manifest

    st = SpaceStats(f"pack ({fmt})")
    rng = np.random.default_rng((seed, 404))
    src = h.cifar_source(work, n_train=96)
    args = ["--format", fmt, "--samples-per-shard", "8", "-q"]
    if fmt == "zarr":
        args += ["--resize", "32x32"]
    ref_dir = work / f"pack-ref-space-{fmt}"
    ref = h.packed(src, ref_dir, fmt, samples_per_shard=8)
    if ref_dir.exists() and not (ref_dir / "manifest.json").exists():
        raise RuntimeError("reference pack failed")
    expected = {name: (b, d) for name, b, d in ref.files()}
    biggest = max(b for b, _ in expected.values())
    for i, limit in enumerate(_limits(rng, 512, int(biggest * 1.05), 2 * n)):
        if st.trials >= n:
            break
        out = work / f"pack-fsize-{fmt}-{i}"
        shutil.rmtree(out, ignore_errors=True)
        r = h.run_stager("pack", str(src), str(out), *args, preexec_fn=fsize_limit(limit))
        if r.returncode == 0:
            st.no_fault += 1
            shutil.rmtree(out, ignore_errors=True)
            continue
        st.trials += 1
        _check_error(st, r, f"pack limit {limit}")
        st.torn_final += _final_files_ok(out, expected, ref.hash_algo)
        st.leftovers += len(h.partials(out))
        r2 = h.run_stager("pack", str(src), str(out), *args)
        ok = r2.returncode == 0 and h.verify_ok(out)[0] and sorted(load_manifest(out).files()) == sorted(ref.files())
        if ok:
            st.rerun_ok += 1
            shutil.rmtree(out, ignore_errors=True)
        else:
            st.lost += ref.num_samples
            st.fail(f"pack rerun after limit {limit}: exit {r2.returncode} {r2.stderr.strip()[-300:]}")
    return st


def stage_fsize_trials(work: Path, n: int, *, seed: int = 0, unpack: str | None = None) -> SpaceStats:
    st = SpaceStats("stage" + (f" --unpack {unpack}" if unpack else ""))
    rng = np.random.default_rng((seed, 505, len(unpack or "")))
    src, m = staged_source(work)
    expected = {name: (b, d) for name, b, d in m.files()}
    want = expected_unpacked(src, m) if unpack else {}
    extra = ["--unpack", unpack] if unpack else []
    hi = max(len(v) for v in want.values()) if unpack else max(b for b, _ in expected.values())
    lo = min(len(v) for v in want.values()) // 2 if unpack else 512
    for i, limit in enumerate(_limits(rng, lo, int(hi * 1.05), 2 * n)):
        if st.trials >= n:
            break
        dest = work / f"stage-fsize-{unpack}-{i}"
        shutil.rmtree(dest, ignore_errors=True)
        r = h.run_stager("stage", str(src), str(dest), "-q", *extra, preexec_fn=fsize_limit(limit))
        if r.returncode == 0:
            st.no_fault += 1
            shutil.rmtree(dest, ignore_errors=True)
            continue
        st.trials += 1
        _check_error(st, r, f"stage limit {limit}")
        st.torn_final += _final_files_ok(dest, expected, m.hash_algo)
        st.leftovers += len(h.partials(dest))
        st.torn_final += torn_unpacked(dest / "unpacked", want)
        if (dest / "stager-receipt.json").exists():
            st.torn_final += 1  # a receipt must never describe a failed stage
        r2 = h.run_stager("stage", str(src), str(dest), "-q", *extra)
        ok = r2.returncode == 0 and (unpack == "only" or h.verify_ok(dest)[0])
        lost = unpack_damage(dest / "unpacked", want)[0] if unpack and ok else 0
        if ok and not lost:
            st.rerun_ok += 1
            shutil.rmtree(dest, ignore_errors=True)
        else:
            st.lost += lost or m.num_samples
            st.fail(f"stage rerun after limit {limit}: exit {r2.returncode} {r2.stderr.strip()[-300:]}, lost {lost}")
    return st


# ---- a real full file system ----------------------------------------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Callable[[int], None]]:
    """Mount a tmpfs of ``size`` bytes at ``path``; yield ``resize(new_size)``; unmount at exit.

    Raises PermissionError (or OSError) where mounting is not allowed.
    """
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        raise PermissionError(f"cannot mount tmpfs at {path}: {r.stderr.strip()}")

    def resize(new: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True, capture_output=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def can_mount_tmpfs(work: Path) -> bool:
    try:
        with tmpfs(work / "mount-probe", 1 << 20):
            return True
    except (OSError, FileNotFoundError):
        return False


def enospc_trials(work: Path, n: int, *, seed: int = 0, command: str = "stage") -> SpaceStats:
    """``command`` ("pack", "stage" or "stage-unpack") into a tmpfs too small for it, then grown."""
    st = SpaceStats(f"{command} into a full tmpfs")
    rng = np.random.default_rng((seed, 606, len(command)))
    src, m = staged_source(work)
    expected = {name: (b, d) for name, b, d in m.files()}
    want = expected_unpacked(src, m) if command == "stage-unpack" else {}
    img_src = h.imagefolder_source(work, classes=4, per_class=48)
    total = m.num_bytes + (sum(len(v) for v in want.values()) if want else 0)
    for i in range(2 * n):
        if st.trials >= n:
            break
        size = int(rng.uniform(0.1, 0.9) * total) // 4096 * 4096 + 4096
        mnt = work / f"tmpfs-{command}-{i}"
        target = mnt / "out"
        env: dict[str, Any] = {}
        with tmpfs(mnt, size) as resize:
            if command == "pack":
                argv = ["pack", str(img_src), str(target), "--format", "tar", "--samples-per-shard", "4", "-q"]
            else:
                argv = ["stage", str(src), str(target), "-q"]
                if command == "stage-unpack":
                    argv += ["--unpack", "also"]
                # Skip the free-space pre-check half the time, so the copy itself meets ENOSPC.
                if i % 2 == 1:
                    env["STAGER_TEST_FREE_BYTES"] = str(1 << 40)
            r = h.run_stager(*argv, env=env)
            if r.returncode == 0:
                st.no_fault += 1
                continue
            st.trials += 1
            _check_error(st, r, f"{command} into {size}-byte tmpfs")
            if command != "pack":
                st.torn_final += _final_files_ok(target, expected, m.hash_algo)
                st.torn_final += torn_unpacked(target / "unpacked", want) if want else 0
                st.torn_final += int((target / "stager-receipt.json").exists())
            st.leftovers += len(h.partials(target)) if target.exists() else 0
            resize(64 << 20)
            r2 = h.run_stager(*argv)
            ok = r2.returncode == 0 and h.verify_ok(target)[0]
            lost = unpack_damage(target / "unpacked", want)[0] if want and ok else 0
            if ok and not lost:
                st.rerun_ok += 1
            else:
                st.lost += lost or m.num_samples
                st.fail(f"{command} rerun after ENOSPC: exit {r2.returncode} {r2.stderr.strip()[-300:]}")
    return st

"""Damaged data: random byte flips and truncations of shards (every format), damaged manifests, and
the loader's ``on_error`` policies on undecodable samples.

Shards: each trial damages one random file of a pack (shard or companion) by flipping 1-4 random
bytes or truncating it at a random length, then asks ``stager verify`` (API, and the CLI on every
fourth trial) and ``stager stage`` (CLI) about it. Detected = verify lists exactly that file and
stage exits 3 with one line naming it, leaving no copy of it in DEST and no ``.partial``.

Manifests: a flipped digit, a truncation at a random byte, or another schema string; ``stager
verify`` and ``stager stage`` must both refuse with exit 3 and one line.

Loader: the payloads of k random samples are overwritten so they cannot be decoded. ``on_error=
"raise"`` must raise :class:`~stager.errors.CorruptSampleError` naming the shard and the key;
``"skip"`` must deliver every other sample exactly once and count k skips.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.faults import harness as h


@dataclass
class DetectStats:
    what: str
    trials: int = 0
    detected: int = 0
    lost: int = 0  # damaged data that got through (staged under a final name / delivered)
    errors: list[str] = field(default_factory=list)

    def miss(self, msg: str) -> None:
        if len(self.errors) < 10:
            self.errors.append(msg)


def corruption_pack(work: Path, fmt: str) -> tuple[Path, Any]:
    src = h.cifar_source(work, n_train=48)
    out = work / f"corrupt-src-{fmt}"
    return out, h.packed(src, out, fmt, samples_per_shard=8)


def damage(path: Path, rng: np.random.Generator) -> str:
    """Flip 1-4 random bytes of ``path`` or truncate it at a random length; describe what was done."""
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5 and len(data) > 0:
        where = sorted({int(x) for x in rng.integers(0, len(data), int(rng.integers(1, 5)))})
        for w in where:
            data[w] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(data))
        return f"flipped bytes at {where}"
    cut = int(rng.integers(0, len(data)))
    path.write_bytes(bytes(data[:cut]))
    return f"truncated to {cut} of {len(data)} bytes"


def shard_trials(work: Path, fmt: str, n: int, *, seed: int = 0) -> DetectStats:
    """``n`` damaged-file trials on a ``fmt`` pack; see the module docstring."""
    from stager.shardcheck import verify

    st = DetectStats(f"damaged shard ({fmt})")
    rng = np.random.default_rng((seed, 707, len(fmt)))
    src, m = corruption_pack(work, fmt)
    files = [name for name, _, _ in m.files()]
    for i in range(n):
        name = files[int(rng.integers(0, len(files)))]
        path = src / name
        original = path.read_bytes()
        how = damage(path, rng)
        st.trials += 1
        try:
            res = verify(src)
            api_ok = [b for b, _ in res.bad] == [name]
            cli_ok = True
            if i % 4 == 0:
                v = h.run_stager("verify", str(src), "-q")
                cli_ok = v.returncode == 3 and name in v.stdout + v.stderr
            dest = work / f"corrupt-dest-{fmt}-{i}"
            shutil.rmtree(dest, ignore_errors=True)
            r = h.run_stager("stage", str(src), str(dest), "-q", "--workers", "2")
            line = h.one_line_error(r.stderr)
            stage_ok = r.returncode == 3 and name in line
            leaked = (dest / name).exists()
            partial = len(h.partials(dest)) if dest.exists() else 0
            if api_ok and cli_ok and stage_ok and not leaked and not partial:
                st.detected += 1
            else:
                st.lost += int(leaked)
                st.miss(f"{name} {how}: verify bad={res.bad} cli={cli_ok} stage exit {r.returncode} "
                        f"{r.stderr.strip()[-200:]!r} leaked={leaked} partials={partial}")
            shutil.rmtree(dest, ignore_errors=True)
        finally:
            path.write_bytes(original)
    return st


def damaged_manifests(manifest: bytes, rng: np.random.Generator, n: int) -> list[tuple[str, bytes]]:
    """``n`` damaged variants of ``manifest``: flipped digit, truncated JSON, other schema, in turn."""
    out = []
    digits = [m.start() for m in re.finditer(rb"[0-9]", manifest)]
    for i in range(n):
        kind = i % 3
        if kind == 0:
            pos = digits[int(rng.integers(0, len(digits)))]
            b = bytearray(manifest)
            b[pos] = ord("0") + (b[pos] - ord("0") + int(rng.integers(1, 10))) % 10
            out.append((f"digit flipped at byte {pos}", bytes(b)))
        elif kind == 1:
            cut = int(rng.integers(1, len(manifest) - 2))  # keep it short of the closing brace
            out.append((f"truncated to {cut} bytes", manifest[:cut]))
        else:
            schema = [b"stager.manifest/1", b"stager.manifest/3", b"webdataset/1", b""][int(rng.integers(0, 4))]
            out.append((f"schema {schema!r}", manifest.replace(b"stager.manifest/2", schema, 1)))
    return out


def manifest_trials(work: Path, n: int, *, seed: int = 0) -> DetectStats:
    st = DetectStats("damaged manifest")
    rng = np.random.default_rng((seed, 808))
    src, _ = corruption_pack(work, "tar")
    mpath = src / "manifest.json"
    original = mpath.read_bytes()
    try:
        for i, (how, data) in enumerate(damaged_manifests(original, rng, n)):
            mpath.write_bytes(data)
            st.trials += 1
            v = h.run_stager("verify", str(src))
            dest = work / f"manifest-dest-{i}"
            r = h.run_stager("stage", str(src), str(dest), "-q")
            ok_v = v.returncode == 3 and bool(h.one_line_error(v.stderr)) and "manifest" in v.stderr
            ok_s = r.returncode == 3 and bool(h.one_line_error(r.stderr))
            copied = [p.name for p in dest.iterdir()] if dest.exists() else []
            if ok_v and ok_s and not copied:
                st.detected += 1
            else:
                st.lost += len(copied)
                st.miss(f"{how}: verify exit {v.returncode} {v.stderr.strip()[-200:]!r}; stage exit {r.returncode} "
                        f"{r.stderr.strip()[-200:]!r}; copied {copied}")
            shutil.rmtree(dest, ignore_errors=True)
    finally:
        mpath.write_bytes(original)
    return st


# ---- loader on_error --------------------------------------------------------------------------------------
@dataclass
class LoaderStats:
    fmt: str
    damaged: int = 0
    raise_named: int = 0  # raise trials whose error named the shard and a damaged key
    raise_trials: int = 0
    skip_trials: int = 0
    skip_exact: int = 0  # skip trials: every undamaged key once, skipped == damaged
    lost: int = 0  # undamaged samples not delivered (or delivered twice) with skip
    errors: list[str] = field(default_factory=list)


def loader_trials(work: Path, fmt: str, n: int, *, seed: int = 0) -> LoaderStats:
    """``n`` rounds: damage k random payloads of a copy of a ``fmt`` pack, read it with both policies."""
    from stager.errors import CorruptSampleError
    from stager.loader import make_loader

    st = LoaderStats(fmt)
    rng = np.random.default_rng((seed, 909, len(fmt)))
    src, m = corruption_pack(work, fmt)
    for t in range(n):
        d = work / f"loader-{fmt}-{t}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        gids = rng.choice(m.num_samples, size=int(rng.integers(1, 4)), replace=False)
        starts = m.sample_starts()
        bad_keys = set()
        for g in gids.tolist():
            si = int(np.searchsorted(starts, g, side="right") - 1)
            info = m.shards[si]
            j = g - int(starts[si])
            off, size = int(info.offsets[j]), int(info.sizes[j])
            with open(d / info.name, "r+b") as f:
                f.seek(off)
                f.write(b"\0" * min(size, 64))  # the image header is gone: undecodable
            bad_keys.add(info.keys[j])
        st.damaged += len(bad_keys)
        st.raise_trials += 1
        try:
            for _ in make_loader(d, 8, seed=t, staged=False, image_size=32, on_error="raise"):
                pass
            st.errors.append(f"{fmt}: on_error=raise read {len(bad_keys)} damaged samples without an error")
        except CorruptSampleError as exc:
            msg = str(exc)
            named = any(k in msg for k in bad_keys) and any(s.name in msg for s in m.shards)
            st.raise_named += int(named)
            if not named:
                st.errors.append(f"{fmt}: raise message names no damaged key/shard: {msg}")
        st.skip_trials += 1
        loader = make_loader(d, 8, seed=t, staged=False, image_size=32, on_error="skip", shuffle=True)
        keys: list[str] = []
        for b in loader:
            keys += b["key"]
        want = [k for s in m.shards for k in s.keys if k not in bad_keys]
        lost, dup = h.multiset_diff(want, keys)
        skipped = int(loader.stats().get("skipped", -1))
        if not lost and not dup and skipped == len(bad_keys) and not (set(keys) & bad_keys):
            st.skip_exact += 1
        else:
            st.lost += lost + dup
            st.errors.append(f"{fmt}: skip delivered lost={lost} dup={dup} skipped={skipped} of {len(bad_keys)}")
        shutil.rmtree(d, ignore_errors=True)
    return st

"""Check a packed (or staged) directory against its manifest.

:func:`verify` re-hashes every shard and companion file listed in ``manifest.json`` and compares
sizes and checksums. With ``deep=True`` it also parses every shard through its format reader
(``iter_samples``, independent of the manifest index) and checks that the container holds exactly
the indexed samples, in order, with the indexed keys and labels, and that the payloads the index
points at (``read``) equal the parsed ones; for a set adopted by ``stager index`` (someone else's
shards) "parse" means indexing the shard again with the recorded options and comparing the entries.
A damaged manifest raises :class:`ManifestError`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stager.checksum import hash_file
from stager.errors import StagerError
from stager.formats import get_format
from stager.index import rescan_shard
from stager.manifest import Manifest, ShardInfo, load_manifest, shard_root

READ_BATCH = 256  # samples compared per reader.read() call in deep mode


@dataclass
class VerifyResult:
    """``ok`` is True when every file (and, with ``deep``, every sample) matches the manifest.

    ``bad`` lists ``(file name, reason)`` for each problem found, in manifest order.
    """

    path: str
    ok: bool
    bad: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    samples: int = 0
    deep: bool = False
    seconds: float = 0.0
    dataset_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "path": self.path,
            "dataset_id": self.dataset_id,
            "deep": self.deep,
            "files": self.files,
            "bytes": self.bytes,
            "samples": self.samples,
            "seconds": round(self.seconds, 4),
            "bad": [{"file": n, "reason": r} for n, r in self.bad],
        }


def _check_file(root: str, name: str, nbytes: int, digest: str, algo: str) -> str | None:
    path = os.path.join(root, name)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if size != nbytes:
        return f"size {size} bytes, expected {nbytes}"
    try:
        got_n, got = hash_file(path, algo)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if got_n != nbytes:
        return f"read {got_n} bytes, expected {nbytes}"
    if got != digest:
        return f"{algo} checksum {got}, expected {digest}"
    return None


def _deep_check(root: str, info: ShardInfo, m: Manifest) -> str | None:
    if m.indexed:  # someone else's shards: index the shard again with the recorded options and compare
        return rescan_shard(os.path.join(root, info.name), info, m)
    fmt = get_format(m.format)
    try:
        reader = fmt.open_reader(os.path.join(root, info.name), info, m)
    except (StagerError, OSError, ValueError, KeyError) as exc:
        return f"cannot open with the {m.format} reader ({exc})"
    try:
        n = 0
        pending: list[Any] = []

        def compare(start: int, parsed: list[Any]) -> str | None:
            got = reader.read(np.arange(start, start + len(parsed)))
            for j, (a, b) in enumerate(zip(parsed, got, strict=True)):
                same = np.array_equal(a, b) if isinstance(a, np.ndarray) else bytes(a) == bytes(b)
                if not same:
                    return f"sample {start + j} ({info.keys[start + j]}): indexed payload differs from the parsed one"
            return None

        for s in reader.iter_samples():
            if n >= info.samples:
                return f"holds more than the {info.samples} indexed samples"
            if s.key != info.keys[n] or int(s.label) != int(info.labels[n]):
                want = (info.keys[n], int(info.labels[n]))
                return f"sample {n}: parsed ({s.key!r}, {s.label}), index says ({want[0]!r}, {want[1]})"
            size = s.data.size if isinstance(s.data, np.ndarray) else len(s.data)
            if size != int(info.sizes[n]):
                return f"sample {n} ({s.key}): {size} bytes, index says {int(info.sizes[n])}"
            pending.append(s.data)
            n += 1
            if len(pending) == READ_BATCH:
                err = compare(n - len(pending), pending)
                if err:
                    return err
                pending = []
        if pending:
            err = compare(n - len(pending), pending)
            if err:
                return err
        if n != info.samples:
            return f"holds {n} samples, index says {info.samples}"
    except (StagerError, OSError, ValueError, KeyError, EOFError) as exc:
        return f"unreadable sample ({exc})"
    finally:
        reader.close()
    return None


def verify(path: str | os.PathLike[str], *, deep: bool = False, threads: int = 4) -> VerifyResult:
    """Verify the pack at ``path`` (directory or manifest path); see the module docstring.

    Files are hashed on ``threads`` threads (I/O overlaps; xxh3 runs near memory bandwidth).
    Raises :class:`ManifestError`/:class:`ShardMissingError` only for the manifest itself.
    """
    t0 = time.perf_counter()
    m = load_manifest(path)
    root = shard_root(path, m)
    files = list(m.files())

    def one(entry: tuple[str, int, str]) -> tuple[str, str | None]:
        name, nbytes, digest = entry
        return name, _check_file(root, name, nbytes, digest, m.hash_algo)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as ex:
        checked = list(ex.map(one, files))
    bad = [(n, r) for n, r in checked if r is not None]
    if deep:
        broken = {n for n, _ in bad}
        for info in m.shards:
            if info.name in broken:
                continue
            reason = _deep_check(root, info, m)
            if reason:
                bad.append((info.name, reason))
    return VerifyResult(
        path=os.fspath(path),
        ok=not bad,
        bad=bad,
        files=len(files),
        bytes=m.num_bytes,
        samples=m.num_samples,
        deep=deep,
        seconds=time.perf_counter() - t0,
        dataset_id=m.dataset_id,
    )

"""Seeded mutation fuzzing of every parser stager owns, for running under a memory limit.

Parsers: the tar member reader (:func:`stager.formats.ustar.iter_members` and the shard reader's
``iter_samples``), TFRecord framing (:func:`stager.formats.record.iter_records` +
:func:`~stager.formats.record.example_to_sample`) and its ``.idx`` index
(:func:`~stager.formats.record.read_index`), the manifest (:meth:`stager.manifest.Manifest.from_bytes`,
also with structure-aware mutations re-signed with a valid digest so the checks behind the digest
run), the staging receipt (:func:`stager.receipt.load_receipt`), the stage journal
(:class:`stager.stage.journal.Journal`) and the node lock's holder record (:class:`stager.fs.lock.NodeLock`).

Each input comes from a valid file mutated by random byte flips, truncation, insertion of
"interesting" values (huge sizes, 0xFF runs, NULs) or splicing, or is pure random bytes. A trial
passes when the parser returns or raises a :class:`~stager.errors.StagerError`; anything else is a
crash. Readers are given a stream that records every read size: a read larger than the file plus
one block would mean an allocation driven by a damaged length field.

``python -m tools.faults.fuzz --per-parser N --seed S [--rlimit-as-mb M]`` prints one JSON object
{parser: {"trials", "ok", "refused", "crashed", "max_read_over_size", "examples"}}.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

INTERESTING = [b"\xff" * 8, b"\x00" * 8, b"77777777777\0", b"99999999999999999999999", b"-1", b"1e999",
               b"\x80" + b"\xff" * 11, b"[" * 64, b'{"a":' * 32, b"NaN", b"\n" * 4]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation (or a few stacked) of ``data``."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        if op == 0 and b:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= rng.randint(1, 255)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)):]
        elif op == 2:  # insert an interesting value
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = rng.choice(INTERESTING)
        elif op == 3 and b:  # overwrite with an interesting value
            v = rng.choice(INTERESTING)
            pos = rng.randrange(len(b))
            b[pos:pos + len(v)] = v
        elif op == 4 and len(b) > 2:  # splice a chunk elsewhere
            i, j = sorted(rng.sample(range(len(b)), 2))
            chunk = b[i:j]
            pos = rng.randrange(len(b))
            b[pos:pos] = chunk[:4096]
        else:  # random bytes
            b = bytearray(rng.randbytes(rng.randint(0, 2048)))
    return bytes(b)


class TrackingReader(io.RawIOBase):
    """Reads from bytes; remembers the largest single read request."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self._f = io.BytesIO(data)
        self.max_request = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if n is not None and n >= 0:
            self.max_request = max(self.max_request, n)
        return self._f.read(n)

    def seek(self, off: int, whence: int = 0) -> int:
        return self._f.seek(off, whence)


# ---- valid seeds ---------------------------------------------------------------------------------------------
def valid_tar() -> bytes:
    from stager.formats.base import Sample
    from stager.formats.tar import TarShardWriter

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.tar")
        w = TarShardWriter(p, shard_name="s.tar", classes=["a", "b"])
        for i in range(3):
            w.write(Sample(f"k{i}", i % 2, bytes([i]) * (100 + 300 * i), "jpg", {"src": f"x{i}"}))
        w.write(Sample("d/" + "long" * 40, 1, b"z" * 10, "png"))  # a PAX/prefix name
        w.close()
        return Path(p).read_bytes()


def valid_record() -> tuple[bytes, bytes]:
    from stager.formats.base import Sample
    from stager.formats.record import RecordShardWriter

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.tfrecord")
        w = RecordShardWriter(p, shard_name="s.tfrecord", classes=["a", "b"])
        for i in range(3):
            w.write(Sample(f"k{i}", i % 2, bytes([i + 1]) * (50 + 200 * i), "jpg"))
        aux = w.close()
        return Path(p).read_bytes(), Path(aux[0][1]).read_bytes()


def rechecksum_tar(data: bytes) -> bytes:
    """Fix the header checksum of every 512-aligned block that looks like a ustar header, so that
    mutations reach the fields behind the checksum."""
    b = bytearray(data)
    for pos in range(0, len(b) - 511, 512):
        if b[pos + 257:pos + 262] == b"ustar":
            b[pos + 148:pos + 156] = b" " * 8
            b[pos + 148:pos + 156] = b"%06o\0 " % sum(b[pos:pos + 512])
    return bytes(b)


def reframe_records(payloads: list[bytes]) -> bytes:
    """TFRecord framing with correct CRCs around ``payloads``."""
    import struct

    from stager.formats.record import masked_crc

    out = bytearray()
    for p in payloads:
        n = struct.pack("<Q", len(p))
        out += n + struct.pack("<I", masked_crc(n)) + p + struct.pack("<I", masked_crc(p))
    return bytes(out)


def record_payloads(data: bytes) -> list[bytes]:
    from stager.formats.record import iter_records

    return [p for _, p in iter_records(io.BytesIO(data), len(data), "seed")]


@functools.cache
def valid_manifest() -> tuple[bytes, str, bytes]:
    """A valid v2 manifest's bytes, with its sample index's name and bytes."""
    from stager.manifest import AuxFile, Manifest, ShardInfo

    shards = []
    for i in range(2):
        keys = [f"k{i}{j}" for j in range(3)]
        shards.append(ShardInfo(f"shard-{i:05d}.tar", 4096, "ab" * 16, keys, np.array([0, 1, 1]),
                                np.array([512, 1536, 2560]), np.array([100, 200, 300]),
                                [AuxFile(f"shard-{i:05d}.tar.idx", 30, "cd" * 16)]))
    m = Manifest(format="tar", classes=["a", "b"], shards=shards, created="2026-01-01T00:00:00+00:00")
    with tempfile.TemporaryDirectory() as d:
        path = m.write_index(d)
        index = Path(path).read_bytes()
    assert m.index is not None
    return m.to_bytes(), m.index.name, index


def valid_receipt() -> bytes:
    from dataclasses import asdict

    from stager.receipt import Receipt

    rec = Receipt("abcd", "ef" * 16, "/src", "/dest", "2026-01-01", "node1", "xxh3_128 while copying",
                  shards=["shard-00000.tar"], files=["shard-00000.tar", "manifest.json"], stats={"x": 1})
    return json.dumps(asdict(rec)).encode()


def random_json(rng: random.Random, depth: int = 0) -> Any:
    k = rng.randrange(9 if depth < 3 else 6)
    if k == 0:
        return None
    if k == 1:
        return rng.choice([True, False])
    if k == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63) - 1, 10**30, 3])
    if k == 3:
        return rng.choice([0.5, -0.0, 1e308, float("inf")])
    if k == 4:
        return rng.choice(["", "..", "../x", "/abs", "a/b", "shard-00000.tar", "manifest.json", "\0", "k00"])
    if k == 5:
        return rng.choice(["stager.manifest/1", "tar", "xxh3_128", "zarr"])
    if k == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["name", "bytes", "keys", "x"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def resigned_manifest(base: bytes, rng: random.Random) -> bytes:
    """Replace one random value in the manifest's JSON tree and re-sign it with a correct digest."""
    from stager.manifest import _digest_of

    body = json.loads(base)
    node: Any = body
    for _ in range(rng.randint(1, 5)):
        if isinstance(node, dict) and node:
            key = rng.choice(sorted(node))
            if rng.random() < 0.4 or not isinstance(node[key], (dict, list)) or not node[key]:
                node[key] = random_json(rng)
                break
            node = node[key]
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.4 or not isinstance(node[i], (dict, list)) or not node[i]:
                node[i] = random_json(rng)
                break
            node = node[i]
        else:
            break
    body["digest"] = _digest_of(body)
    return json.dumps(body, allow_nan=True).encode()


# ---- one trial per parser ------------------------------------------------------------------------------------
def _drain_tar(data: bytes, reader: TrackingReader) -> None:
    from stager.formats.ustar import iter_members

    for _ in iter_members(reader, len(data), "fuzz.tar"):  # type: ignore[arg-type]
        pass


def trial_tar(data: bytes, tmp: Path) -> int:
    """Both tar paths; returns the largest read request beyond the file size (0 if none)."""
    from stager.formats.tar import TarShardReader

    reader = TrackingReader(data)
    try:
        _drain_tar(data, reader)
    finally:
        over = max(0, reader.max_request - len(data) - 1024)
    p = tmp / "s.tar"
    p.write_bytes(data)
    for _ in TarShardReader(str(p)).iter_samples():
        pass
    return over


def trial_record(data: bytes, tmp: Path) -> int:
    from stager.formats.record import example_to_sample, iter_records

    reader = TrackingReader(data)
    try:
        for i, (_off, payload) in enumerate(iter_records(reader, len(data), "fuzz.tfrecord")):  # type: ignore[arg-type]
            example_to_sample(payload, i, "fuzz.tfrecord")
    finally:
        over = max(0, reader.max_request - len(data) - 1024)
    return over


def trial_index(data: bytes, tmp: Path) -> int:
    from stager.formats.record import read_index

    p = tmp / "s.idx"
    p.write_bytes(data)
    read_index(str(p))
    return 0


def trial_manifest(data: bytes, tmp: Path) -> int:
    """Parse a (damaged) manifest beside the valid sample index, read every shard's rows, round-trip."""
    from stager.manifest import Manifest

    _, name, index = valid_manifest()
    (tmp / name).write_bytes(index)
    m = Manifest.from_bytes(data, str(tmp / "manifest.json"))
    for s in m.shards:
        list(s.keys), s.labels.sum(), s.offsets.sum(), s.sizes.sum()
    if m.index is not None:
        Manifest.from_bytes(m.to_bytes(), str(tmp / "manifest.json"))  # what parses must round-trip
    return 0


def trial_sample_index(data: bytes, tmp: Path) -> int:
    """Open a (damaged) sample index under the valid manifest (re-signed to the damaged file's size and
    hash, so that the table parser and the row checks are what is exercised)."""
    from stager.checksum import hash_bytes
    from stager.manifest import Manifest, _digest_of

    base, _, _ = valid_manifest()
    body = json.loads(base)
    h = hash_bytes(data)
    body["index"] = {"name": f"index-{h[:16]}.sidx", "bytes": len(data), "hash": h}
    body["digest"] = _digest_of(body)
    (tmp / body["index"]["name"]).write_bytes(data)
    m = Manifest.from_json(body, str(tmp / "manifest.json"))
    for s in m.shards:
        list(s.keys), s.labels.sum(), s.offsets.sum(), s.sizes.sum()
    return 0


def trial_receipt(data: bytes, tmp: Path) -> int:
    from stager.receipt import RECEIPT_NAME, load_receipt

    (tmp / RECEIPT_NAME).write_bytes(data)
    load_receipt(tmp)
    return 0


def trial_journal(data: bytes, tmp: Path) -> int:
    from stager.stage.journal import Journal

    p = tmp / ".stager-journal.jsonl"
    p.write_bytes(b'{"journal": 1, "digest": "d"}\n' + data)
    j = Journal(p, "d")
    j.close()
    assert all(isinstance(k, str) and type(v) is int for k, v in j.files.items())
    return 0


def trial_lock(data: bytes, tmp: Path) -> int:
    from stager.fs.lock import NodeLock

    p = tmp / ".stager-lock"
    p.write_bytes(data)
    lock = NodeLock(p, timeout=2.0)
    assert isinstance(lock.holder(), dict)
    with lock:  # nobody holds the flock: the damaged record is taken over
        pass
    return 0


Trial = Callable[[bytes, Path], int]


def parsers() -> dict[str, tuple[Trial, Callable[[random.Random], bytes]]]:
    """name -> (trial, input generator)."""
    tar = valid_tar()
    rec, idx = valid_record()
    man, _, man_index = valid_manifest()
    rcp = valid_receipt()
    jr = b'{"f": "shard-00000.tar", "b": 123}\n{"u": "shard-00000.tar"}\n'
    lk = b'{"pid": 1, "host": "h", "boot_id": "b", "time": 0}\n'

    def gen(seed: bytes) -> Callable[[random.Random], bytes]:
        return lambda rng: mutate(seed, rng)

    payloads = record_payloads(rec)

    def reframed(rng: random.Random) -> bytes:
        return reframe_records([mutate(p, rng) if rng.random() < 0.6 else p for p in payloads])

    return {
        "tar member reader (formats/tar.py)": (trial_tar, gen(tar)),
        "tar member reader, re-checksummed headers": (trial_tar, lambda rng: rechecksum_tar(mutate(tar, rng))),
        "TFRecord framing + Example (formats/record.py)": (trial_record, gen(rec)),
        "TFRecord with valid CRCs, mutated Example payloads": (trial_record, reframed),
        "TFRecord .idx index (record.read_index)": (trial_index, gen(idx)),
        "manifest bytes (Manifest.from_bytes)": (trial_manifest, gen(man)),
        "manifest fields, re-signed (Manifest.from_bytes)": (trial_manifest, lambda rng: resigned_manifest(man, rng)),
        "sample index table (manifest.table.parse_table)": (trial_sample_index, gen(man_index)),
        "staging receipt (receipt.load_receipt)": (trial_receipt, gen(rcp)),
        "stage journal (stage.Journal)": (trial_journal, gen(jr)),
        "node lock record (lock.NodeLock)": (trial_lock, gen(lk)),
    }


def run(per_parser: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    from stager.errors import StagerError

    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, (trial, gen) in parsers().items():
            rng = random.Random(f"{seed}/{name}")
            res: dict[str, Any] = {"trials": 0, "ok": 0, "refused": 0, "crashed": 0, "max_read_over_size": 0,
                                   "examples": [], "seconds": 0.0}
            t0 = time.perf_counter()
            for _ in range(per_parser):
                data = gen(rng)
                res["trials"] += 1
                try:
                    over = trial(data, tmp)
                    res["ok"] += 1
                except StagerError:
                    res["refused"] += 1
                    over = 0
                except Exception as exc:  # exactly what the fuzzer looks for
                    res["crashed"] += 1
                    if len(res["examples"]) < 3:
                        res["examples"].append(f"{type(exc).__name__}: {str(exc)[:200]} on {data[:80]!r}")
                    over = 0
                res["max_read_over_size"] = max(res["max_read_over_size"], over)
            res["seconds"] = round(time.perf_counter() - t0, 3)
            out[name] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-parser", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rlimit-as-mb", type=int, default=0, help="cap this process's address space first")
    a = p.parse_args(argv)
    if a.rlimit_as_mb:
        import resource

        lim = a.rlimit_as_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    print(json.dumps(run(a.per_parser, a.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

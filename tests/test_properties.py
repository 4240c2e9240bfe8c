"""Property tests (hypothesis) for every parser stager owns: arbitrary or mutated bytes never crash
with anything but a StagerError, never hang (deadline + pytest-timeout), never read (allocate) more
than the file holds; what parses, round-trips.

Parsers: tar member reader and shard reader (stager/formats/ustar.py, tar.py), TFRecord framing, Example
payloads and the .idx index (stager/formats/record.py), the manifest (Manifest.from_bytes, also
with field mutations re-signed by a valid digest), the staging receipt, the stage journal and the
node-lock record. A seeded sample of the same inputs also runs in a subprocess under a 1 GiB
address-space limit (tools/faults/fuzz.py). ``$STAGER_FAULTS_EXAMPLES`` scales the example counts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import StagerError
from stager.manifest import Manifest, ShardInfo, load_manifest
from tools.faults import fuzz
from tools.faults import harness as h
from tools.faults.tally import record

EXAMPLES = int(os.environ.get("STAGER_FAULTS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=dt.timedelta(seconds=5), derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TAR = fuzz.valid_tar()
REC, IDX = fuzz.valid_record()
PAYLOADS = fuzz.record_payloads(REC)
MANIFEST, _, SAMPLE_INDEX = fuzz.valid_manifest()
RECEIPT = fuzz.valid_receipt()


def prop(row: str, strategy: st.SearchStrategy[Any], check: Callable[[Any, Path], object]) -> None:
    """Run ``check`` on hypothesis examples in a scratch dir; StagerError counts as a clean refusal.
    Records the example count once every example has passed."""
    count = [0, 0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)

        @SETTINGS
        @given(strategy)
        def inner(x: Any) -> None:
            count[0] += 1
            try:
                check(x, tmp)
            except StagerError:
                count[1] += 1

        inner()
    record(f"parser fuzz: {row}", group="parsers", trials=count[0], handled=count[0],
           note="hypothesis: returns or raises a StagerError; reads bounded by the file size", refused=count[1])


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    return st.randoms(use_true_random=False).map(lambda rng: fuzz.mutate(seed, rng))


def bounded(trial: Callable[[bytes, Path], int]) -> Callable[[bytes, Path], None]:
    def check(data: bytes, tmp: Path) -> None:
        assert trial(data, tmp) == 0, "a read larger than the file: allocation driven by a damaged length"

    return check


# ---- tar --------------------------------------------------------------------------------------------------------
def test_tar_arbitrary_bytes() -> None:
    prop("tar member reader, arbitrary bytes", st.binary(max_size=4096), bounded(fuzz.trial_tar))


def test_tar_mutated() -> None:
    prop("tar member reader, mutated shards", mutated(TAR), bounded(fuzz.trial_tar))


def test_tar_mutated_with_valid_checksums() -> None:
    gen = st.randoms(use_true_random=False).map(lambda rng: fuzz.rechecksum_tar(fuzz.mutate(TAR, rng)))
    prop("tar member reader, mutated shards with valid header checksums", gen, bounded(fuzz.trial_tar))


def test_tar_valid_shard_round_trips() -> None:
    from stager.formats.tar import TarShardReader

    p = Path(tempfile.mkdtemp()) / "s.tar"
    p.write_bytes(TAR)
    got = [(s.key, s.label, len(s.data)) for s in TarShardReader(str(p)).iter_samples()]
    assert got == [("k0", 0, 100), ("k1", 1, 400), ("k2", 0, 700), ("d/" + "long" * 40, 1, 10)]


# ---- record -------------------------------------------------------------------------------------------------------
def test_record_arbitrary_bytes() -> None:
    prop("TFRecord framing, arbitrary bytes", st.binary(max_size=4096), bounded(fuzz.trial_record))


def test_record_mutated_payloads_with_valid_crcs() -> None:
    def gen(rng: random.Random) -> bytes:
        return fuzz.reframe_records([fuzz.mutate(p, rng) if rng.random() < 0.7 else p for p in PAYLOADS])

    prop("TFRecord with valid CRCs, mutated tf.train.Example payloads",
         st.randoms(use_true_random=False).map(gen), bounded(fuzz.trial_record))


def test_example_payload_arbitrary_bytes() -> None:
    from stager.formats.record import example_to_sample

    prop("tf.train.Example payload, arbitrary bytes", st.binary(max_size=2048),
         lambda data, tmp: example_to_sample(data, 0, "fuzz"))


def test_record_index_lines() -> None:
    from stager.formats.record import read_index

    line = st.one_of(st.tuples(st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70)).map(
        lambda t: f"{t[0]} {t[1]}"), st.text(max_size=30))

    def check(lines: list[str], tmp: Path) -> None:
        p = tmp / "s.idx"
        p.write_text("\n".join(lines) + "\n", errors="surrogateescape")
        rows = read_index(str(p))  # StagerError or an exact parse
        assert rows.shape == (len(lines), 2) and rows.min(initial=0) >= 0

    prop("TFRecord .idx index, arbitrary lines", st.lists(line, max_size=6), check)


def test_record_index_mutated() -> None:
    prop("TFRecord .idx index, mutated", mutated(IDX), bounded(fuzz.trial_index))


# ---- manifest ------------------------------------------------------------------------------------------------------
def test_manifest_arbitrary_bytes() -> None:
    prop("manifest, arbitrary bytes", st.binary(max_size=2048), bounded(fuzz.trial_manifest))


def test_manifest_mutated() -> None:
    prop("manifest, mutated bytes", mutated(MANIFEST), bounded(fuzz.trial_manifest))


def test_manifest_fields_resigned() -> None:
    gen = st.randoms(use_true_random=False).map(lambda rng: fuzz.resigned_manifest(MANIFEST, rng))
    prop("manifest, mutated fields re-signed with a valid digest", gen, bounded(fuzz.trial_manifest))


def test_sample_index_arbitrary_bytes() -> None:
    prop("sample index, arbitrary bytes", st.binary(max_size=2048), bounded(fuzz.trial_sample_index))


def test_sample_index_mutated() -> None:
    prop("sample index, mutated bytes", mutated(SAMPLE_INDEX), bounded(fuzz.trial_sample_index))


def test_manifest_arbitrary_json_resigned() -> None:
    from stager.manifest import _digest_of

    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                               max_leaves=12)
    body = st.fixed_dictionaries({"schema": st.sampled_from(["stager.manifest/1", "stager.manifest/2"]),
                                  "format": st.sampled_from(["tar", "x"]),
                                  "hash_algo": st.just("xxh3_128"), "classes": json_values,
                                  "shards": st.lists(st.dictionaries(st.sampled_from(
                                      ["name", "samples", "bytes", "hash", "index", "aux"]), json_values), max_size=3),
                                  "index": json_values})

    def check(b: dict[str, Any], tmp: Path) -> None:
        b["digest"] = _digest_of(b)
        fuzz.trial_manifest(json.dumps(b).encode(), tmp)

    prop("manifest, arbitrary JSON structure with a valid digest", body, check)


def test_manifest_round_trip() -> None:
    shard = st.tuples(st.lists(st.from_regex(r"[a-z0-9]{1,8}(/[a-z0-9]{1,8})?", fullmatch=True), max_size=5,
                               unique=True), st.integers(0, 1 << 40))

    def check(shards: list[tuple[list[str], int]], tmp: Path) -> None:
        infos = []
        for i, (keys, nbytes) in enumerate(shards):
            n = len(keys)
            sizes = np.ones(n, np.int64)
            offsets = np.minimum(np.arange(n, dtype=np.int64), max(nbytes - 1, 0))
            infos.append(ShardInfo(f"shard-{i:05d}.tar", max(nbytes, n), "ab", keys, np.zeros(n, np.int64),
                                   offsets, sizes))
        m = Manifest(format="tar", classes=["c"], shards=infos)
        d = tempfile.mkdtemp(dir=tmp)
        m.write(d)
        back = load_manifest(d)
        assert back.digest == m.digest and [list(s.keys) for s in back.shards] == [s.keys for s in infos]
        assert all(np.array_equal(a.offsets, b.offsets) for a, b in zip(back.shards, infos, strict=True))

    prop("manifest, valid manifests round-trip", st.lists(shard, max_size=4), check)


# ---- stage: receipt, journal, lock -----------------------------------------------------------------------------------
def test_receipt_arbitrary_and_mutated() -> None:
    prop("staging receipt, arbitrary bytes", st.binary(max_size=1024), bounded(fuzz.trial_receipt))
    prop("staging receipt, mutated", mutated(RECEIPT), bounded(fuzz.trial_receipt))


def test_journal_arbitrary_lines() -> None:
    prop("stage journal, arbitrary bytes after a valid header", st.binary(max_size=1024), bounded(fuzz.trial_journal))


def test_lock_record_arbitrary_bytes() -> None:
    prop("node-lock holder record, arbitrary bytes", st.binary(max_size=512), bounded(fuzz.trial_lock))


# ---- the same parsers under a memory limit ----------------------------------------------------------------------
def _fuzz_subprocess(per_parser: int, seed: int) -> None:
    r = h.run([sys.executable, "-m", "tools.faults.fuzz", "--per-parser", str(per_parser), "--seed", str(seed),
               "--rlimit-as-mb", "1024"], timeout=600, cwd=h.ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name, v in res.items():
        assert v["crashed"] == 0, (name, v["examples"])
        assert v["max_read_over_size"] == 0, name
        record(f"seeded mutation fuzz under a 1 GiB RLIMIT_AS: {name}", group="parsers", trials=v["trials"],
               handled=v["ok"] + v["refused"], note="subprocess; no crash, no MemoryError, reads <= file size",
               refused=v["refused"])


def test_parsers_under_memory_limit() -> None:
    _fuzz_subprocess(40, seed=1)


@pytest.mark.faults
def test_parsers_under_memory_limit_full() -> None:
    _fuzz_subprocess(3000, seed=2)


def test_fuzzer_reports_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzz harness can fail: a parser raising a builtin error is counted as a crash, with an example."""
    def broken(data: bytes, tmp: Path) -> int:
        if len(data) % 2:
            raise KeyError("boom")
        return 0

    monkeypatch.setattr(fuzz, "parsers", lambda: {"broken": (broken, lambda rng: rng.randbytes(rng.randint(0, 9)))})
    res = fuzz.run(50)["broken"]
    assert res["crashed"] > 0 and res["ok"] > 0 and "KeyError" in res["examples"][0]

"""Manifest v2: per-shard manifest, per-sample columns in one mapped, content-addressed table file.

Invariants tested here: the table round-trips any columns (plain, ragged, strings) and is readable
with numpy alone as docs/formats.md shows; v1 manifests still load and their readers see the same
rows; publishing is atomic (the old manifest stays valid until the new one is renamed; stale index
files are removed); a missing, resized or rehashed index is refused (load, verify exit 3, stage);
and a 10M-sample index loads in memory that does not grow with samples (the arrays are mapped).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.errors import ManifestError, ShardMissingError
from stager.manifest import (
    SCHEMA_V1,
    Manifest,
    Ragged,
    ShardInfo,
    Strings,
    _digest_of,
    is_index_file_name,
    load_manifest,
    parse_table,
    write_table,
)
from stager.pack import pack
from stager.shardcheck import verify

ROOT = Path(__file__).resolve().parents[1]


def _shards(n_shards: int = 3, per: int = 5, extra: bool = False) -> list[ShardInfo]:
    out = []
    for i in range(n_shards):
        keys = [f"c{i % 2}/k{i}-{j:03d}" for j in range(per)]
        cols = {}
        if extra:
            cols = {"field/boxes": Ragged.from_rows([[[j, j, j + 1, j + 1]] * (j % 3) for j in range(per)],
                                                    np.float32, (4,)),
                    "seq": np.full(per, i, np.int32)}
        out.append(ShardInfo(f"shard-{i:05d}.tar", 100_000, f"{i:032x}", keys, np.arange(per) % 2,
                             np.arange(per) * 1024, np.full(per, 100), columns=cols))
    return out


def test_table_round_trips_plain_ragged_and_string_columns() -> None:
    rng = np.random.default_rng(0)
    n = 57
    cols = {
        "a": rng.integers(-(2**40), 2**40, n),
        "b": rng.random((n, 3)).astype(np.float32),
        "r": Ragged.from_rows([rng.random((k, 4)) for k in rng.integers(0, 5, n)], np.float64, (4,)),
        "s": Strings.from_strings([f"ключ-{i}" * (i % 4) for i in range(n)]),
    }
    buf = io.BytesIO()
    nbytes = write_table(buf, n, cols, meta={"who": "test"})
    data = buf.getvalue()
    assert nbytes == len(data)
    t = parse_table(data, "mem")
    assert t.rows == n and t.meta == {"who": "test"}
    np.testing.assert_array_equal(t.array("a"), cols["a"])
    np.testing.assert_array_equal(t.array("b"), cols["b"])
    assert [r.tolist() for r in t.ragged("r")] == [r.tolist() for r in cols["r"]]
    assert list(t.strings("s")) == list(cols["s"])
    perm = [*rng.permutation(n)[:20].tolist(), 0, 0, n - 1]
    assert t.strings("s").take(perm) == [cols["s"][i] for i in perm] and t.strings("s").take([]) == []
    # Every column starts 64-byte aligned, so any dtype maps without a copy.
    header = json.loads(data[16 : 16 + struct.unpack_from("<I", data, 12)[0]])
    assert all(c["offset"] % 64 == 0 for c in header["columns"])


def test_parts_are_written_back_to_back() -> None:
    parts = [Strings.from_strings(["a", "bb"]), Strings.from_strings([]), Strings.from_strings(["ccc"])]
    buf = io.BytesIO()
    write_table(buf, 3, {"k": parts, "v": [np.arange(2), np.arange(0), np.arange(1)]})
    t = parse_table(buf.getvalue(), "mem")
    assert list(t.strings("k")) == ["a", "bb", "ccc"] and t.array("v").tolist() == [0, 1, 0]


def test_write_load_round_trip_with_extra_columns(tmp_path: Path) -> None:
    shards = _shards(extra=True)
    m = Manifest("tar", ["c0", "c1"], shards)
    m.write(tmp_path)
    body = json.loads((tmp_path / "manifest.json").read_text())
    assert body["schema"] == "stager.manifest/2" and "index" not in body["shards"][0]
    assert is_index_file_name(body["index"]["name"]) and (tmp_path / body["index"]["name"]).exists()
    back = load_manifest(tmp_path)
    assert back.digest == m.digest and back.num_samples == 15
    for a, b in zip(back.shards, shards, strict=True):
        assert a == b
        assert a.columns["seq"].tolist() == b.columns["seq"].tolist()
        assert [r.tolist() for r in a.columns["field/boxes"]] == [r.tolist() for r in b.columns["field/boxes"]]
    # Mapped, read-only views: nothing per-sample was copied onto the heap.
    assert not back.shards[1].offsets.flags.writeable
    assert back.keys[7] == shards[1].keys[2]


def test_the_documented_numpy_snippet_reads_the_index(tmp_path: Path) -> None:
    """docs/formats.md's "Reading it without stager" snippet, verbatim, against a real pack."""
    m = Manifest("tar", ["c0", "c1"], _shards())
    out = tmp_path / "out"
    out.mkdir()
    m.write(out)
    doc = (ROOT / "docs" / "formats.md").read_text()
    start = doc.index("## The sample index")
    code = doc[doc.index("```python", start) + 9 : doc.index("```", doc.index("```python", start) + 9)]
    code = code.replace("f.read(col[\"size\"][j])", "b''")  # the shards are not real files here
    code = code.replace('with open(os.path.join("out", m["shards"][0]["name"]), "rb") as f:', "if True:")
    code = code.replace("    f.seek(col[\"offset\"][j])\n", "")
    env: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "formats.md", "exec"), env)
    finally:
        os.chdir(cwd)
    assert env["key"] == m.shards[0].keys[0] and env["label"] == m.shards[0].labels[0]
    assert env["col"]["offset"].tolist() == [o for s in m.shards for o in s.offsets.tolist()]


def _v1_bytes(m: Manifest) -> bytes:
    body = json.loads(m.to_bytes())
    body["schema"] = SCHEMA_V1
    for sj, s in zip(body["shards"], m.shards, strict=True):
        sj["index"] = {"keys": list(s.keys), "labels": s.labels.tolist(), "offsets": s.offsets.tolist(),
                       "sizes": s.sizes.tolist()}
    for k in ("index", "fields", "clips", "digest"):
        body.pop(k)
    body["digest"] = _digest_of(body)
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def test_v1_manifests_still_load_with_the_same_rows(tmp_path: Path) -> None:
    shards = _shards()
    m = Manifest("tar", ["c0", "c1"], shards)
    m.write_index(tmp_path)
    (tmp_path / "manifest.json").write_bytes(_v1_bytes(m))
    back = load_manifest(tmp_path)
    assert back.schema == SCHEMA_V1 and back.index is None and back.samples_index is None
    assert [list(s.keys) for s in back.shards] == [s.keys for s in shards]
    assert back.column("offset").tolist() == m.column("offset").tolist()
    # Rewritten, a v1 dataset becomes v2 with the same rows.
    back.write(tmp_path)
    again = load_manifest(tmp_path)
    assert again.schema == "stager.manifest/2" and again.shards == shards


def test_republish_is_atomic_and_removes_stale_indexes(tmp_path: Path) -> None:
    m1 = Manifest("tar", ["c0", "c1"], _shards())
    m1.write(tmp_path)
    old = m1.index
    shards = _shards()
    shards[0] = ShardInfo(shards[0].name, shards[0].bytes, shards[0].hash, [k + "x" for k in shards[0].keys],
                          shards[0].labels, shards[0].offsets, shards[0].sizes)
    m2 = Manifest("tar", ["c0", "c1"], shards)
    # Until the new manifest's rename, the old manifest and its index are intact beside the new index.
    m2.write_index(tmp_path)
    assert old is not None and m2.index is not None and m2.index.name != old.name
    assert load_manifest(tmp_path).shards[0].keys[0] == "c0/k0-000"
    m2.write(tmp_path)
    assert load_manifest(tmp_path).shards[0].keys[0] == "c0/k0-000x"
    assert sorted(p.name for p in tmp_path.iterdir() if is_index_file_name(p.name)) == [m2.index.name]


def test_damaged_index_is_refused_everywhere(tmp_path: Path, imagenet_tiny: Path) -> None:
    packed_tar = tmp_path / "packed"
    pack(imagenet_tiny, packed_tar, format="tar", samples_per_shard=5)
    m = load_manifest(packed_tar)
    assert m.index is not None
    ipath = packed_tar / m.index.name
    good = ipath.read_bytes()
    try:
        # Same size, one byte changed in the offsets: the size check passes, verify's hash does not.
        bad = bytearray(good)
        bad[-8] ^= 0xFF
        ipath.write_bytes(bytes(bad))
        res = verify(packed_tar)
        assert not res.ok and res.bad[0][0] == m.index.name
        r = subprocess.run([sys.executable, "-m", "stager", "verify", str(packed_tar)], capture_output=True,
                           text=True, check=False)
        assert r.returncode == 3 and m.index.name in r.stderr
        r = subprocess.run([sys.executable, "-m", "stager", "stage", str(packed_tar), str(tmp_path / "d"), "-q"],
                           capture_output=True, text=True, check=False)
        assert r.returncode == 3 and m.index.name in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "d" / "manifest.json").exists()
        # Truncated: every reader refuses it on the size, naming the file.
        ipath.write_bytes(good[:-64])
        with pytest.raises(ManifestError, match="sample index is"):
            load_manifest(packed_tar).shards[0].keys  # noqa: B018
        ipath.unlink()
        with pytest.raises(ShardMissingError, match=m.index.name):
            load_manifest(packed_tar).column("label")
    finally:
        ipath.write_bytes(good)
    assert verify(packed_tar, deep=True).ok


_FABRICATE = textwrap.dedent('''
    import json, os, resource, sys, time
    import numpy as np
    from stager.manifest import Manifest, Ragged, ShardInfo, Strings, load_manifest

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    out, n, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if sys.argv[4] == "make":
        per = n // shards
        infos = []
        for i in range(shards):
            # Keys "iiii/jjjjjjj" built as fixed-width digit bytes (10M Python strings would take minutes).
            j = np.arange(per, dtype=np.int64)
            digits = (j[:, None] // 10 ** np.arange(6, -1, -1)) % 10 + ord("0")
            head = np.frombuffer(f"{i:04d}/".encode(), np.uint8)
            values = np.concatenate([np.broadcast_to(head, (per, 5)), digits.astype(np.uint8)], axis=1).ravel()
            keys = Strings(Ragged(values, np.arange(per + 1, dtype=np.int64) * 12))
            infos.append(ShardInfo(f"shard-{i:05d}.tar", per * 1024, "00", keys, np.zeros(per, np.int64),
                                   np.arange(per, dtype=np.int64) * 1024, np.full(per, 1000, np.int64)))
        Manifest("tar", ["a"], infos).write(out)
        sys.exit(0)
    from stager.loader.dataset_index import index_from_manifest
    base = anon_kb()
    t0 = time.perf_counter()
    m = load_manifest(out)
    idx = index_from_manifest(m)
    ids = np.random.default_rng(0).integers(0, idx.num_samples, 256)
    keys = idx.keys.take(ids.tolist())
    total = int(idx.sizes[ids].sum()) + int(idx.offsets[-1]) + int(idx.labels.max())
    print(json.dumps({"anon_kb": anon_kb() - base, "seconds": time.perf_counter() - t0,
                      "mapped": not idx.offsets.flags.owndata and not idx.sizes.flags.writeable,
                      "keys": keys[:2], "n": idx.num_samples, "total": total}))
''')


def test_ten_million_sample_index_is_mapped_not_loaded(tmp_path: Path) -> None:
    """A 10M-sample index (no image files) loads with heap memory that does not grow with samples:
    the loader's per-sample arrays are views of the mapped file. (Load time is reported by
    tools/bench/bench_scale.py; tests never assert on time.)"""
    script = tmp_path / "fab.py"
    script.write_text(_FABRICATE)
    results = {}
    for n, shards in ((10_000, 10), (10_000_000, 10)):
        out = tmp_path / f"ds{n}"
        out.mkdir()
        subprocess.run([sys.executable, str(script), str(out), str(n), str(shards), "make"], check=True)
        r = subprocess.run([sys.executable, str(script), str(out), str(n), str(shards), "load"], check=True,
                           capture_output=True, text=True)
        results[n] = json.loads(r.stdout)
    small, big = results[10_000], results[10_000_000]
    assert big["n"] == 10_000_000 and big["mapped"] and small["mapped"]
    assert big["keys"][0].count("/") == 1
    # The checks read every row, but through the page cache: the heap grows by far less than the
    # 240 MB of int64 columns and ~130 MB of keys a copy would cost.
    assert big["anon_kb"] - small["anon_kb"] < 32 * 1024, results


def test_strings_take_over_many_rows_in_chunks() -> None:
    """Strings.take gathers in chunks beyond 2,048 rows: same strings, any order, repeats, odd lengths."""
    rng = np.random.default_rng(11)
    words = [f"n{i % 97:05d}/ключ_{i}" * (i % 3) for i in range(9000)]
    s = Strings.from_strings(words)
    for rows in (rng.integers(0, len(words), 7001), np.arange(len(words))[::-1], np.full(4097, 5)):
        assert s.take(rows) == [words[i] for i in rows.tolist()]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab/.é\0"), max_size=6), max_size=40), st.integers(0, 3))
def test_first_repeat_finds_the_first_string_seen_twice(items: list[str], cut: int) -> None:
    """``Strings.first_repeat`` (vectorised hashing, exact comparison) agrees with a dict over the strings,
    also for a column sliced out of a longer one."""
    col = Strings.from_strings(["pad"] * cut + items)[cut:]
    seen: dict[str, int] = {}
    want = None
    for j, k in enumerate(items):
        i = seen.setdefault(k, j)
        if i != j:
            want = (i, j)
            break
    assert col.first_repeat() == want


def test_first_repeat_hashes_strings_longer_than_a_chunk() -> None:
    long = "x" * (3 << 16)
    assert Strings.from_strings([long, long[:-1] + "y", "z", long]).first_repeat() == (0, 3)
    assert Strings.from_strings([long, long[:-1] + "y", "z"]).first_repeat() is None

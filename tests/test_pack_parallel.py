"""``stager pack --workers N`` segment parallelism and the fast paths of pack/tar.

Invariants: the output is byte-identical whatever the number of workers and however shards are cut
into segments (including one shard cut into many segments, with skipped samples); a bad sample in a
middle segment stops the pack with the error naming that file and leaves no partial file; the
parallel listing equals the serial one; the one-pass key check agrees with the per-key check;
with ``tar_json`` every tar sample's ``.json`` names its source file.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import stager.pack.segments as pw
from stager.errors import SourceError, UsageError
from stager.formats import FORMAT_NAMES, format_spec
from stager.formats.base import Lines
from stager.formats.tar import check_key, check_keys
from stager.manifest import load_manifest
from stager.pack import pack
from stager.pack.sources.columns import StrColumn
from stager.pack.sources.select import open_source
from stager.pack.workers import PackPool


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def _manifest(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    m.pop("created", None)
    m.pop("digest", None)
    return m


FRAGMENTS = [n for n in FORMAT_NAMES if format_spec(n).fragments]  # written in parallel segments


@pytest.mark.parametrize("fmt", FRAGMENTS)
@pytest.mark.parametrize("seg_samples", [1, 3, 1000])
def test_segments_give_the_same_bytes_as_one_process(
    imagenet_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seg_samples: int, fmt: str
) -> None:
    monkeypatch.setattr(pw, "SEG_SAMPLES", seg_samples)
    ref = pack(imagenet_tiny, tmp_path / "w1", fmt, workers=1)  # one 256 MiB shard
    assert ref.shards == 1
    for w in (2, 3):
        got = pack(imagenet_tiny, tmp_path / f"w{w}", fmt, workers=w)
        assert _files(tmp_path / f"w{w}") == _files(tmp_path / "w1")
        assert _manifest(tmp_path / f"w{w}") == _manifest(tmp_path / "w1")
        assert got.samples == ref.samples == 24


@pytest.mark.parametrize("fmt", FRAGMENTS)
def test_segments_with_skipped_samples_match_one_process(
    imagenet_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(imagenet_tiny, src)
    bad = sorted(src.rglob("*.JPEG"))[::5]
    for p in bad:  # truncated copies: no end-of-image marker
        p.write_bytes(p.read_bytes()[:300])
    monkeypatch.setattr(pw, "SEG_SAMPLES", 2)
    outs = []
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        r = pack(src, out, fmt, workers=w, on_error="skip", samples_per_shard=9)
        assert len(r.skipped) == len(bad)
        outs.append(out)
    assert _files(outs[0]) == _files(outs[1])
    assert _manifest(outs[0]) == _manifest(outs[1])


@pytest.mark.parametrize("fmt", FRAGMENTS)
def test_bad_sample_in_a_middle_segment_names_the_file(
    imagenet_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(imagenet_tiny, src)
    victim = sorted(src.rglob("*.JPEG"))[13]
    victim.write_bytes(b"not an image at all")
    monkeypatch.setattr(pw, "SEG_SAMPLES", 2)
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=victim.name):
        pack(src, out, fmt, workers=2)
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".partial") or p.name.startswith("shard-")]


def test_parallel_listing_equals_serial(imagenet_tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(imagenet_tiny, src)
    # Class names where folder-order concatenation is not path order ("c-x/..." < "c/..."), nested
    # folders and a key collision (a.b.png and a_b.png both give key a_b).
    for d in ("c", "c-x", "c/sub"):
        (src / d).mkdir(parents=True, exist_ok=True)
    img = next(src.rglob("*.JPEG")).read_bytes()
    for rel in ("c/a.b.jpg", "c/a_b.jpg", "c/sub/z.jpg", "c-x/y.jpg"):
        (src / rel).write_bytes(img)
    serial = open_source(src)
    with PackPool(2) as pool:
        par = open_source(src, map_fn=pool.map)
    assert par.refs == serial.refs and par.classes == serial.classes
    assert [r.locator for r in serial.refs] == sorted(r.locator for r in serial.refs)
    assert len({r.key for r in serial.refs}) == len(serial.refs)


def test_tar_json_names_the_source_file(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(imagenet_tiny, out, "tar", workers=2, tar_json=True)
    m = load_manifest(out)
    seen = 0
    for info in m.shards:
        with tarfile.open(out / info.name) as tf:
            for mem in tf.getmembers():
                if mem.name.endswith(".json"):
                    meta = json.loads(tf.extractfile(mem).read())  # type: ignore[union-attr]
                    assert (imagenet_tiny / meta["source"]).is_file()
                    assert meta["source"].rsplit(".", 1)[0] == meta["key"]
                    seen += 1
    assert seen == m.num_samples


_key_chars = st.sampled_from(["a", "b", ".", "/", "_", "\\", "\0", "\n", "é", " "])


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.text(_key_chars, min_size=0, max_size=8), min_size=1, max_size=6))
def test_check_keys_agrees_with_check_key(keys: list[str]) -> None:
    def one_by_one() -> bool:
        try:
            for k in keys:
                check_key(k)
        except UsageError:
            return False
        return len(set(keys)) == len(keys)

    def at_once(ks: Sequence[str]) -> bool:
        try:
            check_keys(ks)
        except UsageError:
            return False
        return True

    want = one_by_one()
    assert at_once(keys) == want
    # As a listing hands them over: one newline-joined text of its key column (a key holding a
    # newline comes as a list of strings instead).
    column = StrColumn.of(keys)
    lines = column.lines()
    assert list(lines) == keys
    assert at_once(lines) == want
    if isinstance(lines, Lines):
        assert lines.text == "\n".join(keys) and lines.lengths.tolist() == [len(k.encode()) for k in keys]


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(_key_chars, max_size=6), max_size=8), picks=st.lists(st.integers(0, 7), max_size=10))
def test_string_column_gathers_like_its_strings(texts: list[str], picks: list[int]) -> None:
    """StrColumn.joined/lines (numpy gathers from the blob: the plan's fingerprints and the key checks)
    give the bytes and strings of the strings themselves."""
    column = StrColumn.of(texts)
    pos = np.array([p for p in picks if p < len(texts)], dtype=np.int64)
    assert column.joined(pos, sep=0) == "\0".join(texts[p] for p in pos.tolist()).encode()
    assert column.joined(None, sep=10) == "\n".join(texts).encode()
    assert list(column.lines(pos)) == [texts[p] for p in pos.tolist()]
    assert column.lengths().tolist() == [len(t.encode()) for t in texts]


def test_workers_do_not_leave_processes_or_partials(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(imagenet_tiny, out, "tar", workers=2, samples_per_shard=5)
    assert not [n for n in os.listdir(out) if n.endswith(".partial")]
    import multiprocessing as mp

    assert not mp.active_children()


@pytest.mark.parametrize("fmt", [n for n in FORMAT_NAMES if format_spec(n).writable and not format_spec(n).fragments
                                 and format_spec(n).sample_kind == "encoded"])
def test_shard_level_formats_on_a_pool_started_for_listing(imagenet_tiny: Path, tmp_path: Path, fmt: str) -> None:
    # The pool starts while listing the ImageFolder, before the plan exists: its workers get the
    # plan and the source from the plan file instead of inheriting them.
    a = pack(imagenet_tiny, tmp_path / "w1", fmt, workers=1, samples_per_shard=7)
    b = pack(imagenet_tiny, tmp_path / "w2", fmt, workers=2, samples_per_shard=7)
    assert a.shards == b.shards == 4
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")
    assert _manifest(tmp_path / "w1") == _manifest(tmp_path / "w2")


@settings(max_examples=200, deadline=None)
@given(
    key=st.text(st.sampled_from("ab_/-09Z"), min_size=1, max_size=110).filter(
        lambda k: not k.startswith(("/", "__")) and not k.endswith("/") and "//" not in k
    ),
    # Around BY_REFERENCE (8 KiB) too: larger images are queued uncopied and written by writev.
    size=st.one_of(st.integers(0, 1500), st.integers(8192 - 600, 8192 + 2000)),
    label=st.integers(-1, 12),
    ext=st.sampled_from(["jpg", "png", "jpeg", "webp"]),
    with_json=st.booleans(),
    flush=st.sampled_from([1, 700, 1 << 22]),
)
def test_tar_fast_path_equals_generic_headers(
    *, key: str, size: int, label: int, ext: str, with_json: bool, flush: int
) -> None:
    """The one-join member builder gives the bytes of the generic ustar/PAX header code, however
    the bytes are flushed and whether the image is copied or queued as it is; the hasher sees them
    all, in order; and sample_disk_bytes (the plan's shard cut) gives exactly the bytes written."""
    import tempfile

    import numpy as np

    from stager.formats.base import Sample, SizeInputs
    from stager.formats.tar import TarShardWriter, _json_meta, sample_disk_bytes
    from stager.formats.ustar import BLOCK, member_header

    classes = [f"c{i}" for i in range(10)]
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    meta = {"source": f"{key}.{ext}"}
    h = xxhash.xxh3_128()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.tar")
        w = TarShardWriter(path, shard_name="s.tar", classes=classes, json_member=with_json, flush_bytes=flush,
                           hasher=h)
        ext_ = w.write(Sample(key, label, data, ext, meta))
        w.close()
        got = Path(path).read_bytes()
    assert h.hexdigest() == xxhash.xxh3_128_hexdigest(got)

    def pad(n: int) -> bytes:
        return bytes(-n % BLOCK)

    cls = b"%d" % label
    head = member_header(f"{key}.{ext}", size)
    members = [head, data, pad(size), member_header(f"{key}.cls", len(cls)), cls, pad(len(cls))]
    if with_json:
        js = _json_meta(key, label, classes[label] if 0 <= label < 10 else "", meta)
        members += [member_header(f"{key}.json", len(js)), js, pad(len(js))]
    want = b"".join([*members, bytes(2 * BLOCK)])
    assert got == want
    assert (ext_.offset, ext_.size) == (len(head), size)
    per, fixed = sample_disk_bytes(
        SizeInputs([key], np.array([label]), np.array([size]), [ext], classes, None, {"json_member": with_json})
    )
    assert int(per[0]) + fixed == len(got)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.binary(max_size=3000), max_size=40), at=st.integers(0, 5000))
def test_write_parts_writes_every_part_in_order(parts: list[bytes], at: int) -> None:
    """write_parts (the writers' writev/pwritev of queued parts, empty ones included) leaves exactly
    the parts' concatenation, appended or at an offset, and counts its bytes."""
    import tempfile

    from stager.formats.base import write_parts

    want = b"".join(parts)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            assert write_parts(fd, [memoryview(p) if i % 2 else p for i, p in enumerate(parts)]) == len(want)
            assert write_parts(fd, parts, at) == len(want)
        finally:
            os.close(fd)
        got = Path(path).read_bytes()
    tail = max(len(want), at + len(want)) if want else 0  # writing nothing extends nothing
    expect = bytearray(want.ljust(tail, b"\0"))
    expect[at : at + len(want)] = want
    assert got == bytes(expect)

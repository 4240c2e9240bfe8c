"""The conformance suite of shard formats: what every format's reader and writer must do.

Subclass :class:`FormatTests` for a format stager writes, :class:`ReaderTests` for one it only reads
in place (parquet, RecordIO, LMDB), set ``format_name`` to its registry name, and pytest runs every
test below against it::

    from stager.testing.formats import FormatTests

    class TestSquashfs(FormatTests):
        format_name = "squashfs"

        def structure_offset(self, size: int) -> int:
            return 0  # a byte of the superblock: any change to it must be refused

Shards are written the way ``stager pack`` writes them (a ``.partial`` name, companions renamed
beside the shard, a real manifest reloaded through ``load_manifest`` so its digest and extent checks
run), then read back both ways: ``iter_samples`` parsing the container, ``read`` through the
manifest's extents. The capabilities the format's registry entry declares are checked against what
its code does (``byte_ranges``: payloads at their extents in the file; ``companion``: the files
``close()`` returns; ``named_keys``, ``fragments``, ``hashes_while_writing``, ``fields``). Damage
(truncation, flipped bytes) must surface as a :class:`~stager.errors.StagerError` naming the shard,
never as a stray exception.

A read-only format overrides :meth:`ReaderTests.write_shard`: it writes the container with a
third-party writer and adopts it with ``stager index``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from stager.checksum import hash_file, new_hasher
from stager.errors import CorruptSampleError, ShardMissingError, StagerError, UnsafeArchiveError, UsageError
from stager.formats import FORMAT_SPECS, FormatSpec, format_spec, get_format
from stager.formats.base import Extent, Format, FragmentsDone, Sample, SizeInputs, field_payload
from stager.fs.atomic import partial_path
from stager.manifest import AuxFile, Manifest, ShardInfo, check_safe_name, load_manifest
from stager.manifest.fields import FieldSpec, build_field_columns, offset_column, size_column, values_column

CLASSES = ("cat", "dog", "fish")
IMAGE_SHAPE = (6, 5, 3)
# A field of each storage: free bytes, JSON bytes, and the two ragged box columns (docs/fields.md).
FIELDS = (FieldSpec("note", "bytes", "bin"), FieldSpec("info", "json"), FieldSpec("boxes", "boxes"),
          FieldSpec("box_labels", "box_labels"))


def same_payload(a: object, b: object) -> bool:
    """Equal payloads: arrays of one dtype, shape and content, or the same bytes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        return a_arr.dtype == b_arr.dtype and a_arr.shape == b_arr.shape and np.array_equal(a_arr, b_arr)
    return bytes(a) == bytes(b)  # type: ignore[call-overload]


def make_samples(fmt: str, n: int, seed: int = 0, *, fields: bool = False) -> list[Sample]:
    """``n`` samples suited to ``fmt``: random encoded bytes, or fixed-shape arrays for decoded formats;
    keys nested and with dots in directory parts; with ``fields``, values of :data:`FIELDS`."""
    rng = np.random.default_rng((seed, n))
    decoded = format_spec(fmt).sample_kind == "decoded"
    out = []
    for i in range(n):
        key = f"k{i:04d}" if i % 3 else f"sub/dir.v1/k{i:04d}"
        label = int(rng.integers(0, len(CLASSES)))
        data: bytes | np.ndarray
        if decoded:
            data = rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)
        else:
            data = rng.bytes(int(rng.integers(1, 3000)))
        meta: dict[str, Any] = {"source": f"train/{key}.src"}
        values: dict[str, Any] = {}
        if fields:
            nbox = int(rng.integers(0, 4))
            meta.update(height=IMAGE_SHAPE[0], width=IMAGE_SHAPE[1])
            values = {"note": rng.bytes(int(rng.integers(0, 200))), "info": b'{"i":%d}' % i,
                      "boxes": np.sort(rng.uniform(0, 5, (nbox, 4)).astype(np.float32), axis=1).reshape(nbox, 4),
                      "box_labels": rng.integers(0, 9, nbox).astype(np.int64)}
        out.append(Sample(key, label, data, "png" if i % 2 else "jpg", meta, values))
    return out


class ReaderTests:
    """What every format's reader does, whether stager writes the format or adopts it in place."""

    format_name: ClassVar[str]

    # ---- hooks ---------------------------------------------------------------------------------
    @property
    def fmt(self) -> Format:
        return get_format(self.format_name)

    @property
    def spec(self) -> FormatSpec:
        return FORMAT_SPECS[self.format_name]

    def samples(self, n: int, seed: int = 0) -> list[Sample]:
        """``n`` samples this format can hold (see :func:`make_samples`)."""
        return make_samples(self.format_name, n, seed)

    def write_shard(self, out: Path, samples: Sequence[Sample], **options: Any) -> tuple[Manifest, list[Sample]]:
        """One shard of ``samples`` in ``out`` with its manifest: ``(the manifest reloaded, the samples as a
        reader returns them)``. A read-only format writes its container with another tool and indexes it."""
        m, _ = write_dataset(self.format_name, out, samples, **options)
        return m, list(samples)

    def shard_path(self, out: Path, m: Manifest) -> Path:
        """Where the one shard of the dataset at ``out`` is (beside its manifest, or at its ``shard_root``)."""
        return Path(m.shard_root or out) / m.shards[0].name

    def read_all(self, out: Path, m: Manifest) -> list[Sample]:
        """Every sample of the shard, parsed by the format's reader (``iter_samples``)."""
        r = self.fmt.open_reader(str(self.shard_path(out, m)), m.shards[0], m)
        try:
            return list(r.iter_samples())
        finally:
            r.close()

    # ---- the format object and its registry entry ---------------------------------------------
    def test_module_carries_its_registry_entry(self, tmp_path: Path) -> None:
        """The module's ``FORMAT`` is the entry's: names, kind; one that stager does not write refuses to."""
        f = self.fmt
        assert f.spec is self.spec and f.name == self.format_name
        assert f.suffix == self.spec.suffix and f.sample_kind == self.spec.sample_kind
        assert type(f).__module__ == self.spec.module
        name = f.shard_name(0)
        assert check_safe_name(name) == name and name.endswith(f.suffix)
        if not self.spec.writable:
            with pytest.raises(UsageError, match=self.spec.what):
                f.open_writer(str(tmp_path / "x"), shard_name="x", classes=list(CLASSES))
            assert not (tmp_path / "x").exists()

    # ---- reading back -------------------------------------------------------------------------
    def test_iter_samples_round_trips(self, tmp_path: Path) -> None:
        m, want = self.write_shard(tmp_path, self.samples(23))
        got = self.read_all(tmp_path, m)
        assert [s.key for s in got] == [s.key for s in want] == list(m.shards[0].keys)
        assert [s.label for s in got] == [s.label for s in want]
        assert all(same_payload(a.data, b.data) for a, b in zip(got, want, strict=True))
        assert m.num_samples == 23

    def test_read_positions_in_any_order(self, tmp_path: Path) -> None:
        m, want = self.write_shard(tmp_path, self.samples(31, seed=3))
        info = m.shards[0]
        rng = np.random.default_rng(5)
        reader = self.fmt.open_reader(str(self.shard_path(tmp_path, m)), info, m)
        try:
            for positions in (rng.permutation(31), np.array([30, 0, 30, 5, 5, 1]), np.arange(31), [], [17]):
                got = reader.read(positions)
                assert len(got) == len(positions)
                for p, payload in zip(positions, got, strict=True):
                    assert same_payload(payload, want[int(p)].data), (self.format_name, int(p))
        finally:
            reader.close()

    def test_byte_extents_locate_the_payloads(self, tmp_path: Path) -> None:
        """Where the entry declares ``byte_ranges``, a shard with ``bytes`` extents holds each encoded
        payload at its manifest extent: any reader can ``pread`` it without knowing the format."""
        m, want = self.write_shard(tmp_path, self.samples(12, seed=6))
        info = m.shards[0]
        if not self.spec.byte_ranges or info.extents != "bytes" or m.sample_kind != "encoded":
            pytest.skip(f"{self.format_name}: offsets are not byte ranges of encoded payloads here")
        blob = self.shard_path(tmp_path, m).read_bytes()
        for s, off, size in zip(want, info.offsets.tolist(), info.sizes.tolist(), strict=True):
            assert blob[off : off + size] == bytes(s.data)

    def test_missing_shard_raises_shard_missing(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(3))
        self.shard_path(tmp_path, m).unlink()
        with pytest.raises(ShardMissingError):
            self.read_all(tmp_path, m)

    def test_truncated_shard_is_reported_by_read(self, tmp_path: Path) -> None:
        """``read`` through the manifest's extents of a shard cut short raises our error, not a short
        payload."""
        m, _ = self.write_shard(tmp_path, self.samples(9, seed=4))
        info = m.shards[0]
        if info.extents != "bytes" or not self.spec.byte_ranges:
            pytest.skip(f"{self.format_name}: offsets are not byte ranges here")
        path = self.shard_path(tmp_path, m)
        last = int(np.argmax(info.offsets))
        path.write_bytes(path.read_bytes()[: int(info.offsets[last]) + 1])
        reader = self.fmt.open_reader(str(path), info, m)
        try:
            with pytest.raises(StagerError):
                reader.read([last])
        finally:
            reader.close()


class FormatTests(ReaderTests):
    """What a format stager writes does: :class:`ReaderTests`, its writer, and its declared capabilities.

    Subclasses implement :meth:`structure_offset`; ``disk_bytes_slack`` is how many bytes
    ``Format.disk_bytes`` may be off for a shard of 40 small samples (0: exact)."""

    disk_bytes_slack: ClassVar[int] = 0

    def structure_offset(self, size: int) -> int:
        """A byte of the container's own structure (not a payload) in a shard of ``size`` bytes, which
        no reader may accept changed."""
        raise NotImplementedError(f"{type(self).__name__} must say where its container's structure is")

    # ---- the writer ---------------------------------------------------------------------------
    def test_shard_names_are_safe_and_numbered(self) -> None:
        f = self.fmt
        names = [f.shard_name(i) for i in (0, 7, 12345)]
        assert names[1] == f"shard-00007{f.suffix}"
        assert all(check_safe_name(n) == n and n.endswith(f.suffix) for n in names)
        assert len(set(names)) == 3 and sorted(names) == names  # zero-padded: lexical = numeric order

    def test_only_the_shard_and_its_declared_companions_are_left(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(5))
        info = m.shards[0]
        companion = self.spec.companion_name(info.name)
        assert [a.name for a in info.aux] == ([companion] if companion else [])
        assert {p.name for p in tmp_path.iterdir()} == {info.name, "manifest.json", m.index.name if m.index else "",
                                                        *(a.name for a in info.aux)} - {""}

    def test_identical_input_gives_identical_bytes(self, tmp_path: Path) -> None:
        samples = self.samples(12, seed=9)
        m1, e1 = write_dataset(self.format_name, tmp_path / "a", samples)
        m2, e2 = write_dataset(self.format_name, tmp_path / "b", samples)
        assert e1 == e2
        for name, _, _h in m1.files():
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert [h for *_, h in m1.files()] == [h for *_, h in m2.files()]
        m3, _ = write_dataset(self.format_name, tmp_path / "c", self.samples(12, seed=10))
        assert m3.shards[0].hash != m1.shards[0].hash

    def test_empty_shard_is_valid_and_empty(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, [])
        info = m.shards[0]
        assert info.samples == 0 and info.bytes == (tmp_path / info.name).stat().st_size  # 0 for record
        assert self.read_all(tmp_path, m) == []
        reader = self.fmt.open_reader(str(tmp_path / info.name), info, m)
        try:
            assert reader.read([]) == []
        finally:
            reader.close()

    def test_wrong_sample_kind_is_refused(self, tmp_path: Path) -> None:
        f = self.fmt
        wrong: bytes | np.ndarray = (
            b"\xff\xd8 not an array" if f.sample_kind == "decoded" else np.zeros(IMAGE_SHAPE, np.uint8)
        )
        w = f.open_writer(str(partial_path(tmp_path / f.shard_name(0))), shard_name=f.shard_name(0),
                          classes=list(CLASSES))
        with pytest.raises(StagerError):
            w.write(Sample("k0", 0, wrong, "jpg"))
        w.abort()

    def test_disk_bytes_is_the_file_size(self, tmp_path: Path) -> None:
        """``Format.disk_bytes`` (the pack plan's shard cut) predicts the file: exactly, or within
        ``disk_bytes_slack`` bytes."""
        samples = self.samples(40, seed=2)
        m, _ = self.write_shard(tmp_path, samples)
        sizes = np.array([s.data.nbytes if isinstance(s.data, np.ndarray) else len(s.data) for s in samples])
        shape = IMAGE_SHAPE if m.sample_kind == "decoded" else None
        inputs = SizeInputs([s.key for s in samples], np.array([s.label for s in samples], np.int64), sizes,
                            [s.ext for s in samples], list(CLASSES), shape)
        per_sample, fixed = self.fmt.disk_bytes(inputs)
        assert per_sample.shape == (40,) and per_sample.dtype == np.int64
        assert abs(fixed + int(per_sample.sum()) - m.shards[0].bytes) <= self.disk_bytes_slack

    # ---- declared capabilities ----------------------------------------------------------------
    def test_named_keys_are_checked_up_front(self, tmp_path: Path) -> None:
        """``named_keys``: ``check_keys`` refuses a key the container would split differently and a
        repeat; otherwise any key is stored as it is."""
        odd = ["a/b.c", "a/b.c"]
        if self.spec.named_keys:
            with pytest.raises(UsageError):
                self.fmt.check_keys(odd[:1])
            with pytest.raises(UsageError, match="duplicate"):
                self.fmt.check_keys(["ok", "ok"])
            self.fmt.check_keys(["a/b", "c"])
            return
        self.fmt.check_keys(odd)
        sample = self.samples(1)[0]
        m, _ = self.write_shard(tmp_path, [Sample("a/b.c", sample.label, sample.data, sample.ext)])
        assert [s.key for s in self.read_all(tmp_path, m)] == ["a/b.c"]

    def test_fragments_concatenate_to_the_shard(self, tmp_path: Path) -> None:
        """``fragments``: runs of a shard's samples built apart, written one after the other from
        ``fragment_base()`` and finished by ``finish_fragments``, are the writer's shard byte for
        byte, extents relative to each fragment."""
        if not self.spec.fragments:
            pytest.skip("no fragments")
        samples = self.samples(17, seed=12)
        m, extents = write_dataset(self.format_name, tmp_path, samples)
        f: Any = self.fmt  # a FragmentFormat (stager.pack.shard): fragment_base, open_fragment, finish_fragments
        path = tmp_path / "fragments.partial"
        at = base = f.fragment_base()
        extras = []
        start = 0
        with open(path, "wb") as out:
            for n in (5, 1, 11):
                w = f.open_fragment(shard_name=m.shards[0].name, classes=list(CLASSES))
                got = [w.write(s) for s in samples[start : start + n]]
                assert [Extent(e.offset + at, e.size, e.fields) for e in got] == extents[start : start + n]
                out.seek(at)
                at += out.write(b"".join(w.take()))
                extras.append(w.extra())
                start += n
        done = FragmentsDone(m.shards[0].name, list(CLASSES), [s.key for s in samples],
                             [s.label for s in samples], [e.size for e in extents], extras)
        assert f.finish_fragments(str(path), at, done) == []
        assert at > base or not samples
        assert path.read_bytes() == (tmp_path / m.shards[0].name).read_bytes()

    def test_hasher_sees_every_byte(self, tmp_path: Path) -> None:
        """``hashes_while_writing``: the ``hasher`` option is fed the whole shard, once, in order."""
        if not self.spec.hashes_while_writing:
            pytest.skip("the shard is hashed by reading it back")
        h = new_hasher("xxh3_128")
        m, _ = write_dataset(self.format_name, tmp_path, self.samples(20, seed=13), hasher=h, flush_bytes=4096)
        assert h.hexdigest() == m.shards[0].hash

    def test_fields_are_stored_at_their_extents(self, tmp_path: Path) -> None:
        """``fields``: samples with fields are written; byte fields lie at their extents in the file
        (with ``byte_ranges``) and, where the fields ``span``, one read per sample covers its image and
        byte fields without touching another sample's; a reader that yields fields yields them as written."""
        if not self.spec.fields:
            pytest.skip("stores one image and a label")
        samples = make_samples(self.format_name, 9, seed=14, fields=True)
        m, extents = write_dataset(self.format_name, tmp_path, samples, fields=FIELDS)
        info = m.shards[0]
        blob = (tmp_path / info.name).read_bytes()
        byte_fields = [s for s in FIELDS if not s.ragged]
        for e in extents:
            assert e.fields is not None and set(e.fields) >= {f.name for f in byte_fields}
        spans = [(e.offset, e.offset + e.size) for e in extents]
        cols = info.columns
        for i, s in enumerate(samples):
            for spec in byte_fields:
                off, size = int(cols[offset_column(spec.name)][i]), int(cols[size_column(spec.name)][i])
                assert size == len(field_payload(spec, s.fields[spec.name]))
                if self.spec.byte_ranges:
                    assert blob[off : off + size] == field_payload(spec, s.fields[spec.name])
                    spans[i] = (min(spans[i][0], off), max(spans[i][1], off + size))
            for spec in (f for f in FIELDS if f.ragged):
                assert np.array_equal(np.asarray(cols[values_column(spec.name)][i]).reshape(-1),
                                      np.asarray(s.fields[spec.name]).reshape(-1))
        if self.spec.fields == "span":
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "sample spans interleave"
        by_name = {f.name: f for f in FIELDS}
        for got, s in zip(self.read_all(tmp_path, m), samples, strict=True):
            assert same_payload(got.data, s.data)
            for name, value in got.fields.items():
                if by_name[name].ragged:
                    assert np.array_equal(np.asarray(value).reshape(-1), np.asarray(s.fields[name]).reshape(-1))
                else:
                    assert bytes(value) == field_payload(by_name[name], s.fields[name])

    # ---- damage -------------------------------------------------------------------------------
    def test_truncated_shard_raises_our_error(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(9, seed=4))
        path = tmp_path / m.shards[0].name
        blob = path.read_bytes()
        # Cut points that leave a container which is provably incomplete. (A record file cut exactly
        # at a record boundary is a valid shorter file; only the manifest size/hash catches that.)
        boundaries: set[int] = set()
        for a in m.shards[0].aux:
            if a.name.endswith(".idx"):
                for line in (tmp_path / a.name).read_text().splitlines():
                    off, size = map(int, line.split())
                    boundaries.update((off, off + size))
        cuts = {len(blob) - 1, len(blob) // 2, len(blob) // 3, 11}
        for cut in sorted(c + 1 if c in boundaries else c for c in cuts):
            path.write_bytes(blob[:cut])
            with pytest.raises(StagerError) as exc_info:
                self.read_all(tmp_path, m)
            assert path.name in str(exc_info.value), (cut, exc_info.value)

    def test_flipped_bytes_never_escape_as_foreign_errors(self, tmp_path: Path) -> None:
        """Any single flipped byte gives our error or a parse; never a random exception."""
        samples = self.samples(6, seed=8)
        m, _ = self.write_shard(tmp_path, samples)
        path = tmp_path / m.shards[0].name
        blob = path.read_bytes()
        rng = np.random.default_rng(0)
        positions = sorted({0, len(blob) - 1, len(blob) - 22, *rng.integers(0, len(blob), 40).tolist()})
        detected = 0
        for pos in positions:
            damaged = bytearray(blob)
            damaged[pos] ^= 0xFF
            path.write_bytes(bytes(damaged))
            try:
                got = self.read_all(tmp_path, m)
            except StagerError as exc:
                assert path.name in str(exc), exc
                detected += 1
                continue
            assert len(got) <= len(samples) + 1  # parsed something; the file hash is what catches it
        assert detected > 0

    def test_structure_damage_is_detected(self, tmp_path: Path) -> None:
        """A flipped byte in the container's own structure (not a payload) is always refused."""
        m, _ = self.write_shard(tmp_path, self.samples(4))
        path = tmp_path / m.shards[0].name
        blob = bytearray(path.read_bytes())
        blob[self.structure_offset(len(blob))] ^= 0x5A
        path.write_bytes(bytes(blob))
        with pytest.raises((CorruptSampleError, UnsafeArchiveError)) as exc_info:
            self.read_all(tmp_path, m)
        assert path.name in str(exc_info.value)


def write_dataset(fmt: str, out: Path, samples: Sequence[Sample], **options: Any) -> tuple[Manifest, list[Extent]]:
    """Write one shard of ``samples`` in ``out`` the way ``stager pack`` does (writer ``options``, e.g.
    tar's ``json_member`` or ``fields``): ``(the reloaded manifest, each sample's extent)``."""
    f = get_format(fmt)
    out.mkdir(parents=True, exist_ok=True)
    name = f.shard_name(0)
    final = out / name
    tmp = partial_path(final)
    specs: Sequence[FieldSpec] = options.get("fields", ())
    w = f.open_writer(str(tmp), shard_name=name, classes=list(CLASSES), **options)
    try:
        extents = [w.write(s) for s in samples]
        companions = w.close()
    except BaseException:
        w.abort()
        if tmp.exists():
            tmp.unlink()
        raise
    bases = w.field_bases
    extents = [Extent(w.final_offset(e.offset), e.size, None if e.fields is None else
                      {k: (o + bases.get(k, 0), n) for k, (o, n) in e.fields.items()}) for e in extents]
    os.replace(tmp, final)
    aux = []
    for aux_name, aux_tmp in companions:
        assert Path(aux_tmp).parent == out, "companion temp files must live next to the shard"
        os.replace(aux_tmp, out / aux_name)
        nb, h = hash_file(out / aux_name)
        aux.append(AuxFile(aux_name, nb, h))
    nbytes, digest = hash_file(final)
    rows: dict[str, list[Any]] = {}
    for s, e in zip(samples, extents, strict=True):
        for spec in specs:
            if spec.ragged:
                rows.setdefault(values_column(spec.name), []).append(s.fields[spec.name])
            else:
                off, size = (e.fields or {})[spec.name]
                rows.setdefault(offset_column(spec.name), []).append(off)
                rows.setdefault(size_column(spec.name), []).append(size)
    info = ShardInfo(
        name=name, bytes=nbytes, hash=digest, keys=[s.key for s in samples],
        labels=np.array([s.label for s in samples], dtype=np.int64),
        offsets=np.array([e.offset for e in extents], dtype=np.int64),
        sizes=np.array([e.size for e in extents], dtype=np.int64), aux=aux, extents=w.extents,
        columns=build_field_columns(specs, rows) if specs else None,
    )
    decoded = f.sample_kind == "decoded"
    m = Manifest(format=fmt, classes=list(CLASSES), shards=[info], sample_kind=f.sample_kind,
                 image_shape=IMAGE_SHAPE if decoded and samples else None, fields=[s.to_json() for s in specs])
    m.write(out)
    return load_manifest(out), extents

"""An existing stager pack as a source (any format converts to any other).

Samples are sorted by key (unique within a pack), whatever order the pack stored them in; a
locator is ``<shard index>#<position in shard>``, and loads are grouped per shard so that each
format reader fetches its payloads in one call. A pack (or an indexed set) with fields keeps them
(docs/fields.md): byte fields are read at their manifest extents in the shard file (every format
with fields stores them as byte ranges), ragged fields come from the index columns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import SourceError
from stager.formats import get_format
from stager.formats.base import Sample, ShardReader
from stager.manifest import Manifest, load_manifest, shard_root
from stager.manifest.fields import offset_column, sample_fields, size_column, specs_from_json, values_column
from stager.pack.sources.base import SampleRef, Source, key_for, sniff_ext, unique_keys


class PackSource(Source):
    """An existing stager pack, re-read through its format's reader (payloads by manifest index)."""

    kind = "pack"

    def __init__(self, root: Path, manifest: Manifest | None = None) -> None:
        super().__init__(root)
        self.manifest = manifest if manifest is not None else load_manifest(root)
        m = self.manifest
        self.shard_dir = Path(shard_root(root, m))  # an index's shards may live elsewhere
        self.classes = list(m.classes)
        self.sample_kind = m.sample_kind
        self.image_shape = m.image_shape
        self._readers: dict[int, ShardReader] = {}
        self._fds: dict[int, int] = {}  # shard -> descriptor, for field bytes
        # Fields of the schema (RecordIO's label_values, no field kind of docs/fields.md, stay behind).
        self.fields = specs_from_json(sample_fields(m.fields), str(root))
        self._starts = np.concatenate([[0], np.cumsum([s.samples for s in m.shards])]).astype(np.int64)
        refs = []
        for si, s in enumerate(m.shards):
            # An index's keys are other writers' (file names with dots, as webdataset's ShardWriter writes
            # ImageNet's): made pack keys as for file sources (dots in the last part become "_").
            keys = [key_for(k + ".x") for k in s.keys] if m.indexed else s.keys
            for pos, (k, lab, size) in enumerate(zip(keys, s.labels.tolist(), s.sizes.tolist(), strict=True)):
                refs.append(SampleRef(k, int(lab), f"{si}#{pos}", int(size)))
        if m.indexed:
            refs = [r._replace(key=k) for r, k in zip(refs, unique_keys(r.key for r in refs), strict=True)]
        # Keys are unique within a pack; sort for a canonical order independent of the shuffle.
        refs.sort(key=lambda r: r.key)
        self.refs = refs

    def describe(self) -> dict[str, Any]:
        m = self.manifest
        out = {**super().describe(), "format": m.format}
        if m.digest or m.index is not None:  # a set indexed in memory (RecordIO, LMDB) has no manifest digest
            out["dataset_id"] = m.dataset_id
        return out

    def _reader(self, si: int) -> ShardReader:
        r = self._readers.get(si)
        if r is None:
            info = self.manifest.shards[si]
            fmt = get_format(self.manifest.format)
            r = self._readers[si] = fmt.open_reader(str(self.shard_dir / info.name), info, self.manifest)
        return r

    def load_many(self, refs: Sequence[SampleRef]) -> list[Sample | BaseException]:
        by_shard: dict[int, list[int]] = {}
        for i, r in enumerate(refs):
            si = int(r.locator.split("#", 1)[0])
            by_shard.setdefault(si, []).append(i)
        out: list[Sample | BaseException] = [SourceError("unread")] * len(refs)
        for si, idxs in sorted(by_shard.items()):
            positions = [int(refs[i].locator.split("#", 1)[1]) for i in idxs]
            try:
                payloads = self._reader(si).read(positions)
            except (OSError, ValueError, EOFError) as exc:
                err = SourceError(f"{self.shard_dir / self.manifest.shards[si].name}: cannot read samples ({exc})")
                for i in idxs:
                    out[i] = err
                continue
            for i, data, pos in zip(idxs, payloads, positions, strict=True):
                r = refs[i]
                meta = {"source": self.rel_of(r)}
                values = self._field_values(si, pos) if self.fields else {}
                if isinstance(data, np.ndarray):
                    out[i] = Sample(r.key, r.label, data, "png", meta, values)
                else:
                    b = bytes(data)
                    out[i] = Sample(r.key, r.label, b, sniff_ext(b) or "bin", meta, values)
        return out

    def _field_values(self, si: int, pos: int) -> dict[str, Any]:
        """The fields of sample ``pos`` of shard ``si``: bytes read at their extents, ragged index values."""
        gid = int(self._starts[si]) + pos
        cols = self.manifest.extra_columns()
        out: dict[str, Any] = {}
        path = self.shard_dir / self.manifest.shards[si].name
        for s in self.fields:
            if s.ragged:
                out[s.name] = np.array(cols[values_column(s.name)][gid])
                continue
            off, size = int(cols[offset_column(s.name)][gid]), int(cols[size_column(s.name)][gid])
            if self.manifest.sample_kind == "decoded":  # zarr: a decoded row, or bytes of its data array
                reader: Any = self._reader(si)  # a ZarrReader
                out[s.name] = _encoded(reader.read_field(s.kind, s.name, off, size))
                continue
            fd = self._fds.get(si)
            if fd is None:
                fd = self._fds[si] = os.open(path, os.O_RDONLY)
            data = os.pread(fd, size, off)
            if len(data) != size:
                raise SourceError(f"{path}: field {s.name!r} of sample {pos} runs past the end of the file")
            out[s.name] = data
        return out

    def load(self, ref: SampleRef) -> Sample:
        res = self.load_many([ref])[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def path_of(self, ref: SampleRef) -> str:
        si, pos = ref.locator.split("#", 1)
        return f"{self.shard_dir / self.manifest.shards[int(si)].name}[{pos}] ({ref.key})"

    def rel_of(self, ref: SampleRef) -> str:
        si, pos = ref.locator.split("#", 1)
        return f"{self.manifest.shards[int(si)].name}#{pos}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}, "_fds": {}}

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _encoded(value: Any) -> bytes:
    """A field value as the bytes writers store: a zarr pack's decoded mask or image row as PNG."""
    if not isinstance(value, np.ndarray):
        return bytes(value)
    import io  # noqa: PLC0415 (only here)

    from PIL import Image  # noqa: PLC0415 (PIL only where a decoded field is re-encoded)

    buf = io.BytesIO()
    Image.fromarray(value).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()

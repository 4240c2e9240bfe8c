"""Index MXNet RecordIO files (``.rec``, with their ``.idx`` when present; im2rec, ``mx.recordio``, InsightFace).

The file is walked record by record from the mapping (:func:`stager.formats.recordio.walk_records`:
magic, length, continuation flag, IRHeader), so a ``.rec`` without an ``.idx`` is indexed by this
scan; an ``.idx`` beside it (``x.rec`` -> ``x.idx``) must list exactly the records found, each at its
first byte, and gives the sample keys; without one the key is the record's position in the file, as
in the ``.idx`` the api then writes (``<position>\t<offset>`` per record: byte for byte what DALI's
``rec2idx`` writes). A sample's extent is the byte range of its payload (after the IRHeader and the
array labels), read by the loader like a TFRecord's image bytes; a file holding a record split inside
its payload gets ``extents: "records"`` (docs/formats.md). Records without a payload (InsightFace's
header and identity-range records) are not samples.

Labels (``label_key``, default ``label``): the IRHeader's label, or for array labels (``flag > 0``) the
first value; every value goes to the per-sample ``label_values`` column. ``none``: unlabeled.
"""

from __future__ import annotations

import os

from stager.errors import UsageError
from stager.formats.recordio import RecEntry, RecordIOError, idx_path_of, read_idx, walk_records
from stager.index.scan import DamagedShardError, ShardScan, mapped

LABEL_KEYS = ("label",)


def scan_recordio(path: str, name: str, image_key: str | None, label_key: str | None, algo: str) -> ShardScan:
    """Index one ``.rec`` file (see the module docstring); raises a one-line error naming the file and record."""
    if image_key:
        raise UsageError(f"{path}: --image-key does not apply to RecordIO (the payload follows the IRHeader)")
    if label_key not in (None, *LABEL_KEYS):
        raise UsageError(f"{path}: unknown --label-key {label_key!r} for RecordIO; expected label or none")
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns)
        try:
            entries = walk_records(view, path)
        except RecordIOError as exc:
            raise DamagedShardError(str(exc)) from exc
    idx = idx_path_of(path)
    keys = _keys(entries, idx, path)
    if os.path.isfile(idx):
        out.companion = os.path.basename(idx)  # verified against the records: staged with the file
    else:  # MXNet's ``key\toffset`` lines for an .idx written by the api (DALI's reader needs one)
        out.records = [(i, e.start) for i, e in enumerate(entries)]
    samples = [(k, e) for k, e in zip(keys, entries, strict=True) if e.size > 0]
    split = any(e.payload is None for _, e in samples)
    out.extents = "records" if split else "bytes"
    values: list[list[float]] = []
    for i, (key, e) in enumerate(samples):
        out.keys.append(key)
        if split:
            out.offsets.append(e.start)
            out.sizes.append(e.end - e.start)
        else:
            assert e.payload is not None
            out.offsets.append(e.payload[0])
            out.sizes.append(e.payload[1])
        out.labels.append(None if label_key is None else _label(e, i, path))
        values.append(e.labels if e.labels is not None else [e.label])
    out.columns = {"label_values": values}  # kept as a column when any record has array labels
    return out


def _keys(entries: list[RecEntry], idx: str, path: str) -> list[str]:
    """Keys from the ``.idx`` (checked against the records), else the records' positions (the keys of
    the ``.idx`` written for the file, so a second index reads the same keys from it)."""
    if os.path.isfile(idx):
        try:
            return read_idx(idx, path, entries)
        except RecordIOError as exc:
            raise DamagedShardError(str(exc)) from exc
    return [str(i) for i in range(len(entries))]


def _label(e: RecEntry, i: int, path: str) -> int:
    if e.label != int(e.label):
        raise UsageError(f"{path}: record at byte {e.start} (sample {i}): label {e.label} is not a class index; "
                         "pass --label-key none (the values stay in the label_values column)")
    return int(e.label)

"""The options of ``stager index`` (:class:`IndexOptions`) and the input kinds it recognises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stager.checksum import ALGOS, DEFAULT_ALGO
from stager.errors import UsageError
from stager.formats import ADOPTED_FORMATS, FORMAT_SPECS

# The input kinds are the formats `stager index` adopts: their registry entries (stager.formats.registry)
# say which file suffixes are theirs (`adopt_suffixes`, in the order `--format auto` tries them), their
# default image and label keys, whether their scanners adopt fields and whether their values have layouts.
KINDS = ADOPTED_FORMATS
LMDB_LAYOUTS = ("auto", "caffe", "pickle")  # stager.formats.lmdb_values.LAYOUTS


@dataclass(frozen=True)
class IndexOptions:
    """What to index and how (docs/index.md).

    ``image_key``/``label_key``: the field holding the image and the label (per kind: tar member
    extensions such as ``jpg;png`` / ``cls``, ``txt``, ``json`` or ``json:FIELD``; TFRecord feature
    names; parquet column names); None takes the kind's default. ``label_offset`` is added to every
    integer label (``-1`` for TensorFlow's 1-based ImageNet labels). ``label_key="none"`` indexes
    unlabeled data. ``dali_index``: write DALI's ``<file>.idx`` for TFRecord files, and MXNet's
    ``x.idx`` for a RecordIO ``x.rec`` without one (beside the file, or into OUT when ``out`` is
    given). ``lmdb_layout``: what LMDB values hold, ``caffe`` Datums or ``pickle``d ``(image, label)``
    tuples; ``auto`` sniffs. ``fields``: adopt the members / features / columns beside the image as
    fields (docs/fields.md; tar, TFRecord, parquet); False indexes images and labels only.
    ``storage_options`` open a URL SRC (fsspec's options of its backend; not part of what a scan
    depends on).
    """

    format: str = "auto"
    image_key: str | None = None
    label_key: str | None = None
    label_offset: int = 0
    workers: int = 1
    hash_algo: str = DEFAULT_ALGO
    dali_index: bool = True
    overwrite: bool = False
    lmdb_layout: str = "auto"
    fields: bool = True
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.format not in ("auto", *KINDS):
            raise UsageError(f"unknown --format {self.format!r}; expected auto, {', '.join(KINDS)}")
        if self.workers < 1:
            raise UsageError(f"--workers must be >= 1, got {self.workers}")
        if self.hash_algo not in ALGOS:
            raise UsageError(f"unknown --hash {self.hash_algo!r}; expected one of {', '.join(ALGOS)}")
        if self.lmdb_layout not in LMDB_LAYOUTS:
            raise UsageError(f"unknown --lmdb-layout {self.lmdb_layout!r}; expected one of {', '.join(LMDB_LAYOUTS)}")

    def image_key_for(self, kind: str) -> str | None:
        return self.image_key if self.image_key is not None else FORMAT_SPECS[kind].image_key

    def label_key_for(self, kind: str) -> str | None:
        key = self.label_key if self.label_key is not None else FORMAT_SPECS[kind].label_key
        return None if key in ("none", "") else key

    def fingerprint(self, kind: str) -> dict[str, object]:
        """What a shard's scan depends on (besides the file itself): recorded and compared on resume."""
        return {"kind": kind, "image_key": self.image_key_for(kind), "label_key": self.label_key_for(kind),
                "hash": self.hash_algo, **self.scan_extras(kind)}

    def scan_extras(self, kind: str) -> dict[str, Any]:
        """Keyword options of ``kind``'s scanner beyond the common ones (LMDB: ``layout``; tar, TFRecord,
        parquet: ``fields=False`` when fields are not adopted)."""
        spec = FORMAT_SPECS[kind]
        if spec.sniffs_layout:
            return {"layout": self.lmdb_layout}
        return {"fields": False} if not self.fields and spec.fields else {}

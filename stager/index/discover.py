"""Which files of SRC are shards, and of which kind (``--format auto`` looks at names, then bytes)."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Any

from stager.errors import SourceNotFoundError, UsageError
from stager.formats import FORMAT_SPECS
from stager.formats.lmdb_pages import is_lmdb
from stager.formats.record import masked_crc
from stager.formats.recordio import MAGIC_BYTES
from stager.fs.open import is_url, join
from stager.index import remote
from stager.index.options import KINDS
from stager.manifest import INDEX_SUFFIX, MANIFEST_NAME, check_file_name

STATE_DIR = ".stager-index"  # per-shard scan results of an unfinished run (resume)
_IGNORED_SUFFIXES = (".idx", ".json", ".txt", ".md", ".partial", ".lock", ".csv", INDEX_SUFFIX, "-lock", ".lst")
_IGNORED_NAMES = (MANIFEST_NAME, "lock.mdb")  # an LMDB's lock file is not data (read-only staging needs none)


def kind_of_name(name: str) -> str | None:
    low = name.lower()
    for kind in KINDS:
        if low.endswith(FORMAT_SPECS[kind].adopt_suffixes):
            return kind
    return None


def sniff(path: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The input kind of a file or object from its first bytes: a format's registered ``magic``
    (SquashFS's ``hsqs``), ustar magic, ``PAR1``, RecordIO's magic, an LMDB meta page, or a valid
    TFRecord header."""
    try:
        if is_url(path):
            head = remote.head(path, storage_options)
        else:
            with open(path, "rb") as f:
                head = f.read(512)
    except OSError:
        return None
    for kind in KINDS:
        magic = FORMAT_SPECS[kind].magic
        if magic and head.startswith(magic):
            return kind
    if head[:4] == b"PAR1":
        return "parquet"
    if len(head) >= 263 and head[257:262] == b"ustar":
        return "tar"
    if head[:4] == MAGIC_BYTES:
        return "recordio"
    if is_lmdb(head):
        return "lmdb"
    if len(head) >= 12 and masked_crc(head[:8]) == struct.unpack_from("<I", head, 8)[0]:
        return "record"
    return None


def discover(src: str, fmt: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, list[str], str]:
    """``(directory, shard file names sorted, kind)`` for SRC (a directory of shards or one shard file;
    or a URL prefix of shard objects or one object: then ``directory`` is the prefix URL).

    ``fmt`` ``auto`` takes each file's kind from its suffix (``.tar``, ``.tfrecord``/``.tfrecords``/
    ``.record``, ``.parquet``, ``.rec``, ``.mdb``/``.lmdb``, ``.sqfs``/``.squashfs``/``.sqsh``/``.sfs``),
    else from its first bytes (TensorFlow's ``train-00000-of-01024`` has no suffix; a SquashFS image
    named ``data.img``); all shards must be of one kind. Names must be plain file
    names (the manifest's rule).
    """
    if is_url(src):
        directory, names = remote.list_objects(src, storage_options)
        names = [n for n in names if n not in _IGNORED_NAMES and not n.lower().endswith(_IGNORED_SUFFIXES)]
    elif os.path.isfile(src):
        directory, names = os.path.dirname(os.path.abspath(src)), [os.path.basename(src)]
    elif os.path.isdir(src):
        directory = os.path.abspath(src)
        names = sorted(e.name for e in os.scandir(directory) if e.is_file() and not e.name.startswith(".")
                       and e.name not in _IGNORED_NAMES and not e.name.lower().endswith(_IGNORED_SUFFIXES))
    elif os.path.lexists(src):  # a FIFO, socket, device or dangling link
        raise UsageError(f"{src}: neither a directory nor a regular file; give a directory of shards")
    else:
        raise SourceNotFoundError(f"{src}: no such file or directory; give a directory of shards")
    kinds: dict[str, list[str]] = {}
    for n in names:
        k = fmt if fmt != "auto" else (kind_of_name(n) or sniff(join(directory, n), storage_options))
        if k is not None:
            kinds.setdefault(k, []).append(n)
    if not kinds:
        whats = [FORMAT_SPECS[k].what for k in KINDS]
        raise UsageError(f"{src}: no {', '.join(whats[:-1])} or {whats[-1]} shards found; pass --format "
                         f"{'|'.join(KINDS)}")
    if len(kinds) > 1:
        shown = "; ".join(f"{k}: {v[0]}" + (f" and {len(v) - 1} more" if len(v) > 1 else "") for k, v in kinds.items())
        raise UsageError(f"{src}: holds shards of several kinds ({shown}); index one kind at a time "
                         "(put them in separate directories or pass --format)")
    kind, found = next(iter(kinds.items()))
    for n in found:
        check_file_name(n, "shard file name")
    return directory, found, kind

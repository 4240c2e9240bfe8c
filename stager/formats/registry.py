"""The format registry: every shard format stager knows, what it can do, and where its code lives.

Each format is one :class:`FormatSpec` here and one module (named by ``module``, holding ``FORMAT``,
an object with the :class:`stager.formats.base.Format` protocol whose ``spec`` is this entry). Every
list of formats elsewhere (the manifest's accepted formats, ``stager pack --format``, ``stager index
--format``, the pack API's checks, the loader's reading path, ``stage --unpack``) is derived from the
entries' capabilities, never spelled out: adding a format is one module, one entry below and one
conformance test class (:class:`stager.testing.formats.FormatTests`; docs/architecture.md, "Adding a
format").

The capabilities live here rather than on the format classes, which is what zarr's codecs do: the
registry must answer without importing a format's module, so that ``stager <cmd> --help`` loads
neither numpy nor a format, and reading tar shards never imports h5py, zarr or pyarrow (this module
imports nothing but :mod:`stager.errors`). The format class carries its entry as ``spec``, and the
conformance suite checks that the class does what the entry declares.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from stager.errors import UsageError

EXTENT_KINDS = ("bytes", "rows", "records", "inodes")  # a shard's ``extents`` in the manifest (docs/formats.md)
FIELD_LAYOUTS = ("span", "separate")  # how a format stores samples with fields (FormatSpec.fields)
SAMPLE_KINDS = ("encoded", "decoded")


@dataclass(frozen=True)
class FormatSpec:
    """One format's entry: its names and every capability code elsewhere branches on.

    ``name`` is the manifest's ``format``; ``module`` the module that holds its ``FORMAT`` object
    (imported on first use); ``suffix`` a shard file's suffix; ``what`` the container's name in
    messages.

    Capabilities:

    * ``sample_kind``: what its shards hold, ``"encoded"`` image files' bytes or ``"decoded"``
      ``(H, W, C)`` uint8 arrays (an adopted LMDB's manifest may say ``decoded``: raw Datums).
    * ``writable``: ``stager pack`` writes it. Otherwise stager only reads it in place: ``stager
      index`` adopts it, and ``stager pack`` converts it to a writable format.
    * ``extents``: the ``extents`` kinds its shards may declare (docs/formats.md: ``bytes``, ``rows``
      for compressed parquet pages, ``records`` for split RecordIO records, ``inodes`` for SquashFS
      images whose compressed files are found by their inodes).
    * ``byte_ranges``: with ``bytes`` extents, a sample's ``offset``/``size`` is a byte range of the
      shard file holding its payload, readable with one ``pread`` and checked against the shard's
      size. False for zarr, whose offsets are rows and sizes the decoded bytes.
    * ``fields``: how it stores samples with fields (docs/fields.md): ``"span"``, each byte field
      beside its image in the file, so one read spans the sample; ``"separate"``, a dataset or
      column per field, each one more read at its own extent; None, not at all.
    * ``named_keys``: keys are names inside the container that readers group members by (tar's
      ``KEY.ext``): ``stager pack`` checks a whole plan's keys with ``Format.check_keys`` before
      writing, and ``stager index`` refuses a repeated key instead of renumbering the samples.
    * ``fragments``: a shard is fragments built without knowing their offset (``Format.open_fragment``),
      written one after the other from ``Format.fragment_base()``, then what ``Format.finish_fragments``
      writes around them (tar's end marker, HDF5's metadata): ``pack --workers`` writes one shard in
      parallel. Samples with fields only where they ``span`` (a ``separate`` field's data is laid out
      at the end).
    * ``hashes_while_writing``: the writer feeds every byte of the shard to a ``hasher`` option, so
      pack never reads the shard back to hash it.
    * ``stream_unpack``: the shard is a stream of file members that ``stage --unpack`` writes out
      while reading its bytes once (tar), so ``--unpack only`` streams it from SRC without keeping
      a copy in DEST; other formats are unpacked through their reader from a copy in DEST.
    * ``companion``: the per-shard index file a reader of the format expects beside the shard,
      ``{name}`` the shard's file name and ``{stem}`` that name without its last suffix (a TFRecord's
      DALI ``.idx``, a RecordIO's MXNet ``.idx``); ``companion_line`` is one record's line of it,
      formatted with ``(offset, size)`` for TFRecord and ``(key, offset)`` for RecordIO.
    * ``adopt_suffixes``: the file suffixes ``stager index --format auto`` takes as this format, in
      the order tried; empty when ``stager index`` does not adopt it. ``image_key`` and
      ``label_key`` are the container's default image and label fields for ``stager index``.
    * ``sniffs_layout``: its values come in layouts ``stager index`` tells apart (LMDB: Caffe
      Datums or pickles; ``--lmdb-layout``).
    * ``magic``: the bytes a file of the format starts with, by which ``stager index --format auto``
      knows a file whose name has none of ``adopt_suffixes``; empty when its own sniffing decides.
    * ``compressions``: what ``stager pack --compression`` may choose for it, the default first;
      empty when its writer does not compress.
    * ``mountable``: a shard is a file system image that ``stager stage --mount`` mounts read-only
      under DEST (with squashfuse, as the user), so that code reading a directory tree reads it.
    """

    name: str
    module: str
    suffix: str
    what: str
    sample_kind: str = "encoded"
    writable: bool = True
    extents: tuple[str, ...] = ("bytes",)
    byte_ranges: bool = True
    fields: str | None = None
    named_keys: bool = False
    fragments: bool = False
    hashes_while_writing: bool = False
    stream_unpack: bool = False
    companion: str | None = None
    companion_line: bytes = b""
    adopt_suffixes: tuple[str, ...] = ()
    image_key: str | None = None
    label_key: str | None = None
    sniffs_layout: bool = False
    magic: bytes = b""
    compressions: tuple[str, ...] = ()
    mountable: bool = False

    def __post_init__(self) -> None:
        bad = [f"sample_kind {self.sample_kind!r}"] if self.sample_kind not in SAMPLE_KINDS else []
        bad += [f"extents {e!r}" for e in self.extents if e not in EXTENT_KINDS]
        if self.fields is not None and self.fields not in FIELD_LAYOUTS:
            bad.append(f"fields {self.fields!r}")
        if (self.companion is None) != (not self.companion_line):
            bad.append("companion without companion_line (or the reverse)")
        if bad or "bytes" not in self.extents or not self.suffix.startswith("."):
            raise ValueError(f"format {self.name!r}: bad registry entry ({', '.join(bad) or 'suffix or extents'})")

    @property
    def adopted(self) -> bool:
        """``stager index`` adopts files of this format in place."""
        return bool(self.adopt_suffixes)

    def companion_name(self, shard_name: str) -> str | None:
        """The file name of ``shard_name``'s companion index (see ``companion``), or None."""
        if self.companion is None:
            return None
        return self.companion.format(name=shard_name, stem=posixpath.splitext(shard_name)[0])


_REGISTRY: dict[str, FormatSpec] = {}


def _register(spec: FormatSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"format {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec


# The entries, in the order formats are listed to users.
_register(FormatSpec(
    "tar", "stager.formats.tar", ".tar", "tar", fields="span", named_keys=True, fragments=True,
    hashes_while_writing=True, stream_unpack=True, adopt_suffixes=(".tar",), label_key="cls"))
_register(FormatSpec("hdf5", "stager.formats.hdf5", ".h5", "HDF5", fields="separate", fragments=True))
_register(FormatSpec(
    "record", "stager.formats.record", ".tfrecord", "TFRecord", fields="span", hashes_while_writing=True,
    companion="{name}.idx", companion_line=b"%d %d\n", adopt_suffixes=(".tfrecord", ".tfrecords", ".record", ".tfr"),
    image_key="image/encoded", label_key="image/class/label"))
_register(FormatSpec(
    "zarr", "stager.formats.zarr", ".zarr.zip", "zarr", sample_kind="decoded", byte_ranges=False, fields="separate"))
_register(FormatSpec(
    "parquet", "stager.formats.parquet", ".parquet", "parquet", writable=False, extents=("bytes", "rows"),
    fields="separate", adopt_suffixes=(".parquet", ".pq"), image_key="image", label_key="label"))
_register(FormatSpec(
    "recordio", "stager.formats.recordio", ".rec", "MXNet RecordIO", writable=False, extents=("bytes", "records"),
    companion="{stem}.idx", companion_line=b"%d\t%d\n", adopt_suffixes=(".rec",), label_key="label"))
_register(FormatSpec(
    "lmdb", "stager.formats.lmdb", ".mdb", "LMDB", writable=False,
    adopt_suffixes=(".mdb", ".lmdb"),  # data.mdb of an environment directory, or a subdir=False file
    label_key="label", sniffs_layout=True))
_register(FormatSpec(
    "squashfs", "stager.formats.squashfs.shards", ".sqfs", "SquashFS", extents=("bytes", "inodes"), fields="separate",
    named_keys=True, adopt_suffixes=(".sqfs", ".squashfs", ".sqsh", ".sfs"), magic=b"hsqs", label_key="folder",
    compressions=("gzip", "none", "zstd", "xz", "lz4"), mountable=True))

FORMAT_SPECS: Mapping[str, FormatSpec] = MappingProxyType(_REGISTRY)
ALL_FORMATS = tuple(FORMAT_SPECS)  # every format a manifest may name
FORMAT_NAMES = tuple(n for n, s in FORMAT_SPECS.items() if s.writable)  # the formats `stager pack` writes
ADOPTED_FORMATS = tuple(n for n, s in FORMAT_SPECS.items() if s.adopted)  # `stager index` inputs
FIELD_FORMATS = tuple(n for n in FORMAT_NAMES if FORMAT_SPECS[n].fields)  # pack writes samples with fields to these
# Every --compression a writable format takes (stager pack checks it against the chosen format's entry).
COMPRESSIONS = tuple(dict.fromkeys(c for n in FORMAT_NAMES for c in FORMAT_SPECS[n].compressions))


def format_spec(name: str) -> FormatSpec:
    """The entry of format ``name``; a :class:`UsageError` naming the known formats otherwise."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise UsageError(f"unknown format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return spec

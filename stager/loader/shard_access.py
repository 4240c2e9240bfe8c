"""Where the bytes come from: a local directory, an fsspec URL, a staged node-local copy, a folder tree.

:func:`resolve` turns the user's ``path`` into a :class:`Resolved` (index + where to read + whether a
staged copy is used); :class:`ShardAccess` reads runs of samples from shard files (one ``pread`` per
run for local files; one retried ranged GET per run for URLs, :func:`stager.fs.remote.read_range`:
a response cut short is resumed at the offset reached), or, for local shard files of the encoded
formats, maps each shard once and hands out ``memoryview`` slices of the mapping
(:meth:`ShardAccess.mapping`: no copy out of the page cache at all). ``ShardAccess`` is created
inside each worker process (file descriptors and mappings are never shared across ``fork``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from stager.errors import ShardMissingError, SourceNotFoundError, UsageError, VerificationError
from stager.formats import get_format
from stager.fs.open import exists, filesystem, join, local_path_of
from stager.fs.remote import RemoteFile, read_range
from stager.fs.safe import open_regular
from stager.loader.dataset_index import DatasetIndex, index_from_folder, index_from_manifest
from stager.manifest import MANIFEST_NAME, load_manifest, shard_root
from stager.order.reads import MAX_OPEN_FILES, HeldFiles
from stager.receipt import Receipt, find_staged_copy
from stager.redact import redact

if TYPE_CHECKING:
    from stager.loader.cached import CachedShards
    from stager.manifest import Manifest

log = logging.getLogger("stager.loader")

_LOGGED: set[str] = set()  # "staged copy used" and each skipped candidate are logged once per process


def _warn_once(message: str) -> None:
    """A skipped staged-copy candidate (stager.receipt.find_staged_copy): one warning per process."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning("%s", message)
# Payloads separated by less than this many bytes (tar headers, record framing) share one read.
MAX_GAP = 64 << 10
# ...but one read stays below this size (a long sequential stretch, e.g. shuffle=False, is read in
# pieces): bigger reads gain nothing and cost fresh, page-faulted buffers.
MAX_SPAN = 4 << 20
FETCH_BLOCK = 8 << 20  # bytes per ranged GET when a remote zarr shard is fetched whole


def _local_of(p: str) -> str | None:
    """The local path of ``p`` if it is one (``file://`` URLs count as local), else None."""
    return local_path_of(p)


@dataclass
class Resolved:
    """The dataset to read and how: ``root`` is a local directory or an fsspec URL prefix.

    ``local_shards`` lists the shard indices this node may read (all of them unless the staged copy
    is a node partition); ``partition`` is the receipt's partition dict in that case. ``shard_paths``
    (reads through a shard cache, :mod:`stager.loader.cached`): the file of each shard, which need
    not be ``root/<name>``; ``cache``: that cache's directory.
    """

    index: DatasetIndex
    root: str
    source: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    staged: bool = False
    receipt: Receipt | None = None
    local_shards: np.ndarray | None = None
    partition: dict[str, int] | None = None
    shard_paths: list[str | None] | None = None
    cache: str | None = None

    @property
    def is_local(self) -> bool:
        return _local_of(self.root) is not None

    @property
    def staged_mode(self) -> str | None:
        """``"cache"`` when shards come through a shard cache, else the receipt's mode (or None)."""
        if self.cache is not None:
            return "cache"
        return self.receipt.mode if self.receipt is not None else None

    def shard_path(self, shard: int) -> str:
        if self.shard_paths is not None and self.shard_paths[shard] is not None:
            return str(self.shard_paths[shard])
        return self.root.rstrip("/") + "/" + self.index.shard_names[shard]


def _has_manifest(path: str, storage_options: dict[str, Any]) -> bool:
    if path.endswith(".json"):
        return True
    local = _local_of(path)
    if local is not None:
        return os.path.isfile(os.path.join(local, MANIFEST_NAME))
    return exists(join(path, MANIFEST_NAME), storage_options)


def resolve(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    staged: bool | str = "auto",
    staging_roots: tuple[str, ...] = (),
) -> Resolved:
    """Find the dataset behind ``path`` and, if it was staged, the node-local copy.

    ``staged``: ``"auto"`` (use a staged copy if a receipt with the same manifest digest exists under
    ``staging_roots``/$STAGER_DEST/$SLURM_TMPDIR/$TMPDIR), ``False`` (always read ``path``), or
    ``True`` (require one: :class:`ShardMissingError` otherwise).
    """
    so = dict(storage_options or {})
    p = os.fspath(path)
    local = _local_of(p)
    if local is not None and not os.path.exists(local):
        raise SourceNotFoundError(f"{p}: no such file or directory")
    if not _has_manifest(p, so):
        if local is not None:
            return Resolved(index_from_folder(local), local, p)
        fs, fp = filesystem(p, so)
        return Resolved(index_from_folder(fp, fs), p.rstrip("/"), p, so)
    m = load_manifest(p if local is None else local, so)
    index = index_from_manifest(m)
    root = shard_root(p if local is None else local, m)
    res = Resolved(index, root, p, so)
    if staged is False:
        return res
    found = find_staged_copy(m, staging_roots, warn=_warn_once)
    via: CachedShards | None = None
    if found is not None and found[1].cache is not None:
        from stager.loader.cached import through_receipt  # noqa: PLC0415 (only for a copy linked from a cache)

        via = through_receipt(m, root, found[0], found[1])
        if via is None:
            found = None  # its links cannot be trusted now: read SRC (or the reader's own cache)
    if found is None:
        via = _from_reader_caches(m, root) if local is not None else None
        if via is not None:
            res.root, res.staged, res.storage_options = via.cache, True, {}
            res.shard_paths, res.cache = via.paths, via.cache
            _log_once(m.dataset_id, via.cache, f"reading cached copy at {via.cache} instead of {redact(p)}")
            return res
        if staged is True:
            raise ShardMissingError(
                f"{p}: no staged copy found under $STAGER_DEST/$SLURM_TMPDIR/$TMPDIR; run `stager stage` first"
            )
        return res
    dest, rec = found
    res.root, res.staged, res.receipt, res.storage_options = str(dest), True, rec, {}
    if via is not None:
        res.shard_paths, res.cache = via.paths, via.cache
    if rec.mode == "partition":
        part = rec.partition or {}
        names = {n: i for i, n in enumerate(index.shard_names)}
        res.local_shards = np.array(sorted(names[n] for n in rec.shards if n in names), dtype=np.int64)
        res.partition = {k: int(v) for k, v in part.items()}
    what = (
        f"node partition {res.partition.get('node')}/{res.partition.get('num_nodes')} "
        f"({len(rec.shards)} of {index.num_shards} shards)"
        if res.partition is not None
        else "full copy"
    )
    through = f" (linked from the cache {res.cache})" if res.cache else ""
    _log_once(m.dataset_id, str(dest), f"reading staged {what} at {dest}{through} instead of {redact(p)}")
    return res


def _from_reader_caches(m: Manifest, root: str) -> CachedShards | None:
    """The dataset from a cache of ``$STAGER_CACHE`` or the site's, when one is configured and holds it."""
    from stager.cache.config import reader_caches  # noqa: PLC0415 (the loader loads the cache only when one is set)

    if not reader_caches():
        return None
    from stager.loader.cached import in_caches  # noqa: PLC0415 (as above)

    return in_caches(m, root)


def _log_once(dataset_id: str, where: str, message: str) -> None:
    key = f"{dataset_id}:{where}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("stager.loader: %s", message)


def check_shards(res: Resolved, shards: np.ndarray) -> None:
    """Fail before iteration if a needed local shard is missing or has the wrong size.

    Only local files are checked (a ``stat`` each); remote URLs are checked when read.
    """
    local = _local_of(res.root)
    if local is None or res.index.format == "folder":
        return
    for s in shards.tolist():
        path = res.shard_path(s)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ShardMissingError(
                f"{path}: shard listed in the manifest is missing; restore it, re-stage, or re-run `stager pack`"
            ) from None
        want = int(res.index.shard_bytes[s])
        if want >= 0 and size != want:
            raise VerificationError(
                f"{path}: shard is {size} bytes, manifest says {want} (truncated or replaced); "
                "run `stager verify` and re-stage or re-pack it"
            )


class _Mapped(NamedTuple):
    """A mapped shard file: the mapping (None for an empty file) and a read-only view of all of it."""

    mm: mmap.mmap | None
    view: memoryview


class ShardAccess:
    """Reads payloads of runs of samples; one per process (created lazily in each worker).

    ``read(shard, positions)`` returns ``(payloads, nbytes)``: payloads are ``memoryview`` slices of
    one buffer per coalesced span (encoded formats) or ``(H, W, C)`` arrays (zarr), in the order of
    ``positions`` (in-shard positions, ascending within a run).

    ``mapped`` (local shard files of an encoded format, ``use_mmap``): :meth:`mapping` returns the
    whole shard as a read-only ``memoryview`` of one ``mmap``, and payloads are slices of it. The
    shard's size is checked against the manifest's extents when it is mapped; a file truncated *in
    place* after that would fault (SIGBUS) on access, which is why stager only ever replaces files
    by rename.

    File handles (descriptors, mappings, zarr readers) follow the schedule's open-file rule
    (:class:`stager.order.reads.HeldFiles`): the :data:`MAX_OPEN_FILES` most recently read shards
    stay open, the least recently read one is closed first. A mapping dropped from the set is
    unmapped when the last slice of it dies (slices handed to the user stay valid).
    """

    def __init__(self, res: Resolved, *, use_mmap: bool = True) -> None:
        self.res = res
        self.index = res.index
        self._local = _local_of(res.root)
        # Rows of compressed parquet pages and split RecordIO records are no byte ranges of a payload:
        # such shards go through the format reader.
        self._rows = res.index.manifest is not None and any(s.extents != "bytes" for s in res.index.manifest.shards)
        self.mapped = bool(
            use_mmap and self._local is not None and res.index.kind == "encoded" and res.index.format != "folder"
            and not self._rows
        )
        self._held = HeldFiles(MAX_OPEN_FILES)
        self._handles: dict[int, Any] = {}  # shard -> fd | _Mapped | zarr reader, for the shards held
        self._tmp: dict[int, str] = {}
        self._fs: Any = None
        self._pid = os.getpid()

    # ---- handles ------------------------------------------------------------------------------
    def _handle(self, shard: int, open_handle: Callable[[int], Any]) -> Any:
        """``shard``'s open handle, opened by ``open_handle`` unless held (records the read in the set)."""
        got = self._handles.get(shard)
        if got is not None:
            self._held.read(shard)
            return got
        handle = open_handle(shard)  # may raise: then nothing is held
        _opens, closed = self._held.read(shard)
        self._handles[shard] = handle
        if closed is not None:
            _close_handle(self._handles.pop(closed))
        return handle

    def _path(self, shard: int) -> str:
        assert self._local is not None
        if self.res.shard_paths is not None and self.res.shard_paths[shard] is not None:
            return str(self.res.shard_paths[shard])
        return os.path.join(self._local, self.index.shard_names[shard])

    def _open_fd(self, shard: int) -> int:
        path = self._path(shard)
        try:
            return open_regular(path)  # a FIFO or a device in a shard's place never blocks a worker
        except FileNotFoundError:
            raise ShardMissingError(f"{path}: shard missing; re-stage the dataset or re-run `stager pack`") from None

    def _map(self, shard: int) -> _Mapped:
        path = self._path(shard)
        a, b = int(self.index.starts[shard]), int(self.index.starts[shard + 1])
        need = int((self.index.offsets[a:b] + self.index.sizes[a:b]).max()) if b > a else 0
        fd = self._open_fd(shard)
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise VerificationError(
                    f"{path}: shard is {size} bytes but its samples extend to byte {need} (truncated); "
                    "run `stager verify` and re-stage or re-pack it"
                )
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        return _Mapped(mm, memoryview(mm) if mm is not None else memoryview(b""))

    def mapping(self, shard: int) -> memoryview:
        """The whole shard file as a read-only ``memoryview`` (mapped once while held)."""
        return self._handle(shard, self._map).view

    def advise(self, shard: int, start: int, end: int) -> None:
        """Ask the kernel to read ``[start, end)`` of a mapped shard ahead (``MADV_WILLNEED``).

        Issued in stream order, one call per run, so a cold shard is read in runs, ahead of the
        page faults of the samples' consumers, like the ``pread`` path reads it.
        """
        got = self._handles.get(shard)
        mm = got.mm if isinstance(got, _Mapped) else None
        if mm is None or end <= start:
            return
        lo = start - start % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_WILLNEED, lo, min(end, len(mm)) - lo)

    def _filesystem(self) -> Any:
        if self._fs is None:
            self._fs, self._fs_root = filesystem(self.res.root, self.res.storage_options)
        return self._fs

    def _remote_path(self, shard: int) -> str:
        self._filesystem()
        return str(self._fs_root).rstrip("/") + "/" + self.index.shard_names[shard]

    def _extents(self, shard: int) -> str:
        m = self.index.manifest
        return m.shards[shard].extents if m is not None else "bytes"

    def _zarr_reader(self, shard: int) -> Any:
        """The format reader of a shard read by rows (zarr; compressed parquet pages)."""
        return self._handle(shard, self._open_zarr)

    def _open_zarr(self, shard: int) -> Any:
        if self._local is not None:
            path = self._path(shard)
        else:
            # zarr's ZipStore (and pyarrow here) need a local file: remote shards read by rows are
            # fetched whole, once per process, into a temporary file (documented in docs/loader.md).
            path = self._tmp.get(shard) or self._fetch_whole(shard)
        m = self.index.manifest
        assert m is not None
        return get_format(m.format).open_reader(path, m.shards[shard], m)

    def _fetch_whole(self, shard: int) -> str:
        fs = self._filesystem()
        fd, tmp = tempfile.mkstemp(prefix="stager-zarr-", suffix=".zip")
        with os.fdopen(fd, "wb") as f, RemoteFile(fs, self._remote_path(shard), self.res.shard_path(shard)) as src:
            while chunk := src.read(FETCH_BLOCK):
                f.write(chunk)
        self._tmp[shard] = tmp
        return tmp

    # ---- reads --------------------------------------------------------------------------------
    def read(self, shard: int, positions: np.ndarray) -> tuple[list[Any], int]:
        self.check_pid()
        base = int(self.index.starts[shard])
        gids = positions + base
        if self.index.kind == "decoded" or (self._rows and self._extents(shard) != "bytes"):
            arrays = self._zarr_reader(shard).read(positions)
            return arrays, int(self.index.sizes[gids].sum())
        offs = self.index.offsets[gids]
        sizes = self.index.sizes[gids]
        out: list[Any] = [None] * len(gids)
        nbytes = 0
        i, n = 0, len(gids)
        while i < n:
            # Coalesce ascending, nearby payloads into one span: one pread / one ranged GET.
            j, start, end = i + 1, int(offs[i]), int(offs[i] + sizes[i])
            while j < n and 0 <= int(offs[j]) - end <= MAX_GAP and int(offs[j] + sizes[j]) - start <= MAX_SPAN:
                end = int(offs[j] + sizes[j])
                j += 1
            buf = self._read_span(shard, start, end)
            nbytes += len(buf)
            view = memoryview(buf)
            for k in range(i, j):
                o = int(offs[k]) - start
                out[k] = view[o : o + int(sizes[k])]
            i = j
        return out, nbytes

    def read_extent(self, shard: int, start: int, size: int) -> bytes:
        """The ``size`` bytes at ``start`` of ``shard`` (a field's bytes outside its sample's payload:
        hdf5 and parquet keep each field in its own dataset or column, :mod:`stager.loader.fields`)."""
        if self.mapped:
            return bytes(self.mapping(shard)[start : start + size])
        held = self._handles.get(shard)
        if self._local is not None and held is not None and not isinstance(held, int):
            # The shard is held as a format reader (compressed parquet image pages, read by rows):
            # the field's bytes, stored uncompressed, are one pread on a descriptor of their own.
            fd = self._open_fd(shard)
            try:
                buf = os.pread(fd, size, start)
            finally:
                os.close(fd)
            if len(buf) != size:
                raise VerificationError(f"{self._path(shard)}: short read ({len(buf)} of {size} bytes at offset "
                                        f"{start}); the shard is truncated: run `stager verify`")
            return buf
        return self._read_span(shard, start, start + size)

    def read_field(self, shard: int, spec: Any, start: int, size: int) -> Any:
        """A byte field of a sample by its manifest extent: bytes (:meth:`read_extent`), or for zarr
        the decoded row of a mask or image field / the bytes of another (its format reader)."""
        if self.index.kind == "decoded":
            return self._zarr_reader(shard).read_field(spec.kind, spec.name, start, size)
        return self.read_extent(shard, start, size)

    def check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: inherited descriptors are not ours to use
            self._handles.clear()
            self._held.clear()
            self._fs = None
            self._pid = os.getpid()

    def _read_span(self, shard: int, start: int, end: int) -> bytes:
        if self._local is not None:
            buf = os.pread(self._handle(shard, self._open_fd), end - start, start)
        else:
            # A retried ranged GET: a response cut short is resumed at the offset reached (stager.fs.remote).
            buf = read_range(self._filesystem(), self._remote_path(shard), start, end, self.res.shard_path(shard))
        if len(buf) != end - start:
            where = self.res.shard_path(shard)
            raise VerificationError(
                f"{where}: short read ({len(buf)} of {end - start} bytes at offset {start}); "
                "the shard is truncated: run `stager verify` and re-stage or re-pack it"
            )
        return buf

    def close(self) -> None:
        if os is None or sys.meta_path is None:
            # A generator finalised at interpreter exit (an unfinished iterator without workers):
            # module globals are already gone, and the OS releases the files and mappings anyway.
            return
        if self._pid == os.getpid():
            for h in self._handles.values():
                _close_handle(h)  # a mapping is unmapped when the last payload slice handed out dies
        for tmp in self._tmp.values():
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._handles.clear()
        self._held.clear()
        self._tmp.clear()


def _close_handle(handle: Any) -> None:
    """Close a held shard handle: a descriptor, a zarr reader; a mapping goes with its last view."""
    if isinstance(handle, int):
        os.close(handle)
    elif not isinstance(handle, _Mapped):
        handle.close()


def validate_partition(res: Resolved, rank: int, world_size: int) -> tuple[int, int, int]:
    """For a node-partitioned staged copy: ``(node, ranks_per_node, rank within node)``.

    Ranks are laid out node-major (ranks ``node*rpn .. node*rpn+rpn-1`` on node ``node``), as torchrun
    and Slurm's block distribution do. A rank that is not on the receipt's node would read shards
    this node does not hold, so it is refused.
    """
    part = res.partition or {}
    try:
        node, num_nodes, rpn = int(part["node"]), int(part["num_nodes"]), int(part["ranks_per_node"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{res.root}: partitioned receipt lacks node/num_nodes/ranks_per_node ({exc})") from exc
    if num_nodes * rpn != world_size:
        raise UsageError(
            f"{res.root}: staged as {num_nodes} nodes x {rpn} ranks, but the job has world size {world_size}; "
            "re-stage with matching --num-nodes/--ranks-per-node or pass staged=False"
        )
    if rank // rpn != node:
        raise UsageError(
            f"{res.root}: rank {rank} belongs to node {rank // rpn} (node-major layout) but this copy holds "
            f"node {node}'s shards; check the launcher's rank layout or pass staged=False"
        )
    return node, rpn, rank % rpn

"""``stage --unpack``: write shards' samples as an ImageFolder tree, safely and fast.

:func:`run_unpack` is the stage phase: it unpacks this node's shards of a
:class:`~stager.stage.plan.StagePlan` with a thread pool, journals each shard once its files are on
disk and returns :class:`UnpackCounts`. Below it, :class:`Unpacker` writes one shard's samples,
:func:`walk_tar` and :class:`ChunkReader` stream a tar shard, and :class:`SyncfsBatcher` makes the
files durable in the background. ``stager clean`` uses :func:`class_dir_name` and
:func:`unpacked_stem` to find what was written.

Layout: ``ROOT/<class>/<stem>.<ext>`` where ``<class>`` is ``manifest.classes[label]``
(``_unlabeled`` for label -1) and ``<stem>`` is the key without a leading ``<class>/``, its other
``/`` turned into ``_`` (:func:`unpacked_stem`): an ImageFolder pack unpacks to its original file
names, a CIFAR pack's ``data_batch_1/00006`` to ``data_batch_1_00006``. Tar shards are streamed
through one reused buffer (:class:`ChunkReader`) and walked header by header (:func:`walk_tar`, the
same checks as :func:`stager.formats.ustar.iter_members`: checksum, size against the shard, type: links, devices and
FIFOs are refused, as are absolute and ``..`` names); each image member is matched to its manifest
entry by data offset and must have exactly the manifest's size, checked before its data is read.
Other formats go through their readers' ``iter_samples``.

Safety: output names come from the manifest (class names and file stems must be plain file
names), class directories are created by us and must not be symlinks, and files are created
exclusively relative to the class directory's handle (:func:`stager.fs.safe.create_exclusive`:
``openat(class dir fd, basename, O_CREAT|O_EXCL|O_NOFOLLOW)``): a basename has no ``/``, so nothing
is resolved outside the directory we opened. Two samples that map to the same file are refused
instead of silently overwriting each other. A tar shard streamed from SRC is hashed as it is read
and compared with the manifest by the verified copy's one check (:func:`stager.fs.verified.check`).

Speed (measured in docs/bench/stage.md, tools/bench/bench_stage.py ``--unpack-only``): per file one
``openat``/``write``/``close`` and no allocation or copy of its bytes in Python (``os.write`` of a
memoryview into the read buffer; one ``read`` per 1 MiB, a size that stays in the CPU cache
between the read, the hash and the write); the group comes from a setgid class
directory instead of a ``fchown`` per file. Durability: no per-file fsync; a write-behind thread
calls ``syncfs`` on DEST every :data:`WRITE_BEHIND_BYTES` written, so the disk works while we
extract and the final ``syncfs`` (before the receipt) waits only for the tail. A shard is recorded
as unpacked in the journal only after a ``syncfs`` that began after its last file was written.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from stager.checksum import Hasher, new_hasher
from stager.errors import CorruptSampleError, UnsafeArchiveError, VerificationError
from stager.formats import format_spec, get_format
from stager.formats.base import Sample, image_ext
from stager.formats.ustar import (  # one tar header parser for pack, verify and unpack
    BLOCK,
    padded_size,
    walk_headers,
)
from stager.fs.access import chgrp_quiet, copy_mode, current_umask
from stager.fs.atomic import space_error
from stager.fs.kernel import syncfs
from stager.fs.safe import SafeDir, create_exclusive
from stager.fs.verified import Expected, PartialCopy, check
from stager.manifest import UNLABELED, Manifest, ShardInfo, check_entry_name, class_dir_name, unpacked_stem
from stager.progress import Progress
from stager.stage.copier import SRC_FIX, Throttle, group_warning, open_src_file

if TYPE_CHECKING:
    from stager.stage.journal import Journal
    from stager.stage.plan import StagePlan

WRITE_BEHIND_BYTES = 32 << 20
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
T = TypeVar("T")


class ChunkReader:
    """Forward-only reader of a byte stream through one reused buffer.

    ``take(n)`` returns a memoryview of the next ``n`` bytes (shorter at EOF), valid until the next
    call: no copy, no allocation per call. Every byte read is fed once to ``hasher.update`` (if
    any); ``skip`` and ``drain`` read (and hash) what they pass over. ``nbytes`` counts bytes
    consumed. The buffer grows only for a request larger than it.
    """

    def __init__(self, raw: Any, hasher: Hasher | None = None, size: int = 1 << 20) -> None:
        self._raw = raw
        self._readinto = getattr(raw, "readinto", None)
        self._h = hasher
        self._buf = bytearray(size)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0
        self._eof = False
        self.nbytes = 0

    def _fill(self, n: int) -> None:
        """Make at least ``n`` bytes available from ``_start`` (fewer at EOF)."""
        have = self._end - self._start
        if n > len(self._buf):
            buf = bytearray(max(n, 2 * len(self._buf)))
            buf[:have] = self._mv[self._start:self._end]
            self._buf, self._mv = buf, memoryview(buf)
        elif self._start + n > len(self._buf):
            self._mv[:have] = self._mv[self._start:self._end]  # memmove of the unread tail
        else:
            have = -1
        if have >= 0:
            self._start, self._end = 0, have
        while self._end - self._start < n and not self._eof:
            room = self._mv[self._end:]
            if self._readinto is not None:
                got = self._readinto(room) or 0
            else:
                data = self._raw.read(len(room))
                got = len(data)
                room[:got] = data
            if got == 0:
                self._eof = True
                break
            if self._h is not None:
                self._h.update(room[:got])
            self._end += got

    def take(self, n: int) -> memoryview:
        if self._end - self._start < n:
            self._fill(n)
        s = self._start
        e = min(s + n, self._end)
        self._start = e
        self.nbytes += e - s
        return self._mv[s:e]

    def skip(self, n: int) -> int:
        """Pass over ``n`` bytes; return how many there were."""
        done = 0
        while done < n:
            got = len(self.take(min(n - done, len(self._buf))))
            if not got:
                break
            done += got
        return done

    def drain(self) -> None:
        while self.skip(len(self._buf)):
            pass


def walk_tar(r: ChunkReader, file_size: int, where: str, sizes: dict[int, int]
             ) -> Iterator[tuple[str, int, memoryview]]:
    """Yield ``(name, data offset, data)`` for the members whose data offset is a key of ``sizes``.

    Headers are checked by the same parser as :func:`stager.formats.ustar.iter_members`
    (:func:`~stager.formats.ustar.walk_headers`); other regular members (``.cls``/``.json``
    companions) are skipped after their name is checked. A listed member whose size is not
    ``sizes[offset]`` is refused before its data is read. ``data`` is a view into ``r``'s buffer,
    valid until the next iteration.
    """
    for name, start, size in walk_headers(r.take, r.skip, file_size, where):
        padded = padded_size(size)
        want = sizes.get(start)
        if want is None:
            if r.skip(padded) < size:
                raise CorruptSampleError(f"{where}: truncated member {name!r} at byte {start - BLOCK}")
        elif size != want:
            raise UnsafeArchiveError(
                f"{where}: member {name!r} is {size} bytes but the manifest says {want}; refusing"
            )
        else:
            data = r.take(padded)
            if len(data) < size:
                raise CorruptSampleError(f"{where}: truncated member {name!r} at byte {start - BLOCK}")
            yield name, start, data[:size]


class SyncfsBatcher:
    """Makes unpacked files durable in the background, and only then journals their shards.

    Writers call :meth:`wrote` with the bytes of each file and :meth:`shard_done` with a finished
    shard's name (or :meth:`when_durable` with any record to make once what was written so far is on
    disk: a shard file copied while unpacked). A thread calls ``syncfs`` on ``path`` whenever
    :data:`WRITE_BEHIND_BYTES` more were written, so write-back overlaps the extraction; after each
    ``syncfs`` it passes the shards finished before that ``syncfs`` began to ``on_durable`` (the
    journal) and runs the records handed over before it began. :meth:`finish` does the last
    ``syncfs`` and journals the rest: once it returns, every file written is on disk.
    ``sync=False`` (``--no-fsync``): no ``syncfs`` at all; shards are journaled as they finish.
    """

    def __init__(self, path: str | os.PathLike[str], on_durable: Callable[[str], None],
                 every: int | None = None, *, sync: bool = True) -> None:
        self.path = path
        self.sync = sync
        self._on_durable = on_durable
        self._every = every or WRITE_BEHIND_BYTES
        self._pending = 0  # bytes since the last kick; an int += under the GIL, read racily: a hint
        self._done: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stager-unpack-writebehind", daemon=True)
        self._thread.start()

    def wrote(self, nbytes: int) -> None:
        if not self.sync:
            return
        self._pending += nbytes
        if self._pending >= self._every:
            self._pending = 0
            self._kick.set()

    def shard_done(self, name: str) -> None:
        self.when_durable(lambda: self._on_durable(name))

    def when_durable(self, record: Callable[[], None]) -> None:
        """Run ``record`` after the next ``syncfs`` (at once with ``sync=False``: ``--no-fsync``, where
        the journal itself is marked volatile)."""
        if not self.sync:
            record()
            return
        with self._lock:
            self._done.append(record)

    def _sync_and_journal(self) -> None:
        with self._lock:
            ready, self._done = self._done, []
        syncfs(self.path)
        for record in ready:
            record()

    def _run(self) -> None:
        try:
            while True:
                self._kick.wait()
                self._kick.clear()
                if self._stop:
                    return
                self._sync_and_journal()
        except BaseException as exc:  # surfaced by finish()
            self._error = exc

    def finish(self, *, durable: bool = True) -> None:
        """Stop the thread; with ``durable``, ``syncfs`` once more and journal every finished shard."""
        self._stop = True
        self._kick.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        if durable and self.sync:
            self._sync_and_journal()


class Unpacker:
    """Writes samples under ``root`` (created if needed). Thread-safe across shards.

    ``file_mode``/``dir_mode`` are applied to what it creates (``file_mode`` through the ``open``
    mode, so the umask applies as it does for ``tar``); ``gid`` (or None) is the group: class
    directories get it with the setgid bit, so files inherit it with no ``fchown`` (checked on
    the first file of each directory; ``fchown`` per file where a file system does not inherit).
    ``files``/``bytes`` count what was written; ``on_write(nbytes)`` is called per file.
    """

    def __init__(self, root: str | os.PathLike[str], manifest: Manifest, *, file_mode: int = 0o644,
                 dir_mode: int = 0o755, gid: int | None = None,
                 on_write: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.gid = gid if gid is not None and gid != os.getegid() else None
        self.on_write = on_write
        self.chunk_size = 1 << 20  # read buffer of unpack_tar: stays in the CPU cache from read to write
        self.root.parent.mkdir(parents=True, exist_ok=True)
        # Created with dir_mode less the umask, or an existing one of the user's (never a link, never
        # another user's, never writable by others: stager.fs.safe); its handle is what we work under.
        self._root, created = SafeDir.create(self.root, dir_mode, what="unpack directory",
                                             fix="remove it (stage writes it anew) and rerun")
        if created:
            chgrp_quiet(self.root, gid)
        self._root_fd = self._root.fd
        # label -> (class dir fd, class dir path, group state: 0 inherits/none needed, 1 check first file, 2 fchown)
        self._dirs: dict[int, tuple[int, str, int]] = {}
        self._targets: dict[tuple[int, str], tuple[str, str]] = {}
        self._lock = threading.Lock()
        self.files = 0
        self.bytes = 0

    def close(self) -> None:
        for fd, _, _ in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        self._root.close()

    # ---- paths -----------------------------------------------------------------------------------
    def _class_dir(self, label: int, where: str) -> tuple[int, str, int]:
        d = self._dirs.get(label)
        if d is not None:
            return d
        with self._lock:
            d = self._dirs.get(label)
            if d is not None:
                return d
            classes = self.manifest.classes
            if label == -1 or not classes:
                name = UNLABELED
            elif 0 <= label < len(classes):
                name = check_entry_name(classes[label], f"class name (in {where})")
            else:
                raise UnsafeArchiveError(f"{where}: label {label} has no class name; refusing")
            path = os.path.join(self.root, name)
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, self.dir_mode, dir_fd=self._root_fd)
                if self.gid is not None:
                    with contextlib.suppress(PermissionError):
                        os.chown(name, -1, self.gid, dir_fd=self._root_fd, follow_symlinks=False)
            try:  # O_NOFOLLOW|O_DIRECTORY: a symlink or a file planted under the class name is refused
                fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=self._root_fd)
            except (NotADirectoryError, OSError) as exc:
                raise UnsafeArchiveError(
                    f"{path}: not a plain directory under {self.root}; refusing to unpack into it"
                ) from exc
            group = 0
            if self.gid is not None:
                st = os.fstat(fd)
                if st.st_gid == self.gid:
                    with contextlib.suppress(PermissionError):
                        os.fchmod(fd, stat.S_IMODE(st.st_mode) | stat.S_ISGID)
                    group = 1  # inherited if the file system honours setgid directories: see the first file
                else:
                    group = 2  # chgrp refused (EPERM) or an existing directory: fchown each file (may fail too)
            d = self._dirs[label] = (fd, path, group)
            return d

    def _place(self, info: ShardInfo, index: int, ext: str) -> tuple[int, str]:
        """``(label, basename)`` of sample ``index`` of shard ``info``: refuses unsafe basenames and
        two samples mapping to one file; creates the class directory on first use."""
        key = info.keys[index]
        label = int(info.labels[index])
        stem = unpacked_stem(key, class_dir_name(self.manifest.classes, label))
        base = check_entry_name(stem + (f".{ext}" if ext else ""), f"sample file name (key {key!r})")
        if label not in self._dirs:
            self._class_dir(label, info.name)
        prev = self._targets.setdefault((label, base), (info.name, key))  # atomic: no Python __eq__
        if prev != (info.name, key):
            raise UnsafeArchiveError(
                f"{info.name}: sample {key!r} and {prev[0]}:{prev[1]!r} both unpack to "
                f"{os.path.join(self._dirs[label][1], base)}; keys must map to distinct file names per class"
            )
        return label, base

    def target(self, info: ShardInfo, index: int, ext: str) -> str:
        """The output path of sample ``index`` of shard ``info`` with file extension ``ext``."""
        label, base = self._place(info, index, ext)
        return os.path.join(self._dirs[label][1], base)

    def write_file(self, label: int, base: str, data: bytes | memoryview) -> int:
        """Create ``<class dir of label>/base`` holding ``data`` (never through an existing file);
        return the class directory's fd (for :meth:`_remove`)."""
        dfd, dirpath, group = self._dirs[label]
        try:
            fd = create_exclusive(base, self.file_mode, dir_fd=dfd)
        except FileExistsError:
            # A rerun after a crash: replace (never write through) whatever is there, even a symlink.
            os.unlink(base, dir_fd=dfd)
            fd = create_exclusive(base, self.file_mode, dir_fd=dfd)
        try:
            if group:
                self._group(fd, label, group)
            n = os.write(fd, data)
            if n < len(data):
                view = memoryview(data)[n:]
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        except OSError as exc:
            # Never leave a short file under its final name; a full disk is exit 4, not a traceback.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base, dir_fd=dfd)
            err = space_error(exc, os.path.join(dirpath, base))
            if err is not None:
                raise err from exc
            raise
        finally:
            os.close(fd)
        if self.on_write is not None:
            self.on_write(len(data))
        return dfd

    def _group(self, fd: int, label: int, group: int) -> None:
        gid = self.gid
        assert gid is not None
        if group == 1:  # first file in a setgid directory: did it inherit the group?
            dfd, dirpath, _ = self._dirs[label]
            group = 0 if os.fstat(fd).st_gid == gid else 2
            self._dirs[label] = (dfd, dirpath, group)
        if group == 2:
            with contextlib.suppress(PermissionError):
                os.fchown(fd, -1, gid)

    def _count(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.files += files
            self.bytes += nbytes

    # ---- formats ---------------------------------------------------------------------------------
    def unpack_tar(self, stream: Any, info: ShardInfo, hasher: Hasher | None = None,
                   on_progress: Callable[[int, int], None] | None = None, *, context: str = " while unpacking",
                   fix: str = "the source shard is damaged: restore it or re-pack (no file of it kept)") -> int:
        """Stream one tar shard from ``stream`` (a binary file, ideally unbuffered: it is read in
        1 MiB ``readinto`` calls) and write its image members; return files written.

        With ``hasher`` the whole stream is hashed and compared with ``info.hash`` (VerificationError on
        mismatch, saying ``context`` and ``fix``, after removing this shard's files). ``on_progress(files,
        bytes)`` is called every 64 files and at the end.
        """
        offsets = info.offsets.tolist()
        sizes = dict(zip(offsets, info.sizes.tolist(), strict=True))
        index = {o: i for i, o in enumerate(offsets)}
        keys = info.keys
        reader = ChunkReader(stream, hasher, self.chunk_size)
        written: list[tuple[int, str]] = []
        got = bytearray(info.samples)
        nbytes = step_bytes = 0
        try:
            for name, offset, data in walk_tar(reader, info.bytes, info.name, sizes):
                i = index[offset]  # offsets strictly increase, so each entry is met at most once
                # `<key>.<field>`; a key may hold dots where an index adopted real webdataset tars.
                key = keys[i]
                ext = name[len(key) + 1 :]
                if not (name.startswith(key) and name[len(key) : len(key) + 1] == "." and ext):
                    raise UnsafeArchiveError(
                        f"{info.name}: member {name!r} at offset {offset} does not match manifest key "
                        f"{keys[i]!r}; refusing"
                    )
                label, base = self._place(info, i, ext)
                written.append((self.write_file(label, base, data), base))
                got[i] = 1
                nbytes += len(data)
                if on_progress is not None and len(written) % 64 == 0:
                    on_progress(64, nbytes - step_bytes)
                    step_bytes = nbytes
            reader.drain()
            if len(written) != info.samples:
                missing = keys[got.index(0)]
                raise VerificationError(
                    f"{info.name}: {info.samples - len(written)} samples of the manifest are not in the tar "
                    f"(first: {missing!r}); re-pack this dataset"
                )
            if hasher is not None:
                check(Expected(info.name, info.bytes, info.hash, self.manifest.hash_algo), reader.nbytes,
                      hasher.hexdigest(), context=context, fix=fix)
        except CorruptSampleError as exc:
            # A damaged container is a verification failure of the shard (exit 3), like a bad hash.
            self._remove(written)
            raise VerificationError(str(exc)) from exc
        except BaseException:
            self._remove(written)
            raise
        if on_progress is not None and len(written) % 64:
            on_progress(len(written) % 64, nbytes - step_bytes)
        self._count(len(written), nbytes)
        return len(written)

    @staticmethod
    def _remove(paths: list[tuple[int, str]]) -> None:
        for dfd, base in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base, dir_fd=dfd)

    def unpack_samples(self, samples: Iterable[Sample], info: ShardInfo) -> int:
        """Write samples from a format reader's ``iter_samples()`` (encoded bytes or decoded arrays)."""

        index = {k: i for i, k in enumerate(info.keys)}
        n = nbytes = 0
        for s in samples:
            i = index.get(s.key)
            if i is None:
                raise UnsafeArchiveError(f"{info.name}: sample {s.key!r} is not in the manifest; refusing")
            data = s.data
            ext = s.ext
            if isinstance(data, np.ndarray):
                data, ext = _png(data), "png"
            label, base = self._place(info, i, ext)
            self.write_file(label, base, data)
            n += 1
            nbytes += len(data)
        self._count(n, nbytes)
        return n


def _png(arr: Any) -> bytes:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr).save(buf, format="PNG",
                                                                                           compress_level=1)
    return buf.getvalue()


@dataclass(frozen=True)
class UnpackCounts:
    """What :func:`run_unpack` did: ``files`` written, and ``streamed_bytes`` read from SRC for them
    (``--unpack only`` streams tar shards from SRC instead of copying them first; 0 otherwise);
    ``copied_files``/``copied_bytes``: shard files copied into DEST while they were unpacked (``keep``);
    ``warnings`` for the run's result."""

    files: int
    streamed_bytes: int
    copied_files: int = 0
    copied_bytes: int = 0
    warnings: tuple[str, ...] = ()


def shards_to_unpack(plan: StagePlan, journal: Journal) -> list[ShardInfo]:
    """This node's shards that :func:`run_unpack` unpacks: all of them when the tree is missing, else
    those the journal does not list as unpacked."""
    m = plan.manifest
    fresh = not (plan.dest / plan.unpack_dir).is_dir()
    return [m.shards[i] for i in plan.shard_indices if fresh or m.shards[i].name not in journal.unpacked]


def run_unpack(plan: StagePlan, journal: Journal, *, workers: int, quiet: bool, fsync: bool = True,
               keep: Collection[str] = ()) -> UnpackCounts:
    """Unpack this node's shards of ``plan`` into ``DEST/<plan.unpack_dir>`` with ``workers`` threads;
    shards the journal lists as unpacked are skipped (unless the tree is gone: :func:`shards_to_unpack`).

    Tar shards are read from DEST, or streamed (and hashed) from SRC with ``--unpack only``, or, for
    the shard files named in ``keep`` (``--unpack``: not in DEST yet), streamed from SRC once for both:
    each byte read is written to the shard's verified copy (:class:`~stager.fs.verified.PartialCopy`,
    compared with the manifest at the end, published with the source file's access like the copy
    streams' copies, then journaled) and its image members are written out as they pass. Other
    formats are read through their readers from the verified copy in DEST. Files get SRC's access
    (:attr:`~stager.stage.plan.StagePlan.src_access`), directories the matching ``x`` bits. On return
    every file written is durable (``syncfs``) and its shard is journaled; with ``fsync=False``
    (``--no-fsync``) nothing is synced and shards are journaled as they finish (the journal is then
    volatile: ignored after a reboot). On failure the shards finished so far are still made durable
    and journaled, so a rerun skips them.
    """
    m = plan.manifest
    root = plan.dest / plan.unpack_dir
    # The source's group and at most its permissions (a licensed dataset stays group-only); dirs get x
    # wherever files get r.
    mode, gid = plan.src_access
    dir_mode = mode | 0o100 | (0o010 if mode & 0o040 else 0) | (0o001 if mode & 0o004 else 0)
    shards = shards_to_unpack(plan, journal)
    progress = Progress("unpack", total_items=sum(s.samples for s in shards), unit="files", quiet=quiet)
    unpacker = Unpacker(root, m, file_mode=mode, dir_mode=dir_mode, gid=gid)
    batcher = SyncfsBatcher(root, journal.add_unpacked, sync=fsync)
    unpacker.on_write = batcher.wrote
    job = _ShardUnpacking(plan, unpacker, batcher, progress, keep=_Kept(set(keep), journal, batcher))
    try:
        each_in_threads(shards, job.unpack_shard, workers)
    except BaseException:
        # Shards finished before the failure are made durable and journaled, so a rerun skips them.
        with contextlib.suppress(Exception):
            batcher.finish()
        raise
    finally:
        progress.close()
        unpacker.close()
    batcher.finish()
    kept = job.keep
    return UnpackCounts(files=unpacker.files, streamed_bytes=job.streamed_bytes, copied_files=kept.files,
                        copied_bytes=kept.bytes, warnings=tuple(kept.warnings))


def each_in_threads(items: Sequence[T], fn: Callable[[T], object], threads: int) -> None:
    """``fn(item)`` for each of ``items``, taken in order by up to ``threads`` threads. A failure stops
    the items not started yet; once every started call has returned, the failure of the first item (in
    ``items``' order) is re-raised. An exception in the calling thread (Ctrl-C, SIGTERM: :mod:`stager.cli.signals`)
    stops them the same way and is re-raised after the started calls return.

    Threads and a lock rather than ``concurrent.futures``: its import (with ``logging``, whose exit
    hook keeps ``stager stage`` from leaving early: :func:`stager.cli.entry`) cost a small stage more
    than the pool gave it."""
    lock = threading.Lock()
    pending = iter(enumerate(items))
    failed: list[tuple[int, BaseException]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                nxt = next(pending, None)
            if nxt is None:
                return
            try:
                fn(nxt[1])
            except BaseException as exc:
                with lock:
                    failed.append((nxt[0], exc))
                stop.set()
                return

    workers = [threading.Thread(target=loop, name=f"unpack-{i}", daemon=True)
               for i in range(max(1, min(threads, len(items))))]
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    except BaseException:
        stop.set()
        for t in workers:
            if t.ident is not None:
                t.join()
        raise
    if failed:
        raise min(failed, key=lambda f: f[0])[1]


class _Kept:
    """The shard files :func:`run_unpack` copies into DEST as it unpacks them (``names``): each verified
    copy is renamed into place with the source file's access and journaled once the unpack's next
    ``syncfs`` has made it durable (:meth:`SyncfsBatcher.when_durable`): no fsync of its own, one flush
    of the file system for the copy and the tree, as ``sync`` does. DEST's manifest and receipt come
    after the last ``syncfs``, so neither ever names a copy that is not on disk."""

    def __init__(self, names: set[str], journal: Journal, batcher: SyncfsBatcher) -> None:
        self.names = names
        self.journal = journal
        self.batcher = batcher
        self.umask = current_umask() if names else 0
        self.files = self.bytes = 0
        self.warnings: list[str] = []
        self._lock = threading.Lock()

    def publish(self, part: PartialCopy, info: ShardInfo, source: Any) -> None:
        st = os.fstat(source.fileno()) if hasattr(source, "fileno") else None
        mode, gid = (copy_mode(st.st_mode, self.umask), st.st_gid) if st is not None else (0o600, None)
        if not part.publish(mode, gid, fsync=False):
            with self._lock:
                if not self.warnings:
                    self.warnings.append(group_warning(gid))
        self.batcher.when_durable(lambda: self.journal.add_file(info.name, info.bytes))
        with self._lock:
            self.files += 1
            self.bytes += info.bytes


class _Tee:
    """The hasher :class:`ChunkReader` feeds every byte it reads: here the shard's verified copy, which
    hashes and writes it (so :meth:`Unpacker.unpack_tar`'s check at the end is the copy's). A source
    longer than the manifest says fails as soon as it is (``context``, ``fix``: the check's message),
    as the pull copy stops reading there: nothing beyond the shard's size is written into DEST."""

    def __init__(self, part: PartialCopy, context: str, fix: str) -> None:
        self.part = part
        self.context = context
        self.fix = fix
        self.throttle = Throttle()  # tests: as slow as the copy streams' copies

    def update(self, data: bytes | memoryview, /) -> None:
        self.part.write(data)
        self.throttle.passed(len(data))
        if self.part.expect is not None and self.part.nbytes > self.part.expect.bytes:
            self.part.verify(context=self.context, fix=self.fix)

    def hexdigest(self) -> str:
        assert self.part.hasher is not None
        return self.part.hasher.hexdigest()


class _ShardUnpacking:
    """One :func:`run_unpack` call's per-shard work, run by its threads: :meth:`unpack_shard`."""

    def __init__(self, plan: StagePlan, unpacker: Unpacker, batcher: SyncfsBatcher, progress: Progress, *,
                 keep: _Kept) -> None:
        self.plan = plan
        self.keep = keep
        self.unpacker = unpacker
        self.batcher = batcher
        self.progress = progress
        self.src_path_of = {t.name: t.src_path for t in plan.tasks}
        self.streamed_bytes = 0
        self._lock = threading.Lock()

    def unpack_shard(self, info: ShardInfo) -> None:
        """Unpack one shard, then hand it to the batcher (journaled once its files are on disk)."""
        m = self.plan.manifest
        streams = format_spec(m.format).stream_unpack  # tar: members written as the bytes pass
        if m.indexed and not streams:
            self._unpack_by_extents(info)
        elif not streams:
            self._unpack_with_reader(info)
        elif self.plan.unpack == "only":
            self._unpack_tar_from_src(info)
        elif info.name in self.keep.names:
            self._copy_and_unpack_tar(info)
        else:
            with open(self.plan.dest / info.name, "rb", buffering=0) as f:
                self.unpacker.unpack_tar(f, info, None, on_progress=self.progress.update)
        self.batcher.shard_done(info.name)

    def _unpack_tar_from_src(self, info: ShardInfo) -> None:
        """``--unpack only``: stream the tar shard from SRC, hashing it (no copy in DEST to trust)."""
        with open_src_file(self.src_path_of[info.name], self.plan.storage_options) as raw:
            self.unpacker.unpack_tar(raw, info, new_hasher(self.plan.manifest.hash_algo),
                                     on_progress=self.progress.update)
        with self._lock:
            self.streamed_bytes += info.bytes

    def _copy_and_unpack_tar(self, info: ShardInfo) -> None:
        """``--unpack`` of a tar shard not in DEST yet: one pass over SRC's file writes its verified copy
        and its members (:func:`run_unpack`); on any failure neither the copy nor a member is kept."""
        algo = self.plan.manifest.hash_algo
        src = self.src_path_of[info.name]
        with open_src_file(src, self.plan.storage_options) as raw:
            part = PartialCopy(self.plan.dest / info.name, expect=Expected(info.name, info.bytes, info.hash, algo))
            try:
                self.unpacker.unpack_tar(raw, info, _Tee(part, f" copying {src}", SRC_FIX),
                                         on_progress=self.progress.update, context=f" copying {src}", fix=SRC_FIX)
            except BaseException as exc:
                part.fail(exc)
            self.keep.publish(part, info, raw)

    def _unpack_by_extents(self, info: ShardInfo) -> None:
        """Adopted TFRecord/parquet/RecordIO/LMDB files (``stager index``): payloads by the manifest's extents,
        keys and labels from the manifest (their containers need not follow stager's feature names); raw
        LMDB Datums come as arrays and are written as PNG."""
        m = self.plan.manifest
        path = str(self.plan.dest / info.name) if self.plan.unpack != "only" else self.src_path_of[info.name]
        reader = get_format(m.format).open_reader(path, info, m)
        try:
            for a in range(0, info.samples, 256):
                pos = list(range(a, min(a + 256, info.samples)))
                samples = []
                for j, data in zip(pos, reader.read(pos), strict=True):
                    if isinstance(data, np.ndarray):
                        samples.append(Sample(info.keys[j], int(info.labels[j]), data, "png"))
                        continue
                    b = bytes(data)
                    samples.append(Sample(info.keys[j], int(info.labels[j]), b, image_ext(b)))
                self.progress.update(self.unpacker.unpack_samples(samples, info))
        finally:
            reader.close()

    def _unpack_with_reader(self, info: ShardInfo) -> None:
        """hdf5, record, zarr: samples through the format's reader from the verified copy in DEST."""

        m = self.plan.manifest
        reader = get_format(m.format).open_reader(str(self.plan.dest / info.name), info, m)
        try:
            self.progress.update(self.unpacker.unpack_samples(reader.iter_samples(), info))
        finally:
            reader.close()

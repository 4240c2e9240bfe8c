"""``stage --unpack``: write shards' samples as an ImageFolder tree, safely and fast.

Layout: ``ROOT/<class>/<key basename>.<ext>`` where ``<class>`` is ``manifest.classes[label]``
(``_unlabeled`` for label -1). Tar shards are streamed member by member with
:func:`stager.formats.tar.iter_members`, which checks every header (checksum, size against the
shard, type: links, devices and FIFOs are refused, as are absolute and ``..`` names); each image
member is matched to its manifest entry by data offset and must have exactly the manifest's size.
Other formats go through their readers' ``iter_samples``.

Safety: output names come from the manifest (class names and key basenames must be plain file
names), class directories are created by us and must not be symlinks, files are opened with
``O_NOFOLLOW``, and every target's resolved parent is checked to lie under ROOT. Two samples that
map to the same file are refused instead of silently overwriting each other.

Speed: one ``open``/``write``/``close`` per sample, directories created once, no per-file fsync;
:meth:`Unpacker.sync` flushes the whole file system once (``syncfs``) before the receipt is
written. Measured against ``tar xf`` in tools/bench/bench_stage.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .atomicio import space_error
from .errors import CorruptSampleError, UnsafeArchiveError, VerificationError
from .manifest import Manifest, ShardInfo, check_safe_name, manifest_path
from .receipt import chgrp_quiet, source_access

UNLABELED = "_unlabeled"
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class HashingReader(io.RawIOBase):
    """A forward-only reader that feeds every byte it returns to ``hasher`` (``update``).

    ``seek(n, SEEK_CUR)`` reads and hashes the skipped bytes, so the digest covers the whole stream.
    ``drain()`` hashes the rest up to EOF. ``nbytes`` counts bytes read.
    """

    def __init__(self, raw: BinaryIO, hasher: Any | None, chunk: int = 8 << 20) -> None:
        super().__init__()
        self._raw = raw
        self._h = hasher
        self._chunk = chunk
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        data = self._raw.read() if size is None or size < 0 else self._raw.read(size)
        if self._h is not None and data:
            self._h.update(data)
        self.nbytes += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("forward-only stream")
        while offset > 0:
            got = self.read(min(offset, self._chunk))
            if not got:
                break
            offset -= len(got)
        return self.nbytes

    def drain(self) -> None:
        while self.read(self._chunk):
            pass


def _syncfs(path: str) -> None:
    """Flush the file system holding ``path`` once (Linux ``syncfs``); fall back to ``os.sync``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


class Unpacker:
    """Writes samples under ``root`` (created if needed). Thread-safe across shards.

    ``file_mode``/``dir_mode`` are applied to what it creates; ``gid`` (or None) is the group.
    ``files``/``bytes`` count what was written.
    """

    def __init__(self, root: str | os.PathLike[str], manifest: Manifest, *, file_mode: int = 0o644,
                 dir_mode: int = 0o755, gid: int | None = None) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.gid = gid
        self.root.mkdir(parents=True, exist_ok=True)
        if self.root.is_symlink():
            raise UnsafeArchiveError(f"{self.root}: unpack directory is a symlink; refusing to write through it")
        os.chmod(self.root, dir_mode)
        chgrp_quiet(self.root, gid)
        self.real_root = os.path.realpath(self.root)
        self._dirs: dict[int, str] = {}
        self._targets: dict[str, str] = {}
        self._lock = threading.Lock()
        self.files = 0
        self.bytes = 0

    # ---- paths -----------------------------------------------------------------------------------
    def _class_dir(self, label: int, where: str) -> str:
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
                name = check_safe_name(classes[label], f"class name (in {where})")
            else:
                raise UnsafeArchiveError(f"{where}: label {label} has no class name; refusing")
            path = os.path.join(self.root, name)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, self.dir_mode)
                chgrp_quiet(path, self.gid)
            real = os.path.realpath(path)
            if not os.path.isdir(path) or os.path.islink(path) or os.path.dirname(real) != self.real_root:
                raise UnsafeArchiveError(f"{path}: not a plain directory under {self.root}; refusing to unpack into it")
            self._dirs[label] = path
            return path

    def target(self, info: ShardInfo, index: int, ext: str) -> str:
        """The output path of sample ``index`` of shard ``info`` with file extension ``ext``."""
        where = info.name
        key = info.keys[index]
        base = check_safe_name(key.rsplit("/", 1)[-1] + (f".{ext}" if ext else ""), f"sample file name (key {key!r})")
        path = os.path.join(self._class_dir(int(info.labels[index]), where), base)
        with self._lock:
            prev = self._targets.setdefault(path, f"{where}:{key}")
        if prev != f"{where}:{key}":
            raise UnsafeArchiveError(
                f"{where}: sample {key!r} and {prev} both unpack to {path}; keys must have distinct basenames per class"
            )
        return path

    def write_file(self, path: str, data: bytes | memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        try:
            fd = os.open(path, flags, self.file_mode)
        except FileExistsError:
            # A rerun after a crash: replace (never write through) whatever is there, even a symlink.
            os.unlink(path)
            fd = os.open(path, flags, self.file_mode)
        try:
            if self.gid is not None and self.gid != os.getegid():
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, -1, self.gid)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as exc:
            # Never leave a short file under its final name; a full disk is exit 4, not a traceback.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            err = space_error(exc, path)
            if err is not None:
                raise err from exc
            raise
        finally:
            os.close(fd)
        with self._lock:
            self.files += 1
            self.bytes += len(data)

    # ---- formats ---------------------------------------------------------------------------------
    def unpack_tar(self, stream: BinaryIO, info: ShardInfo, hasher: Any | None = None,
                   on_file: Callable[[int], None] | None = None) -> int:
        """Stream one tar shard from ``stream`` and write its image members; return files written.

        With ``hasher`` the whole stream is hashed and compared with ``info.hash``
        (VerificationError on mismatch, after removing this shard's files).
        """
        from .formats.tar import iter_members, split_member_name

        by_offset = {int(o): i for i, o in enumerate(info.offsets.tolist())}
        reader = HashingReader(stream, hasher)
        written: list[str] = []
        seen = np.zeros(info.samples, dtype=bool)
        try:
            for name, offset, data in iter_members(reader, info.bytes, info.name):  # type: ignore[arg-type]
                i = by_offset.get(offset)
                if i is None:
                    continue  # .cls/.json companions: the manifest already holds label and key
                want = int(info.sizes[i])
                if len(data) != want:
                    raise UnsafeArchiveError(
                        f"{info.name}: member {name!r} is {len(data)} bytes but the manifest says {want}; refusing"
                    )
                key, ext = split_member_name(name)
                if key != info.keys[i]:
                    raise UnsafeArchiveError(
                        f"{info.name}: member {name!r} at offset {offset} does not match manifest key "
                        f"{info.keys[i]!r}; refusing"
                    )
                if seen[i]:
                    raise UnsafeArchiveError(f"{info.name}: member {name!r} appears twice; refusing")
                seen[i] = True
                path = self.target(info, i, ext)
                self.write_file(path, data)
                written.append(path)
                if on_file is not None:
                    on_file(len(data))
            reader.drain()
            if not seen.all():
                missing = info.keys[int(np.flatnonzero(~seen)[0])]
                raise VerificationError(
                    f"{info.name}: {int((~seen).sum())} samples of the manifest are not in the tar "
                    f"(first: {missing!r}); re-pack this dataset"
                )
            if hasher is not None:
                got = hasher.hexdigest()
                if reader.nbytes != info.bytes or got != info.hash:
                    raise VerificationError(
                        f"{info.name}: checksum mismatch while unpacking (expected {info.bytes} bytes "
                        f"{info.hash}, got {reader.nbytes} bytes {got}); the source shard is damaged"
                    )
        except CorruptSampleError as exc:
            # A damaged container is a verification failure of the shard (exit 3), like a bad hash.
            self._remove(written)
            raise VerificationError(str(exc)) from exc
        except BaseException:
            self._remove(written)
            raise
        return len(written)

    @staticmethod
    def _remove(paths: list[str]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def unpack_samples(self, samples: Iterable[Any], info: ShardInfo) -> int:
        """Write samples from a format reader's ``iter_samples()`` (encoded bytes or decoded arrays)."""
        index = {k: i for i, k in enumerate(info.keys)}
        n = 0
        for s in samples:
            i = index.get(s.key)
            if i is None:
                raise UnsafeArchiveError(f"{info.name}: sample {s.key!r} is not in the manifest; refusing")
            data = s.data
            ext = s.ext
            if isinstance(data, np.ndarray):
                data, ext = _png(data), "png"
            path = self.target(info, i, ext)
            self.write_file(path, data)
            n += 1
        return n

    def sync(self) -> None:
        _syncfs(str(self.root))


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr).save(buf, format="PNG",
                                                                                           compress_level=1)
    return buf.getvalue()


def run_unpack(plan: Any, journal: Any, workers: int, quiet: bool, result: Any) -> int:
    """Unpack this node's shards of ``plan`` (a :class:`stager.stage.StagePlan`) into
    ``DEST/<plan.unpack_dir>``; shards the journal lists as unpacked are skipped. Returns files written.

    Tar shards are read from DEST, or streamed (and hashed) from the source with ``--unpack only``;
    other formats are read through their readers from the verified copy in DEST.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .checksum import new_hasher
    from .progress import Progress

    m: Manifest = plan.manifest
    root = Path(plan.dest) / plan.unpack_dir
    fresh = not root.is_dir()
    # The source's group and at most its permissions (a licensed dataset stays group-only); dirs get x
    # wherever files get r.
    mode, gid = source_access(manifest_path(plan.source))
    dir_mode = mode | 0o100 | (0o010 if mode & 0o040 else 0) | (0o001 if mode & 0o004 else 0)
    unpacker = Unpacker(root, m, file_mode=mode, dir_mode=dir_mode, gid=gid)
    shards = [m.shards[i] for i in plan.mine if fresh or m.shards[i].name not in journal.unpacked]
    src_of = {t.name: t.src for t in plan.tasks}
    progress = Progress("unpack", total_items=sum(s.samples for s in shards), unit="files", quiet=quiet)
    streamed = [0]

    def one(info: ShardInfo) -> None:
        local = Path(plan.dest) / info.name
        if m.format == "tar":
            if plan.unpack == "only":
                from .stage import _open_source

                with _open_source(src_of[info.name]) as raw:
                    stream = io.BufferedReader(raw, 8 << 20) if isinstance(raw, io.RawIOBase) else raw
                    unpacker.unpack_tar(stream, info, new_hasher(m.hash_algo),
                                        on_file=lambda n: progress.update(1, n))
                streamed[0] += info.bytes
            else:
                with open(local, "rb", buffering=8 << 20) as f:
                    unpacker.unpack_tar(f, info, None, on_file=lambda n: progress.update(1, n))
        else:
            from .formats import get_format

            reader = get_format(m.format).open_reader(str(local), info, m)
            try:
                progress.update(unpacker.unpack_samples(reader.iter_samples(), info))
            finally:
                reader.close()
        journal.add_unpacked(info.name)

    try:
        with ThreadPoolExecutor(max(1, min(workers, len(shards) or 1))) as ex:
            for fut in [ex.submit(one, s) for s in shards]:
                fut.result()
    finally:
        progress.close()
    unpacker.sync()
    if plan.unpack == "only" and m.format == "tar":
        result.bytes_copied += streamed[0]
    return unpacker.files

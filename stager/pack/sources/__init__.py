"""Pack sources: where samples come from before they become shards.

A source lists lightweight :class:`SampleRef` objects (key, label, locator, size estimate, mtime) that
the planner uses without reading any image, and materialises :class:`~stager.formats.base.Sample`
objects on demand with :meth:`Source.load_many`. Four kinds are recognised by :func:`open_source`:

* ``imagefolder``: ``root/<class>/**/<image>``; labels are indices into the sorted class names
  (torchvision's rule); image extensions match case-insensitively; hidden files/folders are skipped.
* ``cifar``: a CIFAR-10 python batches directory (``data_batch_1..5`` = split ``train``,
  ``test_batch`` = split ``test``), read with a restricted unpickler (:func:`restricted_load`).
  Samples are (32, 32, 3) uint8 arrays; ``stager.pack`` PNG-encodes them for encoded formats.
* ``list``: a ``.csv`` (header ``path,label``) or ``.jsonl`` (objects ``{"path", "label"}``) file;
  labels are ints or class names; relative paths resolve against the list file's directory.
* ``pack``: an existing stager pack (a directory with ``manifest.json``), re-read through the format
  readers so that any format converts to any other with keys, labels and classes preserved.

Keys are the relative path without its extension, with dots in the last component replaced by
``_`` (webdataset splits keys at the first dot); collisions get a deterministic ``_<n>`` suffix in
sorted path order. Sources are picklable (loaded batches/readers are dropped on pickling) so pack
workers receive them once.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
from collections.abc import Iterable, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stager.errors import SourceError, SourceNotFoundError, UsageError
from stager.formats.base import Sample

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"})
CIFAR_SPLITS = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class SampleRef(NamedTuple):
    """One sample as the planner sees it; ``locator`` tells the source where to read it.

    ``size`` is the expected payload size in bytes (the file size for file sources) and ``mtime``
    the source file's modification time in ns (0 where meaningless); both enter the plan
    fingerprint so that a changed source file invalidates the shard holding it. A named tuple, not a
    dataclass: listing builds one per file and workers receive them pickled, and a tuple costs a
    fraction of a frozen dataclass on both counts.
    """

    key: str
    label: int
    locator: str
    size: int
    mtime: int = 0


class Source:
    """Base of all sources: ``refs`` in a deterministic order, ``classes``, and a loader."""

    kind = "?"
    sample_kind = "encoded"  # what load_many() returns natively: encoded bytes or decoded arrays

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refs: list[SampleRef] = []
        self.classes: list[str] = []
        self.image_shape: tuple[int, int, int] | None = None  # known fixed (H, W, C), if any

    def describe(self) -> dict[str, Any]:
        """JSON-able provenance for the manifest's ``source`` field."""
        return {"kind": self.kind, "path": str(self.root)}

    def load_many(self, refs: Sequence[SampleRef]) -> list[Sample | BaseException]:
        """Materialise ``refs`` in order; a per-sample failure is returned as its exception."""
        out: list[Sample | BaseException] = []
        for r in refs:
            try:
                out.append(self.load(r))
            except (OSError, SourceError) as exc:
                out.append(exc)
        return out

    def load(self, ref: SampleRef) -> Sample:
        raise NotImplementedError

    def path_of(self, ref: SampleRef) -> str:
        """A human-readable location of ``ref`` for error messages."""
        return ref.locator

    def rel_of(self, ref: SampleRef) -> str:
        """Where ``ref`` came from, relative to the source (stored as the sample's ``source`` meta)."""
        return ref.locator

    def close(self) -> None:
        """Release cached handles (open readers, loaded batches)."""


# ---- keys -------------------------------------------------------------------------------------


def key_for(relpath: str) -> str:
    """``a/b.c.jpg`` -> ``a/b_c``: drop the extension, replace dots in the last component."""
    parts = relpath.replace(os.sep, "/").split("/")
    stem = parts[-1].rsplit(".", 1)[0] if "." in parts[-1] else parts[-1]
    parts[-1] = stem.replace(".", "_")
    return "/".join(p for p in parts if p not in ("", "."))


def unique_keys(keys: Iterable[str]) -> list[str]:
    """Make ``keys`` unique in order: a repeat gets the first free ``_<n>`` suffix (n = 1, 2, ...)."""
    seen: set[str] = set()
    out = []
    for k in keys:
        cand, n = k, 0
        while cand in seen:
            n += 1
            cand = f"{k}_{n}"
        seen.add(cand)
        out.append(cand)
    return out


def sniff_ext(data: bytes) -> str | None:
    """The image type of encoded bytes from their magic number (``jpg``, ``png``, ...), else None."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if data[:2] in (b"P5", b"P6"):
        return "ppm"
    return None


def read_file(path: str, size: int = -1) -> bytes:
    """The bytes of the file at ``path``; ``size`` (the listed size) lets one ``read`` get them all.

    Plain ``os.open``/``os.read``/``os.close``: a Python file object costs ~10 us more per file, which
    is a third of the whole per-sample budget on CIFAR-sized images. A file that grew since listing
    is read to its end.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        want = size + 1 if size >= 0 else 1 << 20
        data = os.read(fd, want)
        if len(data) < want:  # short read on a regular file: end of file
            return data
        parts = [data]
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


# ---- ImageFolder ------------------------------------------------------------------------------


class ImageFolderSource(Source):
    """``root/<class>/**/<image>``: class = top-level sub-folder, label = index in sorted names."""

    kind = "imagefolder"

    def __init__(self, root: Path, *, map_fn: Any = None) -> None:
        """List ``root``; ``map_fn`` (``map``-like, e.g. a process pool's) lists the class folders.

        Listing costs a ``stat`` per file (size and mtime for the plan); ``stager pack --workers N``
        passes its pool's ``map`` so that the folders are listed in parallel.
        """
        super().__init__(root)
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise SourceError(f"{root}: no class sub-folders; expected an ImageFolder tree root/<class>/<image>")
        self.classes = classes
        base = str(root)
        self._cut = len(base) + 1
        parts = list((map_fn or map)(list_class_folder, [(base, c, i) for i, c in enumerate(classes)]))
        locs: list[str] = []
        keys: list[str] = []
        labels: list[int] = []
        sizes: list[int] = []
        mtimes: list[int] = []
        for label, (p_locs, p_keys, p_sizes, p_mtimes) in enumerate(parts):
            locs += p_locs
            keys += p_keys
            labels += [label] * len(p_locs)
            sizes += p_sizes
            mtimes += p_mtimes
        # Samples are in relative-path order; class folders concatenated in name order almost always are.
        if sorted(locs) != locs:
            order = sorted(range(len(locs)), key=locs.__getitem__)
            locs, keys, labels, sizes, mtimes = ([c[i] for i in order] for c in (locs, keys, labels, sizes, mtimes))  # type: ignore[assignment]
        if len(set(keys)) != len(keys):
            keys = unique_keys(keys)
        # tuple.__new__ straight from C: SampleRef's Python-level __new__ would double the cost.
        self.refs = list(map(tuple.__new__, repeat(SampleRef), zip(keys, labels, locs, sizes, mtimes, strict=True)))

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        return Sample(ref.key, ref.label, data, sniff_ext(data) or _suffix(ref.locator), {"source": self.rel_of(ref)})

    def load_many(self, refs: Sequence[SampleRef]) -> list[Sample | BaseException]:
        out: list[Sample | BaseException] = []
        cut = self._cut
        for r in refs:
            loc = r.locator
            try:
                data = read_file(loc, r.size)
            except OSError as exc:
                out.append(exc)
                continue
            out.append(Sample(r.key, r.label, data, sniff_ext(data) or _suffix(loc), {"source": loc[cut:]}))
        return out

    def rel_of(self, ref: SampleRef) -> str:
        return ref.locator[self._cut :]


def _suffix(path: str) -> str:
    return Path(path).suffix.lower().lstrip(".") or "bin"


def list_class_folder(job: tuple[str, str, int]) -> tuple[list[str], list[str], list[int], list[int]]:
    """List one class folder ``(base, class name, label)``: ``(paths, keys, sizes, mtimes_ns)`` of its
    image files in relative-path order (keys not yet made unique across the source). Columns, not
    rows, so that a pool worker's answer pickles cheaply."""
    base, cls, label = job
    rows: list[tuple[str, int, int, int, str]] = []
    _walk_images(f"{base}/{cls}", cls, label, rows)
    rows.sort()
    return (
        [f"{base}/{r[0]}" for r in rows],
        [f"{r[0][: r[0].rfind('/')]}/{r[4]}" for r in rows],  # rel dir + stem (see key_for)
        [r[2] for r in rows],
        [r[3] for r in rows],
    )


def _walk_images(folder: str, rel: str, label: int, rows: list[tuple[str, int, int, int, str]]) -> None:
    """Append ``(relative path, label, size, mtime_ns, key stem)`` for each image file under ``folder``.

    Hidden entries are skipped. The key stem is the file name without its extension, dots replaced by
    ``_`` (what :func:`key_for` gives for the last component), computed here while the name is at hand.
    The folder is listed through a descriptor so that each ``stat`` resolves the name relative to it
    (``fstatat``) instead of walking the whole path again: ~1 us less per file.
    """
    try:
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise SourceError(f"{folder}: cannot list ({exc.strerror}); check permissions") from exc
    try:
        with os.scandir(dfd) as it:
            entries = sorted(it, key=lambda e: e.name)
        exts = IMAGE_EXTENSIONS
        for e in entries:
            name = e.name
            if name[0] == ".":
                continue
            dot = name.rfind(".")
            if dot > 0 and name[dot:].lower() in exts and e.is_file():
                st = e.stat()
                rows.append((f"{rel}/{name}", label, st.st_size, st.st_mtime_ns, name[:dot].replace(".", "_")))
            elif e.is_dir():
                _walk_images(f"{folder}/{name}", f"{rel}/{name}", label, rows)
    except OSError as exc:
        raise SourceError(f"{folder}: cannot list ({exc.strerror}); check permissions") from exc
    finally:
        os.close(dfd)


# ---- CIFAR-10 python batches ---------------------------------------------------------------------


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 writes ``bytes`` in protocol-2 pickles as ``_codecs.encode(text, 'latin1')``; allow
    # exactly that and no other codec.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    # numpy 2 moved numpy.core to numpy._core; resolve whichever this numpy has (never by the
    # module name a pickle asks for).
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    frombuffer = core.numeric._frombuffer
    allowed: dict[tuple[str, str], Any] = {("_codecs", "encode"): _latin1_encode}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = reconstruct
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        allowed[(mod, "_frombuffer")] = frombuffer
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickle plain containers, bytes/str/numbers and numpy arrays; refuse every other global.

    Pickle opcodes for dict/list/tuple/bytes/str/int need no globals; numpy arrays need
    ``_reconstruct``/``_frombuffer``, ``ndarray`` and ``dtype``. Anything else (``os.system``,
    ``builtins.eval``, ...) raises before it can run, because ``find_class`` is the only way a pickle
    reaches a callable.
    """

    def __init__(self, file: io.BufferedIOBase | io.BytesIO, where: str) -> None:
        super().__init__(file, encoding="bytes")
        self.where = where
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None:
            raise SourceError(
                f"{self.where}: refusing to unpickle {module}.{name} (only containers, bytes/str/numbers and "
                "numpy arrays are allowed in CIFAR batches); the file is not a genuine CIFAR batch, do not load it"
            )
        return obj


def restricted_load(path: str | os.PathLike[str]) -> Any:
    """Load a pickle file with :class:`RestrictedUnpickler`; errors name the file."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, where).load()
    except SourceError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise SourceError(f"{where}: not a readable CIFAR batch ({type(exc).__name__}: {exc})") from exc


class CifarSource(Source):
    """CIFAR-10 python batches; ``split`` selects train (data_batch_1..5) or test (test_batch)."""

    kind = "cifar"
    sample_kind = "decoded"

    def __init__(self, root: Path, split: str = "train") -> None:
        super().__init__(root)
        if split not in CIFAR_SPLITS:
            raise UsageError(f"unknown CIFAR split {split!r}; expected one of {', '.join(CIFAR_SPLITS)}")
        self.split = split
        self.batches = [b for b in CIFAR_SPLITS[split] if (root / b).is_file()]
        if not self.batches:
            raise SourceError(f"{root}: no {' / '.join(CIFAR_SPLITS[split])} file for split {split!r}")
        self._cache: dict[str, np.ndarray] = {}
        meta = root / "batches.meta"
        names: list[str] = []
        if meta.is_file():
            m = restricted_load(meta)
            raw = m.get(b"label_names") if isinstance(m, dict) else None
            if isinstance(raw, list):
                names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw]
        refs = []
        max_label = -1
        for b in self.batches:
            data, labels = self._load_batch(b)
            st = (root / b).stat()
            for i, lab in enumerate(labels):
                refs.append(SampleRef(f"{b}/{i:05d}", lab, f"{b}#{i}", 3072, st.st_mtime_ns))
            max_label = max(max_label, *labels) if labels else max_label
            self._cache[b] = data
        self.classes = names or (CIFAR_CLASSES if max_label < 10 else [str(i) for i in range(max_label + 1)])
        if max_label >= len(self.classes):
            raise SourceError(f"{root}: label {max_label} out of range for {len(self.classes)} classes in batches.meta")
        self.refs = refs
        self.image_shape = (32, 32, 3)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "split": self.split}

    def _load_batch(self, name: str) -> tuple[np.ndarray, list[int]]:
        path = self.root / name
        d = restricted_load(path)
        data = d.get(b"data") if isinstance(d, dict) else None
        labels = d.get(b"labels", d.get(b"fine_labels")) if isinstance(d, dict) else None
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072):
            raise SourceError(f"{path}: expected b'data' as a uint8 array of shape (N, 3072)")
        if not (isinstance(labels, list) and len(labels) == len(data) and all(isinstance(x, int) for x in labels)):
            raise SourceError(f"{path}: expected b'labels' as a list of {len(data)} integers")
        if labels and min(labels) < 0:
            raise SourceError(f"{path}: negative label")
        return data, [int(x) for x in labels]

    def load(self, ref: SampleRef) -> Sample:
        batch, idx = ref.locator.rsplit("#", 1)
        data = self._cache.get(batch)
        if data is None:
            data = self._cache[batch] = self._load_batch(batch)[0]
        # CIFAR rows are channel-major: 1024 R, 1024 G, 1024 B.
        img = np.ascontiguousarray(data[int(idx)].reshape(3, 32, 32).transpose(1, 2, 0))
        return Sample(ref.key, ref.label, img, "png", {"source": ref.locator})

    def path_of(self, ref: SampleRef) -> str:
        batch, idx = ref.locator.rsplit("#", 1)
        return f"{self.root / batch}[{idx}]"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def close(self) -> None:
        self._cache.clear()


# ---- list file ----------------------------------------------------------------------------------


class ListSource(Source):
    """A CSV (``path,label`` header) or JSONL (``{"path", "label"}``) list of image files."""

    kind = "list"

    def __init__(self, listfile: Path) -> None:
        super().__init__(listfile)
        base = listfile.parent
        raw = _read_list(listfile)
        if not raw:
            raise SourceError(f"{listfile}: lists no samples")
        int_labels = [isinstance(lab, int) for _, lab, _ in raw]
        if all(int_labels):
            nclass = max(int(lab) for _, lab, _ in raw) + 1
            self.classes = [str(i) for i in range(nclass)]
            ids = {str(i): i for i in range(nclass)}
        elif not any(int_labels):
            self.classes = sorted({str(lab) for _, lab, _ in raw})
            ids = {c: i for i, c in enumerate(self.classes)}
        else:
            raise SourceError(f"{listfile}: labels mix integers and class names; use one kind throughout")
        rows = []
        for p, lab, line in raw:
            full = Path(p) if os.path.isabs(p) else base / p
            try:
                st = full.stat()
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{listfile}:{line}: {full} does not exist; fix the list") from exc
            try:
                rel = os.path.relpath(full, base)
            except ValueError:
                rel = str(full)
            if rel.startswith(".."):
                rel = str(full).lstrip("/")
            rows.append((rel, ids[str(lab)], str(full), st.st_size, st.st_mtime_ns))
        rows.sort()
        keys = unique_keys(key_for(r[0]) for r in rows)
        self.refs = [SampleRef(k, r[1], r[2], r[3], r[4]) for k, r in zip(keys, rows, strict=True)]
        self._rel = {r[2]: r[0] for r in rows}

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        return Sample(ref.key, ref.label, data, sniff_ext(data) or _suffix(ref.locator), {"source": self.rel_of(ref)})

    def rel_of(self, ref: SampleRef) -> str:
        return self._rel.get(ref.locator, ref.locator)


def _label_value(v: Any, where: str) -> int | str:
    if isinstance(v, bool):
        raise SourceError(f"{where}: label must be an integer or a class name, got {v!r}")
    if isinstance(v, str) and v.strip():
        s = v.strip()
        if not s.lstrip("-").isdigit():
            return s
        v = int(s)
    if isinstance(v, int):
        if v < 0:
            raise SourceError(f"{where}: negative label {v}")
        return v
    raise SourceError(f"{where}: label must be an integer or a class name, got {v!r}")


def _read_list(listfile: Path) -> list[tuple[str, int | str, int]]:
    """``(path, label, line number)`` rows of a CSV or JSONL list file."""
    rows: list[tuple[str, int | str, int]] = []
    text = listfile.read_text(encoding="utf-8")
    if listfile.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{listfile}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("path"), str) or "label" not in obj:
                raise SourceError(f"{listfile}:{n}: expected an object with 'path' (string) and 'label'")
            rows.append((obj["path"], _label_value(obj["label"], f"{listfile}:{n}"), n))
        return rows
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or [h.strip().lower() for h in header[:2]] != ["path", "label"]:
        raise SourceError(f"{listfile}: expected a CSV header 'path,label', got {header!r}")
    for n, rec in enumerate(reader, 2):
        if not rec or not any(x.strip() for x in rec):
            continue
        if len(rec) < 2 or not rec[0].strip():
            raise SourceError(f"{listfile}:{n}: expected 'path,label'")
        rows.append((rec[0].strip(), _label_value(rec[1], f"{listfile}:{n}"), n))
    return rows


# ---- an existing pack ---------------------------------------------------------------------------


class PackSource(Source):
    """An existing stager pack, re-read through its format's reader (payloads by manifest index)."""

    kind = "pack"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from stager.manifest import load_manifest

        self.manifest = load_manifest(root)
        m = self.manifest
        self.classes = list(m.classes)
        self.sample_kind = m.sample_kind
        self.image_shape = m.image_shape
        self._readers: dict[int, Any] = {}
        refs = []
        for si, s in enumerate(m.shards):
            for pos, (k, lab, size) in enumerate(zip(s.keys, s.labels.tolist(), s.sizes.tolist(), strict=True)):
                refs.append(SampleRef(k, int(lab), f"{si}#{pos}", int(size)))
        # Keys are unique within a pack; sort for a canonical order independent of the shuffle.
        refs.sort(key=lambda r: r.key)
        self.refs = refs

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "format": self.manifest.format, "dataset_id": self.manifest.dataset_id}

    def _reader(self, si: int) -> Any:
        r = self._readers.get(si)
        if r is None:
            from stager.formats import get_format

            info = self.manifest.shards[si]
            fmt = get_format(self.manifest.format)
            r = self._readers[si] = fmt.open_reader(str(self.root / info.name), info, self.manifest)
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
                err = SourceError(f"{self.root / self.manifest.shards[si].name}: cannot read samples ({exc})")
                for i in idxs:
                    out[i] = err
                continue
            for i, data in zip(idxs, payloads, strict=True):
                r = refs[i]
                meta = {"source": self.rel_of(r)}
                if isinstance(data, np.ndarray):
                    out[i] = Sample(r.key, r.label, data, "png", meta)
                else:
                    b = bytes(data)
                    out[i] = Sample(r.key, r.label, b, sniff_ext(b) or "bin", meta)
        return out

    def load(self, ref: SampleRef) -> Sample:
        res = self.load_many([ref])[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def path_of(self, ref: SampleRef) -> str:
        si, pos = ref.locator.split("#", 1)
        return f"{self.root / self.manifest.shards[int(si)].name}[{pos}] ({ref.key})"

    def rel_of(self, ref: SampleRef) -> str:
        si, pos = ref.locator.split("#", 1)
        return f"{self.manifest.shards[int(si)].name}#{pos}"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}}

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


# ---- detection ----------------------------------------------------------------------------------


def open_source(src: str | os.PathLike[str], *, split: str | None = None, map_fn: Any = None) -> Source:
    """Recognise and list the source at ``src`` (see the module docstring for the kinds).

    ``map_fn`` (``map``-like) is used to list an ImageFolder's class folders (in parallel when it is
    a process pool's ``map``). Raises :class:`SourceNotFoundError` for a missing path and
    :class:`SourceError` for an empty or unrecognisable one.
    """
    root = Path(os.path.abspath(os.fspath(src)))
    if not root.exists():
        raise SourceNotFoundError(f"{root}: source does not exist")
    if root.is_file():
        if root.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
            src_obj: Source = ListSource(root)
        elif root.name == "manifest.json":
            src_obj = PackSource(root.parent)
        else:
            raise SourceError(
                f"{root}: unsupported source file; expected a .csv/.jsonl list, an ImageFolder or CIFAR "
                "batches directory, or a stager pack"
            )
    elif (root / "manifest.json").is_file():
        src_obj = PackSource(root)
    elif any((root / b).is_file() for names in CIFAR_SPLITS.values() for b in names):
        src_obj = CifarSource(root, split or "train")
    else:
        src_obj = ImageFolderSource(root, map_fn=map_fn)
    if split is not None and src_obj.kind != "cifar":
        raise UsageError(f"--split applies to CIFAR batch directories only; {root} is a {src_obj.kind} source")
    if not src_obj.refs:
        raise SourceError(f"{root}: source holds no images ({src_obj.kind}); check the path")
    return src_obj


# ---- preparing samples for a format ---------------------------------------------------------------

_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
RESAMPLE = 2  # PIL.Image.Resampling.BILINEAR (antialiased when downscaling)


# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic); 0xC4/0xC8/0xCC are not.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_header_problem(data: bytes) -> str | None:
    """Walk the JPEG marker segments from SOI to SOS; describe the first inconsistency, else None."""
    i, n, sof = 2, len(data), False
    while i + 4 <= n:
        if data[i] != 0xFF:
            return f"no marker at byte {i}"
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2:
            return f"bad segment length at byte {i}"
        if marker in _SOF:
            if i + 9 > n or not (data[i + 5] | data[i + 6]) or not (data[i + 7] | data[i + 8]):
                return "zero image size in the frame header"
            sof = True
        if marker == 0xDA:  # start of scan: entropy-coded data follows
            return None if sof else "no frame header before the scan"
        i += 2 + length
    return "header ends before the image data"


def check_encoded(data: bytes, where: str) -> str:
    """Cheaply check that ``data`` is a complete image file; return its type (``jpg``, ``png``, ...).

    JPEG: marker segments from SOI to the first scan must be consistent (with a frame header) and
    the file must end with EOI. PNG: signature, an IHDR chunk with a non-zero size first, and the
    IEND chunk last. That catches the common damage (truncated copies, non-images with an image
    extension) for ~2 us per file; PIL's ``Image.open`` costs ~30 us and a full decode ~1.2 ms on
    an ImageNet JPEG (docs/pack.md). Other types are opened and verified with PIL. Raises
    :class:`SourceError` naming ``where``.
    """
    ext = sniff_ext(data)
    if ext is None:
        raise SourceError(f"{where}: not an image file (unrecognised header); remove it or use --on-error skip")
    problem = None
    if ext == "jpg":
        problem = _jpeg_header_problem(data)
        if problem is None and not data.rstrip(b"\x00\r\n ").endswith(b"\xff\xd9"):
            problem = "truncated: no end-of-image marker"
    elif ext == "png":
        if len(data) < 33 or data[12:16] != b"IHDR" or not any(data[16:20]) or not any(data[20:24]):
            problem = "no valid IHDR chunk"
        elif not data.endswith(_PNG_END):
            problem = "truncated: no IEND chunk"
    else:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as im:
                im.verify()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            problem = str(exc)
    if problem:
        kind = {"jpg": "JPEG", "png": "PNG"}.get(ext, ext)
        raise SourceError(f"{where}: damaged {kind} ({problem}); re-copy it or use --on-error skip")
    return ext


def decode_rgb_array(data: bytes, where: str) -> np.ndarray:
    """Fully decode ``data`` to an ``(H, W, 3)`` uint8 array; :class:`SourceError` on failure."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # DecompressionBombError (PIL's pixel limit) is not an OSError: without it a bomb is a traceback.
        raise SourceError(f"{where}: cannot decode image ({exc}); re-copy it or use --on-error skip") from exc


def _encode(arr: np.ndarray, ext: str, quality: int | None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    if ext == "jpg":
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality or 95)
    else:
        Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _resize(arr: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    if arr.shape[:2] == hw:
        return arr
    return np.asarray(Image.fromarray(arr).resize((hw[1], hw[0]), RESAMPLE))


def prepare_sample(
    sample: Sample,
    *,
    target_kind: str,
    where: str,
    resize: tuple[int, int] | None = None,
    quality: int | None = None,
    image_shape: tuple[int, int, int] | None = None,
) -> Sample:
    """Turn a source sample into what a format of ``target_kind`` stores.

    * ``"decoded"`` (zarr): an ``(H, W, 3)`` uint8 array, resized to ``resize`` = (H, W) if given;
      it must equal ``image_shape`` when that is given (else :class:`SourceError` suggesting --resize).
    * ``"encoded"``: image file bytes. Without ``resize``/``quality`` the source file's bytes pass
      through unchanged after :func:`check_encoded`; otherwise the image is decoded, resized and
      re-encoded (JPEG at ``quality`` (default 95) for JPEG sources or whenever ``quality`` is
      given, else PNG). Arrays (CIFAR, zarr packs) are PNG-encoded, or JPEG with ``quality``.
    """
    data = sample.data
    if target_kind == "decoded":
        arr = data if isinstance(data, np.ndarray) else decode_rgb_array(data, where)
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=2)
        if resize:
            arr = _resize(arr, resize)
        if image_shape is not None and tuple(arr.shape) != tuple(image_shape):
            raise SourceError(
                f"{where}: image is {arr.shape[0]}x{arr.shape[1]}, expected {image_shape[0]}x{image_shape[1]}; "
                "zarr stores one fixed size: pass --resize HxW"
            )
        return Sample(sample.key, sample.label, np.ascontiguousarray(arr, dtype=np.uint8), "raw", sample.meta)
    if isinstance(data, np.ndarray):
        arr = _resize(data, resize) if resize else data
        ext = "jpg" if quality else "png"
        return Sample(sample.key, sample.label, _encode(arr, ext, quality), ext, sample.meta)
    ext = check_encoded(data, where)
    if not resize and not quality:
        return Sample(sample.key, sample.label, data, ext, sample.meta)
    arr = decode_rgb_array(data, where)
    if resize:
        arr = _resize(arr, resize)
    out_ext = "jpg" if (quality or ext == "jpg") else "png"
    return Sample(sample.key, sample.label, _encode(arr, out_ext, quality), out_ext, sample.meta)


def probe_hw(source: Source, refs: Sequence[SampleRef], *, skip_bad: bool = False) -> tuple[int, int]:
    """The common (H, W) of ``refs``' images from their headers; :class:`SourceError` if they differ.

    Stops at the first image whose size differs, so non-uniform sets fail fast. With ``skip_bad``
    unreadable images are passed over (the writer skips them later).
    """
    from PIL import Image

    first: tuple[int, int] | None = None
    first_where = ""
    for r in refs:
        where = source.path_of(r)
        try:
            if source.kind in ("imagefolder", "list"):
                with Image.open(r.locator) as im:
                    w, h = im.size
            else:
                s = source.load(r)
                if isinstance(s.data, np.ndarray):
                    h, w = s.data.shape[:2]
                else:
                    with Image.open(io.BytesIO(s.data)) as im:
                        w, h = im.size
        except (OSError, SyntaxError, ValueError, SourceError, Image.DecompressionBombError) as exc:
            if skip_bad:
                continue
            raise SourceError(f"{where}: cannot read image header ({exc}); fix it or pass --resize HxW") from exc
        if first is None:
            first, first_where = (h, w), where
        elif (h, w) != first:
            raise SourceError(
                f"zarr stores one fixed image size but {where} is {h}x{w} and {first_where} is "
                f"{first[0]}x{first[1]}; pass --resize HxW"
            )
    if first is None:
        raise SourceError("no images to probe")
    return first

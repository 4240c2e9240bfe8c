"""Sample checks and preparation before writing: encoded files are checked (JPEG/PNG structure,
decodable size), decoded or re-encoded as the format and ``--resize``/``--quality`` need.

PIL is imported inside the functions that use it (deliberately): a pack whose JPEG/PNG files pass
through unchanged never loads it.
"""

from __future__ import annotations

import io
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from stager.decode.jpeg_header import SOF_MARKERS
from stager.errors import SourceError, UnsuitableSourceError, UsageError
from stager.formats.base import Lines, Sample
from stager.fs.nesting import overlap
from stager.manifest import BAD_NAME_CHARS, NAME_MAX_BYTES, class_dir_name, entry_name_problem, unpacked_stem
from stager.pack.sources.base import SampleRef, Source, sniff_ext
from stager.pack.sources.columns import ListingRefs

_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


RESAMPLE = 2  # PIL.Image.Resampling.BILINEAR (antialiased when downscaling)


_SEGMENT = struct.Struct(">BBH").unpack_from  # 0xFF, marker, segment length: one call per segment
_SOF = frozenset(SOF_MARKERS)


def _jpeg_header_problem(data: bytes) -> str | None:
    """Walk the JPEG marker segments from SOI to SOS; describe the first inconsistency, else None."""
    i, n, sof = 2, len(data), False
    try:
        while True:
            ff, marker, length = _SEGMENT(data, i)  # struct.error past the end: no scan found
            if ff != 0xFF:
                return f"no marker at byte {i}"
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers
                i += 2
                continue
            if length < 2:
                return f"bad segment length at byte {i}"
            if marker in _SOF:
                if i + 9 > n or not (data[i + 5] | data[i + 6]) or not (data[i + 7] | data[i + 8]):
                    return "zero image size in the frame header"
                sof = True
            elif marker == 0xDA:  # start of scan: entropy-coded data follows
                return None if sof else "no frame header before the scan"
            i += 2 + length
    except struct.error:
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
        from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

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
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # DecompressionBombError (PIL's pixel limit) is not an OSError: without it a bomb is a traceback.
        raise SourceError(f"{where}: cannot decode image ({exc}); re-copy it or use --on-error skip") from exc


def _encode(arr: np.ndarray, ext: str, quality: int | None) -> bytes:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    buf = io.BytesIO()
    if ext == "jpg":
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality or 95)
    else:
        Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _resize(arr: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

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
            raise UnsuitableSourceError(
                f"{where}: image is {arr.shape[0]}x{arr.shape[1]}, expected {image_shape[0]}x{image_shape[1]}; "
                "zarr stores one fixed size: pass --resize HxW"
            )
        arr = np.ascontiguousarray(arr, dtype=np.uint8)
        return Sample(sample.key, sample.label, arr, "raw", sample.meta, sample.fields)
    if isinstance(data, np.ndarray):
        arr = _resize(data, resize) if resize else data
        ext = "jpg" if quality else "png"
        return Sample(sample.key, sample.label, _encode(arr, ext, quality), ext, sample.meta, sample.fields)
    ext = check_encoded(data, where)
    if not resize and not quality:
        return Sample(sample.key, sample.label, data, ext, sample.meta, sample.fields)
    arr = decode_rgb_array(data, where)
    if resize:
        arr = _resize(arr, resize)
    out_ext = "jpg" if (quality or ext == "jpg") else "png"
    return Sample(sample.key, sample.label, _encode(arr, out_ext, quality), out_ext, sample.meta, sample.fields)


def probe_hw(source: Source, refs: Sequence[SampleRef], *, skip_bad: bool = False) -> tuple[int, int]:
    """The common (H, W) of ``refs``' images from their headers; :class:`SourceError` if they differ.

    Stops at the first image whose size differs, so non-uniform sets fail fast. With ``skip_bad``
    unreadable images are passed over (the writer skips them later).
    """
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

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
            raise UnsuitableSourceError(
                f"zarr stores one fixed image size but {where} is {h}x{w} and {first_where} is "
                f"{first[0]}x{first[1]}; pass --resize HxW"
            )
    if first is None:
        raise SourceError("no images to probe")
    return first


# A key whose unpacked name could be '.' or '..' (it ends in one after a '/', or is one): checked one by one.
_DOT_KEY = re.compile(r"(?m)^(?:.*/)?\.\.?$")


def check_names(source: Source) -> None:
    """Refuse, before anything is written, a class or sample name that ``stage --unpack`` could not
    create (:func:`stager.manifest.entry_name_problem`, the one rule for names from the data), and two
    samples that would unpack to one file name (:func:`check_unpack_collisions`): one line naming the
    class folder or the samples. Every key is checked through a few passes over chunks of keys joined
    into one string (a columnar listing's chunks come joined: :class:`Lines`), so the check costs
    milliseconds per million."""
    for c in source.classes:
        why = entry_name_problem(c)
        if why is not None:
            where = source.root / c if isinstance(c, str) and source.root.is_dir() and "/" not in c else source.root
            raise SourceError(f"{shown(str(where))}: class name {c!r} {why}; rename it (any letter and spaces are "
                              "fine; not '/', NUL or control characters)")
    refs = source.refs
    chunks: Iterable[Sequence[str]] = (
        refs.key_chunks() if isinstance(refs, ListingRefs) else _key_chunks([r.key for r in refs])
    )
    start = 0
    for chunk in chunks:
        if isinstance(chunk, Lines):  # no key holds a newline (Lines' contract)
            lines, joints_ok = chunk.text, True
            longest = int(chunk.lengths.max(initial=0))
        else:
            lines = "\n".join(chunk)
            joints_ok = lines.count("\n") == len(chunk) - 1  # else a key holds a newline: a bad character
            longest = max(map(len, chunk), default=0) * 4
        suspects = set()
        if not joints_ok or _has_bad_chars(lines) or longest > NAME_MAX_BYTES:
            suspects = {i for i, k in enumerate(chunk)
                        if BAD_NAME_CHARS.search(k) or len(k.encode(errors="surrogatepass")) > NAME_MAX_BYTES}
        if "." in lines and _DOT_KEY.search(lines):  # memchr first: most keys hold no dot at all
            suspects |= {i for i, k in enumerate(chunk) if _DOT_KEY.search(k)}
        for i in sorted(suspects):
            ref = refs[start + i]
            stem = unpacked_stem(ref.key, class_dir_name(source.classes, ref.label))
            why = entry_name_problem(stem)
            if why is not None:
                raise SourceError(f"{shown(source.path_of(ref))}: sample {ref.key!r} would unpack to the file name "
                                  f"{stem!r}, which {why}; rename it (any letter and spaces are fine; not '/', NUL or "
                                  "control characters)")
        start += len(chunk)
    check_unpack_collisions(source)


def shown(text: str) -> str:
    """``text`` (a path from the data) as one printable line: quoted and escaped (``repr``) when it
    holds a control character or bytes that are not UTF-8, which would garble or break the line."""
    return repr(text) if BAD_NAME_CHARS.search(text) else text


# An ImageFolder key in a sub-folder of its class folder (a second '/'): the only kind whose unpacked
# name differs from the key's last part, so the only kind that can meet another sample's name.
_NESTED_KEY = re.compile(r"(?m)^[^\n/]*/[^\n/]*/")


def check_unpack_collisions(source: Source) -> None:
    """Refuse two samples that ``stage --unpack`` would write to one file: the same class folder and
    the same :func:`stager.manifest.unpacked_stem` (the key less its class folder, with ``/`` made
    ``_``: an ImageFolder's ``cat/a/b.jpg`` and ``cat/a_b.jpg`` both become ``cat/a_b``). Extensions
    are not compared: they come from the shard, and ``stager clean`` matches the tree's files by stem.

    An ImageFolder key starts with its class folder, so only keys in sub-folders (found by one regular
    expression per chunk) can meet another name: those are compared with each other and with the key
    ``<class>/<stem>``. Other sources' keys (list files, CIFAR, packs) are compared one by one."""
    refs = source.refs
    if isinstance(refs, ListingRefs):
        seen: dict[tuple[str, str], int] = {}
        labels = refs.columns.labels
        start = 0
        for chunk in refs.key_chunks():
            if _NESTED_KEY.search(chunk.text if isinstance(chunk, Lines) else "\n".join(chunk)):
                for i, k in enumerate(chunk):
                    if k.count("/") > 1:
                        _claim(source, seen, k, int(labels[start + i]), start + i)
            start += len(chunk)
        if not seen:
            return
        plain = {f"{c}/{s}": pos for (c, s), pos in seen.items()}
        start = 0
        for chunk in refs.key_chunks():
            for i, k in enumerate(chunk):
                if k in plain:
                    _collide(source, start + i, plain[k])
            start += len(chunk)
        return
    seen = {}
    for pos, ref in enumerate(refs):
        _claim(source, seen, ref.key, ref.label, pos)


def _claim(source: Source, seen: dict[tuple[str, str], int], key: str, label: int, pos: int) -> None:
    """Record sample ``pos`` (``key``, ``label``) under the file it unpacks to; refuse a second one."""
    cls = class_dir_name(source.classes, label)
    other = seen.setdefault((cls, unpacked_stem(key, cls)), pos)
    if other != pos:
        _collide(source, pos, other)


def _collide(source: Source, a: int, b: int) -> None:
    ra, rb = source.refs[a], source.refs[b]
    cls = class_dir_name(source.classes, ra.label)
    raise SourceError(f"{shown(source.path_of(ra))} and {shown(source.path_of(rb))}: samples {ra.key!r} and {rb.key!r} "
                      f"would both unpack to the file {cls}/{unpacked_stem(ra.key, cls)}.<ext> (`stage --unpack` "
                      "writes <class>/<key less its class folder, '/' as '_'>); rename one of them")


def _has_bad_chars(lines: str) -> bool:
    """Whether ``lines`` (keys joined by newlines) holds a character of :data:`BAD_NAME_CHARS`
    besides the newlines: for ASCII text, whether it is printable once the newlines are spaces (one
    C pass, ~5x the regular expression's speed)."""
    if lines.isascii():
        return not lines.replace("\n", " ").isprintable()
    return BAD_NAME_CHARS.search(lines.replace("\n", "/")) is not None  # '/' is allowed in a key


def _key_chunks(keys: list[str], step: int = 16384) -> Iterator[list[str]]:
    for a in range(0, len(keys), step):
        yield keys[a:a + step]


def check_out_place(src: str | os.PathLike[str], out: Path) -> None:
    """Refuse an OUT that is or lies inside the source directory ``src`` (:class:`UsageError`, exit 2):
    the next pack of SRC would list it (an ImageFolder as a class, as torchvision's would), and
    ``--overwrite`` would clear a directory inside the source."""
    root = os.path.abspath(os.fspath(src))
    if not os.path.isdir(root):
        return
    how = overlap(root, out)
    if how in ("is", "lies inside"):
        raise UsageError(f"{out}: OUT {how} the source {root}, so a later pack of it would list the pack as data "
                         "(an ImageFolder class); put OUT outside SRC")

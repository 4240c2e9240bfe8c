"""The directory tree of an image, level by level, into an :class:`~.listing.ImageListing`.

Each level (the root's entries, then their subdirectories' entries, ...) is one
:func:`~.dirtable.parse_listings` call and one :func:`~.inodes.decode_inodes` call over all of its
directories at once, so an ImageNet-shaped image (one root, 1,000 class folders, 1.28M files) is two
vectorised passes. Checks, each a one-line :class:`~stager.errors.SourceError` or
:class:`~stager.errors.UnsafeArchiveError` naming the image and the entry: a directory reached twice
(a loop, or two directories sharing a listing), names that are empty, ``.``/``..``, hold ``/``,
NUL or control characters, or are not UTF-8, paths longer than PATH_MAX, an entry whose inode
disagrees with it, and file data, fragments or listings outside the image.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stager.errors import SourceError, UnsafeArchiveError
from stager.formats.squashfs.columns import ByteView, segment_starts
from stager.formats.squashfs.dirtable import parse_listings
from stager.formats.squashfs.inodes import Inodes, decode_inodes, dir_index
from stager.formats.squashfs.layout import DATA_SIZE_MASK, DATA_STORED, DIR, LDIR, MAX_NAME, REG, split_ref
from stager.formats.squashfs.listing import ImageListing, block_totals, raw_offsets
from stager.formats.squashfs.meta import MetaTable
from stager.manifest.table import Ragged, Strings

_SINK = ("parent", "top", "itype", "size", "mode", "nlink", "number", "ref", "start_block", "fragment", "frag_offset",
         "nb", "path_lens")


class _Sink:
    """The listing's fixed-width columns (int64), filled level after level in place: a level's inodes
    are decoded straight into its slice (:func:`~.inodes.decode_inodes`'s ``into``), so no column is
    copied to join the levels. The capacity starts at the image's inode count (an estimate: hard links
    add entries) and grows when a level needs more; untouched capacity costs no memory."""

    def __init__(self, capacity: int) -> None:
        self.cols = {c: np.empty(max(capacity, 0), dtype=np.int64) for c in _SINK}
        self.n = 0

    def take(self, n: int) -> dict[str, np.ndarray]:
        """The next ``n`` rows of every column (views, valid until the next ``take``)."""
        have = len(self.cols["parent"])
        if self.n + n > have:
            grown = max(self.n + n, 2 * have)
            for c, col in self.cols.items():
                new = np.empty(grown, dtype=np.int64)
                new[: self.n] = col[: self.n]
                self.cols[c] = new
        views = {c: col[self.n : self.n + n] for c, col in self.cols.items()}
        self.n += n
        return views

    def columns(self) -> dict[str, np.ndarray]:
        return {c: col[: self.n] for c, col in self.cols.items()}


def walk(inode_t: MetaTable, dir_t: MetaTable, root_ref: int, *, block_size: int, fragments: np.ndarray,
         data_end: int, image: str, entries: int = 0) -> ImageListing:
    """Every entry under the root; see :class:`ImageListing` for the order and columns. ``entries``: the
    number expected (the superblock's inode count less the root), to size the columns at once."""
    iv, dv = inode_t.view(), dir_t.view()
    root_pos = np.asarray([inode_t.locate(*split_ref(root_ref))], dtype=np.int64)
    root = decode_inodes(iv, root_pos, np.asarray([DIR]), block_size=block_size, image=image, name_of=lambda i: "/")
    # At most one entry per 16 bytes of inode table (the smallest inode) whatever the superblock claims.
    sink = _Sink(min(entries, inode_t.size // 16))
    levels: list[dict[str, np.ndarray]] = []
    # The directories of the level being listed: entry index (-1: root), their inodes, path strings.
    todo = _Dirs(np.asarray([-1], dtype=np.int64), np.asarray([-1], dtype=np.int64), root, [""])
    seen = {root_ref}
    spans: list[np.ndarray] = []  # (start, size) of every listing: they may not overlap
    ctx = _Walk(inode_t, dir_t, iv, dv, block_size, image)
    while len(todo.entries):
        level, todo = _one_level(ctx, todo, sink, spans, seen)
        levels.append(level)
    _check_spans(np.concatenate(spans), image)
    return _assemble(sink, levels, block_size=block_size, fragments=fragments, data_end=data_end, image=image)


@dataclass
class _Walk:
    inode_t: MetaTable
    dir_t: MetaTable
    iv: ByteView
    dv: ByteView
    block_size: int
    image: str


@dataclass
class _Dirs:
    """The directories whose listings the next level reads: their entry indices (-1: the root), the
    top-level entries they are under (-1: the root), inodes and paths."""

    entries: np.ndarray
    tops: np.ndarray
    inodes: Inodes
    paths: list[str]
    depth: int = 0  # folders above them (their entries' paths hold this many '/')


def _one_level(ctx: _Walk, todo: _Dirs, sink: _Sink, spans: list[np.ndarray],
               seen: set[int]) -> tuple[dict[str, np.ndarray], _Dirs]:
    """List the directories ``todo``: the level's columns, and the directories of the next level.
    (A function of its own, so that the level's intermediate arrays are freed when it returns.)"""
    image, dir_t, dino, dir_paths = ctx.image, ctx.dir_t, todo.inodes, todo.paths
    sizes = dino.listing
    starts = np.zeros(len(sizes), dtype=np.int64)
    has = sizes > 0  # an empty directory may point past the table's end (an empty table)
    starts[has] = dir_t.locate_many(dino.dir_block[has], dino.dir_offset[has])
    over = starts + sizes > dir_t.size
    if over.any():
        i = int(np.argmax(over))
        raise SourceError(f"{image}: damaged directory table: the listing of {dir_paths[i] or '/'!r} runs past "
                          "the table's end; the image is damaged: re-copy or re-make it")
    spans.append(np.stack([starts[has], sizes[has]], axis=1))
    cuts = [dir_index(ctx.iv, ctx.inode_t.buffer, int(dino.index_pos[i]), count=int(dino.index_count[i]),
                      image=image, name=dir_paths[i]) if dino.itype[i] == LDIR else []
            for i in range(len(todo.entries))]
    parsed = parse_listings(dir_t.buffer, ctx.dv, np.arange(len(todo.entries), dtype=np.int64), starts=starts,
                            sizes=sizes, cuts=cuts, image=image, names=[p or "/" for p in dir_paths])
    values, pstarts, name_at = _paths(ctx.dv, parsed.name_pos, parsed.name_len, parsed.dir, dir_paths)
    _check_names(values, pstarts, name_at, todo.depth, image=image, dir_paths=dir_paths, owner=parsed.dir)
    refs = parsed.ino_ref
    pos = ctx.inode_t.locate_many(refs >> 16, refs & 0xFFFF)
    etype = np.where(parsed.type > 7, parsed.type - 7, parsed.type)
    paths = _LazyPaths(values, pstarts)
    base = sink.n
    out = sink.take(len(refs))
    inodes = decode_inodes(ctx.iv, pos, etype, block_size=ctx.block_size, image=image, name_of=paths.__getitem__,
                           into=out)
    bad = inodes.number != parsed.ino_number
    if bad.any():
        i = int(np.argmax(bad))
        raise SourceError(f"{image}: damaged directory table: the entry {paths[i]!r} says inode "
                          f"{int(parsed.ino_number[i])}, its inode is {int(inodes.number[i])}; the image is "
                          "damaged: re-copy or re-make it")
    sub = np.flatnonzero(etype == DIR)
    for i in sub.tolist():
        r = int(refs[i])
        if r in seen:
            raise SourceError(f"{image}: the directory {paths[i]!r} is reached twice (a directory loop); the "
                              "image is damaged or hostile: re-make it with mksquashfs")
        seen.add(r)
    out["parent"][:] = todo.entries[parsed.dir]
    if todo.depth == 0:  # the root's entries: each is its own top-level entry
        out["top"][:] = np.arange(base, base + len(refs), dtype=np.int64)
    else:
        out["top"][:] = todo.tops[parsed.dir]
    nxt = _Dirs(base + sub, out["top"][sub], _take(inodes, sub), [paths[i] for i in sub.tolist()], todo.depth + 1)
    out["ref"][:] = refs
    np.subtract(inodes.block_ptr[1:], inodes.block_ptr[:-1], out=out["nb"])
    np.subtract(pstarts[1:], pstarts[:-1], out=out["path_lens"])
    return {"words": inodes.block_words, "path_values": values}, nxt


def _check_spans(spans: np.ndarray, image: str) -> None:
    """Two directories whose listings overlap (the same entries under two names) are a damaged image."""
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    if (spans[1:, 0] < spans[:-1, 0] + spans[:-1, 1]).any():
        raise SourceError(f"{image}: damaged directory table: two directories share listing entries; the image is "
                          "damaged or hostile: re-make it with mksquashfs")


class _LazyPaths:
    """Paths of one level, decoded only when a message or a directory needs one."""

    def __init__(self, values: np.ndarray, starts: np.ndarray) -> None:
        self._values, self._starts = values, starts

    def __getitem__(self, i: int) -> str:
        a, b = int(self._starts[i]), int(self._starts[i + 1])
        return self._values[a:b].tobytes().decode("utf-8", "surrogateescape")


def _take(ino: Inodes, idx: np.ndarray) -> Inodes:
    cols = {f: getattr(ino, f)[idx] for f in ("itype", "mode", "number", "nlink", "start_block", "size", "fragment",
                                              "frag_offset", "dir_block", "dir_offset", "listing", "index_pos",
                                              "index_count")}
    return Inodes(block_ptr=np.zeros(len(idx) + 1, dtype=np.int64), block_words=np.zeros(0, dtype=np.uint32),
                  **cols)


_BYTES = 1 << 22  # path bytes checked per pass
# The longest path a program can name (Linux's PATH_MAX, 4096, less its NUL). Longer ones are refused:
# nothing could open them through a mount, and a deep tree of long names would cost memory quadratic
# in its depth (every entry's path is kept whole), gigabytes for an image of kilobytes.
MAX_PATH = 4095


def _check_names(values: np.ndarray, starts: np.ndarray, name_at: np.ndarray, depth: int, *, image: str,
                 dir_paths: list[str], owner: np.ndarray) -> None:
    """One level's paths (``values``, entry ``i`` at ``starts[i]:starts[i + 1]``, its name from
    ``name_at[i]``, ``depth`` slashes before it) must end in a path component: not ``.``/``..``, no
    ``/``, NUL or control characters, UTF-8 (the prefixes are names already checked). UTF-8, because
    every path of the listing is decoded as such: keys, class names, messages. No path may be longer
    than :data:`MAX_PATH` bytes."""
    n = len(starts) - 1
    full = np.diff(starts)
    if n and int(full.max()) > MAX_PATH:
        i = int(np.argmax(full))
        head = values[int(starts[i]) : int(starts[i]) + 60].tobytes().decode("utf-8", "replace")
        raise UnsafeArchiveError(f"{image}: the entry {head + '...'!r}, {depth} folders down, has a path of "
                                 f"{int(full[i])} bytes, longer than any program can open ({MAX_PATH}, PATH_MAX); "
                                 "stager reads no such image: re-make it from a shallower tree")
    length = starts[1:] - name_at
    if n and int(length.min()) > 2:  # no name short enough to be . or ..: no gather of first bytes
        bad_entry = np.zeros(n, dtype=bool)
    else:
        last = max(len(values) - 1, 0)
        first = values[np.minimum(name_at, last)] if len(values) else np.zeros(n, np.uint8)
        second = values[np.minimum(name_at + 1, last)] if len(values) else first
        bad_entry = (first == 0x2E) & ((length == 1) | ((length == 2) & (second == 0x2E)))
    slashes, high = 0, False
    for a in range(0, len(values), _BYTES):
        chunk = values[a : a + _BYTES]
        # Two reductions (no temporary) clear the usual chunk: every byte printable ASCII, 0x20-0x7E.
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0x20 or hi >= 0x7F:
            high |= hi >= 0x80
            control = (chunk < 0x20) | (chunk == 0x7F)
            if control.any():
                bad_entry[np.searchsorted(starts, a + np.flatnonzero(control), side="right") - 1] = True
        slashes += int(np.count_nonzero(chunk == 0x2F))
    if slashes != n * depth:  # a '/' inside a name
        per = np.zeros(n, dtype=np.int64)
        for a in range(0, len(values), _BYTES):
            hits = a + np.flatnonzero(values[a : a + _BYTES] == 0x2F)
            np.add.at(per, np.searchsorted(starts, hits, side="right") - 1, 1)
        bad_entry |= per != depth
    if high:  # not all ASCII: the rare case
        bad_entry |= _not_utf8(values, starts)
    if bad_entry.any():
        i = int(np.argmax(bad_entry))
        raw = values[int(name_at[i]) : int(starts[i + 1])].tobytes()
        where = dir_paths[int(owner[i])] or "/"
        raise UnsafeArchiveError(f"{image}: the directory {where!r} holds an entry named {raw!r}, which is not a "
                                 "file name (., .., a name with '/', NUL or control characters, or one that is not "
                                 "UTF-8); stager reads no such image: re-make it from a tree of plain UTF-8 names "
                                 "(convmv -r -f latin1 -t utf8 --notest TREE renames Latin-1 ones)")


def _not_utf8(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Which paths (``values[starts[i]:starts[i + 1]]``) are not UTF-8 (bool, ``(n,)``): the first one
    the decoder stops at, else those that begin inside a character (all the bytes together decode,
    so only a character running across a path's start can make one path invalid on its own)."""
    bad = np.zeros(len(starts) - 1, dtype=bool)
    try:
        values.tobytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        bad[int(np.searchsorted(starts, exc.start, side="right")) - 1] = True
        return bad
    return (values[starts[:-1]] & 0xC0) == 0x80  # paths are never empty: each start is a byte of its own


_PASS_BYTES = 1 << 24  # bytes of rows per pass of _paths (rows x widest path: 16 MiB)


def _paths(table: ByteView, pos: np.ndarray, length: np.ndarray, owner: np.ndarray,
           dir_paths: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """UTF-8 path bytes of one level's entries, whose names are ``length`` bytes at ``pos`` in the
    directory table: each parent's path and ``/`` (none at the top), then the name. Returns
    ``(values, starts (n + 1,), where each name starts in values)``.

    A pass lays its entries out as rows: the parent's prefix right-aligned in the pass's widest
    prefix's width, the name (gathered at the widest name's width) after it, so each row's path is
    one contiguous stretch; a mask from a table of row masks (no per-byte arithmetic) keeps it, and
    where every row of the pass has one length the rows are the values as they are."""
    prefixes = [(p + "/").encode("utf-8", "surrogateescape") if p else b"" for p in dir_paths]
    plen = np.fromiter((len(b) for b in prefixes), dtype=np.int64, count=len(prefixes))
    width = int(plen.max()) if len(plen) else 0
    ptable = np.zeros((len(prefixes), width), dtype=np.uint8)  # each prefix right-aligned
    for i, prefix in enumerate(prefixes):
        if prefix:
            ptable[i, width - len(prefix) :] = np.frombuffer(prefix, dtype=np.uint8)
    elen = plen[owner]
    starts = segment_starts(elen + length)
    values = np.empty(int(starts[-1]), dtype=np.uint8)
    masks: dict[int, np.ndarray] = {}  # row width -> masks[k]: the first k bytes of a row
    n = len(pos)
    step = max(1, _PASS_BYTES // (width + MAX_NAME))  # 65,536 entries a pass at ImageNet's depth
    for a in range(0, n, step):
        b = min(n, a + step)
        ln, pl = length[a:b], elen[a:b]
        w, pw = int(ln.max()), int(pl.max())
        uniform = int(pl.min()) == pw and int(ln.min()) == w
        # One length: the rows are the values, so they are laid out in place (no copy of them after).
        rows = values[starts[a] : starts[b]].reshape(b - a, pw + w) if uniform else \
            np.empty((b - a, pw + w), dtype=np.uint8)
        if pw:
            rows[:, :pw] = ptable[owner[a:b], width - pw :]
        rows[:, pw:] = table.rows(pos[a:b], w)
        if uniform:
            continue
        if pw + w not in masks:
            masks[pw + w] = np.arange(pw + w) < np.arange(pw + w + 1)[:, None]
        lut = masks[pw + w]
        keep = lut[pw + ln]
        if int(pl.min()) != pw:  # prefixes of several lengths: drop the padding before the short ones
            keep &= ~lut[pw - pl]
        values[starts[a] : starts[b]] = rows[keep]
    return values, starts, starts[:-1] + elen


def _assemble(sink: _Sink, levels: list[dict[str, np.ndarray]], *, block_size: int, fragments: np.ndarray,
              data_end: int, image: str) -> ImageListing:
    """All levels as one :class:`ImageListing` (the fixed-width columns are the sink's, in place; the
    ragged ones joined), checked against the data area and fragment table."""

    def cat(name: str) -> np.ndarray:
        """One ragged column over all levels; each level's part is dropped once copied (peak memory)."""
        parts = [lv.pop(name) for lv in levels]
        parts = [p for p in parts if len(p)] or parts[:1]
        if not parts:
            return np.zeros(0, dtype=np.uint8 if name == "path_values" else np.uint32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    cols = sink.columns()
    kind, parent, top = cols["itype"], cols["parent"], cols["top"]
    kind[kind > 7] -= 7  # extended types as their basic ones
    paths = Strings(Ragged(cat("path_values"), segment_starts(cols["path_lens"])))
    lst = ImageListing(paths, kind, parent, top, cols["size"], cols["mode"], cols["nlink"], cols["number"],
                       cols["ref"], cols["start_block"], segment_starts(cols["nb"]),
                       cat("words").astype(np.uint32, copy=False), cols["fragment"], cols["frag_offset"],
                       np.zeros(0, dtype=np.int64), fragments, block_size)
    _check_data(lst, data_end, image)
    lst.raw_offset = raw_offsets(lst)
    return lst


def _check_data(lst: ImageListing, data_end: int, image: str) -> None:
    """Every file's blocks and fragment tail lie in the data area; size words are sane."""
    kind, size, start, block_ptr = lst.kind, lst.size, lst.start_block, lst.block_ptr
    fragment, frag_offset, fragments, block_size = lst.fragment, lst.frag_offset, lst.fragments, lst.block_size
    n = len(kind)
    nb = np.diff(block_ptr)
    bad = np.zeros(n, dtype=bool)
    files = kind == REG
    if len(lst.block_words):
        w = lst.block_words.astype(np.int64)
        stored = w & DATA_SIZE_MASK
        wrong = ((w >> 25) != 0) | (stored > block_size)
        if wrong.any():
            bad[np.repeat(np.arange(n, dtype=np.int64), nb)[wrong]] = True
        total = block_totals(stored, block_ptr)
        bad |= files & (total > 0) & ((start < 96) | (start + total > data_end))
    has = files & (fragment >= 0)
    if has.any():  # the tails, checked over every row and kept where there is one (no gather of those rows)
        tail = nb * -block_size
        tail += size
        end = tail + frag_offset
        wrong = (fragment >= len(fragments)) | (tail <= 0) | (tail >= block_size) | (end > block_size)
        if len(fragments):
            fw = np.ascontiguousarray(fragments[:, 1])[np.clip(fragment, 0, len(fragments) - 1)]
            wrong |= ((fw & DATA_STORED) != 0) & (end > (fw & DATA_SIZE_MASK))
        wrong &= has
        bad |= wrong
    if bad.any():
        i = int(np.argmax(bad))
        raise SourceError(f"{image}: damaged inode of {lst.paths[i]!r}: its data blocks or fragment lie outside the "
                          "image or have impossible sizes; the image is damaged or truncated: re-copy or re-make it")

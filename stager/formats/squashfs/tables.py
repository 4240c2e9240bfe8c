"""The writer's directory tree, and its inode and directory tables.

:class:`Tree` holds what :class:`~.writer.SquashWriter` learnt of each file (where its blocks went,
its fragment) under its directories. :func:`build_tables` numbers the inodes and writes both tables
in one post-order pass, as mksquashfs does: a directory's subdirectories first (each complete with
its own listing and inode), then its files' inodes in name order, then its listing (every child's
inode reference is known by then), then its own inode (its listing's place is known by then). Inode
numbers follow that order, so the root has the highest number, and the export table is the list of
references in writing order.

Listings are sorted by name (bytes, as the kernel's lookup requires). A new header starts after 256
entries, when the next inode lives in another inode-table block, when the inode number would be
more than 32767 from the header's base, and whenever an entry would end in another directory-table
block than its header began in; the first header of each directory-table block after the first gets
an index entry (an extended directory inode), which lets the kernel's lookup skip ahead and lets
stager's reader walk a large directory as many short chains (:mod:`.dirtable`).
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass, field

from stager.errors import SourceError
from stager.formats.squashfs.compress import Compress
from stager.formats.squashfs.layout import (
    DIR,
    DIR_COUNT,
    DIR_ENTRY,
    DIR_HEADER,
    DIR_INDEX,
    DIR_INODE,
    LDIR,
    LDIR_INODE,
    LREG,
    LREG_INODE,
    METADATA_SIZE,
    NO_FRAGMENT,
    NO_XATTR,
    REG,
    REG_INODE,
    inode_ref,
)
from stager.formats.squashfs.meta import MetaWriter

FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z, as stager's tar shards: identical input, identical bytes
FILE_MODE, DIR_MODE = 0o644, 0o755


@dataclass
class Dir:
    """A directory of the tree being written: ``children`` maps a name (UTF-8 bytes) to a file id
    (int, an index into :class:`Files`) or a :class:`Dir`."""

    children: dict[bytes, int | Dir] = field(default_factory=dict)
    inodes: int = 0  # inodes in this subtree, itself included (set by build_tables)


class Files:
    """Per-file facts in compact columns (a million files cost tens of MB, not a million objects):
    ``start`` (image offset of the first block), ``size``, ``fragment`` (-1: none), ``frag_offset``,
    ``sparse`` (bytes of sparse blocks), and each file's block size words at ``words[ptr[i]:ptr[i] + nb[i]]``."""

    def __init__(self) -> None:
        self.start = array("q")
        self.size = array("q")
        self.fragment = array("q")
        self.frag_offset = array("q")
        self.sparse = array("q")
        self.ptr = array("q")
        self.nb = array("q")
        self.words = array("I")

    def add(self, size: int) -> int:
        """A new file of ``size`` bytes with no data placed yet; its id."""
        self.start.append(0)
        self.size.append(size)
        self.fragment.append(-1)
        self.frag_offset.append(0)
        self.sparse.append(0)
        self.ptr.append(0)
        self.nb.append(0)
        return len(self.size) - 1

    def set_blocks(self, fid: int, start: int, words: list[int], sparse: int = 0) -> None:
        self.start[fid] = start
        self.ptr[fid] = len(self.words)
        self.nb[fid] = len(words)
        self.words.extend(words)
        self.sparse[fid] = sparse

    def __len__(self) -> int:
        return len(self.size)


class Tree:
    """The directory tree of relative paths added so far."""

    def __init__(self) -> None:
        self.root = Dir()
        self.dirs = 1

    def add(self, parts: list[str], fid: int, image: str) -> None:
        """Place file ``fid`` at the path of components ``parts`` (checked by the caller)."""
        relpath = "/".join(parts)
        node = self.root
        for k, part in enumerate(parts[:-1]):
            key = part.encode("utf-8", "surrogateescape")
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Dir()
                self.dirs += 1
            elif not isinstance(child, Dir):
                raise SourceError(f"{image}: {'/'.join(parts[: k + 1])!r} is a file, and {relpath!r} needs it as a "
                                  "directory; two samples map to one path: rename one")
            node = child
        key = parts[-1].encode("utf-8", "surrogateescape")
        if key in node.children:
            raise SourceError(f"{image}: {relpath!r} is added twice (two samples map to one path); keys must be "
                              "unique: rename one")
        node.children[key] = fid


@dataclass
class Tables:
    """What :func:`build_tables` made: both tables on disk, the root's reference, every inode's
    reference by inode number - 1 (the export table's records), the inode count, and each file's
    inode reference by file id (``file_refs``: where a reader finds the file without a listing)."""

    inode_table: bytes
    dir_table: bytes
    root_ref: int
    refs: array
    inodes: int
    file_refs: array


class _Emitter:
    def __init__(self, files: Files, block_size: int, compress: Compress | None, total_inodes: int) -> None:
        self.files = files
        self.block_size = block_size
        self.inodes = MetaWriter(compress)
        self.dirs = MetaWriter(compress)
        self.refs = array("q")
        self.file_refs = array("q", bytes(8 * len(files)))
        self.total = total_inodes
        self.next_number = 1

    def file_inode(self, fid: int, num: int) -> bytes:
        f = self.files
        start, size, frag = f.start[fid], f.size[fid], f.fragment[fid]
        words = f.words[f.ptr[fid] : f.ptr[fid] + f.nb[fid]]
        fr = NO_FRAGMENT if frag < 0 else frag
        if start < 1 << 32 and size < 1 << 32 and f.sparse[fid] == 0:
            head = REG_INODE.pack(REG, FILE_MODE, 0, 0, FIXED_MTIME, num, start, fr, f.frag_offset[fid], size)
        else:
            head = LREG_INODE.pack(LREG, FILE_MODE, 0, 0, FIXED_MTIME, num, start, size, f.sparse[fid], 1, fr,
                                   f.frag_offset[fid], NO_XATTR)
        return head + words.tobytes()

    def directory(self, d: Dir, parent_number: int) -> tuple[int, int]:
        """Write ``d`` (subtree first); return ``(its inode number, its inode reference)``."""
        items = sorted(d.children.items(), key=lambda kv: kv[0])
        subdirs = [(n, c) for n, c in items if isinstance(c, Dir)]
        files = [(n, c) for n, c in items if not isinstance(c, Dir)] if subdirs else items
        # Subdirectories first: they need d's number as their parent, known only after d's files are
        # numbered; every subtree's size is known (Dir.inodes), so d's number is too.
        number_of_d = self.next_number + d.inodes - 1
        entries: list[tuple[bytes, int, int, int]] = []  # name, basic type, inode number, reference
        for n, c in subdirs:
            num, ref = self.directory(c, number_of_d)
            entries.append((n, DIR, num, ref))
        first = self.next_number
        chunks = [self.file_inode(fid, first + k) for k, (_n, fid) in enumerate(files)]  # type: ignore[arg-type]
        self.next_number += len(files)
        pos = self.inodes.written
        self.inodes.write(b"".join(chunks))  # the blocks before each position are final now
        for k, ((n, fid), chunk) in enumerate(zip(files, chunks, strict=True)):
            ref = inode_ref(*self.inodes.ref(pos))
            pos += len(chunk)
            self.refs.append(ref)
            self.file_refs[fid] = ref  # type: ignore[index]
            entries.append((n, REG, first + k, ref))
        if subdirs:
            entries.sort(key=lambda e: e[0])
        assert self.next_number == number_of_d
        return number_of_d, self._dir_inode(entries, len(subdirs), parent_number)

    def _dir_inode(self, entries: list[tuple[bytes, int, int, int]], subdirs: int, parent: int) -> int:
        start_pos = self.dirs.written
        listing, headers = _listing(entries, start_pos)
        blk, off = self.dirs.ref(start_pos)
        self.dirs.write(listing)
        index = []
        last_block = start_pos // METADATA_SIZE
        for hoff, first_name in headers[1:]:
            b = (start_pos + hoff) // METADATA_SIZE
            if b != last_block:
                index.append(DIR_INDEX.pack(hoff, self.dirs.ref(start_pos + hoff)[0], len(first_name) - 1)
                              + first_name)
                last_block = b
        num = self.next_number
        self.next_number += 1
        size = len(listing) + 3
        if index or size > 0xFFFF:
            ino = LDIR_INODE.pack(LDIR, DIR_MODE, 0, 0, FIXED_MTIME, num, 2 + subdirs, size, blk, parent, len(index),
                                  off, NO_XATTR) + b"".join(index)
        else:
            ino = DIR_INODE.pack(DIR, DIR_MODE, 0, 0, FIXED_MTIME, num, blk, 2 + subdirs, size, off, parent)
        ref = inode_ref(*self.inodes.ref())
        self.inodes.write(ino)
        self.refs.append(ref)
        return ref


def _count(root: Dir) -> int:
    """Set ``inodes`` of every directory under ``root`` (post-order, without recursion); the depth."""
    order, todo, depth = [], [(root, 1)], 1
    while todo:
        d, k = todo.pop()
        order.append(d)
        depth = max(depth, k)
        todo.extend((c, k + 1) for c in d.children.values() if isinstance(c, Dir))
    for d in reversed(order):
        d.inodes = 1 + sum(c.inodes if isinstance(c, Dir) else 1 for c in d.children.values())
    return depth


def _listing(entries: list[tuple[bytes, int, int, int]], at: int) -> tuple[bytes, list[tuple[int, bytes]]]:
    """A directory's listing for entries sorted by name, starting at directory-table position ``at``:
    its bytes, and ``(listing offset, first name)`` of each header."""
    out = bytearray()
    headers: list[tuple[int, bytes]] = []
    count = hpos = 0
    hblock = base = hstart = -1
    for name, typ, num, ref in entries:
        block, off = ref >> 16, ref & 0xFFFF
        end = at + len(out) + DIR_ENTRY.size + len(name)
        if (count == DIR_COUNT or block != hblock or not -32768 <= num - base <= 32767
                or (end - 1) // METADATA_SIZE != hstart // METADATA_SIZE):
            if count:
                struct.pack_into("<I", out, hpos, count - 1)
            hpos = len(out)
            hstart = at + hpos
            out += DIR_HEADER.pack(0, block, num)
            headers.append((hpos, name))
            hblock, base, count = block, num, 0
        out += DIR_ENTRY.pack(off, num - base, typ, len(name) - 1) + name
        count += 1
    if count:
        struct.pack_into("<I", out, hpos, count - 1)
    return bytes(out), headers


def build_tables(tree: Tree, files: Files, block_size: int, compress: Compress | None) -> Tables:
    """Number the inodes and write the inode and directory tables (see the module docstring)."""
    total = len(files) + tree.dirs
    if total >= 1 << 32:
        raise SourceError(f"{total} inodes: more than a SquashFS image holds; use a smaller --shard-size")
    depth = _count(tree.root)
    em = _Emitter(files, block_size, compress, total)
    # One Python frame per level of the tree: deep trees (thousands of levels) are legal paths.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, depth + 200))
    try:
        _root_number, root_ref = em.directory(tree.root, total + 1)
    finally:
        sys.setrecursionlimit(limit)
    return Tables(em.inodes.finish(), em.dirs.finish(), root_ref, em.refs, total, em.file_refs)

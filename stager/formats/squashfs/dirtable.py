"""Directory listings, parsed in bulk.

A directory's listing is a run of headers ``(count - 1, inode block, base inode number)`` each
followed by up to 256 entries ``(offset in the inode block, inode number delta, type, name size - 1,
name)``. Entries have variable length, so one listing is a chain that must be walked in order; a
Python loop over a million entries costs seconds. :func:`parse_listings` walks **many chains at
once** with numpy, one record of every chain per step: the chains are the listings of one tree level
(every class folder of an ImageFolder image), cut further at the headers a large directory's
extended inode indexes (mksquashfs indexes the first header in each 8 KiB metadata block, so an
ImageNet class folder is a dozen chains of ~250 entries). A step costs the same for 10 or 10,000
chains, so the listing takes as many steps as the longest chain has records.

When few chains are left (a deep, narrow tree), they finish in a plain loop. A chain that does not
end exactly where the next begins (an index that does not point at a header) is parsed again from
its directory's start without the index, and only a listing that fails that too is an error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from stager.errors import SourceError
from stager.formats.squashfs.columns import ByteView, segment_starts
from stager.formats.squashfs.layout import DIR_COUNT, DIR_ENTRY, DIR_HEADER, ENTRY_DTYPE, HEADER_DTYPE, MAX_NAME

_FEW = 24  # below this many live chains, a Python loop beats a numpy step


@dataclass
class Parsed:
    """Parsed directory entries, in listing order of the directories given, int64 columns of shape
    ``(entries,)``: ``dir`` (the caller's directory id), ``name_pos``/``name_len`` (the name's bytes in
    the directory table buffer), ``ino_ref`` (the inode reference, block << 16 | offset), ``ino_number``,
    ``type`` (the entry's inode type)."""

    dir: np.ndarray
    name_pos: np.ndarray
    name_len: np.ndarray
    ino_ref: np.ndarray
    ino_number: np.ndarray
    type: np.ndarray

    @classmethod
    def concat(cls, parts: list[Parsed]) -> Parsed:
        names = ("dir", "name_pos", "name_len", "ino_ref", "ino_number", "type")
        if not parts:
            return cls(*(np.zeros(0, dtype=np.int64) for _ in names))
        return cls(*(np.concatenate([getattr(p, n) for p in parts]) for n in names))


class _ChainError(Exception):
    pass


def parse_listings(table: memoryview, view: ByteView, dirs: np.ndarray, *, starts: np.ndarray, sizes: np.ndarray,
                   cuts: list[list[int]], image: str, names: list[str]) -> Parsed:
    """The entries of directories ``dirs`` (ids, int64) whose listings are ``sizes`` bytes at buffer
    offsets ``starts``; ``cuts[i]`` are listing offsets of headers from directory ``i``'s index
    (may be empty or wrong). ``names[i]`` names directory ``i`` in messages."""
    chain_dir, chain_start, chain_end = [], [], []
    for i in range(len(dirs)):
        s, n = int(starts[i]), int(sizes[i])
        if n == 0:
            continue
        offs = sorted({0, *(c for c in cuts[i] if 0 < c < n)})
        for a, b in zip(offs, [*offs[1:], n], strict=True):
            chain_dir.append(i)
            chain_start.append(s + a)
            chain_end.append(s + b)
    cd = np.asarray(chain_dir, dtype=np.int64)
    recs, failed = _lockstep(table, view, np.asarray(chain_start, dtype=np.int64),
                             np.asarray(chain_end, dtype=np.int64))
    bad_dirs = sorted({int(cd[c]) for c in failed})
    if bad_dirs:  # drop what the lockstep read of them; read them again whole
        keep = ~np.isin(cd[recs["chain"]], bad_dirs)
        recs = {k: v[keep] for k, v in recs.items()}
    out = _from_records(recs, cd, dirs)
    if not bad_dirs:
        return out  # already in listing order: directory by directory, each in its order
    parts = [out]
    for i in bad_dirs:  # again from the listing's start, ignoring the index
        s, n = int(starts[i]), int(sizes[i])
        try:
            r = _walk_py(table, s, s + n)
        except _ChainError as exc:
            raise SourceError(f"{image}: damaged directory listing of {names[i]!r}: {exc}; the image is damaged: "
                              "re-copy or re-make it") from exc
        cols = {k: np.asarray(v, dtype=np.int64) for k, v in r.items()}
        cols["chain"] = np.zeros(len(cols["pos"]), dtype=np.int64)
        parts.append(_from_records(cols, np.full(1, i, dtype=np.int64), dirs))
    out = Parsed.concat(parts)
    order = np.argsort(out.dir, kind="stable")  # back to the order of the directories given
    return Parsed(*(getattr(out, f)[order] for f in ("dir", "name_pos", "name_len", "ino_ref", "ino_number",
                                                      "type")))


def _from_records(recs: dict[str, np.ndarray], chain_dir: np.ndarray, dirs: np.ndarray) -> Parsed:
    return Parsed(dirs[chain_dir[recs["chain"]]] if len(recs["chain"]) else np.zeros(0, dtype=np.int64),
                   recs["pos"], recs["len"], recs["ref"], recs["ino"], recs["type"])


def _lockstep(table: memoryview, v: ByteView, starts: np.ndarray,
              ends: np.ndarray) -> tuple[dict[str, np.ndarray], set[int]]:
    """Walk every chain ``[starts[i], ends[i])`` one record per step; ``(records, failed chains)``.

    A step only advances each live chain past one entry (a header first, when one is due) and keeps
    the arrays it advanced from: where each chain's entry starts and which header it is under. The
    entries' fields are gathered once at the end, in chain order (:func:`_gather`)."""
    n = len(starts)
    u16, u32 = v.scalars(_U16), v.scalars(_U32)
    w = _Walk(n)
    chain = np.arange(n, dtype=np.int64)
    pos, end = starts.astype(np.int64), ends.astype(np.int64)
    rem = np.zeros(n, dtype=np.int64)  # entries left under the current header (0: a header comes next)
    hid = np.full(n, -1, dtype=np.int64)  # the current header's id (its index in w.heads)
    step = 0
    while len(chain) >= _FEW:
        h = rem == 0
        if h.any():
            hp = pos[h]
            bad = hp + DIR_HEADER.size > end[h]
            count = u32[np.where(bad, 0, hp)].astype(np.int64) + 1
            bad |= count > DIR_COUNT
            rem[h] = count
            hid = hid.copy()  # the arrays recorded so far stay as they were
            hid[h] = np.arange(w.nh, w.nh + len(hp), dtype=np.int64)
            w.nh += len(hp)
            w.heads.append(hp)
            pos = pos.copy()
            pos[h] = hp + DIR_HEADER.size
            if bad.any():
                dead = np.zeros(len(chain), dtype=bool)
                dead[np.flatnonzero(h)[bad]] = True
                w.failed.update(chain[dead].tolist())
                keep = ~dead
                chain, pos, end, rem, hid = chain[keep], pos[keep], end[keep], rem[keep], hid[keep]
                continue
        nxt = pos + (DIR_ENTRY.size + 1)
        nxt += u16[pos + 6]  # the entry's name size - 1
        w.pos.append(pos)
        w.chain.append(chain)
        w.hid.append(hid)
        rem -= 1
        step += 1
        over = nxt >= end
        if over.any():
            bad = (nxt > end) | (over & (rem != 0))
            w.failed.update(chain[bad].tolist())
            w.count[chain[over]] = step
            keep = ~over
            chain, pos, end, rem, hid = chain[keep], nxt[keep], end[keep], rem[keep], hid[keep]
        else:
            pos = nxt
    heads = v.records(np.concatenate(w.heads), HEADER_DTYPE) if w.heads else np.zeros(0, HEADER_DTYPE)
    for i in range(len(chain)):  # the few chains left: a plain loop
        c = int(chain[i])
        k = int(hid[i])
        try:
            r = _walk_py(table, int(pos[i]), int(end[i]), rem=int(rem[i]), hblk=int(heads["start"][k]) if k >= 0 else 0,
                         hino=int(heads["number"][k]) if k >= 0 else 0)
        except _ChainError:
            w.failed.add(c)
            continue
        w.rest[c] = (step, r)
        w.count[c] = step + len(r["pos"])
    return _gather(v, w, heads), w.failed


_U16, _U32 = np.dtype("<u2"), np.dtype("<u4")


class _Walk:
    """What a lockstep walk of ``n`` chains recorded: per step, the live chains, where their entries
    start and their headers' ids; the headers' positions; per chain its record count; the plain-loop
    rest of the chains that finished in one (``{chain: (first record index, columns)}``)."""

    def __init__(self, n: int) -> None:
        self.pos: list[np.ndarray] = []
        self.chain: list[np.ndarray] = []
        self.hid: list[np.ndarray] = []
        self.heads: list[np.ndarray] = []
        self.nh = 0
        self.count = np.zeros(n, dtype=np.int64)
        self.rest: dict[int, tuple[int, dict[str, list[int]]]] = {}
        self.failed: set[int] = set()


def _gather(v: ByteView, w: _Walk, heads: np.ndarray) -> dict[str, np.ndarray]:
    """The records of a walk in chain order (each chain's records in reading order), failed chains
    left out: the lockstep's entry starts and header ids are put in place (record ``s`` of chain ``c``
    goes to ``offs[c] + s``), then every entry's fields are read at once."""
    n = len(w.count)
    dead = np.zeros(n, dtype=bool)
    dead[list(w.failed)] = True
    counts = np.where(dead, 0, w.count)
    offs = segment_starts(counts)
    total = int(offs[-1])
    epos = np.zeros(total, dtype=np.int64)  # slots of the plain loops' records stay 0 until filled below
    ehid = np.zeros(total, dtype=np.int64)
    for step, (chain, pos, hid) in enumerate(zip(w.chain, w.pos, w.hid, strict=True)):  # one step's records
        dest = offs[chain] + step
        if w.failed:
            keep = ~dead[chain]
            dest, pos, hid = dest[keep], pos[keep], hid[keep]
        epos[dest] = pos
        ehid[dest] = hid
    e = v.records(epos, ENTRY_DTYPE)
    if not len(heads):  # every chain was read by the plain loop: their slots are overwritten below
        heads = np.zeros(1, HEADER_DTYPE)
    out = {"pos": epos + DIR_ENTRY.size, "len": e["size"].astype(np.int64) + 1,
           "ref": (heads["start"].astype(np.int64)[ehid] << 16) | e["offset"],
           "ino": heads["number"].astype(np.int64)[ehid] + e["delta"], "type": e["type"].astype(np.int64)}
    for c, (first, r) in w.rest.items():  # the plain loops' records, already decoded
        if dead[c]:
            continue
        a = int(offs[c]) + first
        for k, col in out.items():
            col[a : a + len(r[k])] = r[k]
    chain_of = np.repeat(np.arange(n, dtype=np.int64), counts)
    big = np.flatnonzero(out["len"] > MAX_NAME)
    if len(big):  # a name longer than the kernel allows: its chain was misread; its directory is read again
        w.failed.update(chain_of[big].tolist())
    out["chain"] = chain_of
    return out


def _walk_py(data: memoryview, pos: int, end: int, *, rem: int = 0, hblk: int = 0,
             hino: int = 0) -> dict[str, list[int]]:
    """One chain from ``pos`` to exactly ``end``, ``rem`` entries left under the current header."""
    r: dict[str, list[int]] = {k: [] for k in ("pos", "len", "ref", "ino", "type")}
    unpack_h, unpack_e = DIR_HEADER.unpack_from, DIR_ENTRY.unpack_from
    try:
        while pos < end or rem:
            if rem == 0:
                if pos + DIR_HEADER.size > end:
                    raise _ChainError(f"a header at byte {pos} runs past the listing's end")
                count, hblk, hino = unpack_h(data, pos)
                rem = count + 1
                if rem > DIR_COUNT:
                    raise _ChainError(f"a header at byte {pos} claims {rem} entries (at most {DIR_COUNT})")
                pos += DIR_HEADER.size
            if pos + DIR_ENTRY.size > end:
                raise _ChainError(f"an entry at byte {pos} runs past the listing's end")
            off, delta, typ, size = unpack_e(data, pos)
            size += 1
            if size > MAX_NAME or pos + DIR_ENTRY.size + size > end:
                raise _ChainError(f"an entry at byte {pos} has a name of {size} bytes past the listing's end")
            r["pos"].append(pos + DIR_ENTRY.size)
            r["len"].append(size)
            r["ref"].append(hblk << 16 | off)
            r["ino"].append(hino + delta)
            r["type"].append(typ)
            pos += DIR_ENTRY.size + size
            rem -= 1
    except struct.error as exc:
        raise _ChainError(str(exc)) from exc
    return r

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


@dataclass
class _Chains:
    """The live chains of a lockstep walk (int64 columns of shape ``(live,)``)."""

    chain: np.ndarray
    pos: np.ndarray
    end: np.ndarray
    rem: np.ndarray  # entries left under the current header (0: a header comes next)
    hblk: np.ndarray
    hino: np.ndarray

    def keep(self, mask: np.ndarray) -> _Chains:
        return _Chains(self.chain[mask], self.pos[mask], self.end[mask], self.rem[mask], self.hblk[mask],
                       self.hino[mask])


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
    """Walk every chain ``[starts[i], ends[i])`` one record per step; ``(records, failed chains)``."""
    n = len(starts)
    z = np.zeros(n, dtype=np.int64)
    live = _Chains(np.arange(n, dtype=np.int64), starts.copy(), ends.copy(), z.copy(), z.copy(), z.copy())
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("chain", "pos", "len", "ref", "ino", "type")}
    first_index: list[int] = []  # per part of out: the index of its first record within its chain
    loops: list[bool] = []  # per part: a plain-loop rest of one chain (else one lockstep step)
    failed: set[int] = set()
    last = v.n - 8  # the last position an 8-byte read may start at
    step = 0
    while len(live.chain) >= _FEW:
        bad, nxt = _step(v, live, last, out)
        first_index.append(step)  # a live chain reads one record a step, from step 0
        loops.append(False)
        step += 1
        live.pos = nxt
        live.rem = live.rem - 1
        at_end = live.pos == live.end
        bad |= at_end & (live.rem != 0)
        failed.update(live.chain[bad].tolist())
        live = live.keep(~(bad | (at_end & (live.rem == 0))))
    for i in range(len(live.chain)):  # the few chains left: a plain loop
        try:
            r = _walk_py(table, int(live.pos[i]), int(live.end[i]), rem=int(live.rem[i]), hblk=int(live.hblk[i]),
                         hino=int(live.hino[i]))
        except _ChainError:
            failed.add(int(live.chain[i]))
            continue
        out["chain"].append(np.full(len(r["pos"]), live.chain[i], dtype=np.int64))
        for k in ("pos", "len", "ref", "ino", "type"):
            out[k].append(np.asarray(r[k], dtype=np.int64))
        first_index.append(step)
        loops.append(True)
    return _chain_order(out, first_index, loops, n, failed), failed


def _step(v: ByteView, live: _Chains, last: int, out: dict[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One lockstep step: every live chain reads its header if one is due, then one entry, appended to
    ``out``. Returns ``(chains that broke, each chain's next position)``; ``live`` gets the headers."""
    h = live.rem == 0
    bad = np.zeros(len(live.chain), dtype=bool)
    if h.any():
        hp = live.pos[h]
        hbad = hp + DIR_HEADER.size > live.end[h]
        head = v.records(np.where(hbad, 0, hp), HEADER_DTYPE)
        count = head["count"].astype(np.int64) + 1
        hbad |= count > DIR_COUNT
        live.rem[h] = count
        live.hblk[h] = head["start"]
        live.hino[h] = head["number"]
        live.pos[h] = hp + DIR_HEADER.size
        bad[h] = hbad
    p = live.pos
    bad |= p + DIR_ENTRY.size > live.end
    e = v.records(np.where(bad | (p > last), 0, p), ENTRY_DTYPE)
    size = e["size"].astype(np.int64) + 1
    nxt = p + DIR_ENTRY.size + size
    bad |= (nxt > live.end) | (size > MAX_NAME)
    cols = {"chain": live.chain, "pos": p + DIR_ENTRY.size, "len": size, "ref": (live.hblk << 16) | e["offset"],
            "ino": live.hino + e["delta"], "type": e["type"]}
    ok = None if not bad.any() else ~bad
    for k, col in cols.items():
        out[k].append(col if ok is None else col[ok])
    return bad, nxt


def _chain_order(out: dict[str, list[np.ndarray]], first_index: list[int], loops: list[bool], n: int,
                 failed: set[int]) -> dict[str, np.ndarray]:
    """The records of the lockstep parts (a part: one step's records, or a chain's plain-loop rest)
    scattered into chain order, each chain's records in reading order: record ``k`` of a part of
    chain ``c`` goes to ``offs[c] + first_index + k``. One copy, no sort."""
    counts = np.zeros(n, dtype=np.int64)
    for chain, loop in zip(out["chain"], loops, strict=True):
        if loop:
            counts[chain[:1]] += len(chain)
        else:
            counts[chain] += 1  # a step: each chain once
    dead = np.zeros(n, dtype=bool)
    dead[list(failed)] = True
    counts[dead] = 0
    offs = segment_starts(counts)
    cols = {k: np.empty(int(offs[-1]), dtype=np.int64) for k in out}
    for j, chain in enumerate(out["chain"]):
        if not len(chain):
            continue
        dest = (offs[chain[0]] + first_index[j] + np.arange(len(chain)) if loops[j]
                else offs[chain] + first_index[j])
        keep = ~dead[chain] if failed else slice(None)
        for k in out:
            cols[k][dest[keep]] = out[k][j][keep]
    return cols


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

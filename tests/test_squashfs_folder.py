"""The vectorised string work of reading an image as an ImageFolder (``formats/squashfs/folder.py``)
agrees with plain Python on any paths: extension matching (case, the longest extension, paths shorter
than a word at the buffer's start), keys cut from paths (one length or many, long ones, the last
strings of the buffer) and their hashes (equal keys hash equal, and a repeat is found exactly)."""

from __future__ import annotations

import datetime as dt

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stager.formats.squashfs.folder import IMG_EXTENSIONS, cut_keys, extension_lengths, first_equal
from stager.manifest.table import Strings

NAME = st.text(alphabet=st.sampled_from("abAB._-/0é"), min_size=0, max_size=12)
EXT = st.sampled_from(["", ".jpg", ".JPEG", ".Png", ".tif", ".tiff", ".TIFF", ".webp", ".jp", ".bmpx", ".pgm"])
PATHS = st.lists(st.tuples(NAME, EXT).map("".join), min_size=1, max_size=60)


def reference_extension(path: str, extensions: tuple[str, ...]) -> int:
    raw = path.encode()
    for ext in sorted(extensions, key=len, reverse=True):
        want = ext.lower().encode()
        if len(raw) > len(want) and raw[-len(want):].lower() == want:
            return len(want)
    return 0


@settings(max_examples=300, deadline=dt.timedelta(seconds=5), derandomize=True)
@given(paths=PATHS)
def test_extension_lengths_match_plain_python(paths: list[str]) -> None:
    got = extension_lengths(Strings.from_strings(paths), IMG_EXTENSIONS).tolist()
    assert got == [reference_extension(p, IMG_EXTENSIONS) for p in paths]


@settings(max_examples=300, deadline=dt.timedelta(seconds=5), derandomize=True)
@given(paths=PATHS, data=st.data())
def test_cut_keys_match_plain_python(paths: list[str], data: st.DataObject) -> None:
    col = Strings.from_strings(paths)
    raw = [p.encode() for p in paths]
    rows = sorted(data.draw(st.sets(st.integers(0, len(paths) - 1))))
    cut = [data.draw(st.integers(0, len(raw[r]))) for r in rows]
    keys, hashes = cut_keys(col, np.asarray(rows, dtype=np.int64), np.asarray(cut, dtype=np.int64))
    want = [raw[r][: len(raw[r]) - c] for r, c in zip(rows, cut, strict=True)]
    assert [bytes(keys.raw[i]) for i in range(len(keys))] == want
    by_key: dict[bytes, int] = {}
    first = None
    for j, k in enumerate(want):
        i = by_key.setdefault(k, j)
        if i != j:
            assert hashes[i] == hashes[j]
            first = first or (i, j)
    assert first_equal(keys, hashes) == first


def test_cut_keys_of_long_and_uneven_strings() -> None:
    """Strings far longer than a pass's typical width, in passes of one length and of many, up to the
    buffer's last byte."""
    rng = np.random.default_rng(0)
    paths = [f"c{i % 7}/" + "x" * int(rng.integers(0, 300)) + f"{i}.jpg" for i in range(70_000)]
    paths[-1] = "y" * 400 + ".jpg"
    col = Strings.from_strings(paths)
    rows = np.arange(len(paths), dtype=np.int64)
    keys, hashes = cut_keys(col, rows, np.full(len(paths), 4, dtype=np.int64))
    assert list(keys) == [p[:-4] for p in paths]
    assert first_equal(keys, hashes) is None
    same = Strings.from_strings([f"n{i:08d}/n{i:08d}_{i:05d}.JPEG" for i in range(40_000)])
    keys, hashes = cut_keys(same, np.arange(40_000, dtype=np.int64), np.full(40_000, 5, dtype=np.int64))
    assert keys[12345] == "n00012345/n00012345_12345" and len(np.unique(hashes)) == 40_000

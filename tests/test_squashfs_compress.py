"""gzip blocks inflate the same with python-isal (when installed: twice zlib's speed) as with zlib:
the same bytes, and the same refusals of a block that expands past its limit, is truncated or is no
zlib stream (a :class:`DecompressError` the reader turns into a one-line error naming the image)."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

from stager.formats.squashfs.compress import BY_NAME, DecompressError, _gunzip, decompressor, inflate_module

MODULES: list[Any] = [zlib]
try:
    from isal import isal_zlib

    MODULES.append(isal_zlib)
except ImportError:  # the fallback is what runs; nothing else to compare
    pass


@pytest.mark.parametrize("inflate", MODULES, ids=lambda m: m.__name__)
def test_gzip_blocks_inflate_and_refuse_alike(inflate: Any) -> None:
    rng = random.Random(0)
    block = bytes(rng.choice(b"abcd") for _ in range(8192))
    packed = zlib.compress(block, 9)
    assert _gunzip(packed, 8192, inflate) == block
    assert _gunzip(memoryview(packed), 8192, inflate) == block
    with pytest.raises(DecompressError, match="expands past 4096"):
        _gunzip(packed, 4096, inflate)
    with pytest.raises(DecompressError, match="truncated"):
        _gunzip(packed[: len(packed) // 2], 8192, inflate)
    with pytest.raises(DecompressError, match="zlib"):
        _gunzip(b"\x78\x9c not deflate at all", 8192, inflate)


def test_the_reader_uses_the_faster_module_where_installed() -> None:
    assert inflate_module() is MODULES[-1]
    data = bytes(range(256)) * 64
    assert decompressor(BY_NAME["gzip"], "img.sqfs")(zlib.compress(data), len(data)) == data

"""Shard checksums.

The default is xxh3-128: non-cryptographic but a strong 128-bit hash that runs at memory bandwidth
(tens of GB/s), so verifying a staged copy costs far less than the copy itself. blake2b is offered
for users who want a cryptographic digest (about 1 GB/s per core). docs/benchmarks.md has figures.
"""

from __future__ import annotations

import os
from typing import Protocol

import xxhash

from stager.errors import UsageError

DEFAULT_ALGO = "xxh3_128"
ALGOS = ("xxh3_128", "blake2b")
READ_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher(algo: str = DEFAULT_ALGO) -> Hasher:
    """Return a fresh incremental hasher for ``algo`` (one of :data:`ALGOS`)."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "blake2b":
        import hashlib  # noqa: PLC0415 (OpenSSL's binding: only for the non-default algorithm)

        return hashlib.blake2b(digest_size=32)
    raise UsageError(f"unknown checksum algorithm {algo!r}; expected one of {', '.join(ALGOS)}")


def hash_bytes(data: bytes | memoryview, algo: str = DEFAULT_ALGO) -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def hash_file(path: str | os.PathLike[str], algo: str = DEFAULT_ALGO, chunk: int = READ_CHUNK) -> tuple[int, str]:
    """Hash a whole file; return ``(bytes read, hex digest)``."""
    h = new_hasher(algo)
    total = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            total += n
    return total, h.hexdigest()

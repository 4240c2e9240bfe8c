"""Re-hash a pack's (or a staged copy's) files and, with ``deep``, parse and decode its samples: ``stager verify``.

:func:`verify` re-hashes every shard and companion file listed in ``manifest.json``, and its sample
index, and compares sizes and checksums (a sound index's rows are then checked against the manifest:
labels in range, extents inside their shards). With ``deep=True`` it also parses every shard through its format reader
(``iter_samples``, independent of the manifest index) and checks that the container holds exactly
the indexed samples, in order, with the indexed keys and labels, and that the payloads the index
points at (``read``) equal the parsed ones; for a set adopted by ``stager index`` (someone else's
shards) "parse" means indexing the shard again with the recorded options and comparing the entries.
Deep mode then decodes every JPEG/PNG payload the loader would decode, with the loader's own decoder
(:func:`stager.decode.decode_rgb`), so a sample the loader refuses as damaged fails here too, named
by shard and key, even when its bytes hash as the manifest says (damaged before it was packed).
A damaged manifest raises :class:`ManifestError`. A staged copy that holds a share of the shards by
design (a receipt of ``--partition`` or ``--unpack only``) is checked against the shards its receipt
lists; :func:`advice` repairs it with the flags that staged it, in the directory verified.

A pack at a URL (``s3://...``, ``https://...``) is verified the same way: each file is streamed
through the hasher with retried ranged GETs (:mod:`stager.fs.remote`), nothing is written locally;
with ``deep`` each shard is fetched into a temporary directory (the format readers need a local
file), checked and removed before the next, so local disk holds at most ``threads`` shards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stager.checksum import new_hasher
from stager.decode import decode_rgb
from stager.errors import StagerError
from stager.formats import get_format
from stager.fs.open import filesystem, local_path_of
from stager.fs.remote import RemoteFile, stream_to
from stager.fs.safe import kind_of
from stager.fs.verified import Expected, mismatch, verify_file
from stager.index import rescan_shard
from stager.manifest import Manifest, ShardInfo, dataset_root, load_manifest, shard_root
from stager.manifest.fields import offset_column, size_column, values_column

READ_BATCH = 256  # samples compared per reader.read() call in deep mode
REMOTE_BLOCK = 8 << 20  # bytes per ranged GET when hashing a remote file


@dataclass
class VerifyResult:
    """``ok`` is True when every file (and, with ``deep``, every sample) matches the manifest.

    ``bad`` lists ``(file name, reason)`` for each problem found, in manifest order.
    """

    path: str
    ok: bool
    bad: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    samples: int = 0
    deep: bool = False
    seconds: float = 0.0
    dataset_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "path": self.path,
            "dataset_id": self.dataset_id,
            "deep": self.deep,
            "files": self.files,
            "bytes": self.bytes,
            "samples": self.samples,
            "seconds": round(self.seconds, 4),
            "bad": [{"file": n, "reason": r} for n, r in self.bad],
        }


def _check_file(root: str, name: str, nbytes: int, digest: str, algo: str) -> str | None:
    path = os.path.join(root, name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"is a {kind_of(st)}, expected a regular file"  # never opened: a FIFO would block
    size = st.st_size
    if size != nbytes:
        return f"size {size} bytes, expected {nbytes}"
    try:
        return verify_file(path, Expected(name, nbytes, digest, algo))
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _open_reader(root: str, info: ShardInfo, m: Manifest) -> tuple[Any, str | None]:
    """``(reader, None)`` for shard ``info`` with its format's reader, or ``(None, why it cannot be opened)``."""
    try:
        return get_format(m.format).open_reader(os.path.join(root, info.name), info, m), None
    except (StagerError, OSError, ValueError, KeyError) as exc:
        return None, f"cannot open with the {m.format} reader ({exc})"


def _deep_check(root: str, info: ShardInfo, m: Manifest) -> str | None:
    if m.indexed:  # someone else's shards: index the shard again with the recorded options and compare
        return rescan_shard(os.path.join(root, info.name), info, m)
    reader, err = _open_reader(root, info, m)
    if reader is None:
        return err
    try:
        n = 0
        pending: list[Any] = []

        def compare(start: int, parsed: list[Any]) -> str | None:
            got = reader.read(np.arange(start, start + len(parsed)))
            for j, (a, b) in enumerate(zip(parsed, got, strict=True)):
                same = np.array_equal(a, b) if isinstance(a, np.ndarray) else bytes(a) == bytes(b)
                if not same:
                    return f"sample {start + j} ({info.keys[start + j]}): indexed payload differs from the parsed one"
            return None

        for s in reader.iter_samples():
            if n >= info.samples:
                return f"holds more than the {info.samples} indexed samples"
            if s.key != info.keys[n] or int(s.label) != int(info.labels[n]):
                want = (info.keys[n], int(info.labels[n]))
                return f"sample {n}: parsed ({s.key!r}, {s.label}), index says ({want[0]!r}, {want[1]})"
            size = s.data.size if isinstance(s.data, np.ndarray) else len(s.data)
            if size != int(info.sizes[n]):
                return f"sample {n} ({s.key}): {size} bytes, index says {int(info.sizes[n])}"
            if s.fields:
                err = _check_fields(s.fields, n, info, os.path.join(root, info.name))
                if err:
                    return f"sample {n} ({s.key}): {err}"
            pending.append(s.data)
            n += 1
            if len(pending) == READ_BATCH:
                err = compare(n - len(pending), pending)
                if err:
                    return err
                pending = []
        if pending:
            err = compare(n - len(pending), pending)
            if err:
                return err
        if n != info.samples:
            return f"holds {n} samples, index says {info.samples}"
    except (StagerError, OSError, ValueError, KeyError, EOFError) as exc:
        return f"unreadable sample ({exc})"
    finally:
        reader.close()
    return None


IMAGE_MAGIC = (b"\xff\xd8", b"\x89PNG\r\n\x1a\n")  # JPEG and PNG: the payloads the loader decodes
UNDECODABLE = "cannot be decoded"  # the words of a decode failure in ``VerifyResult.bad`` (the CLI's advice differs)


def _decode_check(root: str, info: ShardInfo, m: Manifest) -> str | None:
    """Decode every JPEG/PNG payload of shard ``info`` as the loader does; the first failure, named by key."""
    reader, err = _open_reader(root, info, m)
    if reader is None:
        return err
    try:
        for start in range(0, info.samples, READ_BATCH):
            got = reader.read(np.arange(start, min(start + READ_BATCH, info.samples)))
            for j, data in enumerate(got):
                if isinstance(data, np.ndarray) or not bytes(data[:8]).startswith(IMAGE_MAGIC):
                    continue  # decoded arrays, and payloads that are no image the loader decodes
                try:
                    decode_rgb(bytes(data))
                except (StagerError, OSError, ValueError) as exc:
                    return f"sample {start + j} ({info.keys[start + j]}): {UNDECODABLE} ({exc})"
    except (StagerError, OSError, ValueError, KeyError, EOFError) as exc:
        return f"unreadable sample ({exc})"
    finally:
        reader.close()
    return None


def _check_fields(fields: dict[str, Any], n: int, info: ShardInfo, path: str) -> str | None:
    """The fields a reader parsed (tar members) against the index: byte fields' bytes at their extents,
    ragged fields' values (docs/fields.md)."""
    cols = info.columns
    for name, value in fields.items():
        ragged = cols.get(values_column(name))
        if ragged is not None:
            want = np.asarray(ragged[n])
            if want.shape != np.shape(value) or not np.allclose(want, value, rtol=1e-6, atol=1e-4):
                return f"field {name!r} differs from the index"
            continue
        off, size = int(cols[offset_column(name)][n]), int(cols[size_column(name)][n])
        with open(path, "rb") as f:
            at = os.pread(f.fileno(), size, off)
        if at != bytes(value):
            return f"field {name!r}: the index's extent {off}+{size} does not hold the parsed bytes"
    return None


def _check_remote(fs: Any, root: str, url: str, entry: tuple[str, int, str], algo: str, *,
                  keep: str | None = None) -> str | None:
    """:func:`_check_file` for the object ``entry`` (name, bytes, hash) under ``root`` of ``fs``
    (``url`` names it in messages), streamed through the hasher; with ``keep`` the bytes are also
    written to that local path."""
    name, nbytes, digest = entry
    path = root.rstrip("/") + "/" + name
    try:
        src = RemoteFile(fs, path, f"{url.rstrip('/')}/{name}")
    except FileNotFoundError:
        return "missing"
    if src.size != nbytes:
        return f"size {src.size} bytes, expected {nbytes}"
    h = new_hasher(algo)
    with src, (open(keep, "wb") if keep else contextlib.nullcontext()) as out:
        total = stream_to(src, out, h, REMOTE_BLOCK)
    return mismatch(Expected(name, nbytes, digest, algo), total, h.hexdigest())


def _verify_remote(root_url: str, m: Manifest, storage_options: Mapping[str, Any] | None, *, deep: bool,
                   threads: int) -> list[tuple[str, str]]:
    """``(file, reason)`` for every bad file of ``m``, whose shards are under ``root_url`` (see the
    module docstring)."""
    fs, root = filesystem(root_url, storage_options)
    algo = m.hash_algo

    def one(info: ShardInfo) -> list[tuple[str, str]]:
        bad: list[tuple[str, str]] = []
        tmp = tempfile.mkdtemp(prefix="stager-verify-") if deep else None
        try:
            for entry in [(info.name, info.bytes, info.hash), *((a.name, a.bytes, a.hash) for a in info.aux)]:
                keep = os.path.join(tmp, entry[0]) if tmp else None
                reason = _check_remote(fs, root, root_url, entry, algo, keep=keep)
                if reason:
                    bad.append((entry[0], reason))
            if tmp and not bad:
                reason = _deep_check(tmp, info, m) or _decode_check(tmp, info, m)
                if reason:
                    bad.append((info.name, reason))
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        return bad

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(m.shards) or 1))) as ex:
        return [b for found in ex.map(one, m.shards) for b in found]


def verify(path: str | os.PathLike[str], *, deep: bool = False, threads: int = 4,
           storage_options: Mapping[str, Any] | None = None) -> VerifyResult:
    """Verify the pack at ``path`` (directory, manifest path or URL); see the module docstring.

    Files are hashed on ``threads`` threads (I/O overlaps; xxh3 runs near memory bandwidth).
    ``storage_options`` go to every open of a URL. Raises :class:`ManifestError`/
    :class:`ShardMissingError` only for the manifest itself.
    """
    t0 = time.perf_counter()
    p = os.fspath(path)
    m = load_manifest(p, dict(storage_options or {}))
    root = shard_root(p, m)
    files = list(m.files())
    # The sample index first: per-sample checks (deep) trust it only once its hash matched.
    bad = _check_index(dataset_root(p), m, storage_options)
    deep = deep and not bad
    local = local_path_of(root)
    if local is None:
        bad += _verify_remote(root, m, storage_options, deep=deep, threads=threads)
    else:
        only = _staged_share(p, m)
        if only is not None:
            files = [f for f in files if f[0] in only or (m.index is not None and f[0] == m.index.name)]
        bad += _verify_local(local, m, deep=deep, threads=threads, only=only)
    return VerifyResult(
        path=p,
        ok=not bad,
        bad=bad,
        files=len(files),
        bytes=m.num_bytes,
        samples=m.num_samples,
        deep=deep,
        seconds=time.perf_counter() - t0,
        dataset_id=m.dataset_id,
    )


def _check_index(root: str, m: Manifest, storage_options: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``[(index name, reason)]`` when the sample index (beside the manifest, at ``root``) is missing,
    differs from its manifest entry, or holds rows the manifest contradicts; ``[]`` when sound."""
    if m.index is None:
        return []
    ix = m.index
    entry = (ix.name, ix.bytes, ix.hash)
    local = local_path_of(root)
    if local is None:
        fs, froot = filesystem(root, storage_options)
        reason = _check_remote(fs, froot, root, entry, m.hash_algo)
    else:
        reason = _check_file(local, *entry, m.hash_algo)
    if reason is None and m.samples_index is not None:
        try:
            m.samples_index.table  # noqa: B018 - opening it runs the per-row checks
        except StagerError as exc:
            reason = str(exc)
    return [(ix.name, reason)] if reason else []


def _staged_receipt(p: str, m: Manifest) -> Any:
    """The receipt of the staged copy of ``m`` at the local directory of ``p`` (a
    :class:`stager.receipt.Receipt`), or None (a pack, a URL, another dataset's or a damaged receipt)."""
    from stager.receipt import load_receipt  # noqa: PLC0415 (only for a local directory)

    local = local_path_of(dataset_root(p))
    if local is None:
        return None
    rec = None
    with contextlib.suppress(StagerError, OSError):
        rec = load_receipt(local)
    return rec if rec is not None and rec.manifest_digest.endswith(m.digest) else None


def _staged_share(p: str, m: Manifest) -> set[str] | None:
    """For a staged copy that holds a share of the shards by design (``--partition``: this node's;
    ``--unpack only``: none), the files it should hold (its receipt's shards and their companions);
    None when every file of the manifest belongs there."""
    rec = _staged_receipt(p, m)
    if rec is None or not (rec.mode == "partition" or rec.manifest_digest.startswith("unpack-only:")):
        return None
    keep = set(rec.shards)
    return {n for s in m.shards if s.name in keep for n in (s.name, *(a.name for a in s.aux))}


def _verify_local(root: str, m: Manifest, *, deep: bool, threads: int,
                  only: set[str] | None = None) -> list[tuple[str, str]]:
    """``[(file, reason)]`` for the bad files of ``m`` at ``root`` (``only``: just those names)."""
    index = m.index.name if m.index is not None else None
    files = [f for f in m.files() if f[0] != index and (only is None or f[0] in only)]

    def one(entry: tuple[str, int, str]) -> tuple[str, str | None]:
        name, nbytes, digest = entry
        return name, _check_file(root, name, nbytes, digest, m.hash_algo)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(files)))) as ex:
        checked = list(ex.map(one, files))
    bad = [(n, r) for n, r in checked if r is not None]
    if deep:
        broken = {n for n, _ in bad}
        todo = [info for info in m.shards if info.name not in broken and (only is None or info.name in only)]

        def deep_one(info: ShardInfo) -> str | None:
            return _deep_check(root, info, m) or _decode_check(root, info, m)

        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo) or 1))) as ex:
            reasons = list(ex.map(deep_one, todo))  # decoding releases the GIL: shards in parallel
        bad += [(info.name, r) for info, r in zip(todo, reasons, strict=True) if r]
    return bad


def advice(result: VerifyResult) -> str:
    """What to do about ``result``'s bad files, as commands that repair them when run as printed.

    A staged copy (a receipt beside the manifest) whose files differ from the manifest: ``stager stage
    --repair SRC DEST`` (hashes DEST again and copies exactly the damaged files; after ``stager cache
    verify CACHE`` when DEST links a shard cache's objects). Samples that hash as the manifest says but
    cannot be decoded were damaged before they were packed: no copy repairs them. A pack's damaged
    files: the ``stager pack`` that wrote it, run again, rewrites exactly those shards.
    """
    undecodable = [n for n, r in result.bad if UNDECODABLE in r]
    if len(undecodable) == len(result.bad):
        return ("the damaged samples hash as the manifest says, so they were damaged before packing: replace them "
                "in the source and re-run the `stager pack` that wrote this pack, or read around them with "
                "on_error='skip' (stager.loader.make_loader(..., on_error='skip'))")
    root = dataset_root(result.path)
    rec = None
    if local_path_of(root) is not None:
        with contextlib.suppress(StagerError, OSError):
            rec = load_manifest_receipt(result.path)
    if rec is not None:
        # The directory verified (the copy may have been moved since the receipt was written), and the
        # flags that staged it: a --partition copy repaired without them would become a full copy.
        here = os.path.abspath(local_path_of(root) or root)
        cmd = f"stager stage --repair {_quote(rec.source)} {_quote(here)}{_mode_flags(rec)}"
        if rec.cache:
            cdir = _quote(str(rec.cache.get("dir")))
            return (f"repair the staged copy: run `stager cache verify {cdir}` (it removes damaged cache objects), "
                    f"then `{cmd} --cache {cdir}`")
        return f"repair the staged copy: run `{cmd}` (it hashes DEST again and copies exactly the damaged files)"
    return ("restore them from a copy, or run again the `stager pack` command that wrote this pack: with the same "
            "source and options it rewrites exactly the damaged shards")


def load_manifest_receipt(path: str) -> Any:
    """The receipt of the staged copy of the manifest at ``path`` (None for a pack)."""
    return _staged_receipt(path, load_manifest(path))


def _mode_flags(rec: Any) -> str:
    """The ``stager stage`` flags that reproduce the receipt's mode (partition, shared, unpacked tree)."""
    flags = ""
    part = rec.partition if isinstance(rec.partition, dict) else {}
    if rec.mode in ("partition", "shared") and part:
        flags += f" --{rec.mode} --node {int(part.get('node', 0))} --num-nodes {int(part.get('num_nodes', 1))}"
        if rec.mode == "partition":
            flags += f" --seed {int(part.get('seed', 0))}"
    if rec.unpacked:
        flags += " --unpack only" if rec.manifest_digest.startswith("unpack-only:") else " --unpack"
        name = os.path.basename(str(rec.unpacked).rstrip("/"))
        if name != "unpacked":
            flags += f" --unpack-dir {_quote(name)}"
    return flags


def _quote(s: str) -> str:
    import shlex  # noqa: PLC0415 (only for advice)

    return shlex.quote(s)

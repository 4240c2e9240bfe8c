"""Flags, checked where they are parsed: the one place every sub-command takes its flag types and shared flags from.

* :class:`Parser`: an ``ArgumentParser`` whose ``error()`` raises :class:`~stager.errors.UsageError` (exit 2)
  instead of printing a usage block and exiting, so that the CLI reports a bad flag as it reports every
  other error: one line ``stager <cmd>: error: ...`` on stderr and, with ``--json``, one JSON object on
  stdout. Its help pages keep their examples (the epilog) as written.
* ``type=`` functions: :func:`positive_int`, :func:`workers`, :func:`nonneg_int`, :func:`size`, :func:`byte_count`,
  :func:`quota`,
  :func:`duration`, :func:`interval`, :func:`hw`, :func:`node_count`, :func:`label_offset`, :func:`stripe_count`,
  :func:`rank_list`. Numbers stay in bounds that the engines can hold (64 bits, a year, 8 EiB, a million
  nodes, ``-j`` at most 4 per CPU): a typo is a usage error, not a traceback or a node out of memory. A bad value is a
  usage error that names the flag (argparse adds ``argument --workers/-j:``).
* shared flags, meaning the same in every command: :func:`add_common` (``--json``, ``-q``),
  :func:`add_workers` (``-j/--workers``), :func:`add_cache_dir` (a cache directory defaulting to
  ``$STAGER_CACHE``, as ``stage --cache`` does), :func:`add_hash` (``--hash``), :func:`add_storage_options`.

Nothing here imports numpy or an engine: ``stager <cmd> --help`` stays fast (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from stager.errors import UsageError
from stager.world import MAX_NODES  # --num-nodes, --nodes: as many as the launchers' variables may say

JSON_FLAG = "--json"
MAX_BYTES = (1 << 63) - 1  # the largest size and integer: what a file offset (off_t) holds
MIN_WORKER_LIMIT = 64  # -j up to this is always accepted (copy streams to an object store may want many)
MAX_SIDE = 65_535  # --resize: JPEG's largest side
MAX_PIXELS = 1 << 28  # --resize: 268M pixels (PIL refuses to decode beyond ~179M as a decompression bomb)
MAX_SECONDS = 366 * 24 * 3600.0  # the longest duration: a year (beyond, timers overflow); no flag: no limit
PROG_ATTR = "_stager_prog"  # the innermost parser's prog ("stager cache gc"), recorded in the namespace


def usage_error(message: str, prog: str) -> UsageError:
    """A :class:`UsageError` that remembers which (sub-)command's parser raised it (``exc.prog``)."""
    exc = UsageError(message)
    exc.prog = prog  # type: ignore[attr-defined]
    return exc


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for the stager CLI; sub-parsers are made of the same class.

    ``error()`` raises :class:`UsageError` (message plus ``see `stager <cmd> --help```), never exits;
    ``parse_known_args`` records the innermost parser's ``prog`` in the namespace (:data:`PROG_ATTR`),
    so that a later error names the sub-command; the epilog (examples) is printed as written.
    """

    def error(self, message: str) -> NoReturn:
        raise usage_error(f"{message} (see `{self.prog} --help`)", self.prog)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if getattr(ns, PROG_ATTR, None) is None:  # a sub-parser, which ran inside this one, set it first
            setattr(ns, PROG_ATTR, self.prog)
        return ns, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, PROG_ATTR, self.prog)
            raise usage_error(f"unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)", prog)
        return ns

    def format_help(self) -> str:
        epilog, self.epilog = self.epilog, None
        try:
            text = super().format_help()
        finally:
            self.epilog = epilog
        return text + (f"\n{epilog.strip(chr(10))}\n" if epilog else "")


def examples(*lines: str) -> str:
    """An epilog of example command lines (``# comment`` lines are kept as comments)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def prog_of(args: argparse.Namespace | None, default: str = "stager") -> str:
    """The innermost parser's prog of a parsed command line (``stager pack``, ``stager cache gc``)."""
    return str(getattr(args, PROG_ATTR, None) or default)


def json_requested(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``--json`` (before a ``--``): for errors raised before it is parsed. As
    argparse reads it: a prefix of it (``--js``), and also ``--json=...`` (an error of its own, which the
    user still wants as JSON)."""
    for a in argv:
        if a == "--":
            return False
        flag = a.split("=", 1)[0]
        if len(flag) >= len("--j") and JSON_FLAG.startswith(flag):
            return True
    return False


# ---- types -------------------------------------------------------------------------------------------
def _int(text: str, what: str) -> int:
    """``text`` as an integer that fits 64 bits (beyond, numpy and the OS would overflow)."""
    try:
        v = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not -MAX_BYTES - 1 <= v <= MAX_BYTES:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}, which is out of range (64 bits)")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (threads, counts)."""
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def max_workers() -> int:
    """The most processes or threads ``-j`` may ask for: 4 per CPU this process may run on, at least 64.
    More is a typo (``-j 99999999`` would fork until the node runs out of memory)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(MIN_WORKER_LIMIT, 4 * cpus)


def workers(text: str) -> int:
    """``-j N``: an integer from 1 to :func:`max_workers`."""
    v = positive_int(text)
    limit = max_workers()
    if v > limit:
        raise argparse.ArgumentTypeError(f"{text!r} is more than this node can run (at most {limit}: 4 per CPU, "
                                         f"at least {MIN_WORKER_LIMIT})")
    return v


def nonneg_int(text: str) -> int:
    """An integer >= 0 (an index, a limit)."""
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def node_count(text: str) -> int:
    """A number of nodes: 1 to :data:`MAX_NODES` (more than any machine has is a typo, and would take the
    memory of one entry per node)."""
    v = positive_int(text)
    if v > MAX_NODES:
        raise argparse.ArgumentTypeError(f"expected a number of nodes up to {MAX_NODES:,}, got {text!r}")
    return v


def label_offset(text: str) -> int:
    """An integer added to labels: within 32 bits, as labels are class indices."""
    v = _int(text, "an integer")
    if not -(1 << 31) <= v < 1 << 31:
        raise argparse.ArgumentTypeError(f"expected an integer within 32 bits (a label offset, e.g. -1), got {text!r}")
    return v


def stripe_count(text: str) -> int:
    """A Lustre stripe count: >= 1, or -1 for every OST (``lfs setstripe -c -1``)."""
    v = _int(text, "a stripe count (>= 1, or -1 for every OST)")
    if v < 1 and v != -1:
        raise argparse.ArgumentTypeError(f"expected a stripe count >= 1 (or -1 for every OST), got {text!r}")
    return v


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60}
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "e": 10**18}


def parse_size(text: str, *, minimum: int = 1) -> int:
    """``"256MiB"``, ``"1G"``, ``"4m"`` -> bytes. Bare/``i``/``iB`` suffixes are powers of 1024;
    ``kB``/``MB``/``GB``/``TB``/``PB``/``EB`` are powers of 1000 (so ``1G == 1GiB == 1073741824``, ``1GB == 10**9``).
    A fraction needs a unit (``1.5G``): a plain number is whole bytes. At most :data:`MAX_BYTES`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtpeKMGTPE]?)(i?)([bB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 268435456, 256MiB, 1G or 500MB")
    num, unit, iec, b = m.groups()
    unit = unit.lower()
    if not unit and "." in num:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a plain number is whole bytes; give a unit for a "
                                         f"fraction (e.g. {num}G)")
    mult = _SI[unit] if (unit and b and not iec) else _UNITS[unit]
    whole, _, frac = num.partition(".")
    value = int(whole) * mult + (int(frac) * mult) // 10 ** len(frac) if frac else int(whole) * mult
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: more than the largest file offset (8 EiB)")
    if value < minimum:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be at least {minimum} byte"
                                          f"{'s' if minimum != 1 else ''}")
    return value


def size(text: str) -> int:
    """A size of at least one byte (``256MiB``, ``1G``, ``500MB``, a plain number of bytes)."""
    return parse_size(text)


def byte_count(text: str) -> int:
    """A size that may be 0 (``--max-bytes 0``: evict everything that may go)."""
    return parse_size(text, minimum=0)


def quota(text: str) -> str:
    """A shard cache's quota, checked by the cache's own parser (:meth:`stager.cache.config.Quota.parse`:
    bytes, ``0.5`` or ``50%`` of its disk); the text is kept for it."""
    from stager.cache.config import Quota  # noqa: PLC0415 (only when the flag is given: start-up stays lean)

    try:
        Quota.parse(text, "")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None
    if re.fullmatch(r"\s*\d+\.\d+\s*", text) and float(text) > 1:  # neither a fraction (<= 1) nor whole bytes
        raise argparse.ArgumentTypeError(f"invalid quota {text!r}: a fraction of the disk is at most 1 (0.5 or 50%) "
                                         f"and a plain number is whole bytes; give a unit ({text.strip()}G)")
    return text


_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(s|m|min|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected seconds, e.g. 600, 90s, 10m or 1h")
    v = float(m.group(1)) * _SECONDS[m.group(2) or ""]
    if not math.isfinite(v) or v > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: at most a year ({MAX_SECONDS:.0f}s); to wait "
                                         "without a limit, leave the flag out")
    return v


def duration(text: str) -> float:
    """Seconds >= 0 (``600``, ``90s``, ``10m``, ``1h``): a timeout; 0 means do not wait."""
    return _seconds(text)


def interval(text: str) -> float:
    """Seconds > 0 (a polling interval)."""
    v = _seconds(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"invalid interval {text!r}: must be more than 0 seconds")
    return v


def hw(text: str) -> tuple[int, int]:
    """``"224x224"`` -> (224, 224) (height x width): each side 1 to :data:`MAX_SIDE`, at most :data:`MAX_PIXELS`."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected HxW, e.g. 224x224")
    h, w = int(m.group(1)), int(m.group(2))
    if max(h, w) > MAX_SIDE or h * w > MAX_PIXELS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: at most {MAX_SIDE} pixels a side and "
                                         f"{MAX_PIXELS:,} pixels in all")
    return h, w


def rank_list(text: str) -> list[int]:
    """``"0-3"``, ``"4,5"``, ``"0-1,6"`` -> the global ranks, each >= 0."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rank list {text!r}: expected e.g. 0-3 or 0,1,4") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"invalid rank list {text!r}: expected e.g. 0-3 or 0,1,4")
    return out


# ---- shared flags ------------------------------------------------------------------------------------
def add_common(p: argparse.ArgumentParser) -> None:
    """``--json`` and ``-q``, the same in every command (cli.main applies them; docs/architecture.md)."""
    p.add_argument(JSON_FLAG, action="store_true",
                   help="print exactly one JSON object on stdout, whatever happens (the result, or the error); "
                   "no progress; warnings and errors still go to stderr")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress and no summary; warnings and errors still go to stderr")


def add_workers(p: argparse.ArgumentParser, *, default: int | None, help: str) -> None:
    """``-j/--workers N`` (1 <= N <= :func:`max_workers`)."""
    p.add_argument("-j", "--workers", type=workers, default=default, metavar="N", help=help)


def add_hash(p: argparse.ArgumentParser) -> None:
    """``--hash``: the checksum of every shard and companion file, recorded in the manifest."""
    p.add_argument("--hash", dest="hash_algo", choices=("xxh3_128", "blake2b"), default="xxh3_128",
                   help="checksum recorded for every file and checked by verify and stage: xxh3_128 (default, "
                   "fast) or blake2b (cryptographic, for data from someone you do not trust)")


def add_cache_dir(p: argparse.ArgumentParser) -> None:
    """The cache directory of ``stager cache <cmd> [DIR]``: optional, ``$STAGER_CACHE`` when omitted (as for
    ``stage --cache``); :func:`cache_dir` resolves it."""
    p.add_argument("dir", metavar="DIR", nargs="?", default=None,
                   help="the cache directory (default: $STAGER_CACHE, as for `stager stage`)")


def cache_dir(args: argparse.Namespace) -> str:
    """``DIR`` as given, else ``$STAGER_CACHE``; a :class:`UsageError` when neither is."""
    from stager.cache.config import CACHE_ENV, cache_from_env  # noqa: PLC0415 (the cache's module, when a command runs)

    where = args.dir or cache_from_env()
    if not where:
        raise UsageError(f"no cache directory: give DIR or set ${CACHE_ENV} (see `{prog_of(args)} --help`)")
    return str(where)


def add_storage_options(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) for commands that take a URL (stager/fs/open.py)."""
    p.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                   type=_storage_option_arg,
                   help="option for opening URLs (fsspec storage options; repeatable): dotted keys nest, values are "
                   "JSON where they parse, e.g. client_kwargs.endpoint_url=http://host:9000 or anon=true")


def _storage_option_arg(text: str) -> str:
    """``type=`` of ``--storage-option``: the KEY=VALUE shape checked at parse time, by the opener's own parser."""
    from stager.fs.open import parse_storage_options  # noqa: PLC0415 (only when the flag is given: start-up stays lean)

    try:
        parse_storage_options([text])
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--storage-option`` flags as one nested dict."""
    from stager.fs.open import parse_storage_options  # noqa: PLC0415 (the opener's module, when a command runs)

    return parse_storage_options(getattr(args, "storage_options", None) or [])

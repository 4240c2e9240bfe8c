"""Flags, checked where they are parsed: the one place every sub-command takes its flag types and shared flags from.

* :class:`Parser`: an ``ArgumentParser`` whose ``error()`` raises :class:`~stager.errors.UsageError` (exit 2)
  instead of printing a usage block and exiting, so that the CLI reports a bad flag as it reports every
  other error: one line ``stager <cmd>: error: ...`` on stderr and, with ``--json``, one JSON object on
  stdout. Its help pages keep their examples (the epilog) as written.
* ``type=`` functions: :func:`positive_int`, :func:`nonneg_int`, :func:`size`, :func:`byte_count`,
  :func:`duration`, :func:`interval`, :func:`hw`, :func:`stripe_count`, :func:`rank_list`. A bad value is a
  usage error that names the flag (argparse adds ``argument --workers/-j:``).
* shared flags, meaning the same in every command: :func:`add_common` (``--json``, ``-q``),
  :func:`add_workers` (``-j/--workers``), :func:`add_cache_dir` (a cache directory defaulting to
  ``$STAGER_CACHE``, as ``stage --cache`` does), :func:`add_hash` (``--hash``), :func:`add_storage_options`.

Nothing here imports numpy or an engine: ``stager <cmd> --help`` stays fast (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from stager.errors import UsageError

JSON_FLAG = "--json"
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
    """Whether ``argv`` asks for ``--json`` (before a ``--``): for errors raised before it is parsed."""
    for a in argv:
        if a == "--":
            return False
        if a == JSON_FLAG:
            return True
    return False


# ---- types -------------------------------------------------------------------------------------------
def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (workers, threads, counts)."""
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """An integer >= 0 (an index, a limit)."""
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def stripe_count(text: str) -> int:
    """A Lustre stripe count: >= 1, or -1 for every OST (``lfs setstripe -c -1``)."""
    v = _int(text, "a stripe count (>= 1, or -1 for every OST)")
    if v < 1 and v != -1:
        raise argparse.ArgumentTypeError(f"expected a stripe count >= 1 (or -1 for every OST), got {text!r}")
    return v


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str, *, minimum: int = 1) -> int:
    """``"256MiB"``, ``"1G"``, ``"4m"`` -> bytes. Bare/``i``/``iB`` suffixes are powers of 1024;
    ``kB``/``MB``/``GB``/``TB`` are powers of 1000 (so ``1G == 1GiB == 1073741824``, ``1GB == 10**9``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 268435456, 256MiB, 1G or 500MB")
    num, unit, iec, b = m.groups()
    unit = unit.lower()
    mult = _SI[unit] if (unit and b and not iec) else _UNITS[unit]
    value = int(float(num) * mult)
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


_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(s|m|min|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected seconds, e.g. 600, 90s, 10m or 1h")
    return float(m.group(1)) * _SECONDS[m.group(2) or ""]


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
    """``"224x224"`` -> (224, 224) (height x width)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected HxW, e.g. 224x224")
    return int(m.group(1)), int(m.group(2))


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
    """``-j/--workers N`` (N >= 1)."""
    p.add_argument("-j", "--workers", type=positive_int, default=default, metavar="N", help=help)


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

"""A mix of datasets: its streams, each stream's share of an epoch, and how batches are composed.

A :class:`Mix` is what the loader and ``stager stage`` take in place of one dataset path: a tuple
of :class:`Stream` (a dataset path or URL, a name, and at most one of ``weight``, ``samples`` or
``repeat``), the batch ``composition`` and optionally the epoch's length ``epoch_samples``.
Everything here is validated when built, so a bad mix fails with one line before any dataset is
opened (docs/loader.md, "Mixing datasets"). How a stream's share becomes samples per epoch is
:func:`stager.order.mix.stream_takes`; this module only holds and checks the request.

* ``weight``: a relative share of the epoch: the weighted streams share what the streams with an
  absolute count leave of ``epoch_samples`` (default: the streams' total size), in proportion;
* ``samples``: exactly that many samples per epoch;
* ``repeat``: ``repeat`` times the stream's size per epoch (0.5: half of it, rotating; 3: three passes);
* none of them: ``repeat=1``, every sample once per epoch.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stager.errors import StagerError, UsageError
from stager.redact import location_path, redact

COMPOSITIONS = ("random", "stratified", "per_stream")
STREAM_KEYS = ("name", "path", "weight", "samples", "repeat", "storage_options")
MIX_KEYS = ("streams", "composition", "epoch_samples")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def default_name(path: str) -> str:
    """A stream's name when none is given: the last component of its path (``manifest.json`` skipped),
    reduced to the characters a stream name allows. Of a URL only its path counts
    (:func:`~stager.redact.location_path`): a secret in its userinfo, query or fragment (``?sig=...``)
    never becomes part of a name, which is printed, stored and made a directory (``DEST/<name>``)."""
    p = location_path(path).rstrip("/")
    parts = [x for x in p.split("/") if x]
    if parts and parts[-1].endswith(".json"):
        parts = parts[:-1]
    base = parts[-1] if parts else "stream"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", base).lstrip("_.-")[:64]
    return name or "stream"


@dataclass(frozen=True)
class Stream:
    """One dataset of a mix (see the module docstring).

    ``path``: a packed directory or its ``manifest.json``, an index of adopted shards, or an ImageFolder
    tree; local, ``file://`` or any fsspec URL. ``name``: ``[A-Za-z0-9][A-Za-z0-9_.-]*`` (default: the
    path's last component); it names the stream in errors, logs and ``stats()``, and its staged
    copy's directory. ``storage_options``: this stream's fsspec options (over the loader's).
    """

    path: str
    weight: float | None = None
    samples: int | None = None
    repeat: float | None = None
    name: str = ""
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        path = self.path
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise UsageError(f"stream {self.name or '?'}: path must be a non-empty string, got {self.path!r}")
        object.__setattr__(self, "path", path)
        name = self.name or default_name(path)
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise UsageError(f"stream name {name!r}: expected [A-Za-z0-9][A-Za-z0-9_.-]* (at most 64 characters)")
        object.__setattr__(self, "name", name)
        given = [k for k in ("weight", "samples", "repeat") if getattr(self, k) is not None]
        if len(given) > 1:
            raise UsageError(f"stream {name!r}: give one of weight, samples or repeat, not {' and '.join(given)}")
        self._check_share(name)
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise UsageError(f"stream {name!r}: storage_options must be a mapping, got {self.storage_options!r}")

    def _check_share(self, name: str) -> None:
        w, n, r = self.weight, self.samples, self.repeat
        if w is not None and not (_is_number(w) and math.isfinite(w) and w > 0):
            raise UsageError(f"stream {name!r}: weight must be a positive finite number, got {w!r}")
        if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
            raise UsageError(f"stream {name!r}: samples must be a positive integer (samples per epoch), got {n!r}")
        if r is not None and not (_is_number(r) and math.isfinite(r) and r > 0):
            raise UsageError(f"stream {name!r}: repeat must be a positive finite number, got {r!r}")

    @property
    def share(self) -> str:
        """How the stream's epoch take is given, for messages: ``weight 0.7``, ``samples 5000``, ``repeat 2``."""
        for k in ("weight", "samples", "repeat"):
            v = getattr(self, k)
            if v is not None:
                return f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
        return "repeat 1"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "path": redact(self.path)}  # printed and stored: no secrets
        for k in ("weight", "samples", "repeat"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


@dataclass(frozen=True)
class Mix:
    """Several datasets read as one (module docstring). ``source``: the mix file it was read from, if any."""

    streams: tuple[Stream, ...]
    composition: str = "random"
    epoch_samples: int | None = None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        streams = tuple(self.streams)
        object.__setattr__(self, "streams", streams)
        where = f"{self.source}: " if self.source else ""
        if not streams:
            raise UsageError(f"{where}a mix needs at least one stream")
        for s in streams:
            if not isinstance(s, Stream):
                raise UsageError(f"{where}mix streams must be Stream objects, got {type(s).__name__}")
        if self.composition not in COMPOSITIONS:
            raise UsageError(f"{where}unknown composition {self.composition!r}; expected one of "
                             f"{', '.join(COMPOSITIONS)}")
        e = self.epoch_samples
        if e is not None and not (isinstance(e, int) and not isinstance(e, bool) and e > 0):
            raise UsageError(f"{where}epoch_samples must be a positive integer, got {e!r}")
        _check_unique(streams, where)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.streams)

    def describe(self) -> str:
        """One line: ``mix of 3 streams (coco weight 2, o365 weight 1, clean repeat 3), stratified``."""
        inner = ", ".join(f"{s.name} {s.share}" for s in self.streams)
        return f"mix of {len(self.streams)} stream{'s' if len(self.streams) != 1 else ''} ({inner}), {self.composition}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"streams": [s.to_json() for s in self.streams], "composition": self.composition}
        if self.epoch_samples is not None:
            out["epoch_samples"] = self.epoch_samples
        return out


def named_error(name: str, exc: StagerError) -> StagerError:
    """``exc`` with ``stream 'name': `` in front: the same class (so the same exit code), one line."""
    try:
        return type(exc)(f"stream {name!r}: {exc}")
    except TypeError:
        return exc


def _same_place(path: str) -> str:
    """A path's identity for the duplicate check: absolute and normalised (URLs without a trailing slash)."""
    if "://" in path and not path.startswith("file://"):
        return path.rstrip("/")
    p = path.removeprefix("file://")
    p = os.path.dirname(p) if p.endswith("manifest.json") else p
    return os.path.realpath(p)


def _check_unique(streams: tuple[Stream, ...], where: str) -> None:
    names: dict[str, int] = {}
    places: dict[str, str] = {}
    for i, s in enumerate(streams):
        if s.name in names:
            raise UsageError(f"{where}duplicate stream name {s.name!r} (streams {names[s.name] + 1} and {i + 1}); "
                             "give each stream its own name")
        names[s.name] = i
        place = _same_place(s.path)
        if place in places:
            raise UsageError(f"{where}duplicate stream: {places[place]!r} and {s.name!r} both read {s.path}; "
                             "list a dataset once and give it a weight, samples or repeat")
        places[place] = s.name


def stream_of(item: Any, where: str = "") -> Stream:
    """One stream from what a user may write: a :class:`Stream`, a path, a ``(path, weight)`` pair, or
    a mapping with :data:`STREAM_KEYS` (a mix file's entries)."""
    if isinstance(item, Stream):
        return item
    if isinstance(item, (str, os.PathLike)):
        return Stream(os.fspath(item))
    if isinstance(item, tuple) and len(item) == 2:
        path, weight = item
        if not isinstance(path, (str, os.PathLike)):
            raise UsageError(f"{where}a (path, weight) pair needs a path first, got {item!r}")
        return Stream(os.fspath(path), weight=weight)
    if isinstance(item, Mapping):
        unknown = sorted(set(map(str, item)) - set(STREAM_KEYS))
        label = item.get("name") or item.get("path") or "?"
        if unknown:
            raise UsageError(f"{where}stream {label!r}: unknown key {', '.join(map(repr, unknown))}; expected "
                             f"{', '.join(STREAM_KEYS)}")
        if "path" not in item:
            raise UsageError(f"{where}stream {label!r}: no path")
        return Stream(**{k: item[k] for k in STREAM_KEYS if k in item and k != "name"}, name=item.get("name") or "")
    raise UsageError(f"{where}a stream is a path, a (path, weight) pair, a Stream or a mapping, got {item!r}")


def mix_of(streams: Iterable[Any], *, composition: str = "random", epoch_samples: int | None = None,
           source: str | None = None) -> Mix:
    """A :class:`Mix` from a list of streams as :func:`stream_of` takes them."""
    where = f"{source}: " if source else ""
    if isinstance(streams, (str, bytes, Mapping)):
        raise UsageError(f"{where}streams must be a list, got {type(streams).__name__}")
    return Mix(tuple(stream_of(s, where) for s in streams), composition=composition, epoch_samples=epoch_samples,
               source=source)

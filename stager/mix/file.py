"""Mix files: a mix written as YAML or JSON, and telling a mix from a dataset path.

A mix file (``*.yaml``, ``*.yml``, or ``*.json`` with a top-level ``streams`` list)::

    composition: stratified          # random (default) | stratified | per_stream
    epoch_samples: 500000            # optional: the epoch's length
    streams:
      - path: ../coco-packed         # relative to this file
        weight: 3
      - name: o365
        path: s3://datasets/o365
        samples: 200000
        storage_options: {anon: true}
      - path: /lustre/clean
        repeat: 2

Relative local paths are taken relative to the file's directory, so a mix file travels with the
datasets it names. The loader and ``stager stage`` accept such a file wherever they take a dataset
path (:func:`as_mix`). PyYAML is imported only to read a YAML file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from stager.errors import SourceNotFoundError, UsageError
from stager.fs.open import is_url, local_path_of, read_bytes
from stager.mix.spec import MIX_KEYS, Mix, Stream, mix_of

YAML_SUFFIXES = (".yaml", ".yml")
MAX_MIX_BYTES = 1 << 20  # a mix file names datasets; anything bigger is not one


def _suffix(path: str) -> str:
    return os.path.splitext(path.rstrip("/"))[1].lower()


def is_mix_path(path: str | os.PathLike[str]) -> bool:
    """``path`` names a mix file: ``*.yaml``/``*.yml``, or a JSON file (not ``manifest.json``) whose top
    level has ``streams``. Only JSON files are opened to tell (a manifest path is a plain JSON file too)."""
    p = os.fspath(path)
    suffix = _suffix(p)
    if suffix in YAML_SUFFIXES:
        return True
    if suffix != ".json" or os.path.basename(p.rstrip("/")) == "manifest.json":
        return False
    local = local_path_of(p)
    if local is not None and not os.path.isfile(local):
        return False
    try:
        doc = json.loads(read_bytes(p, limit=MAX_MIX_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "streams" in doc


def is_mix(obj: Any) -> bool:
    """``obj`` is a mix the loader takes in place of a path: a :class:`Mix`, a list or tuple of streams
    (paths, ``(path, weight)`` pairs, :class:`Stream` objects), or a mix file path."""
    if isinstance(obj, (Mix, Stream)):
        return True
    if isinstance(obj, (list, tuple)):
        return True
    if isinstance(obj, (str, os.PathLike)):
        return is_mix_path(obj)
    return False


def _parse(data: bytes, path: str) -> Any:
    if _suffix(path) in YAML_SUFFIXES:
        try:
            import yaml  # noqa: PLC0415 (only YAML mix files need it)
        except ImportError as exc:
            raise UsageError(f"{path}: reading a YAML mix file needs PyYAML (pip install pyyaml), or write the "
                             "mix as JSON") from exc
        try:
            return yaml.safe_load(data)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise UsageError(f"{path}: not valid YAML{at} ({getattr(exc, 'problem', exc)})") from None
    try:
        return json.loads(data)
    except ValueError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None


def _relative_to(path: str, base_dir: str | None) -> str:
    """A stream path from a mix file: relative local paths are resolved against the file's directory."""
    if base_dir is None or is_url(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def load_mix_file(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Mix:
    """Read the mix file ``path`` (module docstring); one-line :class:`UsageError` for anything malformed."""
    p = os.fspath(path)
    local = local_path_of(p)
    if local is not None and not os.path.isfile(local):
        raise SourceNotFoundError(f"{p}: no such mix file")
    data = read_bytes(p, storage_options, limit=MAX_MIX_BYTES)
    if len(data) > MAX_MIX_BYTES:
        raise UsageError(f"{p}: over {MAX_MIX_BYTES} bytes; a mix file lists streams, not data")
    doc = _parse(data, p)
    if not isinstance(doc, dict):
        raise UsageError(f"{p}: a mix file is a mapping with a 'streams' list, got {type(doc).__name__}")
    unknown = sorted(set(map(str, doc)) - set(MIX_KEYS))
    if unknown:
        raise UsageError(f"{p}: unknown key {', '.join(map(repr, unknown))}; expected {', '.join(MIX_KEYS)}")
    streams = doc.get("streams")
    if not isinstance(streams, list) or not streams:
        raise UsageError(f"{p}: 'streams' must be a non-empty list of streams (each with a path)")
    base = os.path.dirname(os.path.abspath(local)) if local is not None else None
    entries: list[Any] = []
    for i, s in enumerate(streams):
        if isinstance(s, str):
            s = {"path": s}
        if not isinstance(s, dict):
            raise UsageError(f"{p}: stream {i + 1} must be a mapping with a path, got {s!r}")
        if isinstance(s.get("path"), str):
            s = {**s, "path": _relative_to(s["path"], base)}
        entries.append(s)
    return mix_of(entries, composition=doc.get("composition", "random"), epoch_samples=doc.get("epoch_samples"),
                  source=p)


def as_mix(obj: Any, *, composition: str | None = None, storage_options: Mapping[str, Any] | None = None) -> Mix:
    """The :class:`Mix` ``obj`` describes (see :func:`is_mix`); ``composition`` overrides the mix's own."""
    if isinstance(obj, Mix):
        mix = obj
    elif isinstance(obj, Stream):
        mix = Mix((obj,))
    elif isinstance(obj, (str, os.PathLike)):
        mix = load_mix_file(obj, storage_options)
    elif isinstance(obj, Sequence):
        mix = mix_of(obj)
    else:
        raise UsageError(f"not a mix: {obj!r}")
    if composition is not None and composition != mix.composition:
        mix = Mix(mix.streams, composition=composition, epoch_samples=mix.epoch_samples, source=mix.source)
    return mix

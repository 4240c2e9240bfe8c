"""Opening a mix's streams for the loader: one :class:`~stager.loader.rank.RankDataset` per stream, checked.

:func:`open_members` resolves every stream (its staged copy when one exists, else its source, with
a warning when other streams of the mix were staged), checks that the streams can share a batch
(one sample kind, the same window length for clip packs, one payload type for ``decode="raw"``, the
fields they all have with the same schema) and that the mix makes sense for the job (no dataset
twice; no stream with fewer items than ranks), and builds each stream's dataset with the fields
the batch will hold. Every failure is one line naming the stream and what differs.

Each member is the single-dataset loader's own :class:`~stager.loader.rank.RankDataset`, so a
stream is read exactly as a dataset on its own is: any format stager reads, adopted sets, local,
staged or on an object store; its plan's run layout, its partition on a node-partitioned staged
copy, its decoding and its fields. The mix (:mod:`stager.loader.mix.dataset`) plans across them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from stager.errors import StagerError, UsageError
from stager.loader.clips import item_space
from stager.loader.options import LoaderOptions
from stager.loader.rank import RankDataset
from stager.loader.shard_access import Resolved, resolve
from stager.manifest.fields import FieldSpec, sample_fields, specs_from_json
from stager.mix import Mix, Stream, named_error
from stager.redact import redact

log = logging.getLogger("stager.loader")


def stream_options(stream: Stream, options: LoaderOptions, fields: tuple[str, ...] | None) -> LoaderOptions:
    """A member's options: the mix's, with the stream's storage options over the loader's and the fields
    the batch holds (``()``: none)."""
    so = {**(options.storage_options or {}), **(stream.storage_options or {})}
    return dataclasses.replace(options, storage_options=so or None, fields=fields, composition=None)


def _resolve_all(mix: Mix, options: LoaderOptions) -> list[Resolved]:
    out = []
    for s in mix.streams:
        opts = stream_options(s, options, None)
        try:
            out.append(resolve(s.path, storage_options=opts.storage_options, staged=opts.staged,
                               staging_roots=opts.staging_roots))
        except StagerError as exc:
            raise named_error(s.name, exc) from exc
    staged = [s.name for s, r in zip(mix.streams, out, strict=True) if r.staged]
    if staged and options.staged == "auto":
        for s, r in zip(mix.streams, out, strict=True):
            if not r.staged:
                log.warning("stager.loader: stream %r has no staged copy (streams %s do); reading it from its source "
                            "%s", s.name, ", ".join(map(repr, staged)), redact(r.source))
    return out


def _check_distinct(mix: Mix, resolved: Sequence[Resolved]) -> None:
    seen: dict[str, str] = {}
    for s, r in zip(mix.streams, resolved, strict=True):
        ident = r.index.dataset_id
        if ident in seen:
            raise UsageError(f"duplicate stream: {seen[ident]!r} and {s.name!r} are the same dataset ({ident}); list "
                             "it once and give it a weight, samples or repeat")
        seen[ident] = s.name


def _kind_name(per_item: int) -> str:
    return "images" if per_item == 1 else f"clips of {per_item} frames"


def _check_kinds(mix: Mix, resolved: Sequence[Resolved], options: LoaderOptions) -> None:
    """One sample kind across the streams: images or clips of one length; one payload type for raw."""
    kinds = []
    for s, r in zip(mix.streams, resolved, strict=True):
        items = item_space(r.index)
        kinds.append((s.name, items.per_item, r.index.kind))
    name0, per0, kind0 = kinds[0]
    for name, per, kind in kinds[1:]:
        if per != per0:
            raise UsageError(f"stream {name!r} holds {_kind_name(per)}, stream {name0!r} {_kind_name(per0)}: a mix's "
                             "streams must hold one kind of sample")
        if kind != kind0 and options.decode == "raw":
            raise UsageError(f"stream {name!r} stores {kind} samples, stream {name0!r} {kind0} ones: their raw "
                             "payloads differ (bytes vs arrays); read the mix with decode='uint8'")


def _schema(r: Resolved) -> dict[str, FieldSpec]:
    m = r.index.manifest
    if m is None:
        return {}
    return {f.name: f for f in specs_from_json(sample_fields(m.fields), r.source)}


def _same_field(a: FieldSpec, b: FieldSpec) -> bool:
    return (a.kind, a.dtype, a.item) == (b.kind, b.dtype, b.item)


def common_fields(mix: Mix, resolved: Sequence[Resolved], options: LoaderOptions) -> tuple[str, ...]:
    """The fields every batch of the mix holds: those asked for (``options.fields``; None: every field
    all streams have), each in every stream with one schema (kind, dtype, item shape); else one line
    naming the stream and the difference. Fields only some streams have are left out (logged)."""
    schemas = [_schema(r) for r in resolved]
    names = mix.names
    if options.fields is not None:
        wanted = list(options.fields)
        for f in wanted:
            for name, schema in zip(names, schemas, strict=True):
                if f not in schema:
                    raise UsageError(f"field {f!r} is not in stream {name!r} (it has {sorted(schema) or 'no fields'}); "
                                     "a mix reads the fields all its streams have")
    else:
        if options.decode != "uint8":
            return ()
        wanted = [f for f in schemas[0] if all(f in sc for sc in schemas[1:])]
        partial = sorted({f for sc in schemas for f in sc} - set(wanted))
        if partial:
            log.info("stager.loader: fields %s are not in every stream of the mix and are not read", partial)
    for f in wanted:
        first = schemas[0][f]
        for name, schema in zip(names[1:], schemas[1:], strict=True):
            other = schema[f]
            if not _same_field(first, other):
                raise UsageError(
                    f"field {f!r} differs between streams {names[0]!r} ({first.kind}, {first.dtype or 'bytes'}, "
                    f"item {list(first.item)}) and {name!r} ({other.kind}, {other.dtype or 'bytes'}, item "
                    f"{list(other.item)}); pass fields= with the fields they share")
    return tuple(wanted)


def open_members(mix: Mix, options: LoaderOptions, rank: int, world_size: int) -> list[RankDataset]:
    """One checked :class:`RankDataset` per stream of ``mix`` for rank ``rank`` of ``world_size`` (module docstring)."""
    resolved = _resolve_all(mix, options)
    _check_distinct(mix, resolved)
    _check_kinds(mix, resolved, options)
    fields = common_fields(mix, resolved, options)
    members: list[RankDataset] = []
    for s, r in zip(mix.streams, resolved, strict=True):
        opts = dataclasses.replace(stream_options(s, options, fields), rank=rank, world_size=world_size)
        try:
            members.append(RankDataset(s.path, opts, resolved=r))
        except StagerError as exc:
            raise named_error(s.name, exc) from exc
        n = members[-1].items.count
        if n < world_size:
            raise UsageError(f"stream {s.name!r} has {n} samples, fewer than the {world_size} ranks; drop it from the "
                             "mix or run on fewer ranks")
    return members

"""Index webdataset tar shards as real writers make them (webdataset's ``ShardWriter``, ``tarp``, GNU tar).

Headers are checked by the one tar parser, :func:`stager.formats.ustar.walk_headers` (PAX headers with
float mtimes and long names, GNU long names, checksums, sizes, no links or devices). Members are
grouped into samples by key: a sample is a run of consecutive members ``<key>.<field>``, and its key
is the longest name prefix, ending before a dot of the last path component, that its first two
members share. So ``n01440764_10026.JPEG.jpg`` + ``n01440764_10026.JPEG.cls`` is the sample
``n01440764_10026.JPEG`` (keys with dots, as ``ShardWriter`` writes ImageNet file names), and
``x.jpg`` + ``x.cls`` + ``x.seg.png`` is ``x`` with fields ``jpg``, ``cls``, ``seg.png``. A lone
member is a sample whose key is its name without its last extension.

The image is the field named by ``image_key`` (``;``-separated candidates, first present wins), else
the one field whose last extension is an image type (of several, the one bare extension: ``jpg``
beside ``mask.png``). Every other member is a field (:mod:`stager.index.fields`: ``mask.png`` a
mask, ``boxes.json`` boxes parsed once here, ``json`` the field ``meta``, ``.npy`` an array...).
The label (``label_key``): ``cls`` or any text field (an integer, or a class name), ``json`` (its
``label`` value) or ``json:FIELD``.
"""

from __future__ import annotations

import json
from typing import Any

from stager.errors import UsageError
from stager.formats.tar import IMAGE_EXTS
from stager.formats.ustar import walk_headers
from stager.index.fields import FieldRows, Found, parse_ragged, tar_member_spec
from stager.index.scan import DamagedShardError, ShardScan, mapped
from stager.manifest.fields import FieldSpec

LABEL_EXTS = ("cls", "cls2", "txt", "json", "label", "labels", "index", "idx")
MAX_LABEL_BYTES = 1 << 20  # a label member larger than this is not a label


def _prefixes(name: str) -> list[str]:
    """Keys ``name`` may belong to: its prefixes ending before a dot of its last component."""
    head = name.rfind("/") + 1
    return [name[:i] for i in range(head + 1, len(name)) if name[i] == "."]


class NoImageError(DamagedShardError):
    """A sample without an image member: at a shard's edge, the sign of a sample split across shards."""


class _Sample:
    __slots__ = ("fields", "key")

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.fields: dict[str, tuple[int, int, bytes | None]] = {}  # field -> (offset, size, data)


def scan_tar(path: str, name: str, image_key: str | None, label_key: str | None, algo: str, *,
              fields: bool = True) -> ShardScan:
    """Index one tar shard (see the module docstring); raises CorruptSampleError naming the shard."""
    label_field, _, json_field = (label_key or "").partition(":")
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            b = bytes(view[pos : pos + n])
            pos += n
            return b

        def skip(n: int) -> None:
            nonlocal pos
            pos += n

        rows = FieldRows(out, path)
        cur: _Sample | None = None
        seen: set[str] = set()
        pending: tuple[str, int, int, bytes | None] | None = None  # a first member whose key is undecided

        def finish(s: _Sample, last: bool = False) -> None:
            assert s.key is not None
            if s.key in seen:
                raise DamagedShardError(f"{path}: members of sample {s.key!r} are not consecutive; "
                                         "rewrite the shard so that each sample's members are adjacent")
            first = not seen
            seen.add(s.key)
            try:
                _emit(out, s, image_key=image_key, label_field=label_field, json_field=json_field, path=path)
                if fields:
                    rows.add(s.key, _fields(s, image_key=image_key, label_field=label_field, path=path))
            except NoImageError:
                if not (first or last):
                    raise
                # At the shard's edge: the api checks whether the neighbour shard holds the rest.
                out.edges.append((0 if first else 1, s.key, str(sorted(s.fields))))

        for mname, off, size in walk_headers(take, skip, len(view), path):
            if not mname.isascii():
                _utf8(mname, path)
            ext = mname.rsplit(".", 1)[-1].lower() if "." in mname.rsplit("/", 1)[-1] else ""
            data = take(size + (-size % 512))[:size] if ext in LABEL_EXTS and size <= MAX_LABEL_BYTES else None
            if data is None:
                skip(size + (-size % 512))
            if cur is not None and cur.key is not None and mname.startswith(cur.key + "."):
                cur.fields[_field(cur, mname, path)] = (off, size, data)
                continue
            if pending is not None:
                shared = [p for p in _prefixes(pending[0]) if mname.startswith(p + ".")]
                if shared:
                    cur = _Sample(max(shared, key=len))
                    cur.fields[_field(cur, pending[0], path)] = pending[1:]
                    cur.fields[_field(cur, mname, path)] = (off, size, data)
                    pending = None
                    continue
                finish(_lone(*pending, path))
            elif cur is not None:
                finish(cur)
            cur, pending = None, (mname, off, size, data)
        if pending is not None:
            finish(_lone(*pending, path), last=True)
        elif cur is not None:
            finish(cur, last=True)
    return out


def _utf8(mname: str, path: str) -> None:
    """Refuse a member name that is not UTF-8 (the ustar reader keeps its bytes as surrogate escapes): keys
    and field names are UTF-8 text in the manifest and the sample index, so such a name cannot be recorded."""
    try:
        mname.encode("utf-8")
    except UnicodeEncodeError:
        raise DamagedShardError(f"{path}: member name {mname!r} is not UTF-8; keys are UTF-8 text: "
                                "rename the member (e.g. repack the tar with UTF-8 names)") from None


def _field(s: _Sample, member: str, path: str) -> str:
    assert s.key is not None
    f = member[len(s.key) + 1 :]
    if f in s.fields:
        raise DamagedShardError(f"{path}: sample {s.key!r} has two {f!r} members")
    return f


def _lone(mname: str, off: int, size: int, data: bytes | None, path: str) -> _Sample:
    pre = _prefixes(mname)
    if not pre:
        raise DamagedShardError(f"{path}: member {mname!r} has no extension (webdataset expects <key>.<field>)")
    s = _Sample(pre[-1])
    s.fields[mname[len(pre[-1]) + 1 :]] = (off, size, data)
    return s


def _image_field(s: _Sample, image_key: str | None, path: str) -> str:
    if image_key:
        for cand in image_key.split(";"):
            if cand in s.fields:
                return cand
        raise DamagedShardError(f"{path}: sample {s.key!r} has no {image_key!r} member (fields: "
                                 f"{', '.join(sorted(s.fields))}); pass --image-key with the image's field")
    found = [f for f in s.fields if f.rsplit(".", 1)[-1].lower() in IMAGE_EXTS]
    if len(found) > 1:  # KEY.jpg beside KEY.mask.png: the bare extension is the primary image
        found = [f for f in found if "." not in f] or found
    if len(found) == 1:
        return found[0]
    if not found:
        raise NoImageError(f"{path}: sample {s.key!r} has no image member (fields: {', '.join(sorted(s.fields))}); "
                           "pass --image-key FIELD (e.g. jpg or 'jpg;png')")
    raise DamagedShardError(f"{path}: sample {s.key!r} has several image members (fields: "
                             f"{', '.join(sorted(s.fields))}); "
                             "pass --image-key FIELD (e.g. jpg or 'jpg;png')")


def _emit(out: ShardScan, s: _Sample, *, image_key: str | None, label_field: str, json_field: str, path: str) -> None:
    img = _image_field(s, image_key, path)
    off, size, _ = s.fields[img]
    out.keys.append(s.key or "")
    out.offsets.append(off)
    out.sizes.append(size)
    out.labels.append(_label(s, label_field, json_field, path) if label_field else None)


def _fields(s: _Sample, *, image_key: str | None, label_field: str, path: str) -> list[Found]:
    """The sample's members other than its image and label, as fields (:func:`tar_member_spec`); a JSON
    member holding a ``boxes`` list (and ``box_labels``) also gives those ragged fields."""
    img = _image_field(s, image_key, path)
    found: dict[str, Found] = {}
    where = f"{path}: sample {s.key!r}"
    for member, (off, size, data) in s.fields.items():
        if member == img or (member == label_field and not member.endswith("json")):
            continue
        spec = tar_member_spec(member)
        if spec is None or spec.name in found:
            continue
        if spec.ragged:
            if data is None:
                raise DamagedShardError(f"{where}: {member!r} is too large to be a list of boxes")
            found[spec.name] = Found(spec, values=parse_ragged(spec, data, f"{where} ({member})"))
            continue
        found[spec.name] = Found(spec, extent=(off, size))
        if spec.kind == "json" and data is not None and b'"boxes"' in data:
            _boxes_in_json(found, data, f"{where} ({member})")
    return list(found.values())


def _boxes_in_json(found: dict[str, Found], data: bytes, where: str) -> None:
    """``{"boxes": [[x0, y0, x1, y1], ...], "box_labels": [...]}`` inside a JSON member: those fields."""
    try:
        info = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DamagedShardError(f"{where}: bad JSON ({exc})") from exc
    if not isinstance(info, dict):
        return
    for name in ("boxes", "box_labels"):
        if name in info and name not in found:
            spec = FieldSpec(name, name)
            found[name] = Found(spec, values=parse_ragged(spec, info[name], where))


def _label(s: _Sample, field: str, json_field: str, path: str) -> Any:
    got = s.fields.get(field)
    if got is None:
        return None
    data = got[2]
    if data is None:
        raise UsageError(f"{path}: sample {s.key!r}: label member {field!r} is not a label (too large or not "
                         f"one of .{', .'.join(LABEL_EXTS)}); pass another --label-key")
    if field.endswith("json"):
        try:
            info = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise DamagedShardError(f"{path}: sample {s.key!r}: bad JSON in {field!r} ({exc})") from exc
        value = info.get(json_field or "label") if isinstance(info, dict) else None
        if value is None or isinstance(value, bool) or not isinstance(value, (int, str)):
            return None if value is None else _bad(path, s, field, value)
        return value
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise DamagedShardError(f"{path}: sample {s.key!r}: {field!r} is not UTF-8 text") from exc
    try:
        return int(text)
    except ValueError:
        return text or None


def _bad(path: str, s: _Sample, field: str, value: Any) -> Any:
    raise DamagedShardError(f"{path}: sample {s.key!r}: label {value!r} in {field!r} is neither an integer "
                             "nor a class name")

"""``stager.pack.pack`` through the real format readers: round trips, conversion, planning, errors.

Every pack is read back with each format's own reader (``iter_samples`` parsing the container and
``read`` using the manifest index) and compared with the source files read independently of
stager.pack.sources: encoded formats must return every source file's bytes exactly; zarr returns the
decoded pixels.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import itertools
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from stager.errors import DestinationError, SourceError, SourceNotFoundError, UsageError
from stager.formats import FORMAT_NAMES, get_format
from stager.manifest import load_manifest
from stager.pack.api import pack
from stager.pack.options import PackOptions
from stager.pack.plan import cut_shards, plan_order
from stager.shardcheck import verify

ENCODED = [f for f in FORMAT_NAMES if get_format(f).sample_kind == "encoded"]


def read_pack(out: Path) -> dict[str, tuple[int, Any]]:
    """``{key: (label, payload)}`` of a pack, parsed by the format reader; cross-checks ``read``."""
    m = load_manifest(out)
    fmt = get_format(m.format)
    got: dict[str, tuple[int, Any]] = {}
    for info in m.shards:
        r = fmt.open_reader(str(out / info.name), info, m)
        try:
            parsed = list(r.iter_samples())
            indexed = r.read(np.arange(info.samples))
        finally:
            r.close()
        assert [s.key for s in parsed] == info.keys
        assert [int(s.label) for s in parsed] == info.labels.tolist()
        for s, payload in zip(parsed, indexed, strict=True):
            if isinstance(s.data, np.ndarray):
                np.testing.assert_array_equal(s.data, payload)
            else:
                assert bytes(payload) == bytes(s.data)
            assert s.key not in got
            got[s.key] = (int(s.label), s.data)
    assert len(got) == m.num_samples
    return got


def imagefolder_truth(root: Path) -> dict[str, tuple[int, bytes]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return {
        str(f.relative_to(root).with_suffix("")): (classes.index(f.relative_to(root).parts[0]), f.read_bytes())
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def cifar_truth(batches: Path, split: str = "train") -> dict[str, tuple[int, np.ndarray]]:
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    out = {}
    for n in names:
        with open(batches / n, "rb") as f:  # our own fixture: a plain pickle load is fine here
            d = pickle.load(f, encoding="bytes")
        for i, (row, lab) in enumerate(zip(d[b"data"], d[b"labels"], strict=True)):
            out[f"{n}/{i:05d}"] = (lab, row.reshape(3, 32, 32).transpose(1, 2, 0))
    return out


def decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("fmt", ENCODED)
def test_imagefolder_round_trip_bytes_exact(imagenet_tiny: Path, tmp_path: Path, fmt: str) -> None:
    r = pack(imagenet_tiny, tmp_path / "o", fmt, samples_per_shard=5)
    assert r.manifest is not None and r.samples == 24 and r.shards == 5
    assert r.manifest.classes == sorted(p.name for p in imagenet_tiny.iterdir())
    got = read_pack(tmp_path / "o")
    truth = imagefolder_truth(imagenet_tiny)
    assert got.keys() == truth.keys()
    for k, (label, data) in truth.items():
        assert got[k][0] == label and bytes(got[k][1]) == data, k
    assert verify(tmp_path / "o", deep=True).ok


@pytest.mark.parametrize("workers", [1, 2])
def test_result_profiles_its_phases(imagenet_tiny: Path, tmp_path: Path, workers: int) -> None:
    """``PackResult.phases`` (wall) and ``phases_cpu`` (this process) give each phase's seconds, the
    profile docs/benchmarks.md reports; together they take no longer than the whole call."""
    r = pack(imagenet_tiny, tmp_path / "out", "tar", workers=workers, samples_per_shard=10)
    assert list(r.phases) == list(r.phases_cpu) == ["list", "plan", "resume", "write", "publish"]
    assert all(v >= 0 for v in [*r.phases.values(), *r.phases_cpu.values()])
    assert sum(r.phases.values()) <= r.seconds
    done = pack(imagenet_tiny, tmp_path / "out", "tar", workers=workers, samples_per_shard=10)
    assert done.reused == done.shards and list(done.phases) == ["list", "plan", "resume"]  # nothing to write


@pytest.mark.parametrize("name", ["a\nb.JPEG", "a\x01b.JPEG", "\n.JPEG", "a\n\nb.JPEG"])
def test_a_newline_or_control_character_in_a_file_name_is_refused(imagenet_tiny: Path, tmp_path: Path,
                                                                    name: str) -> None:
    """The keys are checked all at once in one newline-joined text (issue 40): a key that holds a
    newline itself is still refused, naming the file, before anything is written."""
    src = tmp_path / "src"
    shutil.copytree(imagenet_tiny, src)
    first = sorted(p for p in src.rglob("*.JPEG"))[3]
    first.rename(first.with_name(name))
    with pytest.raises(SourceError, match="control character"):
        pack(src, tmp_path / "out", "tar")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_keys_checked_and_planned_in_chunks_as_at_once(imagenet_tiny: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A columnar listing's keys are checked and sized a chunk of text at a time (bounded memory at
    ImageNet's count): the same plan and shards as one chunk, and a bad name in a later chunk is
    still refused, naming its file."""
    from stager.pack.sources import columns

    for fmt in ("tar", "hdf5"):
        whole = pack(imagenet_tiny, tmp_path / f"whole-{fmt}", fmt, samples_per_shard=7)
        monkeypatch.setattr(columns, "CHUNK_LINES", 5)
        chunked = pack(imagenet_tiny, tmp_path / f"chunked-{fmt}", fmt, samples_per_shard=7)
        monkeypatch.undo()
        assert chunked.plan is not None and whole.plan is not None
        assert chunked.plan.fingerprint == whole.plan.fingerprint
        assert [s.est_bytes for s in chunked.plan.shards] == [s.est_bytes for s in whole.plan.shards]
        for name in (s.name for s in whole.manifest.shards):  # type: ignore[union-attr]
            assert (tmp_path / f"chunked-{fmt}" / name).read_bytes() == (tmp_path / f"whole-{fmt}" / name).read_bytes()
    src = tmp_path / "src"
    shutil.copytree(imagenet_tiny, src)
    last = sorted(src.rglob("*.JPEG"))[-1]
    last.rename(last.with_name("bad\x02.JPEG"))
    monkeypatch.setattr(columns, "CHUNK_LINES", 5)
    with pytest.raises(SourceError, match="control character"):
        pack(src, tmp_path / "bad", "tar")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_cifar_round_trip(cifar_tiny: Path, tmp_path: Path, fmt: str) -> None:
    for split in ("train", "test"):
        out = tmp_path / split
        pack(cifar_tiny, out, fmt, samples_per_shard=16, split=split)
        got = read_pack(out)
        truth = cifar_truth(cifar_tiny, split)
        assert got.keys() == truth.keys()
        for k, (label, arr) in truth.items():
            data = got[k][1]
            pixels = data if isinstance(data, np.ndarray) else decode(bytes(data))
            assert got[k][0] == label
            np.testing.assert_array_equal(pixels, arr)
        m = load_manifest(out)
        assert m.source["split"] == split and m.classes[0] == "airplane"
        if fmt == "zarr":
            assert m.sample_kind == "decoded" and m.image_shape == (32, 32, 3)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_list_file_round_trip(cifar_tiny: Path, tmp_path: Path, fmt: str) -> None:
    import shutil

    shutil.copytree(cifar_tiny.parent / "cifar-png" / "test", tmp_path / "imgs")
    files = sorted((tmp_path / "imgs").rglob("*.png"))[:12]
    lst = tmp_path / "list.jsonl"  # relative paths resolve against the list file's directory
    lst.write_text(
        "".join(json.dumps({"path": str(f.relative_to(tmp_path)), "label": f.parent.name}) + "\n" for f in files)
    )
    pack(lst, tmp_path / "o", fmt, samples_per_shard=5)
    got = read_pack(tmp_path / "o")
    names = sorted({f.parent.name for f in files})
    assert load_manifest(tmp_path / "o").classes == names
    assert len(got) == len(files)
    for f in files:
        label, data = got[str(f.relative_to(tmp_path).with_suffix(""))]
        assert label == names.index(f.parent.name)
        if isinstance(data, np.ndarray):
            np.testing.assert_array_equal(data, decode(f.read_bytes()))
        else:
            assert bytes(data) == f.read_bytes()


def test_conversion_between_all_formats(cifar_tiny: Path, tmp_path: Path) -> None:
    """tar -> every format -> every other format: keys, labels, classes and pixels survive."""
    base = tmp_path / "base"
    pack(cifar_tiny, base, "tar", samples_per_shard=25)
    truth = cifar_truth(cifar_tiny)
    classes = load_manifest(base).classes
    for a in FORMAT_NAMES:
        pack(base, tmp_path / a, a, samples_per_shard=17, seed=3)
        for b in FORMAT_NAMES:
            out = tmp_path / f"{a}-{b}"
            pack(tmp_path / a, out, b, samples_per_shard=40)
            m = load_manifest(out)
            assert m.classes == classes and m.source["kind"] == "pack" and m.format == b
            got = read_pack(out)
            assert got.keys() == truth.keys()
            for k, (label, arr) in truth.items():
                data = got[k][1]
                assert got[k][0] == label
                np.testing.assert_array_equal(data if isinstance(data, np.ndarray) else decode(bytes(data)), arr)
    # Encoded -> encoded conversion copies the payload bytes unchanged.
    base_payloads = {k: bytes(v[1]) for k, v in read_pack(base).items()}
    for a in ENCODED:
        for b in ENCODED:
            assert {k: bytes(v[1]) for k, v in read_pack(tmp_path / f"{a}-{b}").items()} == base_payloads


# ---- planning -------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 1000), max_size=60),
    sps=st.one_of(st.none(), st.integers(1, 10)),
    cap=st.one_of(st.none(), st.integers(1, 3000)),
)
def test_cut_shards_invariants(sizes: list[int], sps: int | None, cap: int | None) -> None:
    arr = np.asarray(sizes, dtype=np.int64)
    runs = cut_shards(arr, samples_per_shard=sps, shard_size=cap)
    flat = [i for a, b in runs for i in range(a, b)]
    assert flat == list(range(len(sizes)))  # every sample exactly once, in order
    for a, b in runs:
        assert b > a
        if sps is not None:
            assert b - a <= sps
        if cap is not None and b - a > 1:
            assert int(arr[a:b].sum()) <= cap
    for (a, b), (c, _) in itertools.pairwise(runs):  # a shard ends only when a limit forces it
        n, total = b - a, int(arr[a:b].sum()) + int(arr[c])
        assert (sps is not None and n >= sps) or (cap is not None and total > cap)


def test_plan_order_seeds() -> None:
    a, b = plan_order(100, seed=1), plan_order(100, seed=2)
    assert sorted(a.tolist()) == list(range(100)) and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, plan_order(100, seed=1))
    np.testing.assert_array_equal(plan_order(100, seed=1, keep_order=True), np.arange(100))


def test_shard_size_bytes_and_dry_run(imagenet_tiny: Path, tmp_path: Path) -> None:
    total = sum(f.stat().st_size for f in imagenet_tiny.rglob("*.JPEG"))
    dry = pack(imagenet_tiny, tmp_path / "o", "tar", shard_size=total // 4, dry_run=True)
    assert dry.manifest is None and not (tmp_path / "o").exists()
    assert dry.samples == 24 and dry.shards >= 4
    real = pack(imagenet_tiny, tmp_path / "o", "tar", shard_size=total // 4)
    assert real.shards == dry.shards and real.plan is not None and dry.plan is not None
    assert real.plan.fingerprint == dry.plan.fingerprint


def test_rerun_same_plan_keeps_files_and_changed_source_redoes(imagenet_tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    import shutil

    shutil.copytree(imagenet_tiny, src)
    out = tmp_path / "o"
    pack(src, out, "tar", samples_per_shard=6)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = pack(src, out, "tar", samples_per_shard=6)
    assert again.reused == 4 and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # Touching one source file changes only the shard that holds it.
    victim = sorted(src.rglob("*.JPEG"))[0]
    os.utime(victim, ns=(1, 1))
    third = pack(src, out, "tar", samples_per_shard=6)
    assert third.reused == 3 and verify(out).ok
    # A damaged shard is detected on rerun and rewritten.
    shard = out / third.manifest.shards[0].name  # type: ignore[union-attr]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not verify(out).ok
    fourth = pack(src, out, "tar", samples_per_shard=6)
    assert fourth.reused == 3 and verify(out, deep=True).ok


# ---- bad input ------------------------------------------------------------------------------------


def _bad_tree(root: Path, imagenet_tiny: Path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(imagenet_tiny, root)
    victim = sorted(root.rglob("*.JPEG"))[5]
    victim.write_bytes(victim.read_bytes()[:2000])  # truncated copy
    fake = root / "n00000001" / "readme.jpg"
    fake.write_bytes(b"this is not an image at all")
    return victim, fake


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_bad_images_raise_or_skip(imagenet_tiny: Path, tmp_path: Path, fmt: str) -> None:
    victim, fake = _bad_tree(tmp_path / "src", imagenet_tiny)
    resize = (24, 32) if fmt == "zarr" else None
    out = tmp_path / "o"
    with pytest.raises(SourceError, match=rf"({victim.name}|{fake.name})"):
        pack(tmp_path / "src", out, fmt, samples_per_shard=4, resize=resize)
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]
    r = pack(tmp_path / "src", out, fmt, samples_per_shard=4, resize=resize, on_error="skip")
    assert r.samples == 23 and len(r.skipped) == 2  # 24 files + 1 fake, 2 bad
    m = load_manifest(out)
    assert sorted(Path(s["path"]).name for s in m.skipped) == sorted([victim.name, fake.name])
    assert all(s["error"] for s in m.skipped)
    assert len(read_pack(out)) == 23
    assert verify(out, deep=True).ok


def test_zarr_needs_uniform_size(imagenet_tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"one fixed image size.*--resize HxW"):
        pack(imagenet_tiny, tmp_path / "o", "zarr")
    assert not (tmp_path / "o").exists()
    r = pack(imagenet_tiny, tmp_path / "o", "zarr", resize=(48, 64))
    assert r.manifest is not None and r.manifest.image_shape == (48, 64, 3)
    assert all(a.shape == (48, 64, 3) for _, a in read_pack(tmp_path / "o").values())


def test_resize_and_quality_reencode(imagenet_tiny: Path, tmp_path: Path) -> None:
    pack(imagenet_tiny, tmp_path / "o", "tar", resize=(40, 50), quality=70)
    for _, data in read_pack(tmp_path / "o").values():
        im = Image.open(io.BytesIO(bytes(data)))
        assert im.format == "JPEG" and im.size == (50, 40)


def test_usage_and_destination_errors(imagenet_tiny: Path, cifar_tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown format 'parquet'"):
        pack(imagenet_tiny, tmp_path / "o", "parquet")
    with pytest.raises(SourceNotFoundError):
        pack(tmp_path / "missing", tmp_path / "o", "tar")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(SourceError, match="holds no images"):
        pack(tmp_path / "empty", tmp_path / "o", "tar")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.pdf").write_bytes(b"precious")
    with pytest.raises(DestinationError, match=r"thesis\.pdf.*--overwrite"):
        pack(imagenet_tiny, busy, "tar")
    assert sorted(os.listdir(busy)) == ["thesis.pdf"]
    pack(imagenet_tiny, busy, "tar", overwrite=True)
    assert (busy / "thesis.pdf").read_bytes() == b"precious" and verify(busy).ok
    # Another source's pack is refused; the same source with new options replaces it.
    out = tmp_path / "o3"
    pack(imagenet_tiny, out, "tar")
    with pytest.raises(DestinationError, match="another source"):
        pack(cifar_tiny, out, "hdf5")
    r = pack(imagenet_tiny, out, "record", samples_per_shard=7)
    assert not [p for p in os.listdir(out) if p.endswith(".tar")]
    assert r.shards == 4 and verify(out).ok


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"samples_per_shard": 0}, "samples_per_shard must be >= 1"),
        ({"shard_size": 0}, "shard_size must be >= 1 byte"),
        ({"workers": 0}, "workers must be >= 1"),
        ({"resize": (0, 4)}, r"resize must be \(H, W\)"),
        ({"resize": (4, 4, 3)}, r"resize must be \(H, W\)"),
        ({"quality": 101}, r"quality must be in 1\.\.100"),
        ({"on_error": "ignore"}, "on_error must be one of raise, skip"),
        ({"hash_algo": "md5"}, "unknown hash 'md5'"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_is_read(
    tmp_path: Path, bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        PackOptions(**bad)
    with pytest.raises(UsageError, match=message):  # the source does not exist: options are checked first
        pack(tmp_path / "missing", tmp_path / "o", "tar", **bad)
    assert not (tmp_path / "o").exists()


def test_pack_options_mirror_the_public_signature() -> None:
    """``pack(src, out, format, **keywords)`` keeps its keywords and defaults; each is a PackOptions field."""
    params = inspect.signature(pack).parameters
    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
              for f in dataclasses.fields(PackOptions)}
    assert list(params)[:3] == ["src", "out", "format"] and params["format"].default == fields["format"]
    keywords = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == {n: d for n, d in fields.items() if n != "format"}
    assert PackOptions(resize=[32.0, 24]).resize == (32, 24)  # type: ignore[arg-type]

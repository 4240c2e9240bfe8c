"""Pack sources (stager/pack/sources/): listing, labels, keys, the restricted CIFAR unpickler, checks."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from stager.errors import SourceError, SourceNotFoundError, UsageError
from stager.pack.sources.base import key_for, unique_keys
from stager.pack.sources.checks import check_encoded, prepare_sample
from stager.pack.sources.cifar import restricted_load
from stager.pack.sources.select import open_source
from tools.datagen import jpeg_bytes, png_bytes


def _png(seed: int, hw: tuple[int, int] = (8, 8)) -> bytes:
    return png_bytes(np.random.default_rng(seed).integers(0, 256, (*hw, 3), dtype=np.uint8))


# ---- keys ---------------------------------------------------------------------------------------


def test_key_for_drops_extension_and_dots_in_last_component() -> None:
    assert key_for("cls/a.b.c.JPEG") == "cls/a_b_c"
    assert key_for("cls/v1.0/img.png") == "cls/v1.0/img"
    assert key_for("img") == "img"


@given(st.lists(st.sampled_from(["a", "a_1", "b", "a_2", "a_1_1"]), max_size=30))
def test_unique_keys_are_unique_and_stable(keys: list[str]) -> None:
    out = unique_keys(keys)
    assert len(out) == len(keys) and len(set(out)) == len(out)
    assert out == unique_keys(keys)
    seen: set[str] = set()
    for k, o in zip(keys, out, strict=True):
        assert o == k if k not in seen else o.startswith(k + "_")
        seen.add(o)


# ---- ImageFolder ----------------------------------------------------------------------------------


def test_imagefolder_labels_recursion_hidden_and_extensions(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    files = {
        "zebra/a.jpg": jpeg_bytes(np.zeros((8, 8, 3), np.uint8)),
        "apple/sub/deep/b.PNG": _png(1),
        "apple/c.Jpeg": jpeg_bytes(np.full((8, 8, 3), 200, np.uint8)),
        "apple/x.y.png": _png(2),
        "apple/x_y.png": _png(3),  # collides with x.y.png after dot replacement
        "apple/.hidden.png": _png(4),
        "apple/notes.txt": b"not an image",
        ".cache/c.png": _png(5),
        "mango/.git/e.png": _png(6),
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    with pytest.raises(SourceError, match="mango: class folder holds no images"):
        open_source(root)  # an empty class folder is refused (torchvision's ImageFolder raises too)...
    from stager.pack.options import PackOptions

    src = open_source(root, options=PackOptions(allow_empty_classes=True))  # ...unless kept on request
    assert src.kind == "imagefolder"
    assert src.classes == ["apple", "mango", "zebra"]  # hidden .cache excluded, empty mango kept
    by_key = {r.key: r for r in src.refs}
    assert set(by_key) == {"apple/c", "apple/sub/deep/b", "apple/x_y", "apple/x_y_1", "zebra/a"}
    assert {k: r.label for k, r in by_key.items()} == {
        "apple/c": 0,
        "apple/sub/deep/b": 0,
        "apple/x_y": 0,
        "apple/x_y_1": 0,
        "zebra/a": 2,
    }
    # Sorted path order decides who keeps the plain key: "x.y.png" < "x_y.png".
    assert by_key["apple/x_y"].locator.endswith("x.y.png")
    for r in src.refs:
        s = src.load(r)
        assert s.data == Path(r.locator).read_bytes()
        assert r.size == len(s.data)
    assert src.load(by_key["apple/sub/deep/b"]).ext == "png"
    assert src.load(by_key["apple/c"]).ext == "jpg"


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        open_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no class sub-folders"):
        open_source(tmp_path / "empty")
    (tmp_path / "empty" / "cls").mkdir()
    with pytest.raises(SourceError, match="holds no images"):
        open_source(tmp_path / "empty")


# ---- CIFAR -----------------------------------------------------------------------------------------


def test_cifar_splits_labels_and_pixels(cifar_tiny: Path) -> None:
    train, test = open_source(cifar_tiny), open_source(cifar_tiny, split="test")
    assert (len(train.refs), len(test.refs)) == (60, 20)
    assert train.classes[:2] == ["airplane", "automobile"] and len(train.classes) == 10
    with open(cifar_tiny / "test_batch", "rb") as f:  # our own trusted fixture: plain pickle is fine
        raw = pickle.load(f, encoding="bytes")
    for i, r in enumerate(test.refs):
        s = test.load(r)
        assert r.key == f"test_batch/{i:05d}" and s.label == raw[b"labels"][i]
        assert s.data.shape == (32, 32, 3) and s.data.dtype == np.uint8
        np.testing.assert_array_equal(s.data, raw[b"data"][i].reshape(3, 32, 32).transpose(1, 2, 0))
    with pytest.raises(UsageError, match="split"):
        open_source(cifar_tiny, split="val")


class _Boom:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.cmd,))


def test_restricted_unpickler_refuses_code_without_running_it(tmp_path: Path, cifar_tiny: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "cifar-10-batches-py"
    shutil.copytree(cifar_tiny, evil)
    payload = {b"data": _Boom(f"touch {marker}"), b"labels": [0]}
    (evil / "data_batch_1").write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(SourceError, match=r"data_batch_1: refusing to unpickle posix\.system"):
        open_source(evil)
    assert not marker.exists()
    for proto in (2, 4, 5):
        (evil / "x.pkl").write_bytes(pickle.dumps({b"f": eval}, protocol=proto))
        with pytest.raises(SourceError, match=r"refusing to unpickle (__builtin__|builtins)\.eval"):
            restricted_load(evil / "x.pkl")


@pytest.mark.parametrize("proto", [2, 4, 5])
def test_restricted_unpickler_reads_numpy_batches(tmp_path: Path, proto: int) -> None:
    arr = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    (tmp_path / "b").write_bytes(pickle.dumps({b"data": arr, b"labels": [3, 4], "s": "x"}, protocol=proto))
    d = restricted_load(tmp_path / "b")
    np.testing.assert_array_equal(d[b"data"], arr)
    assert d[b"labels"] == [3, 4] and d["s"] == "x"


def test_cifar_malformed_batch_is_one_line_error(tmp_path: Path, cifar_tiny: Path) -> None:
    bad = tmp_path / "c"
    shutil.copytree(cifar_tiny, bad)
    (bad / "data_batch_2").write_bytes(pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(SourceError, match=r"data_batch_2: expected b'data' as a uint8 array"):
        open_source(bad)
    (bad / "data_batch_2").write_bytes(b"\x80\x02garbage")
    with pytest.raises(SourceError, match="data_batch_2: not a readable CIFAR batch"):
        open_source(bad)


# ---- list files --------------------------------------------------------------------------------------


def test_csv_and_jsonl_lists(tmp_path: Path) -> None:
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(4):
        (imgs / f"{i}.png").write_bytes(_png(i))
    (tmp_path / "l.csv").write_text("path,label\nimgs/0.png,2\nimgs/1.png,0\n" + f"{imgs / '2.png'},1\n")
    src = open_source(tmp_path / "l.csv")
    assert src.kind == "list" and src.classes == ["0", "1", "2"]
    assert [(r.key, r.label) for r in src.refs] == [("imgs/0", 2), ("imgs/1", 0), ("imgs/2", 1)]
    sub = tmp_path / "lists"
    sub.mkdir()
    (sub / "l.jsonl").write_text(
        json.dumps({"path": "../imgs/3.png", "label": "dog"})
        + "\n\n"
        + json.dumps({"path": "../imgs/0.png", "label": "cat"})
    )
    src = open_source(sub / "l.jsonl")
    assert src.classes == ["cat", "dog"]
    assert {Path(r.locator).name: r.label for r in src.refs} == {"3.png": 1, "0.png": 0}
    for r in src.refs:
        assert src.load(r).data == Path(r.locator).read_bytes()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("file,label\na.png,0\n", "header 'path,label'"),
        ("path,label\nmissing.png,0\n", r"l\.csv:2: .*missing\.png does not exist"),
        ("path,label\na.png,0\nb.png,cat\n", "mix integers and class names"),
        ("path,label\na.png,-1\n", "negative label"),
    ],
)
def test_bad_list_files(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "a.png").write_bytes(_png(0))
    (tmp_path / "b.png").write_bytes(_png(1))
    (tmp_path / "l.csv").write_text(text)
    with pytest.raises((SourceError, SourceNotFoundError), match=match):
        open_source(tmp_path / "l.csv")


# ---- checks and preparation ---------------------------------------------------------------------------


def test_check_encoded_catches_truncation_and_non_images() -> None:
    jpg = jpeg_bytes(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    png = _png(0)
    assert check_encoded(jpg, "x") == "jpg" and check_encoded(png, "x") == "png"
    with pytest.raises(SourceError, match=r"a\.jpg: damaged JPEG \(truncated"):
        check_encoded(jpg[: len(jpg) // 2], "a.jpg")
    with pytest.raises(SourceError, match=r"b\.png: damaged PNG \(truncated"):
        check_encoded(png[:-5], "b.png")
    with pytest.raises(SourceError, match=r"c\.jpg: not an image file"):
        check_encoded(b"hello world, definitely text", "c.jpg")


def test_prepare_sample_resize_quality_and_decoded() -> None:
    from stager.formats.base import Sample

    arr = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    s = Sample("k", 1, png_bytes(arr), "png")
    same = prepare_sample(s, target_kind="encoded", where="k")
    assert same.data == s.data and same.ext == "png"
    out = prepare_sample(s, target_kind="encoded", where="k", resize=(10, 12), quality=80)
    assert out.ext == "jpg" and Image.open(io.BytesIO(out.data)).size == (12, 10)
    dec = prepare_sample(s, target_kind="decoded", where="k")
    np.testing.assert_array_equal(dec.data, arr)
    with pytest.raises(SourceError, match=r"k: image is 20x30, expected 8x8.*--resize"):
        prepare_sample(s, target_kind="decoded", where="k", image_shape=(8, 8, 3))
    enc = prepare_sample(Sample("k", 1, arr, "png"), target_kind="encoded", where="k")
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(enc.data))), arr)


@settings(max_examples=25, deadline=None)
@given(
    q=st.integers(5, 100),
    progressive=st.booleans(),
    subsampling=st.sampled_from([0, 1, 2]),
    exif=st.booleans(),
    hw=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    cut=st.floats(0.0, 0.999),
)
def test_jpeg_structure_check_accepts_valid_and_rejects_every_truncation(
    *, q: int, progressive: bool, subsampling: int, exif: bool, hw: tuple[int, int], cut: float
) -> None:
    arr = np.random.default_rng(q).integers(0, 256, (*hw, 3), dtype=np.uint8)
    buf = io.BytesIO()
    kw: dict[str, object] = {"quality": q, "progressive": progressive, "subsampling": subsampling}
    if exif:
        e = Image.Exif()
        e[0x010E] = "a description long enough to matter " * 4
        kw["exif"] = e.tobytes()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    data = buf.getvalue()
    assert check_encoded(data, "x.jpg") == "jpg"
    with pytest.raises(SourceError, match=r"x\.jpg: damaged JPEG"):
        check_encoded(data[: max(3, int(len(data) * cut))], "x.jpg")

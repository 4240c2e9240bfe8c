"""`stager index`: existing shards written by the real libraries (webdataset's ShardWriter, the `tfrecord`
package's TFRecordWriter, pyarrow, Hugging Face `datasets`) adopted in place, then read by verify, stage,
pack and the loader exactly as a stager pack.

TFRecords come from the `tfrecord` package rather than TensorFlow: its writer frames records exactly as
TensorFlow's (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload; stager's
record tests hold the framing equal to TensorFlow's spec) and it is a 60 KB test dependency, where
tensorflow-cpu is ~500 MB, too heavy for CI.

Invariant checked for every kind: through the loader every sample comes exactly once per epoch with
the label its source file gives it, in one process and (test_three_gloo_ranks) across 3 gloo ranks,
and a staged copy reads the same.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.cli import main as cli
from stager.errors import CorruptSampleError, DestinationError, UsageError
from stager.index import IndexOptions, index_dataset
from stager.loader import make_loader
from stager.manifest import MANIFEST_NAME, load_manifest
from stager.shardcheck import verify
from stager.stage import stage
from tools.datagen import jpeg_bytes, png_bytes

NO_PYARROW = "pyarrow is not installed (pip install 'stager[parquet]'; make venv installs it)"


def _img(i: int, png: bool = False) -> bytes:
    arr = np.random.default_rng(i).integers(0, 255, (12, 10, 3), dtype=np.uint8)
    return png_bytes(arr) if png else jpeg_bytes(arr)


# ---- real writers ------------------------------------------------------------------------------------
def write_wds(d: Path, n: int = 23, per_shard: int = 8) -> dict[str, tuple[bytes, int]]:
    """webdataset ShardWriter: PAX headers with float mtimes, dotted keys (ImageNet file names), jpg and png."""
    import webdataset as wds

    d.mkdir(parents=True)
    truth = {}
    with wds.ShardWriter(str(d / "train-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for i in range(n):
            key, ext, data = f"n01440764_{i:05d}.JPEG", ("png" if i % 5 == 0 else "jpg"), _img(i, i % 5 == 0)
            w.write({"__key__": key, ext: data, "cls": i % 4, "json": {"label": i % 4, "name": f"c{i % 4}"},
                     "txt": f"class{i % 4}"})
            truth[key] = (data, i % 4)
    return truth


def write_tfrecords(d: Path, n: int = 20, files: int = 2) -> dict[str, tuple[bytes, int]]:
    """The `tfrecord` package's TFRecordWriter, ImageNet keys, 1-based labels (TensorFlow's build scripts)."""
    from tfrecord import TFRecordWriter

    d.mkdir(parents=True)
    truth = {}
    per = n // files
    for f in range(files):
        w = TFRecordWriter(str(d / f"train-{f:05d}-of-{files:05d}"))
        for i in range(f * per, (f + 1) * per):
            data = _img(100 + i)
            w.write({"image/encoded": (data, "byte"), "image/class/label": (i % 5 + 1, "int"),
                     "image/filename": (f"n0_{i}.JPEG".encode(), "byte"), "image/height": (12, "int")})
            truth[f"n0_{i}.JPEG"] = (data, i % 5)
        w.close()
    return truth


def write_hf_parquet(d: Path, n: int = 25) -> dict[str, tuple[bytes, int]]:
    """Hugging Face `datasets`: an in-memory Dataset with Image and ClassLabel features, to_parquet (offline)."""
    pytest.importorskip("pyarrow", reason=NO_PYARROW)
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install 'stager[test]')")
    d.mkdir(parents=True)
    names = ["tench", "goldfish", "shark"]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    rows = [{"bytes": _img(200 + i), "path": f"img_{i}.jpg"} for i in range(n)]
    ds = datasets.Dataset.from_dict({"image": rows, "label": [i % 3 for i in range(n)]}, features=feats)
    ds.to_parquet(str(d / "train-00000-of-00001.parquet"))
    return {r["path"]: (r["bytes"], i % 3) for i, r in enumerate(rows)}


def write_pyarrow(d: Path, n: int = 30) -> dict[int, tuple[bytes, str]]:
    """pyarrow: a plain binary column with string labels; one file snappy-compressed (pyarrow's default),
    one uncompressed with dictionary pages (pyarrow's default dictionary encoding)."""
    pa = pytest.importorskip("pyarrow", reason=NO_PYARROW)
    pq = pytest.importorskip("pyarrow.parquet", reason=NO_PYARROW)
    d.mkdir(parents=True)
    images = [_img(300 + i) for i in range(n)]
    labels = [f"k{i % 3}" for i in range(n)]
    t = pa.table({"image": pa.array(images, pa.binary()), "label": labels})
    pq.write_table(t.slice(0, 17), d / "a.parquet", row_group_size=6)
    pq.write_table(t.slice(17), d / "b.parquet", row_group_size=5, compression="none")
    return {i: (images[i], labels[i]) for i in range(n)}


# ---- what must hold -----------------------------------------------------------------------------------
def read_all(path: Path | str, **kw: Any) -> dict[str, tuple[bytes, int]]:
    """Every sample through the loader (one epoch, raw bytes): key -> (bytes, label); each key exactly once."""
    loader = make_loader(str(path), batch_size=4, decode="raw", seed=3, **kw)
    got: dict[str, tuple[bytes, int]] = {}
    for b in loader:
        for k, img, lab in zip(b["key"], b["image"], b["label"].tolist(), strict=True):
            assert k not in got, f"{k} twice"
            got[k] = (bytes(img), lab)
    return got


def test_webdataset_shardwriter_tars(tmp_path: Path) -> None:
    truth = write_wds(tmp_path / "wds")
    r = index_dataset(tmp_path / "wds")
    assert (r.kind, r.shards, r.samples, r.shard_root) == ("tar", 3, 23, None)
    m = load_manifest(tmp_path / "wds")
    assert m.format == "tar" and m.indexed and m.classes == ["0", "1", "2", "3"]
    assert set(m.shards[0].keys) <= set(truth)  # dotted keys kept whole
    got = read_all(tmp_path / "wds", staged=False)
    assert got == {k: (d, lab) for k, (d, lab) in truth.items()}
    assert verify(tmp_path / "wds", deep=True).ok
    # Labels from .txt (class names, sorted) and from .json's field.
    index_dataset(tmp_path / "wds", tmp_path / "by-txt", IndexOptions(label_key="txt"))
    m2 = load_manifest(tmp_path / "by-txt")
    assert m2.classes == ["class0", "class1", "class2", "class3"] and m2.shard_root == str(tmp_path / "wds")
    assert {k: lab for k, (_, lab) in read_all(tmp_path / "by-txt", staged=False).items()} == {
        k: lab for k, (_, lab) in truth.items()}
    index_dataset(tmp_path / "wds", tmp_path / "by-json", IndexOptions(label_key="json:name"))
    assert load_manifest(tmp_path / "by-json").classes == ["c0", "c1", "c2", "c3"]
    assert verify(tmp_path / "by-json", deep=True).ok


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), 1.5e9 + 0.25
            t.addfile(ti, io.BytesIO(data))


def test_tar_sample_split_across_shards_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "split"
    d.mkdir()
    _tar(d / "a-0.tar", [("s1.cls", b"1"), ("s1.jpg", _img(1)), ("s2.cls", b"0")])
    _tar(d / "a-1.tar", [("s2.jpg", _img(2)), ("s3.cls", b"1"), ("s3.jpg", _img(3))])
    with pytest.raises(CorruptSampleError, match=r"a-1.tar: sample 's2' continues from a-0.tar"):
        index_dataset(d)
    assert not (d / MANIFEST_NAME).exists()
    assert cli(["index", str(d), "-q"]) == 3


def test_tar_without_image_or_with_two_asks_for_image_key(tmp_path: Path) -> None:
    d = tmp_path / "two"
    d.mkdir()
    _tar(d / "a.tar", [("s1.cls", b"1"), ("s1.jpg", _img(1)), ("s1.png", _img(2, True))])
    with pytest.raises(CorruptSampleError, match=r"several image members.*--image-key"):
        index_dataset(d)
    r = index_dataset(d, options=IndexOptions(image_key="jpg"))
    assert r.samples == 1 and read_all(d, staged=False)["s1"] == (_img(1), 1)
    # KEY.jpg beside KEY.seg.png: the bare extension is the image, the other a field (docs/fields.md)
    _tar(d / "a.tar", [("s1.cls", b"1"), ("s1.jpg", _img(1)), ("s1.seg.png", _img(2, True))])
    m = load_manifest(index_dataset(d).manifest_path)
    assert read_all(d, staged=False)["s1"] == (_img(1), 1) and m.fields[0]["name"] == "seg"


def test_tfrecords_from_the_tfrecord_package(tmp_path: Path) -> None:
    from tfrecord.tools.tfrecord2idx import create_index

    truth = write_tfrecords(tmp_path / "tfr")
    r = index_dataset(tmp_path / "tfr", options=IndexOptions(label_offset=-1, workers=2))
    assert (r.kind, r.samples, r.scanned) == ("record", 20, 2)
    m = load_manifest(tmp_path / "tfr")
    assert m.format == "record" and m.classes == ["0", "1", "2", "3", "4"]
    assert [a.name for a in m.shards[0].aux] == ["train-00000-of-00002.idx"]  # staged with its file
    for s in m.shards:  # DALI's index format, byte for byte what tfrecord's create_index writes
        create_index(str(tmp_path / "tfr" / s.name), str(tmp_path / f"{s.name}.ref"))
        assert (tmp_path / "tfr" / f"{s.name}.idx").read_bytes() == (tmp_path / f"{s.name}.ref").read_bytes()
    assert read_all(tmp_path / "tfr", staged=False) == truth
    assert verify(tmp_path / "tfr", deep=True).ok
    # CRCs are checked while indexing: one flipped payload byte is caught and named.
    f = tmp_path / "tfr" / "train-00001-of-00002"
    data = bytearray(f.read_bytes())
    data[200] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptSampleError, match="train-00001-of-00002: record data CRC mismatch"):
        index_dataset(tmp_path / "tfr", tmp_path / "again")


def test_hugging_face_parquet(tmp_path: Path) -> None:
    truth = write_hf_parquet(tmp_path / "hf")
    index_dataset(tmp_path / "hf")
    m = load_manifest(tmp_path / "hf")
    assert m.format == "parquet" and m.classes == ["tench", "goldfish", "shark"]
    assert [s.extents for s in m.shards] == ["bytes"]  # datasets writes image bytes uncompressed: zero-copy
    assert read_all(tmp_path / "hf", staged=False) == truth
    assert read_all(tmp_path / "hf", staged=False, num_workers=2) == truth
    assert verify(tmp_path / "hf", deep=True).ok


def test_pyarrow_parquet_read_only_source_with_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    truth = write_pyarrow(tmp_path / "pq")
    os.chmod(tmp_path / "pq", 0o555)
    try:
        if not os.access(tmp_path / "pq", os.W_OK):  # (root may write anyway)
            with pytest.raises(DestinationError, match=r"not writable.*--out"):
                index_dataset(tmp_path / "pq")
    finally:
        os.chmod(tmp_path / "pq", 0o755)
    out = tmp_path / "idx"
    assert cli(["index", str(tmp_path / "pq"), "--out", str(out), "--json", "-q"]) == 0
    m = load_manifest(out)
    assert m.shard_root == str(tmp_path / "pq") and not (tmp_path / "pq" / MANIFEST_NAME).exists()
    assert [s.extents for s in m.shards] == ["rows", "bytes"]  # snappy pages by rows, plain ones by bytes
    assert m.classes == ["k0", "k1", "k2"]
    want = {f"{'a' if i < 17 else 'b'}.parquet/{(i if i < 17 else i - 17):08d}": (d, int(lab[1]))
            for i, (d, lab) in truth.items()}
    assert read_all(out, staged=False) == want
    assert verify(out, deep=True).ok
    # Staged: copied from shard_root; the copy's manifest drops it, keeps the digest; the loader finds it.
    monkeypatch.setenv("STAGER_DEST", str(tmp_path / "node"))
    res = stage(out)
    dest = Path(res.dest)
    staged = load_manifest(dest)
    assert staged.shard_root is None and staged.digest == m.digest
    assert "shard_root" not in json.loads((dest / MANIFEST_NAME).read_text())
    loader = make_loader(str(out), batch_size=4, decode="raw")
    assert sum(len(b["key"]) for b in loader) == 30 and loader.stats()["staged"]
    assert read_all(out) == want and read_all(dest, staged=False) == want
    # A shard changed afterwards: verify names it, exit 3.
    with open(tmp_path / "pq" / "b.parquet", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    assert cli(["verify", str(out), "-q"]) == 3


def test_resume_and_pack_convert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    truth = write_wds(tmp_path / "wds", n=30, per_shard=6)
    from stager.index import api

    real = api.SCANNERS["tar"]
    calls: list[str] = []

    def flaky(path: str, name: str, *a: Any) -> Any:
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed mid-run
        return real(path, name, *a)

    monkeypatch.setitem(api.SCANNERS, "tar", flaky)
    with pytest.raises(KeyboardInterrupt):
        index_dataset(tmp_path / "wds")
    assert not (tmp_path / "wds" / MANIFEST_NAME).exists()
    monkeypatch.setitem(api.SCANNERS, "tar", real)
    r = index_dataset(tmp_path / "wds")
    assert (r.resumed, r.scanned) == (2, 3) and not (tmp_path / "wds" / ".stager-index").exists()
    # Any format from an index: pack reads it like a pack; `pack` never treats the index's shards as its own.
    from stager.pack import pack

    pack(tmp_path / "wds", tmp_path / "h5", "hdf5")
    assert read_all(tmp_path / "h5", staged=False) == {k.replace(".JPEG", "_JPEG"): v for k, v in truth.items()}
    with pytest.raises(DestinationError, match="stager index"):
        pack(tmp_path / "h5", tmp_path / "wds", "tar", overwrite=True)
    assert len(list((tmp_path / "wds").glob("*.tar"))) == 5


def test_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert cli(["index", str(tmp_path / "empty"), "-q"]) == 2
    write_hf_parquet(tmp_path / "hf", n=3)
    with pytest.raises(UsageError, match=r"no column .img..*--image-key"):
        index_dataset(tmp_path / "hf", options=IndexOptions(image_key="img"))


def test_partition_and_unpack_of_an_index(tmp_path: Path) -> None:
    truth = write_tfrecords(tmp_path / "tfr", n=24, files=4)
    index_dataset(tmp_path / "tfr", tmp_path / "idx", IndexOptions(label_offset=-1))
    assert (tmp_path / "idx" / "train-00000-of-00004.idx").exists()  # DALI index files go into --out
    got: dict[str, tuple[bytes, int]] = {}
    for node in (0, 1):
        res = stage(tmp_path / "idx", tmp_path / f"n{node}", partition=True, node=node, num_nodes=2,
                    ranks_per_node=1, unpack="also")
        m = load_manifest(tmp_path / f"n{node}")
        held = [s for s in m.shards if (tmp_path / f"n{node}" / s.name).exists()]
        for s in held:
            for k, o, z, lab in zip(s.keys, s.offsets.tolist(), s.sizes.tolist(), s.labels.tolist(), strict=True):
                with open(tmp_path / f"n{node}" / s.name, "rb") as f:
                    f.seek(o)
                    got[k] = (f.read(z), lab)
        assert res.unpacked
    assert got == truth
    files = sorted(p.name for n in (0, 1) for p in (tmp_path / f"n{n}" / "unpacked").rglob("*.jpg"))
    assert files == sorted(f"{k}.jpg" for k in truth)


def test_collective_stage_of_an_index(tmp_path: Path) -> None:
    truth = write_hf_parquet(tmp_path / "hf", n=12)
    index_dataset(tmp_path / "hf", tmp_path / "idx")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "stager", "stage", str(tmp_path / "idx"),
                                       str(tmp_path / f"d{i}"), "--collective", "--timeout", "30", "--json", "-q"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        assert json.loads(so.splitlines()[-1])["collective"]
    for i in range(2):
        assert read_all(tmp_path / f"d{i}", staged=False) == truth


# ---- 3 gloo ranks --------------------------------------------------------------------------------------
WORLD = 3


def _rank_main(rank: int, port: int, datas: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    mine = {}
    for data in datas:
        loader = make_loader(data, 4, num_workers=1, decode="raw", seed=7, staged=False,
                             multiprocessing_context="fork")
        got = []
        for b in loader:
            got += [(k, bytes(x).hex()[:64], lab) for k, x, lab in zip(b["key"], b["image"], b["label"].tolist(),
                                                                      strict=True)]
            t = torch.tensor([len(b["key"])])
            dist.all_reduce(t)
        mine[data] = got
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_three_gloo_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    sets = {"wds": write_wds(tmp_path / "wds"), "pq": write_pyarrow(tmp_path / "pq")}
    index_dataset(tmp_path / "wds")
    index_dataset(tmp_path / "pq")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    datas = [str(tmp_path / "wds"), str(tmp_path / "pq")]
    mp.spawn(_rank_main, args=(port, datas, str(tmp_path / "out.json")), nprocs=WORLD, join=True)
    ranks = json.loads((tmp_path / "out.json").read_text())
    for data in datas:
        m = load_manifest(data)
        seqs = [r[data] for r in ranks]
        assert len({len(s) for s in seqs}) == 1, "equal work per rank"
        flat = [x for s in seqs for x in s]
        n = m.num_samples
        pad = len(flat) - n
        assert 0 <= pad < WORLD
        keys = [k for k, _, _ in flat]
        assert set(keys) == {k for s in m.shards for k in s.keys} and len(set(keys)) == n
        truth: dict[str, Any] = sets["wds"] if data.endswith("wds") else {
            f"{'a' if i < 17 else 'b'}.parquet/{(i if i < 17 else i - 17):08d}": (d, int(lab[1]))
            for i, (d, lab) in sets["pq"].items()}
        for k, head, lab in flat:
            assert head == truth[k][0].hex()[:64] and lab == truth[k][1]

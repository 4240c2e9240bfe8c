"""Clip packs with fields per frame (docs/clips.md, "Fields per frame"): masks and boxes per frame
follow the clip's one crop and flip.

A tiny synthetic set, real PNG files and real packs: each frame's red channel is a palette colour of
its class (blocks that move from frame to frame), so its mask is a function of its pixels; green and
blue are fixed gradients of the column and row, the same in every frame, so one crop per clip means
equal green/blue channels across a clip's T frames.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.loader import make_loader
from stager.manifest import load_manifest

T, H, W, SEQS, FRAMES = 3, 48, 64, 2, 7
PALETTE = np.array([0, 60, 120, 180, 240], dtype=np.int16)  # red value of classes 0..4
FIELDS = "mask:mask,boxes:boxes,box_labels:box_labels"


def _write_frames(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    rows, cols = np.mgrid[0:H, 0:W]
    for s in range(SEQS):
        seq = root / f"seq_{s}"
        seq.mkdir(parents=True)
        base = rng.integers(0, len(PALETTE), size=(H // 8, W // 8))
        for f in range(FRAMES):
            mask = np.kron(np.roll(base, f, axis=1), np.ones((8, 8), dtype=np.int64)).astype(np.uint8)
            img = np.stack([PALETTE[mask], cols * 255 // (W - 1), rows * 255 // (H - 1)], axis=-1).astype(np.uint8)
            Image.fromarray(img).save(seq / f"{f:06d}.png")
            Image.fromarray(mask).save(seq / f"{f:06d}.mask.png")
            x0 = (8 * f) % (W - 16)
            boxes = [[x0, 4.0, x0 + 16.0, 20.0], [0.0, 24.0, float(W), float(H)]]
            (seq / f"{f:06d}.boxes.json").write_text(json.dumps(boxes))
            (seq / f"{f:06d}.box_labels.json").write_text(json.dumps([f % 5, 1]))


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cf") / "frames"
    _write_frames(root)
    return root


def _near_edge(mask: np.ndarray, r: int) -> np.ndarray:
    """Pixels of (..., S, S) ``mask`` within ``r`` pixels (Chebyshev) of a different class or of the
    crop's border (the decoder resamples the image over the box rounded to whole source pixels)."""
    s = mask.shape[-1]
    pad = np.pad(mask, [(0, 0)] * (mask.ndim - 2) + [(r, r), (r, r)], constant_values=255)
    out = np.zeros(mask.shape, dtype=bool)
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            out |= pad[..., dy : dy + s, dx : dx + s] != mask
    return out


def stager(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stager", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def pack_dir(frames: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cfp") / "out"
    # 4 frames per shard: sequences continue across shards, windows cross shard boundaries.
    r = stager("pack", frames, out, "--format", "tar", "--clip-length", T, "--fields", FIELDS,
               "--samples-per-shard", 4)
    assert r.returncode == 0, r.stderr
    return out


def test_pack_has_fields_per_frame_and_no_sidecar_frames(pack_dir: Path) -> None:
    m = load_manifest(pack_dir / "manifest.json")
    assert [f["name"] for f in m.fields] == ["box_labels", "boxes", "mask"]
    assert m.clips is not None and m.clips["sequences"] == SEQS and m.clips["windows"] == SEQS * (FRAMES - T + 1)
    assert len(m.column("offset")) == SEQS * FRAMES  # sidecar files are not frames
    assert "field/mask/offset" in m.extra_columns()


@pytest.mark.parametrize("fmt", ["tar", "record", "hdf5", "zarr"])
def test_masks_and_boxes_follow_the_clip_crop(frames: Path, pack_dir: Path, tmp_path: Path, fmt: str) -> None:
    path = pack_dir
    if fmt != "tar":
        path = tmp_path / fmt
        resize = ["--resize", f"{H}x{W}"] if fmt == "zarr" else []  # zarr holds decoded arrays of one size
        r = stager("pack", frames, path, "--format", fmt, "--clip-length", T, "--fields", FIELDS, *resize)
        assert r.returncode == 0, r.stderr
    size = 24
    seen: list[int] = []
    # Ranks and workers once (tar); the other formats in-process, to keep the test fast.
    ranks, workers = (2, 2) if fmt == "tar" else (1, 0)
    for rank in range(ranks):
        for b in make_loader(path, 3, rank=rank, world_size=ranks, num_workers=workers, seed=7, transform="train",
                             image_size=size):
            img, mask = b["image"].numpy(), b["mask"].numpy()
            n = img.shape[0]
            assert img.shape == (n, T, 3, size, size) and mask.shape == (n, T, size, size) and mask.dtype == np.uint8
            # One crop per clip: the position gradients (green, blue) agree across the T frames.
            assert (img[:, :, 1:] == img[:, :1, 1:]).all()
            # Each frame's mask is the class of its own pixels, except where the bilinear image blends
            # two classes: within 2 output pixels of a class edge in the mask or of the border.
            cls = np.abs(img[:, :, 0, :, :, None].astype(np.int16) - PALETTE).argmin(-1)
            assert not ((cls != mask) & ~_near_edge(mask, 2)).any()
            assert (cls == mask).mean() > 0.75
            assert len(b["boxes"]) == n and all(len(bx) == T for bx in b["boxes"])
            for bx, lb in zip(b["boxes"], b["box_labels"], strict=True):
                for fb, fl in zip(bx, lb, strict=True):
                    assert fb.shape[1:] == (4,) and len(fl) == len(fb)
                    assert (fb >= 0).all() and (fb <= size).all() and (fb[:, 2:] >= fb[:, :2]).all()
            seen += b["index"].tolist()
    total = SEQS * (FRAMES - T + 1)
    assert sorted(seen)[:total] == list(range(total)) and len(set(seen)) == total  # padding may repeat


def test_eval_and_callable_transform(pack_dir: Path) -> None:
    b = next(iter(make_loader(pack_dir, 2, transform="eval", image_size=16, fields=["mask"])))
    assert tuple(b["mask"].shape) == (2, T, 16, 16) and "boxes" not in b

    def t(clip: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
        assert clip["image"].shape == (T, H, W, 3) and clip["mask"].shape == (T, H, W)
        return {"image": clip["image"][:, :8, :8], "mask": clip["mask"][:, :8, :8]}

    b = next(iter(make_loader(pack_dir, 2, transform=t, fields=["mask"])))
    assert tuple(b["image"].shape) == (2, T, 3, 8, 8) and tuple(b["mask"].shape) == (2, T, 8, 8)


def test_frame_missing_a_sidecar_is_one_line_naming_it(frames: Path, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "f"
    shutil.copytree(frames, root)
    (root / "seq_1" / "000004.mask.png").unlink()
    r = stager("pack", root, tmp_path / "o", "--format", "tar", "--clip-length", T, "--fields", FIELDS)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert str(root / "seq_1" / "000004.png") in r.stderr and "mask" in r.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_fields_on_video_files_are_refused(tmp_path: Path) -> None:
    from tools.datagen import make_videos

    make_videos(tmp_path, sequences=1, frames=4, size=(16, 16), folders=False)
    r = stager("pack", tmp_path / "videos", tmp_path / "o", "--format", "tar", "--clip-length", 2,
               "--fields", "mask:mask")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--fields" in r.stderr

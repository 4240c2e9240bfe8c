"""stager.decode: every backend on every input kind, crop geometry invariants, fast-vs-reference."""

from __future__ import annotations

import io
import math
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from PIL import Image

import stager.decode as dc
from stager.decode.crop import center_crop_box, random_resized_crop_box
from stager.decode.jpeg_header import parse_jpeg_header
from stager.errors import CorruptSampleError, UsageError
from tools.datagen import render_image

try:
    import simplejpeg  # noqa: F401

    HAVE_FAST = True
except ImportError:  # pragma: no cover - the test extra installs it
    HAVE_FAST = False

NO_FAST = "simplejpeg is not installed (a dependency of stager: pip install simplejpeg; make venv installs it)"
BACKENDS = ["pil", pytest.param("fast", marks=pytest.mark.skipif(not HAVE_FAST, reason=NO_FAST))]


def _rgb(h: int = 150, w: int = 200, seed: int = 0) -> np.ndarray:
    return render_image(np.random.default_rng(seed), seed % 4, 4, h, w)


def _save(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _inputs() -> dict[str, bytes]:
    """One payload per input kind the loader may meet in a shard."""
    arr = _rgb()
    im = Image.fromarray(arr)
    rgba = np.dstack([arr, np.linspace(0, 255, arr.shape[1], dtype=np.uint8)[None, :].repeat(arr.shape[0], 0)])
    pal = im.quantize(64)
    pal.info["transparency"] = 3
    gray16 = Image.fromarray(arr[..., 0].astype(np.uint16) * 200)  # 16-bit grayscale PNG
    return {
        "jpeg420": _save(im, "JPEG", quality=90),
        "jpeg444": _save(im, "JPEG", quality=90, subsampling=0),
        "jpeg422": _save(im, "JPEG", quality=85, subsampling=1),
        "jpeg_progressive": _save(im, "JPEG", quality=90, progressive=True),
        "jpeg_gray": _save(im.convert("L"), "JPEG", quality=90),
        "jpeg_cmyk": _save(im.convert("CMYK"), "JPEG", quality=90),
        "jpeg_odd_size": _save(Image.fromarray(_rgb(77, 131, 5)), "JPEG", quality=90),
        "png_rgb": _save(im, "PNG"),
        "png_rgba": _save(Image.fromarray(rgba, "RGBA"), "PNG"),
        "png_palette": _save(pal, "PNG", transparency=3),
        "png_gray": _save(im.convert("L"), "PNG"),
        "png_gray16": _save(gray16, "PNG"),
        "webp": _save(im, "WEBP", lossless=True),
        "bmp": _save(im, "BMP"),
        "gif": _save(im.convert("P"), "GIF"),
    }


INPUTS = _inputs()


def _reference_rgb(data: bytes) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return np.asarray(im.convert("RGB"))


@pytest.fixture(params=BACKENDS)
def decoder(request: pytest.FixtureRequest) -> dc.Decoder:
    return dc.get_decoder(request.param)


# --- every backend, every input kind -------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_every_input_kind_comes_out_rgb_uint8(decoder: dc.Decoder, kind: str) -> None:
    data = INPUTS[kind]
    ref = _reference_rgb(data)
    full = dc.decode_rgb(data, decoder=decoder)
    assert full.dtype == np.uint8 and full.shape == ref.shape and full.flags.c_contiguous
    # Same libjpeg settings, same Pillow conversions: identical pixels for the full decode.
    assert np.array_equal(full, ref), kind
    assert dc.image_size(data, decoder=decoder) == ref.shape[:2]
    for out in (
        dc.decode_random_resized_crop(data, 48, np.random.default_rng(1), decoder=decoder),
        dc.decode_center_crop(data, 48, decoder=decoder),
        dc.decode_center_crop(data, 40, resize=64, decoder=decoder),
    ):
        assert out.dtype == np.uint8 and out.flags.c_contiguous
        assert out.shape in ((48, 48, 3), (40, 40, 3))


def test_gray_and_cmyk_are_expanded_to_colour_channels(decoder: dc.Decoder) -> None:
    gray = dc.decode_rgb(INPUTS["jpeg_gray"], decoder=decoder)
    assert np.array_equal(gray[..., 0], gray[..., 1]) and np.array_equal(gray[..., 1], gray[..., 2])
    cmyk = dc.decode_rgb(INPUTS["jpeg_cmyk"], decoder=decoder)
    original = _rgb().astype(int)
    # CMYK JPEG round trip is lossy but must still look like the original RGB image.
    assert np.abs(cmyk.astype(int) - original).mean() < 12


def test_deterministic_given_rng_state(decoder: dc.Decoder) -> None:
    data = INPUTS["jpeg420"]
    outs = [dc.decode_random_resized_crop(data, 32, np.random.default_rng((7, e)), decoder=decoder) for e in (0, 0, 1)]
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])
    rng = np.random.default_rng(3)
    a = [dc.decode_random_resized_crop(data, 32, rng, decoder=decoder) for _ in range(3)]
    rng = np.random.default_rng(3)
    b = [dc.decode_random_resized_crop(data, 32, rng, decoder=decoder) for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_flip_is_a_fair_coin_after_the_box(decoder: dc.Decoder) -> None:
    data = INPUTS["jpeg444"]
    flipped = 0
    for seed in range(40):
        plain = dc.decode_random_resized_crop(data, 24, np.random.default_rng(seed), flip=False, decoder=decoder)
        maybe = dc.decode_random_resized_crop(data, 24, np.random.default_rng(seed), flip=True, decoder=decoder)
        if np.array_equal(maybe, plain[:, ::-1]) and not np.array_equal(maybe, plain):
            flipped += 1
        else:
            assert np.array_equal(maybe, plain), seed
    assert 8 <= flipped <= 32  # p=0.5 over 40 draws; bounds hold with probability > 0.9999


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"not an image at all",
        INPUTS["jpeg420"][: len(INPUTS["jpeg420"]) // 2],
        INPUTS["jpeg_progressive"][: len(INPUTS["jpeg_progressive"]) // 2],
        INPUTS["png_rgb"][: len(INPUTS["png_rgb"]) // 2],
        INPUTS["jpeg420"][:2] + b"\x00" * 64 + INPUTS["jpeg420"][66:],  # markers destroyed
        b"\xff\xd8\xff\xc0\x00\x11\x08" + b"\xff" * 20,  # frame header running past the end
    ],
    ids=["empty", "text", "jpeg_truncated", "progressive_truncated", "png_truncated", "jpeg_no_markers", "jpeg_short"],
)
def test_corrupt_bytes_raise_corrupt_sample_error(decoder: dc.Decoder, bad: bytes) -> None:
    for call in (
        lambda: dc.decode_rgb(bad, decoder=decoder),
        lambda: dc.decode_random_resized_crop(bad, 32, np.random.default_rng(0), decoder=decoder),
        lambda: dc.decode_center_crop(bad, 32, decoder=decoder),
    ):
        with pytest.raises(CorruptSampleError, match="cannot decode"):
            call()


def _png_header_only(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
        + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat))
    )  # fmt: skip


def _jpeg_with_size(width: int, height: int) -> bytes:
    data = bytearray(INPUTS["jpeg420"])
    o = parse_jpeg_header(data).height_offset
    data[o : o + 4] = struct.pack(">HH", height, width)
    return bytes(data)


def test_decompression_bombs_are_refused_before_allocation() -> None:
    # A child with a 1.5 GiB address-space cap: allocating any of these images would raise
    # MemoryError (not CorruptSampleError) or die, so passing proves the refusal came first.
    code = textwrap.dedent(
        """
        import resource, sys
        import numpy as np
        from tests.test_decode import _png_header_only, _jpeg_with_size
        import stager.decode as dc
        from stager.errors import CorruptSampleError
        resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
        bombs = {"png_huge": _png_header_only(100_000, 100_000),
                 "png_just_over_limit": _png_header_only(10_000, 9_000),   # warns in Pillow; must be an error
                 "jpeg_huge": _jpeg_with_size(65_000, 65_000),
                 "jpeg_just_over_limit": _jpeg_with_size(10_000, 9_000)}
        for name in ("pil", "fast") if len(sys.argv) < 2 else sys.argv[1:]:
            dec = dc.get_decoder(name)
            for kind, data in bombs.items():
                rng = np.random.default_rng(0)
                for fn in (lambda: dc.image_size(data, decoder=dec), lambda: dc.decode_rgb(data, decoder=dec),
                           lambda: dc.decode_random_resized_crop(data, 224, rng, decoder=dec)):
                    try:
                        fn()
                    except CorruptSampleError as e:
                        assert "decompression" in str(e).lower(), (name, kind, str(e))
                    else:
                        raise SystemExit(f"{name}/{kind}: accepted")
        print("refused all")
        """
    )
    args = [] if HAVE_FAST else ["pil"]
    res = subprocess.run(
        [sys.executable, "-W", "default", "-c", code, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "refused all" in res.stdout


# --- crop geometry --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(375, 500), (500, 375), (64, 64), (30, 400), (400, 30), (1, 1), (7, 3)])
def test_random_resized_crop_box_invariants(shape: tuple[int, int]) -> None:
    h, w = shape
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    rng = np.random.default_rng(0)
    fallbacks = 0
    for _ in range(400):
        top, left, bh, bw = random_resized_crop_box(h, w, rng, scale, ratio)
        assert top >= 0 and left >= 0 and bh >= 1 and bw >= 1
        assert top + bh <= h and left + bw <= w
        central = top == (h - bh) // 2 and left == (w - bw) // 2
        # Rounding to whole pixels moves area and aspect by at most half a pixel per side.
        slack_a = (bh + bw + 1) / (2 * h * w)
        in_scale = scale[0] - slack_a <= bh * bw / (h * w) <= scale[1] + slack_a
        aspect = bw / bh
        slack_r = 0.5 / bh + 0.5 * bw / bh**2 + 0.5 / bh
        in_ratio = ratio[0] - slack_r <= aspect <= ratio[1] + slack_r
        if not (in_scale and in_ratio):
            assert central, (top, left, bh, bw)
            fallbacks += 1
    if min(h, w) >= 64 and max(h, w) / min(h, w) <= 4 / 3:
        assert fallbacks < 4  # fallback is a rare event for normal photos


def test_random_resized_crop_box_distribution() -> None:
    h, w = 375, 500
    rng = np.random.default_rng(1)
    boxes = np.array([random_resized_crop_box(h, w, rng) for _ in range(4000)], dtype=float)
    area = boxes[:, 2] * boxes[:, 3] / (h * w)
    log_r = np.log(boxes[:, 3] / boxes[:, 2])
    # Accepted boxes are (area, log aspect) uniform on [0.08, 1] x [log 3/4, log 4/3] restricted to
    # those that fit: area <= (w/h)/r and area <= r*(h/w). Expected mean area by quadrature:
    r = np.exp(np.linspace(math.log(3 / 4), math.log(4 / 3), 2001))
    a = np.linspace(0.08, 1.0, 2001)
    fits = (a[None, :] <= (w / h) / r[:, None]) & (a[None, :] <= r[:, None] * (h / w))
    assert area.mean() == pytest.approx((a[None, :] * fits).sum() / fits.sum(), abs=0.015)
    assert log_r.mean() == pytest.approx((np.log(r)[:, None] * fits).sum() / fits.sum(), abs=0.015)
    assert log_r.min() > math.log(3 / 4) - 0.05 and log_r.max() < math.log(4 / 3) + 0.05
    tops = boxes[:, 0] / np.maximum(h - boxes[:, 2], 1)
    assert 0.45 < tops[boxes[:, 2] < 300].mean() < 0.55  # placement uniform


def test_center_crop_box_matches_resize_then_crop() -> None:
    top, left, bh, bw = center_crop_box(375, 500, 224, 256)
    assert bh == pytest.approx(224 * 375 / 256) and bw == pytest.approx(224 * 500 / 341)
    assert top + bh / 2 == pytest.approx(375 / 2, abs=1) and left + bw / 2 == pytest.approx(250, abs=1)


def test_usage_errors() -> None:
    data = INPUTS["jpeg420"]
    rng = np.random.default_rng(0)
    with pytest.raises(UsageError):
        dc.decode_random_resized_crop(data, 0, rng)
    with pytest.raises(UsageError):
        dc.decode_random_resized_crop(data, 32, rng, scale=(1.0, 0.5))
    with pytest.raises(UsageError):
        dc.decode_random_resized_crop(data, 32, rng, ratio=(2.0, 1.0))
    with pytest.raises(UsageError):
        dc.decode_center_crop(data, 64, resize=32)
    with pytest.raises(UsageError, match="unknown decode backend"):
        dc.get_decoder("nope")


def test_accepts_bytes_like() -> None:
    data = INPUTS["jpeg420"]
    ref = dc.decode_rgb(data)
    assert np.array_equal(dc.decode_rgb(bytearray(data)), ref)  # type: ignore[arg-type]
    assert np.array_equal(dc.decode_rgb(memoryview(data)), ref)  # type: ignore[arg-type]


def test_backend_selection_by_env_and_call() -> None:
    res = subprocess.run(
        [sys.executable, "-c", "import stager.decode as dc; print(dc.backend())"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STAGER_DECODE_BACKEND": "pil"},
    )
    assert res.returncode == 0 and res.stdout.strip() == "pil", res.stderr
    before = dc.backend()
    try:
        assert dc.set_backend("pil") == "pil" == dc.backend()
    finally:
        dc.set_backend("auto")
    assert dc.backend() == before
    if HAVE_FAST:
        assert before.startswith("simplejpeg")


# --- fast path vs reference -----------------------------------------------------------------------


def _photos(n: int = 6) -> list[bytes]:
    out = []
    for i in range(n):
        h, w = [(240, 320), (320, 240), (250, 333), (200, 400)][i % 4]
        im = Image.fromarray(_rgb(h, w, seed=10 + i))
        out.append(_save(im, "JPEG", quality=90, progressive=(i == 5)))
    return out


@pytest.mark.skipif(not HAVE_FAST, reason=NO_FAST)
def test_fast_path_close_to_reference() -> None:
    fast, ref = dc.get_decoder("fast"), dc.get_decoder("pil")
    rrc, cc = [], []
    for i, data in enumerate(_photos()):
        for seed in range(8):
            a = dc.decode_random_resized_crop(data, 64, np.random.default_rng((i, seed)), decoder=fast)
            b = dc.decode_random_resized_crop(data, 64, np.random.default_rng((i, seed)), decoder=ref)
            rrc.append(np.abs(a.astype(np.int16) - b).mean())
        c_fast = dc.decode_center_crop(data, 64, decoder=fast)
        c_ref = dc.decode_center_crop(data, 64, decoder=ref)
        cc.append(np.abs(c_fast.astype(np.int16) - c_ref).mean())
    # Differences are interpolation (bilinear vs Pillow's antialiased bilinear, DCT-domain
    # downscaling) on noisy synthetic photos; a wrong crop or channel order would give 30+.
    assert np.mean(rrc) < 4.0 and max(rrc) < 8.0, (np.mean(rrc), max(rrc))
    assert np.mean(cc) < 4.0 and max(cc) < 6.0, cc
    approx = dc.get_decoder("fast-approx")
    data = _photos(1)[0]
    a = dc.decode_random_resized_crop(data, 64, np.random.default_rng(0), decoder=approx)
    b = dc.decode_random_resized_crop(data, 64, np.random.default_rng(0), decoder=ref)
    assert np.abs(a.astype(np.int16) - b).mean() < 5.0


@pytest.mark.skipif(not HAVE_FAST, reason=NO_FAST)
@pytest.mark.parametrize("kind", ["jpeg420", "jpeg444", "jpeg422", "jpeg_gray", "jpeg_odd_size", "jpeg_progressive"])
def test_row_truncation_is_bit_exact(kind: str) -> None:
    from stager.decode.fast_backend import FastJpegDecoder

    data = INPUTS[kind]
    for dct_scale in (False, True):
        cut = FastJpegDecoder(truncate=True, dct_scale=dct_scale)
        whole = FastJpegDecoder(truncate=False, dct_scale=dct_scale)
        for seed in range(30):
            size = (8, 16, 40)[seed % 3]
            a = dc.decode_random_resized_crop(data, size, np.random.default_rng(seed), decoder=cut)
            b = dc.decode_random_resized_crop(data, size, np.random.default_rng(seed), decoder=whole)
            assert np.array_equal(a, b), (kind, dct_scale, seed)


@pytest.mark.skipif(not HAVE_FAST, reason=NO_FAST)
def test_header_parser_agrees_with_pillow_and_simplejpeg() -> None:
    import simplejpeg as sj

    for kind, data in INPUTS.items():
        if not kind.startswith("jpeg"):
            continue
        hdr = parse_jpeg_header(data)
        h, w, _, _ = sj.decode_jpeg_header(data)
        assert (hdr.height, hdr.width) == (h, w) == Image.open(io.BytesIO(data)).size[::-1]
        assert hdr.single_scan == (kind != "jpeg_progressive")


def test_decoders_pickle_for_spawned_workers(decoder: dc.Decoder) -> None:
    import pickle

    clone = pickle.loads(pickle.dumps(decoder))
    data = INPUTS["jpeg420"]
    a = dc.decode_random_resized_crop(data, 40, np.random.default_rng(5), decoder=decoder)
    b = dc.decode_random_resized_crop(data, 40, np.random.default_rng(5), decoder=clone)
    assert clone.name == decoder.name and np.array_equal(a, b)


@pytest.mark.skipif(not HAVE_FAST, reason=NO_FAST)
def test_scratch_reuse_does_not_leak_between_calls() -> None:
    fast = dc.get_decoder("fast")
    first = dc.decode_center_crop(INPUTS["jpeg420"], 64, decoder=fast)
    kept = first.copy()
    dc.decode_center_crop(INPUTS["jpeg444"], 64, decoder=fast)  # reuses the scratch buffer
    assert np.array_equal(first, kept)
    full = dc.decode_rgb(INPUTS["jpeg420"], decoder=fast)
    dc.decode_random_resized_crop(INPUTS["jpeg422"], 64, np.random.default_rng(0), decoder=fast)
    assert np.array_equal(full, _reference_rgb(INPUTS["jpeg420"]))

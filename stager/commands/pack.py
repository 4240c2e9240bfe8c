"""``stager pack SRC OUT --format FMT``: pack a source into verified shards (docs/pack.md)."""

from __future__ import annotations

import argparse
import re

from stager.cli import add_common, add_storage_options, emit, storage_options
from stager.errors import UsageError
from stager.formats import FORMAT_NAMES  # the format registry alone: neither numpy nor a format module

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"1G"``, ``"4m"`` -> bytes. Bare/``i``/``iB`` suffixes are powers of 1024;
    ``kB``/``MB``/``GB``/``TB`` are powers of 1000 (so ``1G == 1GiB == 1073741824``, ``1GB == 10**9``).
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected e.g. 268435456, 256MiB, 1G or 500MB")
    num, unit, iec, b = m.groups()
    unit = unit.lower()
    mult = _SI[unit] if (unit and b and not iec) else _UNITS[unit]
    value = int(float(num) * mult)
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be at least 1 byte")
    return value


def parse_hw(text: str) -> tuple[int, int]:
    """``"224x224"`` -> (224, 224) (height x width)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected HxW, e.g. 224x224")
    return int(m.group(1)), int(m.group(2))


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pack",
        help="pack an ImageFolder, CIFAR batches, a list file, MXNet .rec, an LMDB or another pack into shards",
        description="Pack SRC (ImageFolder tree, CIFAR-10 python batches dir, .csv/.jsonl list, MXNet .rec file(s), "
        "an LMDB directory, or an existing pack) into verified shards under OUT, with manifest.json written last. "
        "Reruns resume.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT", help="output directory, or a URL (s3://bucket/prefix, any fsspec URL): "
                   "shards are uploaded as they are finished, the manifest last")
    p.add_argument("--format", required=True, help=f"shard format: {'|'.join(FORMAT_NAMES)}")
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=256 << 20,
        metavar="BYTES",
        help="target shard size (default 256MiB; accepts 256MiB, 1G, 500MB)",
    )
    p.add_argument(
        "--samples-per-shard",
        type=_positive,
        default=None,
        metavar="N",
        help="at most N samples per shard (a shard ends at whichever limit comes first)",
    )
    p.add_argument(
        "--workers",
        type=_positive,
        default=1,
        metavar="N",
        help="writer processes (output bytes are identical for any N)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--keep-order", action="store_true", help="keep the source order instead of shuffling")
    p.add_argument("--resize", type=parse_hw, default=None, metavar="HxW", help="re-encode images at HxW")
    p.add_argument("--quality", type=int, default=None, metavar="Q", help="re-encode as JPEG at quality Q (1-100)")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="bad source image: stop (raise, default) or skip and list it in manifest.skipped",
    )
    p.add_argument(
        "--fields", default=None, metavar="NAME:KIND,...",
        help="kinds of a list file's extra columns or a sidecar folder's members: image, mask, boxes, box_labels, "
             "per_box, array, json, bytes (docs/fields.md); undeclared ones are typed by extension",
    )
    p.add_argument("--split", choices=("train", "test"), default=None, help="CIFAR split (default train)")
    p.add_argument(
        "--overwrite", action="store_true", help="write into OUT even if it holds other files or another source's pack"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    p.add_argument("--allow-empty-classes", action="store_true",
                   help="keep an ImageFolder class folder that holds no images as a class with no samples "
                   "(refused by default, as torchvision's ImageFolder does)")
    p.add_argument(
        "--tar-json",
        action="store_true",
        help="tar: also write a KEY.json member per sample (class, key, label, source path); "
        "by default a sample is KEY.<ext> + KEY.cls and the manifest holds the rest",
    )
    p.add_argument("--hash", dest="hash_algo", choices=("xxh3_128", "blake2b"), default="xxh3_128")
    p.add_argument("--stripe-count", type=int, default=None, metavar="N", help="Lustre stripe count for OUT")
    p.add_argument("--stripe-size", type=parse_size, default=None, metavar="BYTES", help="Lustre stripe size")
    p.add_argument("--clip-length", type=_positive, default=None, metavar="T",
                   help="pack SRC (frame folders SRC/[<class>/]<sequence>/<frame>.png|jpg, or video files) as "
                   "frames read in windows of T consecutive frames (docs/clips.md)")
    p.add_argument("--clip-stride", type=_positive, default=1, metavar="K", help="a window starts every K frames")
    p.add_argument("--frame-step", type=_positive, default=1, metavar="D", help="frames of a window are D apart")
    p.add_argument("--frame-format", choices=("jpg", "png"), default="jpg",
                   help="how decoded video frames are stored (jpg at --quality, default 95; or png)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at registration: stager.pack pulls numpy, xxhash and the source readers.
    from stager.pack.api import format_result, pack

    if args.format not in FORMAT_NAMES:
        raise UsageError(f"unknown format {args.format!r}; expected one of {', '.join(FORMAT_NAMES)}")
    result = pack(
        args.src,
        args.out,
        args.format,
        samples_per_shard=args.samples_per_shard,
        shard_size=args.shard_size,
        workers=args.workers,
        seed=args.seed,
        keep_order=args.keep_order,
        resize=args.resize,
        quality=args.quality,
        on_error=args.on_error,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        quiet=args.quiet,
        hash_algo=args.hash_algo,
        stripe_count=args.stripe_count,
        stripe_size=args.stripe_size,
        split=args.split,
        tar_json=args.tar_json,
        storage_options=storage_options(args),
        fields=args.fields,
        clip_length=args.clip_length,
        clip_stride=args.clip_stride,
        frame_step=args.frame_step,
        frame_format=args.frame_format,
        allow_empty_classes=args.allow_empty_classes,
    )
    emit(args, result.to_json(), format_result(result))
    return 0

"""``stager pack SRC OUT --format FMT``: pack a source into verified shards (docs/pack.md)."""

from __future__ import annotations

import argparse

from stager.cli.args import (
    add_common,
    add_hash,
    add_storage_options,
    add_workers,
    examples,
    hw,
    positive_int,
    size,
    storage_options,
    stripe_count,
)
from stager.cli.result import CommandResult
from stager.errors import UsageError
from stager.formats import FORMAT_NAMES, FORMAT_SPECS  # the format registry alone: neither numpy nor a format module
from stager.formats.registry import COMPRESSIONS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pack",
        help="pack an ImageFolder, CIFAR batches, a list file, MXNet .rec, an LMDB or another pack into shards",
        description="Pack SRC (ImageFolder tree, CIFAR-10 python batches dir, .csv/.jsonl list, MXNet .rec file(s), "
        "an LMDB directory, or an existing pack) into verified shards under OUT, with manifest.json written last. "
        "Reruns resume.",
        epilog=examples(
            "stager pack imagenet/train /lustre/$USER/imagenet-train --format tar -j 8",
            "stager pack labels.csv out/ --format hdf5 --samples-per-shard 10000   # a list file: path,label",
            "stager pack out/ converted/ --format record   # convert a pack (or an index) to TFRecord",
            "stager pack imagenet/train out/ --format tar --dry-run   # print the plan, write nothing",
            "stager pack imagenet/train out/ --format squashfs --compression zstd   # images a site mounts",
        ),
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT", help="output directory, or a URL (s3://bucket/prefix, any fsspec URL): "
                   "shards are uploaded as they are finished, the manifest last")
    p.add_argument("--format", required=True, help=f"shard format: {'|'.join(FORMAT_NAMES)}")
    p.add_argument(
        "--shard-size",
        type=size,
        default=256 << 20,
        metavar="BYTES",
        help="target shard size (default 256MiB; accepts 256MiB, 1G, 500MB)",
    )
    p.add_argument(
        "--samples-per-shard",
        type=positive_int,
        default=None,
        metavar="N",
        help="at most N samples per shard (a shard ends at whichever limit comes first)",
    )
    add_workers(p, default=1, help="writer processes (output bytes are identical for any N; default 1)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--keep-order", action="store_true", help="keep the source order instead of shuffling")
    p.add_argument("--resize", type=hw, default=None, metavar="HxW", help="re-encode images at HxW")
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
    compressing = [n for n in FORMAT_NAMES if FORMAT_SPECS[n].compressions]
    p.add_argument(
        "--compression", choices=COMPRESSIONS, default=None,
        help=f"{', '.join(compressing)}: how files are compressed (default "
        + "; ".join(f"{n}: {FORMAT_SPECS[n].compressions[0]}" for n in compressing)
        + "); already-compressed JPEG, PNG, WebP and video files are stored as they are",
    )
    add_hash(p)
    p.add_argument("--stripe-count", type=stripe_count, default=None, metavar="N",
                   help="Lustre stripe count for OUT (-1: every OST)")
    p.add_argument("--stripe-size", type=size, default=None, metavar="BYTES", help="Lustre stripe size")
    p.add_argument("--clip-length", type=positive_int, default=None, metavar="T",
                   help="pack SRC (frame folders SRC/[<class>/]<sequence>/<frame>.png|jpg, or video files) as "
                   "frames read in windows of T consecutive frames (docs/clips.md)")
    p.add_argument("--clip-stride", type=positive_int, default=1, metavar="K", help="a window starts every K frames")
    p.add_argument("--frame-step", type=positive_int, default=1, metavar="D", help="frames of a window are D apart")
    p.add_argument("--frame-format", choices=("jpg", "png"), default="jpg",
                   help="how decoded video frames are stored (jpg at --quality, default 95; or png)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
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
        compression=args.compression,
        storage_options=storage_options(args),
        fields=args.fields,
        clip_length=args.clip_length,
        clip_stride=args.clip_stride,
        frame_step=args.frame_step,
        frame_format=args.frame_format,
        allow_empty_classes=args.allow_empty_classes,
    )
    return CommandResult(result.to_json(), format_result(result))

"""``stager index SRC [--out DIR]``: a manifest for existing webdataset tars, TFRecords, parquet, MXNet RecordIO,
LMDB or SquashFS images (docs/index.md)."""

from __future__ import annotations

import argparse

from stager.cli.args import (
    add_common,
    add_hash,
    add_storage_options,
    add_workers,
    examples,
    label_offset,
    storage_options,
)
from stager.cli.result import CommandResult
from stager.formats import ADOPTED_FORMATS  # the format registry alone: neither numpy nor a format module


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="adopt existing webdataset tars, TFRecords, parquet, MXNet .rec, LMDB or SquashFS images in place "
        "(write a manifest)",
        description="Scan existing shards (a directory of .tar, TFRecord, .parquet or MXNet .rec files, an LMDB "
        "directory holding data.mdb, or SquashFS images of ImageFolder trees) and write a stager "
        "manifest for them: sizes, checksums and every image's byte extent, so that verify, stage, pack and the "
        "loader work on them without rewriting a byte. Reruns resume.",
        epilog=examples(
            "stager index /data/imagenet-wds -j 8   # webdataset tars: manifest.json written beside them",
            "stager index /shared/ro/tfrecords --out ~/imagenet-idx --label-offset -1   # read-only SRC",
            "stager index s3://bucket/shards --out idx/ --storage-option anon=true",
            "stager index /shared/imagenet-train.sqfs --out ~/imagenet-idx   # an image made by mksquashfs",
        ),
    )
    p.add_argument("src", metavar="SRC", help="directory of shards (or one shard file); or a URL prefix of shard "
                   "objects (s3://bucket/prefix, az://..., https://...), with --out")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write the manifest into DIR, naming the shards where they are (for a read-only SRC); "
                   "default: beside the shards")
    p.add_argument("--format", default="auto", choices=("auto", *ADOPTED_FORMATS), help="input kind (default: auto)")
    p.add_argument("--image-key", default=None, metavar="KEY",
                   help="the image: tar member field(s) 'jpg;png' (default: the one image-type member), "
                   "TFRecord feature (default image/encoded), parquet column (default image), SquashFS sample file "
                   "extensions 'jpg;png' (default: ImageFolder's); not for .rec/LMDB")
    p.add_argument("--label-key", default=None, metavar="KEY",
                   help="the label: tar cls|txt|json|json:FIELD (default cls), TFRecord feature (default "
                   "image/class/label), parquet column (default label), .rec/LMDB label, SquashFS folder (the "
                   "top-level folders); 'none' for unlabeled data")
    p.add_argument("--lmdb-layout", default="auto", choices=("auto", "caffe", "pickle"),
                   help="what LMDB values hold: caffe Datums or pickled (image bytes, label) tuples (default: sniffed)")
    p.add_argument("--label-offset", type=label_offset, default=0, metavar="N",
                   help="added to integer labels (-1 for TensorFlow's 1-based ImageNet TFRecords)")
    add_workers(p, default=1, help="shards indexed in parallel (default 1)")
    add_hash(p)
    p.add_argument("--no-fields", action="store_true",
                   help="index images and labels only: do not adopt the other tar members, TFRecord features or "
                   "parquet columns as fields (docs/fields.md)")
    p.add_argument("--no-dali-index", action="store_true",
                   help="do not write DALI .idx files for TFRecords (nor MXNet .idx files for .rec files without one)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.index import IndexOptions, index_dataset

    opts = IndexOptions(format=args.format, image_key=args.image_key, label_key=args.label_key,
                        label_offset=args.label_offset, workers=args.workers, hash_algo=args.hash_algo,
                        dali_index=not args.no_dali_index, storage_options=storage_options(args) or None,
                        lmdb_layout=args.lmdb_layout, fields=not args.no_fields)
    r = index_dataset(args.src, args.out, opts, quiet=args.quiet)
    where = f" (shards in {r.shard_root})" if r.shard_root else ""
    human = (f"{r.manifest_path}: {r.kind} index of {r.shards} shards, {r.samples:,} samples, {r.classes} classes, "
             f"{r.bytes / 1e6:,.1f} MB in {r.seconds:.2f}s ({r.bytes / max(r.seconds, 1e-9) / 1e9:.2f} GB/s, "
             f"{r.samples / max(r.seconds, 1e-9):,.0f} samples/s; {r.resumed} resumed){where}")
    return CommandResult(r.to_json(), human)

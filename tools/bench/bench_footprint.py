"""Start-up time and memory at ImageNet count: manifest v2 (mapped sample index) vs v1 (inline JSON).

Fabricates one tar pack of ``--n`` samples (1.28M by default: ImageNet-1k's train count; one ~1 KB
JPEG repeated, so the data costs only disk) with stager's own writer, and writes two manifests for
the same shards: v2 (``manifest.json`` + ``index-<hash>.sidx``) and the v1 layout (every sample's
key, label, offset and size as JSON lists, as stager wrote before). Then, side by side in one run,
each in a fresh process: ``stager inspect``, ``stager verify``, ``stager stage``, and the loader's
time to its first batch with its per-process anonymous memory (``RssAnon``: heap, not the page
cache of mapped files), sampled every 5 ms.

    python tools/bench/bench_footprint.py                 # 1.28M samples (~6 GB of disk, a few minutes)
    python tools/bench/bench_footprint.py --n 100000      # quicker
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT_MD = ROOT / "docs" / "bench" / "footprint.md"

# Runs a stager command in-process, sampling RssAnon; prints {"seconds", "peak_anon_mb", "rc"}.
_CLI = textwrap.dedent('''
    import json, sys, threading, time
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    peak, stop = [0.0], threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon()); time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    from stager.cli import main
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
    seconds = time.perf_counter() - t0
    stop.set(); peak[0] = max(peak[0], anon())
    print(json.dumps({"seconds": seconds, "peak_anon_mb": peak[0], "rc": rc}), file=sys.stderr)
''')

# The loader: torch imported first (a training script has it), then make_loader -> first batch.
_LOADER = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import stager.loader.torch_dataset
    def anon(pid="self"):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    base = anon()
    t0 = time.perf_counter()
    from stager.loader import make_loader
    loader = make_loader(sys.argv[1], batch_size=256, num_workers=int(sys.argv[2]), decode="raw", staged=False)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in range(50):
        next(it)
    me = str(os.getpid())
    kids = [p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().split()[3] == me]
    print(json.dumps({"first_batch_s": first, "anon_main_mb": anon(), "anon_workers_mb": [anon(k) for k in kids],
                      "torch_baseline_mb": base}))
''')


def fabricate(out: Path, n: int, per_shard: int) -> None:
    """A tar pack of ``n`` samples through stager's writer, with a v2 manifest."""
    from PIL import Image

    from stager.checksum import hash_file
    from stager.formats import get_format
    from stager.formats.base import Sample
    from stager.manifest import Manifest, ShardInfo, Strings

    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    jpg = buf.getvalue()
    fmt = get_format("tar")
    classes = [f"n{c:08d}" for c in range(1000)]
    shards = []
    for si, a in enumerate(range(0, n, per_shard)):
        b = min(n, a + per_shard)
        name = f"shard-{si:05d}.tar"
        w = fmt.open_writer(str(out / name), shard_name=name, classes=classes)
        keys, labels, offs, sizes = [], [], [], []
        for i in range(a, b):
            lab = i % 1000
            k = f"{classes[lab]}/{classes[lab]}_{i:07d}"
            e = w.write(Sample(k, lab, jpg, "jpg", {}))
            keys.append(k)
            labels.append(lab)
            offs.append(e.offset)
            sizes.append(e.size)
        w.close()
        nb, h = hash_file(out / name)
        shards.append(ShardInfo(name, nb, h, Strings.from_strings(keys), np.array(labels), np.array(offs),
                                np.array(sizes)))
    Manifest("tar", classes, shards, created="2026-01-01T00:00:00+00:00").write(out)


def v1_copy(v2: Path, out: Path) -> None:
    """The same shards (symlinked) under a v1 manifest: the per-sample index inline as JSON lists."""
    from stager.manifest import SCHEMA_V1, _digest_of, load_manifest

    out.mkdir(parents=True, exist_ok=True)
    m = load_manifest(v2)
    body = json.loads((v2 / "manifest.json").read_bytes())
    body["schema"] = SCHEMA_V1
    for sj, s in zip(body["shards"], m.shards, strict=True):
        sj["index"] = {"keys": list(s.keys), "labels": s.labels.tolist(), "offsets": s.offsets.tolist(),
                       "sizes": s.sizes.tolist()}
        (out / s.name).unlink(missing_ok=True)
        (out / s.name).symlink_to(v2 / s.name)
    for k in ("index", "fields", "clips", "digest"):
        body.pop(k, None)
    body["digest"] = _digest_of(body)
    (out / "manifest.json").write_text(json.dumps(body, separators=(",", ":")) + "\n")


def run_py(code: str, *args: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        p = subprocess.run([sys.executable, f.name, *args], capture_output=True, text=True, check=False, cwd=ROOT)
    finally:
        os.unlink(f.name)
    line = [x for x in (p.stdout + "\n" + p.stderr).splitlines()
            if x.startswith("{") and ('"peak_anon_mb"' in x or '"first_batch_s"' in x)]
    if not line:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(line[-1])


def measure(path: Path, work: Path, workers: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    out["inspect"] = run_py(_CLI, "inspect", str(path), "--json")
    out["verify"] = run_py(_CLI, "verify", str(path), "-q")
    dest = work / f"stage-{path.name}"
    shutil.rmtree(dest, ignore_errors=True)
    out["stage"] = run_py(_CLI, "stage", str(path), str(dest), "-q")
    shutil.rmtree(dest, ignore_errors=True)
    out["loader"] = run_py(_LOADER, str(path), str(workers))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_281_167)
    ap.add_argument("--per-shard", type=int, default=260_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default=os.environ.get("STAGER_BENCH_DIR", "/tmp/stager-bench-footprint"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    v2, v1 = work / "v2", work / "v1"
    fabricate(v2, args.n, args.per_shard)
    v1_copy(v2, v1)
    sizes = {"v2": (v2 / "manifest.json").stat().st_size, "v1": (v1 / "manifest.json").stat().st_size}
    index_bytes = sum(p.stat().st_size for p in v2.glob("index-*.sidx"))
    res = {"v1": measure(v1, work, args.workers), "v2": measure(v2, work, args.workers)}
    shutil.rmtree(work, ignore_errors=True)
    (work.parent / "footprint.json").write_text(json.dumps({"n": args.n, "manifest_bytes": sizes,
                                                           "index_bytes": index_bytes, **res}))
    write_md(args, sizes, index_bytes, res)


def write_md(args: argparse.Namespace, sizes: dict[str, int], index_bytes: int, res: dict) -> None:
    rows = []
    for cmd in ("inspect", "verify", "stage"):
        a, b = res["v1"][cmd], res["v2"][cmd]
        ratio = a["seconds"] / max(b["seconds"], 1e-9)
        rows.append(f"| `stager {cmd}` | {a['seconds']:.2f} s, {a['peak_anon_mb']:.0f} MB | "
                    f"{b['seconds']:.2f} s, {b['peak_anon_mb']:.0f} MB | {ratio:.1f}x |")
    a, b = res["v1"]["loader"], res["v2"]["loader"]
    wk = lambda r: "/".join(f"{x:.0f}" for x in r["anon_workers_mb"]) or "-"  # noqa: E731
    rows.append(f"| loader, first batch ({args.workers} workers) | {a['first_batch_s']:.2f} s | "
                f"{b['first_batch_s']:.2f} s | {a['first_batch_s'] / max(b['first_batch_s'], 1e-9):.1f}x |")
    rows.append(f"| loader anon MB, main / workers | {a['anon_main_mb']:.0f} / {wk(a)} | "
                f"{b['anon_main_mb']:.0f} / {wk(b)} | (torch alone: {b['torch_baseline_mb']:.0f} MB) |")
    md = "\n".join([
        f"### Start-up and memory at {args.n:,} samples: manifest v1 vs v2",
        "",
        f"`python tools/bench/bench_footprint.py --n {args.n}`: one tar pack, two manifests for the same shards. "
        f"manifest.json: v1 {sizes['v1'] / 1e6:.1f} MB, v2 {sizes['v2'] / 1e3:.1f} KB plus a "
        f"{index_bytes / 1e6:.1f} MB mapped sample index. Seconds are wall time of a fresh process; MB are the "
        "peak anonymous memory (RssAnon, sampled every 5 ms: heap, not page cache).",
        "",
        "| | v1 (inline JSON index) | v2 (mapped sample index) | v1/v2 time |",
        "| --- | ---: | ---: | ---: |",
        *rows,
        "",
    ])
    OUT_MD.parent.mkdir(parents=True, exist_ok=True)
    OUT_MD.write_text(md)
    print(md)


if __name__ == "__main__":
    main()

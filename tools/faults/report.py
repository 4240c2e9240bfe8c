"""Run the fault-injection, hostile-input and parser suites with full counts; write docs/reliability.md.

``python -m tools.faults.report`` (what ``make faults`` runs) runs

    pytest -m "faults or not (slow or gpu)" tests/faults tests/test_hostile.py tests/test_properties.py \
        tests/cluster/test_cluster_faults.py

with ``$STAGER_FAULTS_TALLY`` pointing at a scratch file: every test appends the counts it has
just asserted on (tools/faults/tally.py), so each row of the table is exactly what passing
assertions checked. Hostile-input cases run as real ``python -m stager`` processes
(``$STAGER_FAULTS_SUBPROCESS=1``) and hypothesis runs ``--examples`` examples per property.
``--quick`` runs only the fast subset (what ``make test`` runs) to try the machinery. The exit
status is pytest's; the table is written either way, with failures listed at the top.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.faults.harness import ROOT, SUBPROCESS_ENV
from tools.faults.tally import TALLY_ENV, Row, load

SUITES = ["tests/faults", "tests/test_hostile.py", "tests/test_properties.py", "tests/cluster/test_cluster_faults.py"]
OUT = ROOT / "docs" / "reliability.md"

GROUP_TITLES = {
    "kill -9": "Crashes: kill -9 at random points",
    "out of space": "Out of space",
    "corruption": "Damaged data",
    "concurrency": "Concurrency on one node",
    "hostile input": "Hostile input",
    "permissions": "Permissions and clean",
    "parsers": "Parsers: arbitrary and mutated bytes",
    "cluster": "Faults on a real Slurm cluster (tools/cluster: 4 nodes, slurmd each, sshfs behind a capped link)",
}

INTRO = """# Reliability: faults and hostile input, with figures

stager runs in job prologues on thousands of nodes and unpacks archives other people made. This page
is the evidence that it keeps working under kills, full disks and damaged bytes, never writes outside
its destination and never exposes a licensed dataset. **Every row below is produced by a command in
this repository** and was asserted by a passing test; regenerate the page with

    make faults            # = python -m tools.faults.report  (a few minutes on 2 busy cores)

`make test` runs a fast subset of the same tests (a few kill points per command, fewer examples).

How to read a row: *trials* counts the faults injected or inputs tried (only kills that landed while
the process was running count as kill points); *detected/handled* counts trials whose outcome was
exactly right (for kills: the rerun completed, `stager verify` passed and the result equalled a clean
run; for damage: detected and refused with the documented exit code and a one-line error naming the
file; for hostile input: refused with nothing written outside DEST); *data lost* counts samples lost,
duplicated or delivered wrong (plus, for hostile rows, cases not handled). Counters behind each row
are in the details table.
"""

METHOD = """## What each suite does

* **kill -9** (tools/faults/kill.py, tests/faults/test_kill.py): the real command (`python -m stager
  pack|stage|stage --unpack also|only`, `tools/train.py --data <packed CIFAR-like set>
  --checkpoint-every 2 --dump-keys`) runs in its own session and its whole process group gets SIGKILL
  at a seeded random point: even trials when a progress condition holds (N shard or `.partial` files
  in OUT/DEST, N unpacked files, N training steps logged, then up to 20-80 ms more), odd trials after a
  random delay within a measured clean run. Copies are throttled (`STAGER_TEST_THROTTLE_BPS`) so kills
  land mid-copy. Then the command is rerun (training: `--resume`) and checked: exit 0, `stager verify`
  passes, pack output has the clean run's files and keys, every unpacked file has its sample's bytes,
  every training key is seen exactly once per epoch (steps replayed after a resume must repeat the
  same keys), no `.partial` file, pack state dir or lock is left.
* **Out of space** (tools/faults/space.py): `RLIMIT_FSIZE` set in the child to a seeded log-uniform
  random size (SIGXFSZ left at its default: the command must turn it into an error itself), and a
  real tmpfs of random size (`mount -t tmpfs -o size=N`, root only, skipped elsewhere; half the stage
  trials bypass the free-space pre-check so the copy itself meets ENOSPC). Expected: exit 4, one line
  naming the file, no incomplete file under a final name, no receipt, no `.partial`; the rerun
  without the limit (or after growing the tmpfs) completes and verifies.
* **Damaged data** (tools/faults/corrupt.py): 1-4 flipped bytes or a truncation at a random length of
  a random shard or companion file, in every format; `stager verify` (API, and CLI every 4th trial)
  must list exactly that file and `stager stage` must exit 3 naming it, with no copy of it and no
  `.partial` in DEST. Manifests: a flipped digit (the digest catches it), a truncation, another
  schema; verify and stage exit 3. Loader: k random payloads overwritten so they cannot be decoded;
  `on_error="raise"` must name shard and key, `on_error="skip"` must deliver every other key once
  and count k skips.
* **Concurrency** (tools/faults/concurrency.py): 3-6 `stager stage` processes on one DEST with
  readers (`make_loader(SRC, staged="auto")`, raw payloads hashed) started with them, during and
  after staging; then rounds where the lock holder is killed mid-copy.
* **Hostile input** (tests/test_hostile.py): crafted shards with correct hashes (so the parsers are
  the defence) and manifests with valid digests, run through `stage --unpack also|only` and `verify
  --deep` inside a sandbox whose snapshot (everything but DEST) must not change.
* **Parsers** (tests/test_properties.py, tools/faults/fuzz.py): hypothesis properties and a seeded
  mutation fuzzer (bit flips, truncation, huge length fields, splices; tar headers re-checksummed and
  TFRecord frames re-CRC'd so mutations reach the fields behind the checks; manifest fields re-signed
  with a valid digest) under a 1 GiB address-space limit; a read request larger than the file is a
  failure (an allocation driven by a damaged length field).
* **Cluster** (tests/cluster/test_cluster_faults.py, on `make cluster`, root only): `stager stage`
  runs as a Slurm job step on real nodes (network namespaces on a bridge, one slurmd each) reading
  the shared file system (sshfs) through the storage host's link, slowed to 16 Mbit/s so the fault
  lands mid-transfer; each fault is injected when the first `.partial` file appears on a node. *kill
  -9*: the stager of node3 is killed from inside its namespace during `--collective` on 4 nodes; the
  other three must exit 5 naming node 2 (SLURM_NODEID) with their `--json` error object. *Link
  down*: node2's `eth0` is set down for 15 s during `--collective`; every node must end (no hang) with
  exit 5 and a JSON error naming it. *Storage link down*: the storage host's link is down for 4 s
  during a direct stage on 2 nodes; the stage must complete (exit 0, TCP retransmits) with no byte
  served twice. *scancel*: a 2-node job staging into a job-independent DEST is cancelled; the
  resubmitted job must resume. *Full disk*: node4's small tmpfs is filled to half the dataset; stage
  must exit 4 up front and, with the free-space check bypassed, at ENOSPC mid-copy, with nothing
  torn and no `.partial`, while node3 completes in the same job. After each fault: no file under a
  final shard name differs from the manifest, no stager process outlives its job, and a rerun exits
  0 with every node's copy hashed against the manifest. The counters say what the fault left
  (shards already complete, `.partial` files) and what the rerun kept.
"""

PICKLE = """## Pickles: the risk and the safe path

CIFAR-10's "python version" batches are pickles, and unpickling runs code: a crafted
`data_batch_1` can call `os.system` the moment it is loaded with `pickle.load`. stager never calls
`pickle.load` on them. `stager.pack.sources.cifar.restricted_load` uses `RestrictedUnpickler`, whose
`find_class` (the only way a pickle reaches a callable) allows exactly numpy's array reconstruction
(`_reconstruct`, `_frombuffer`, `ndarray`, `dtype`) and `_codecs.encode` with the latin1 codec only;
everything else raises `SourceError` before anything runs. The suite feeds it `os.system`, `eval`,
`subprocess.getoutput`, a payload hidden in a nested container, protocol 0 and 2 and 4 pickles, a
malicious `batches.meta` and `_codecs.encode` with another codec; every one is refused and the marker
file the payload would create never appears.

Safe path for untrusted downloads: `stager pack cifar-10-batches-py OUT` (restricted unpickler) once,
then use only OUT (manifest + shards: no pickles, every byte hashed). Do not `pickle.load` CIFAR
batches yourself, and note that training checkpoints (`tools/trainlib/checkpoint.py`, loaded with
`torch.load(weights_only=False)`) are pickles too: resume only from checkpoints your own jobs wrote.
PIL's decompression-bomb limit stays on (`Image.MAX_IMAGE_PIXELS`; stager turns the warning into an
error), so a 0.2 MB PNG that decodes to 225 MB, or a JPEG whose header claims 3.6 Gpx, is refused by
`pack --resize` and by the loader (or skipped with `on_error="skip"`) without allocating it.
"""


def run_suites(quick: bool, examples: int, tally: Path, extra: list[str]) -> tuple[int, str, float]:
    env = dict(os.environ)
    env[TALLY_ENV] = str(tally)
    env["STAGER_FAULTS_EXAMPLES"] = str(examples)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if not quick:
        env[SUBPROCESS_ENV] = "1"
    marker = "not (slow or gpu or faults)" if quick else "faults or not (slow or gpu)"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *SUITES, *extra]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout[-6000:])
    sys.stderr.write(proc.stderr[-3000:])
    summary = next((ln for ln in reversed(proc.stdout.splitlines()) if " in " in ln and ("passed" in ln or
                                                                                          "failed" in ln)), "")
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return proc.returncode, "\n".join([summary.strip("= "), *failed]), time.monotonic() - t0


def render(rows: list[Row], status: str, rc: int, seconds: float, quick: bool) -> str:
    order = list(GROUP_TITLES)
    rows = sorted(rows, key=lambda r: (order.index(r.group) if r.group in order else len(order), r.row))
    kills = sum(r.trials for r in rows if r.group == "kill -9")
    out = [INTRO]
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out.append(f"Last run: {when}, {'fast subset (--quick)' if quick else 'full counts'}, {seconds / 60:.1f} min "
               f"on {os.cpu_count()} CPUs (load {load:.1f}), Python {platform.python_version()}, "
               f"{platform.system()} {platform.release()}. pytest: `{status.splitlines()[0] if status else '?'}`. "
               f"Kill points in total: **{kills}**.\n")
    if rc != 0:
        out.append("**Some tests failed in this run; their rows are missing or partial:**\n")
        out += [f"    {ln}" for ln in status.splitlines()[1:]] + [""]
    out.append("| fault or input | trials | detected/handled | data lost |")
    out.append("|---|---:|---:|---:|")
    group = None
    for r in rows:
        if r.group != group:
            group = r.group
            out.append(f"| ***{GROUP_TITLES.get(group, group)}*** | | | |")
        out.append(f"| {r.row} | {r.trials} | {r.handled} | {r.lost} |")
    out.append("")
    out.append("### Details\n")
    out.append("| row | checked | counters |")
    out.append("|---|---|---|")
    for r in rows:
        counters = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(r.extra.items())) or "-"
        out.append(f"| {r.row} | {'; '.join(r.notes) or '-'} | {counters} |")
    out.append("")
    out.append(METHOD)
    out.append(PICKLE)
    out.append(FINDINGS)
    return "\n".join(out)


FINDINGS = """## Bugs this suite found (fixed)

* `stage --unpack` on a full disk: an ENOSPC/EFBIG while writing an unpacked file was a traceback
  (exit 1) and left a short file under its final name; now exit 4, one line, the file removed
  (stager/stage/unpack.py `Unpacker.write_file`).
* `pack --resize` on a decompression bomb: PIL's `DecompressionBombError` (not an `OSError`) escaped
  as a traceback; now a `SourceError` naming the file (stager/pack/sources/).
* `load_manifest` read `f.read(4 GiB + 1)`, which asks for a 4 GiB buffer up front: a `MemoryError`
  under `ulimit -v` or strict overcommit, both common on HPC nodes (stager/manifest.py).
* Parsers that raised builtin errors on damaged input: the record `.idx` reader (`OverflowError` on
  out-of-range integers), the stage journal (`AttributeError`/`KeyError`/`TypeError` on lines that
  are JSON but not records), the receipt (`RecursionError` on deep nesting; fields of the wrong type
  accepted and crashing `stager clean` later), the lock record (`TypeError` on a non-object).
* `stager pack` into a full disk: the per-shard done-record (`write_hint`) let ENOSPC escape as a
  traceback; now exit 4 with one line (stager/pack/).
* `stager clean` removed the whole unpacked tree, including files a user had added there; it now
  removes only the files `stage --unpack` writes for the manifest, and directories left empty.
* `stager pack --format hdf5` under a file-size limit crashed (SIGSEGV inside h5py closing a file after
  EFBIG) instead of exiting 4; the writer now builds the file in memory (core driver) and writes
  it with `os.write`, so the limit is a clean `OutOfSpaceError` (stager/formats/hdf5.py).
* The receipt was always world-readable (0644) and the unpacked tree world-readable (0644/0755) in
  the process's group, even for a group-only (licensed) source; both now keep the source's group and
  at most its permission bits.
* On the cluster: when a node's link went down mid-collective, the other nodes' main threads were
  blocked inside the all_gather and their watchdog ended them with `os._exit(5)` after writing
  stderr only, so `stage --json` printed no JSON object and job scripts parsing it found nothing; the
  watchdog now reports through the CLI's own error path first (`stager.errors.exit_now`).
* On the cluster: the job scripts wrote every node's `stage --json` line into one file through srun,
  which relays task output in pieces of at most 1 KiB, so the long lines of 4 nodes interleaved into
  unparsable JSON; each node now writes its own file (`srun --output=$OUT/stage-train.%N.json`).

## Known gaps

* The loader `on_error` trials cover the encoded formats (tar, record, hdf5); zarr stores decoded
  arrays whose damage the chunk CRC catches at read time (covered by the zarr reader's own tests).
* tmpfs trials need root (mount); elsewhere they are skipped and their row is absent.
* Cluster rows need root and the cluster's packages (tools/cluster); elsewhere they are absent. Each
  cluster fault is one trial per run (a Slurm job per fault and per rerun), not a random series.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only the fast subset (what `make test` runs)")
    p.add_argument("--examples", type=int, default=400, help="hypothesis examples per property (full run)")
    p.add_argument("--out", default=str(OUT), help="markdown file to write (default docs/reliability.md)")
    p.add_argument("--keep-tally", metavar="FILE", help="also keep the raw tally lines in FILE")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -x)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tally = Path(d) / "tally.jsonl"
        rc, status, seconds = run_suites(a.quick, 60 if a.quick else a.examples, tally, a.pytest_args)
        rows = load(tally)
        if a.keep_tally and tally.exists():
            Path(a.keep_tally).write_bytes(tally.read_bytes())
    text = render(rows, status, rc, seconds, a.quick)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(f"wrote {a.out}: {len(rows)} rows, exit {rc}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

"""``stager pack|inspect|verify`` as real subprocesses: JSON output, exit codes, determinism across
worker counts, resume after ``kill -9``, and a write that runs out of space.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.formats import FORMAT_NAMES
from stager.manifest import load_manifest
from stager.pack.state import DONE_SUFFIX
from tools.datagen import png_bytes


def stager(*args: Any, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "stager", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        **kw,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def manifest_body(out: Path) -> dict[str, Any]:
    body = json.loads((out / "manifest.json").read_text())
    for k in ("created", "digest"):
        body.pop(k)
    return body


def test_pack_inspect_verify_json(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    p = stager("pack", imagenet_tiny, out, "--format", "record", "--shard-size", "64KiB", "--json")
    res = json.loads(p.stdout)
    assert res["ok"] and res["samples"] == 24 and res["format"] == "record" and res["shards"] > 2
    assert p.stderr == ""  # --json: no progress (the same in every command)
    assert "pack record" in stager("pack", imagenet_tiny, tmp_path / "o2", "--format", "record").stderr  # progress
    info = json.loads(stager("inspect", out, "--json").stdout)
    assert info["samples"] == 24 and info["shards"] == res["shards"] and info["classes"] == 4
    assert sum(r["samples"] for r in info["shard_table"]) == 24
    assert all(r["aux"] == [r["name"] + ".idx"] for r in info["shard_table"])
    human = stager("inspect", out).stdout
    assert "record pack, 24 samples" in human and info["shard_table"][0]["name"] in human
    v = json.loads(stager("verify", out, "--deep", "--json").stdout)
    assert v["ok"] and v["files"] == 2 * res["shards"] + 1  # shards, their .idx, the sample index


def test_verify_names_each_bad_file_and_exits_3(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    stager("pack", imagenet_tiny, out, "--format", "tar", "--samples-per-shard", "6", "-q")
    m = load_manifest(out)
    a, b, c = (out / s.name for s in m.shards[:3])
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 1  # same size, different content
    a.write_bytes(bytes(data))
    b.unlink()
    with open(c, "ab") as f:
        f.write(b"x")
    p = stager("verify", out, check=False)
    assert p.returncode == 3
    bad = [line for line in p.stderr.splitlines() if "BAD" in line]
    assert len(bad) == 3
    assert f"{a.name}: xxh3_128 checksum" in bad[0] and f"{b.name}: missing" in bad[1] and c.name in bad[2]
    # Deep verification catches an index that no longer matches the container even when hashes do.
    out2 = tmp_path / "o2"
    stager("pack", imagenet_tiny, out2, "--format", "hdf5", "-q")
    m2 = load_manifest(out2).detached()
    m2.shards[0].labels[3] = (m2.shards[0].labels[3] + 1) % len(m2.classes)
    m2.write(out2)
    assert stager("verify", out2).returncode == 0
    p = stager("verify", out2, "--deep", check=False)
    assert p.returncode == 3 and "sample 3: parsed" in p.stderr


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_workers_do_not_change_bytes(cifar_tiny: Path, tmp_path: Path, fmt: str) -> None:
    outs = []
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        stager("pack", cifar_tiny, out, "--format", fmt, "--samples-per-shard", "7", "--workers", w, "--seed", 5, "-q")
        outs.append(out)
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    assert manifest_body(outs[0]) == manifest_body(outs[1])
    assert len(shard_bytes(outs[0])) >= 9


def _many_pngs(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:05d}.png").write_bytes(png_bytes(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)))


@pytest.mark.parametrize("fmt", ["tar", "record"])
def test_resume_after_kill_9(tmp_path: Path, fmt: str) -> None:
    src, out, ref = tmp_path / "src", tmp_path / "o", tmp_path / "ref"
    _many_pngs(src, 600)
    args = ["--format", fmt, "--samples-per-shard", "2", "-q"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stager", "pack", str(src), str(out), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    state = out / ".stager-pack"
    deadline = time.monotonic() + 120
    # Kill as soon as the first shard is complete (its done-record exists), mid-way through 300.
    while time.monotonic() < deadline and proc.poll() is None:
        # Done-records are published atomically: a *.done name (not *.partial) means complete.
        if state.is_dir() and any(p.name.endswith(DONE_SUFFIX) for p in state.iterdir()):
            break
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists(), "pack finished before it could be killed"
    finished = len([p for p in out.iterdir() if p.name.startswith("shard-") and not p.name.endswith(".partial")])
    assert 0 < finished < 300
    res = json.loads(stager("pack", src, out, *args, "--json").stdout)
    assert res["reused_shards"] >= 1 and res["shards"] == 300
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")] and not state.exists()
    assert stager("verify", out, "--deep").returncode == 0
    stager("pack", src, ref, *args)
    assert shard_bytes(out) == shard_bytes(ref)
    body, ref_body = manifest_body(out), manifest_body(ref)
    assert body["shards"] == ref_body["shards"] and body["options"] == ref_body["options"]


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed

    return apply


def test_out_of_space_is_exit_4_and_leaves_no_partial_file(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    p = stager(
        "pack",
        imagenet_tiny,
        out,
        "--format",
        "tar",
        "--samples-per-shard",
        "12",
        check=False,
        preexec_fn=_limit_file_size(60_000),
    )
    assert p.returncode == 4, p.stderr
    err = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "file size limit" in err[0] and "shard-" in err[0]
    assert not (out / "manifest.json").exists()
    assert not [x for x in out.iterdir() if x.name.endswith(".partial")]
    assert not [x for x in out.iterdir() if x.name.endswith(".tar")]  # no shard under a final name
    stager("pack", imagenet_tiny, out, "--format", "tar", "--samples-per-shard", "12", "-q")  # rerun completes
    assert stager("verify", out).returncode == 0


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--format", "parquet"], 2, "unknown format 'parquet'"),
        (["--format", "tar", "--shard-size", "12 parsecs"], 2, "invalid size"),
        (["--format", "zarr"], 2, "--resize HxW"),
        (["--format", "tar", "--split", "test"], 2, "--split applies to CIFAR"),
    ],
)
def test_cli_errors_are_one_line(imagenet_tiny: Path, tmp_path: Path, args: list[str], code: int, needle: str) -> None:
    p = stager("pack", imagenet_tiny, tmp_path / "o", *args, check=False)
    assert p.returncode == code and needle in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.startswith("stager pack: error:")]) == 1
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_missing_source_and_busy_destination(imagenet_tiny: Path, tmp_path: Path) -> None:
    p = stager("pack", tmp_path / "nope", tmp_path / "o", "--format", "tar", check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    p = stager("pack", imagenet_tiny, tmp_path / "busy", "--format", "tar", check=False)
    assert p.returncode == 2 and "--overwrite" in p.stderr
    p = stager("pack", imagenet_tiny, tmp_path / "o", "--format", "tar", "--dry-run", "--json")
    plan = json.loads(p.stdout)
    assert plan["dry_run"] and plan["samples"] == 24 and not (tmp_path / "o").exists()


def test_rerun_of_a_complete_pack_clears_state_left_by_a_late_kill(imagenet_tiny: Path, tmp_path: Path) -> None:
    """A kill between writing manifest.json and removing .stager-pack leaves the state directory
    and possibly a stale partial; the rerun finds the pack complete and must still clear them."""
    from stager.pack.api import pack
    from stager.pack.state import STATE_DIR

    out = tmp_path / "o"
    pack(imagenet_tiny, out, "tar", samples_per_shard=8)
    (out / STATE_DIR).mkdir()
    (out / STATE_DIR / "shard-00000.tar.json").write_text("{}")
    (out / "shard-00001.tar.0123456789ab.partial").write_bytes(b"x")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.endswith(".partial")}
    r = pack(imagenet_tiny, out, "tar", samples_per_shard=8)
    assert r.reused == len(r.manifest.shards)
    assert not (out / STATE_DIR).exists()
    assert not list(out.glob("*.partial"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_registering_pack_names_every_format_without_importing_numpy() -> None:
    """``stager pack --help`` lists every format of the registry, and registering the command imports
    neither numpy nor any format's module (only the registry)."""
    help_text = subprocess.run([sys.executable, "-m", "stager", "pack", "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "|".join(FORMAT_NAMES) in " ".join(help_text.split())
    code = ("import sys, stager.commands.pack; print('numpy' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('stager.formats.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "False ['stager.formats.registry']", "importing stager.commands.pack loaded numpy"

"""One contract for the command line (stager/cli/, stager/errors.py; README.md "Exit codes").

The sweep runs every sub-command's usual mistakes as real processes and holds each to the contract:
the exit code of the table (never 1: that is a bug), no traceback, exactly one line on stderr
(``stager <cmd>: error: ...``), and with ``--json`` exactly one JSON object on stdout that says the
same. Around it: the README's table is the enum's, every error class exits with a code of the table,
flags mean the same in every command (``-j``, ``-q``, ``--json``, ``$STAGER_CACHE``), an output on a
read-only file system or in a directory the user may not write is a usage error naming the path,
Ctrl-C under ``--json`` still prints one object (exit 130), and every ``--help`` page has an example.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stager.errors import ExitCode, StagerError
from stager.manifest import load_manifest
from tests.asuser import VICTIM, requires_users, stager_as
from tests.cli_support import AS_TYPED, assert_error_contract, clean_env, open_writer_when_read, stager
from tools.datagen import jpeg_bytes, render_image

ROOT = Path(__file__).resolve().parents[1]


# ---- the table --------------------------------------------------------------------------------------------
def readme_exit_table() -> dict[int, str]:
    """``{code: name}`` from README.md's "Exit codes" table (rows ``| 2 | `USAGE` | ...``)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| `([A-Z_]+)` \|", section, re.M)}


def test_readme_exit_table_is_the_enum() -> None:
    assert readme_exit_table() == {int(c): c.name for c in ExitCode}


def _error_classes() -> set[type[StagerError]]:
    """Every StagerError subclass in stager/ (the modules that define one are imported first)."""
    for path in sorted((ROOT / "stager").rglob("*.py")):
        if re.search(r"^class \w+\(.*Error\b", path.read_text(), re.M):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            importlib.import_module(mod)
    seen: set[type[StagerError]] = set()
    todo: list[type[StagerError]] = [StagerError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return seen


def test_every_error_class_exits_with_a_code_of_the_table_and_never_1() -> None:
    classes = _error_classes()
    assert len(classes) > 20
    assert StagerError.exit_code == ExitCode.INTERNAL  # a bare StagerError is a broken invariant
    bad = {c.__qualname__: c.exit_code for c in classes
           if c.exit_code not in set(ExitCode) or c.exit_code in (ExitCode.OK, ExitCode.INTERNAL)}
    assert not bad, f"error classes outside the table or exiting 1: {bad}"


def test_untranslated_os_errors_map_by_errno() -> None:
    from stager.errors import from_os_error

    cases = {errno.ENOENT: 2, errno.ENOTDIR: 2, errno.EISDIR: 2, errno.EROFS: 2, errno.EACCES: 2, errno.EPERM: 2,
             errno.ENOSPC: 4, errno.EDQUOT: 4, errno.EFBIG: 4, errno.EIO: 3, errno.ECONNRESET: 5}
    for e, code in cases.items():
        err = from_os_error(OSError(e, os.strerror(e), "/some/path"))
        assert err.exit_code == code and str(err).startswith("/some/path: ") and "\n" not in str(err), (e, err)
        assert isinstance(err, OSError)


# ---- the sweep --------------------------------------------------------------------------------------------
# (id, argv with {placeholders}, exit code). Placeholders: a pack, an image tree, one of the pack's shards, a
# plain file, an empty directory, a missing path, a fresh output path, a fresh DEST.
MISTAKES: list[tuple[str, str, int]] = [
    ("pack-missing-src", "pack {missing} {out} --format tar", 2),
    ("pack-src-is-a-file", "pack {file} {out} --format tar", 2),
    ("pack-src-empty", "pack {empty} {out} --format tar", 2),
    ("pack-unknown-format", "pack {tree} {out} --format parquet", 2),
    ("pack-no-format", "pack {tree} {out}", 2),
    ("pack-j-0", "pack {tree} {out} --format tar -j 0", 2),
    ("pack-workers-negative", "pack {tree} {out} --format tar --workers -2", 2),
    ("pack-shard-size-0", "pack {tree} {out} --format tar --shard-size 0", 2),
    ("pack-samples-per-shard-0", "pack {tree} {out} --format tar --samples-per-shard 0", 2),
    ("pack-resize-0", "pack {tree} {out} --format tar --resize 0x5", 2),
    ("pack-quality-500", "pack {tree} {out} --format tar --quality 500", 2),
    ("pack-stripe-count-0", "pack {tree} {out} --format tar --stripe-count 0", 2),
    ("pack-out-is-a-file", "pack {tree} {file} --format tar", 2),
    ("pack-flag-typo", "pack {tree} {out} --format tar --shard-sise 1M", 2),
    ("pack-split-not-cifar", "pack {tree} {out} --format tar --split test", 2),
    ("pack-zarr-mixed-sizes", "pack {tree} {out} --format zarr", 2),
    ("index-missing", "index {missing}", 2),
    ("index-empty", "index {empty}", 2),
    ("index-a-plain-file", "index {file}", 2),
    ("index-j-0", "index {pack} -j 0", 2),
    ("index-unknown-format", "index {pack} --format bogus", 2),
    ("inspect-missing", "inspect {missing}", 2),
    ("inspect-image-tree", "inspect {tree}", 2),
    ("inspect-one-shard", "inspect {shard}", 2),
    ("inspect-a-plain-file", "inspect {file}", 2),
    ("inspect-limit-negative", "inspect {pack} --limit -1", 2),
    ("verify-missing", "verify {missing}", 2),
    ("verify-image-tree", "verify {tree}", 2),
    ("verify-one-shard", "verify {shard}", 2),
    ("verify-threads-negative", "verify {pack} --threads -4", 2),
    ("verify-threads-0", "verify {pack} --threads 0", 2),
    ("stage-missing", "stage {missing} {dest}", 2),
    ("stage-image-tree", "stage {tree} {dest}", 2),
    ("stage-one-shard", "stage {shard} {dest}", 2),
    ("stage-a-plain-file", "stage {file} {dest}", 2),
    ("stage-j-0", "stage {pack} {dest} -j 0", 2),
    ("stage-timeout-negative", "stage {pack} {dest} --timeout -5", 2),
    ("stage-node-out-of-range", "stage {pack} {dest} --partition --node 5 --num-nodes 2", 2),
    ("stage-node-without-num-nodes", "stage {pack} {dest} --partition --node 1", 2),
    ("stage-num-nodes-0", "stage {pack} {dest} --num-nodes 0", 2),
    ("stage-chunk-size-0", "stage {pack} {dest} --collective --chunk-size 0", 2),
    ("stage-dest-is-a-file", "stage {pack} {file}", 2),
    ("stage-follow-without-budget", "stage {pack} {dest} --follow", 2),
    ("stage-budget-not-a-size", "stage {pack} {dest} --follow --budget lots", 2),
    ("stage-collective-unpack", "stage {pack} {dest} --collective --unpack", 2),
    ("stage-cache-only-with-dest", "stage {pack} {dest} --cache {empty} --cache-only", 2),
    ("clean-missing", "clean {missing}", 2),
    ("clean-not-staged", "clean {tree}", 2),
    ("clean-timeout-negative", "clean {tree} --timeout -1", 2),
    ("hints-missing", "hints {missing}", 2),
    ("hints-nodes-0", "hints {tree} --nodes 0", 2),
    ("hints-url", "hints s3://bucket/prefix", 2),
    ("cache-ls-no-dir", "cache ls", 2),
    ("cache-du-no-dir", "cache du", 2),
    ("cache-gc-no-dir", "cache gc", 2),
    ("cache-ls-missing", "cache ls {missing}", 2),
    ("cache-du-not-a-cache", "cache du {tree}", 2),
    ("cache-verify-not-a-cache", "cache verify {tree}", 2),
    ("cache-gc-max-bytes-negative", "cache gc {empty} --max-bytes -1", 2),
    ("cache-gc-timeout-negative", "cache gc {empty} --timeout -1", 2),
    ("cache-init-bad-quota", "cache init {empty} --quota bogus", 2),
    ("cache-init-a-plain-file", "cache init {file}", 2),
    ("cache-pin-nothing", "cache pin {empty}", 2),
    ("cache-unknown-command", "cache frobnicate", 2),
    ("no-command", "", 2),
    ("unknown-command", "frobnicate", 2),
]


@pytest.fixture(scope="module")
def places(imagenet_tiny: Path, imagenet_tiny_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("mistakes")
    (base / "file.txt").write_text("not a dataset\n")
    (base / "empty").mkdir()
    shard = sorted(imagenet_tiny_tar.glob("shard-*"))[0]
    return {"pack": str(imagenet_tiny_tar), "tree": str(imagenet_tiny), "shard": str(shard),
            "file": str(base / "file.txt"), "empty": str(base / "empty"), "missing": str(base / "missing"),
            "base": str(base)}


def _prog(argv: list[str]) -> str:
    """The prog a mistake is reported under: ``stager``, ``stager pack``, ``stager cache gc``."""
    words = [a for a in argv[:2] if not a.startswith("-") and "/" not in a]
    if not words or words[0] not in ("pack", "index", "inspect", "verify", "stage", "clean", "hints", "cache"):
        return "stager"
    if words[0] == "cache" and len(words) > 1 and words[1] in ("init", "ls", "du", "gc", "pin", "unpin", "verify"):
        return f"stager cache {words[1]}"
    return f"stager {words[0]}"


@pytest.mark.parametrize(("case", "argv", "code"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_every_commands_usual_mistakes_follow_the_table(places: dict[str, str], case: str, argv: str,
                                                       code: int) -> None:
    where = Path(places["base"]) / case
    args = argv.format(out=where / "out", dest=where / "dest", **places).split()
    r = stager(*args, "--json")
    assert_error_contract(r, code, _prog(args), as_json=True)
    assert not (where / "out").exists() and not (where / "dest").exists(), "nothing written for a mistake"


@pytest.mark.parametrize("case", ["pack-j-0", "stage-image-tree", "verify-threads-negative", "cache-ls-no-dir",
                                  "no-command"])
def test_without_json_stdout_stays_empty(places: dict[str, str], case: str) -> None:
    _, argv, code = next(m for m in MISTAKES if m[0] == case)
    args = argv.format(out=Path(places["base"]) / "plain-out", dest=Path(places["base"]) / "plain-dest",
                       **places).split()
    assert_error_contract(stager(*args), code, _prog(args), as_json=False)


def test_the_image_tree_message_gives_the_command_that_fits(places: dict[str, str], tmp_path: Path) -> None:
    """`stage` of an image tree says to pack it first; the pack it names, then staged, works."""
    r = stager("stage", places["tree"], tmp_path / "d")
    assert r.returncode == 2 and f"stager pack {places['tree']} OUT --format tar" in r.stderr, r.stderr
    assert stager("pack", places["tree"], tmp_path / "out", "--format", "tar", "-q").returncode == 0
    assert stager("stage", tmp_path / "out", tmp_path / "d", "-q").returncode == 0


def test_an_unfinished_pack_or_index_says_which_command_finishes_it(imagenet_tiny: Path, tmp_path: Path) -> None:
    from stager.index.discover import STATE_DIR as INDEX_STATE
    from stager.manifest.document import UNFINISHED_STATE
    from stager.pack.state import STATE_DIR as PACK_STATE

    assert UNFINISHED_STATE == {PACK_STATE: "stager pack", INDEX_STATE: "stager index"}
    for state, command in UNFINISHED_STATE.items():
        d = tmp_path / state.strip(".")
        (d / state).mkdir(parents=True)  # what an interrupted run leaves: its state, no manifest yet
        for cmd in ("stage", "verify", "inspect"):
            r = stager(cmd, d, *([tmp_path / "dest"] if cmd == "stage" else []), "--json")
            assert_error_contract(r, 2, f"stager {cmd}", as_json=True)
            assert f"an unfinished `{command}`" in r.stderr, r.stderr


def test_a_single_shard_names_its_pack(places: dict[str, str], tmp_path: Path) -> None:
    r = stager("stage", places["shard"], tmp_path / "d")
    assert r.returncode == 2 and f"give the pack's directory, {places['pack']}" in r.stderr, r.stderr


# ---- outputs that cannot be written -----------------------------------------------------------------------
@contextlib.contextmanager
def read_only_mount(tmp_path: Path) -> Iterator[list[str]]:
    """A prefix that runs a command in a mount namespace where ``tmp_path/ro`` is a read-only bind mount
    (``unshare`` with a user namespace, so it needs no privilege where those are allowed); skips when not."""
    ro = tmp_path / "ro"
    ro.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux)")
    prefix = [unshare, "--map-root-user", "--mount", "sh", "-c",
              f'mount --bind "{ro}" "{ro}" && mount -o remount,bind,ro "{ro}" && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{ro}/probe" 2>/dev/null'], capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    yield prefix


def test_pack_to_a_read_only_file_system_is_a_usage_error(imagenet_tiny: Path, tmp_path: Path) -> None:
    with read_only_mount(tmp_path) as prefix:
        out = tmp_path / "ro" / "out"
        r = subprocess.run([*prefix, sys.executable, "-m", "stager", "pack", str(imagenet_tiny), str(out),
                            "--format", "tar", "--json"], capture_output=True, text=True, env=clean_env(),
                           check=False, timeout=600)
    assert_error_contract(r, 2, "stager pack", as_json=True)
    assert str(out) in r.stderr and "read-only" in r.stderr and "writable" in r.stderr, r.stderr


@requires_users
def test_an_output_the_user_may_not_write_is_a_usage_error(node: Any, imagenet_tiny_tar: Path) -> None:
    src = node.data / "packed"
    shutil.copytree(imagenet_tiny_tar, src)
    for p in [src, *src.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    locked = node.data / "locked"  # root's 0755: VICTIM may read, not write
    locked.mkdir()
    env = node.env(VICTIM)
    r = stager_as(VICTIM, "pack", src, locked / "copy", "--format", "tar", "--json", env=env)
    assert_error_contract(r, 2, "stager pack", as_json=True)
    assert str(locked) in r.stderr, r.stderr
    r = stager_as(VICTIM, "stage", src, locked / "dest", "--json", env=env)
    assert_error_contract(r, 2, "stager stage", as_json=True)
    assert str(locked) in r.stderr, r.stderr


# ---- Ctrl-C -----------------------------------------------------------------------------------------------
def _list_with_a_fifo(tmp_path: Path, n: int = 3, side: int = 40) -> tuple[Path, Path, bytes]:
    """A list file of ``n`` JPEGs whose last (by path) is a FIFO nobody writes yet; returns (list, fifo, the
    JPEG bytes the FIFO should carry)."""
    import numpy as np

    rng = np.random.default_rng(5)
    d = tmp_path / "imgs"
    d.mkdir()
    rows = []
    for i in range(n - 1):
        (d / f"img{i}.jpg").write_bytes(jpeg_bytes(render_image(rng, i % 2, 2, side, side)))
        rows.append(f"{d / f'img{i}.jpg'},{i % 2}")
    fifo = d / "zz-last.jpg"
    os.mkfifo(fifo)
    rows.append(f"{fifo},1")
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\n" + "\n".join(rows) + "\n")
    return lst, fifo, jpeg_bytes(render_image(rng, 1, 2, side, side))


def test_ctrl_c_under_json_prints_one_object_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C while pack waits on a FIFO. The writer's open lets pack's ``open`` return, so the signal lands in
    ``open``, between ``open`` and ``read`` or in ``read``: in the middle case Python used to run the handler
    only once ``read`` returned, never here (this test hung on a busy CI machine); stager's signal relay
    interrupts the read (test_attack_cli.py makes that case happen every time)."""
    lst, fifo, _ = _list_with_a_fifo(tmp_path)
    proc = subprocess.Popen([*AS_TYPED, sys.executable, "-m", "stager", "pack", str(lst), str(tmp_path / "out"),
                             "--format", "tar", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), start_new_session=True)
    fd = open_writer_when_read(fifo, proc)
    try:
        proc.send_signal(signal.SIGINT)  # pack is inside its run, opening or reading the FIFO
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(fd)
        if proc.poll() is None:  # it did not end: nothing of it outlives the test, which fails
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == ExitCode.INTERRUPTED and "Traceback" not in err, (out, err)
    assert err.splitlines() == ["stager pack: error: interrupted"], err
    (line,) = out.splitlines()
    obj = json.loads(line)
    assert obj["ok"] is False and obj["exit_code"] == 130 and obj["type"] == "KeyboardInterrupt", obj


# ---- shared flags -----------------------------------------------------------------------------------------
def test_quiet_prints_no_summary_and_json_no_progress(imagenet_tiny: Path, imagenet_tiny_tar: Path,
                                                      tmp_path: Path) -> None:
    for args in (["pack", imagenet_tiny, tmp_path / "p", "--format", "tar", "--samples-per-shard", "4"],
                 ["index", tmp_path / "p", "--out", tmp_path / "i"],
                 ["stage", imagenet_tiny_tar, tmp_path / "s"], ["verify", imagenet_tiny_tar],
                 ["inspect", imagenet_tiny_tar], ["hints", imagenet_tiny_tar], ["clean", tmp_path / "s"]):
        q = stager(*args, "-q")
        assert q.returncode == 0 and q.stdout == "" and q.stderr == "", (args, q)
        if args[0] == "clean":
            assert stager("stage", imagenet_tiny_tar, tmp_path / "s", "-q").returncode == 0
        j = stager(*args, "--json")
        assert j.returncode == 0 and j.stderr == "", (args, j.stderr)  # no progress, no summary
        (line,) = j.stdout.splitlines()
        assert json.loads(line)["ok"] is True


def test_j_means_workers_in_every_command(imagenet_tiny: Path, tmp_path: Path) -> None:
    a = stager("pack", imagenet_tiny, tmp_path / "a", "--format", "tar", "--samples-per-shard", "5", "-j", "2", "-q")
    b = stager("pack", imagenet_tiny, tmp_path / "b", "--format", "tar", "--samples-per-shard", "5", "--workers", "2",
               "-q")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    shards = [[(x.name, x.hash) for x in load_manifest(tmp_path / d).shards] for d in ("a", "b")]
    assert shards[0] == shards[1] and len(shards[0]) == 5
    for cmd in ("pack", "index", "stage"):
        page = stager(cmd, "--help").stdout
        assert re.search(r"-j N, --workers N", page), (cmd, page)


def test_cache_commands_honour_stager_cache(imagenet_tiny_tar: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = clean_env(STAGER_CACHE=str(cache))
    assert stager("stage", imagenet_tiny_tar, tmp_path / "d", "-q", env=env).returncode == 0  # fills $STAGER_CACHE
    ls = stager("cache", "ls", "--json", env=env)
    assert ls.returncode == 0, ls.stderr
    assert [d["files"] for d in json.loads(ls.stdout)["datasets"]] == [len(list(imagenet_tiny_tar.glob("shard-*")))
                                                                       + 1]
    du = stager("cache", "du", "--json", env=env)
    assert du.returncode == 0 and json.loads(du.stdout)["cache"]["dir"] == str(cache), du.stderr
    gc = stager("cache", "gc", "--dry-run", "--json", env=env)
    assert gc.returncode == 0 and json.loads(gc.stdout)["ok"], gc.stderr
    other = stager("cache", "du", str(tmp_path / "other"), env=env)  # DIR given wins over $STAGER_CACHE
    assert other.returncode == 2 and str(tmp_path / "other") in other.stderr


# ---- help pages -------------------------------------------------------------------------------------------
HELP_PAGES = [[], ["pack"], ["index"], ["inspect"], ["verify"], ["stage"], ["clean"], ["hints"], ["cache"],
              *([["cache", c] for c in ("init", "ls", "du", "gc", "pin", "unpin", "verify")])]


@pytest.mark.parametrize("cmd", HELP_PAGES, ids=[" ".join(c) or "stager" for c in HELP_PAGES])
def test_every_help_page_has_an_example(cmd: list[str]) -> None:
    r = stager(*cmd, "--help")
    assert r.returncode == 0, r.stderr
    examples = r.stdout.split("\nexamples:\n", 1)
    assert len(examples) == 2 and re.search(r"^  (srun .*)?stager ", examples[1], re.M), r.stdout


def test_every_flag_has_help_text() -> None:
    from stager.cli import build_parser

    parser = build_parser()
    pages = [parser]
    missing = []
    while pages:
        p = pages.pop()
        for action in p._actions:
            if action.choices and isinstance(action.choices, dict):  # sub-commands
                pages += list(action.choices.values())
            elif not action.help and action.option_strings:
                missing.append(f"{p.prog} {'/'.join(action.option_strings)}")
    assert not missing, missing


def test_inspect_names_its_pack_and_shows_its_fields(tmp_path: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(3)
    rows = []
    for i in range(4):
        img = tmp_path / f"{i}.jpg"
        img.write_bytes(jpeg_bytes(render_image(rng, i % 2, 2, 32, 32)))
        rows.append(json.dumps({"path": str(img), "label": i % 2, "weight": [float(i), 1.0]}))
    (tmp_path / "list.jsonl").write_text("\n".join(rows) + "\n")
    assert stager("pack", tmp_path / "list.jsonl", tmp_path / "p", "--format", "tar", "-q").returncode == 0
    usage = stager("inspect", "--help").stdout.split("\n\n", 1)[0]
    assert usage.split()[-1] == "PACK" and "OUT" not in usage, usage
    out = stager("inspect", tmp_path / "p").stdout
    assert "fields: weight (json, .json)" in out and "classes: 0, 1 (2-2 samples per class)" in out, out

"""The Slurm job scripts in tools/slurm/ are valid bash and only use flags our parsers accept.

Every ``stager <cmd> ...`` and ``train.py ...`` invocation is extracted from the scripts (comments
dropped, continuation lines joined, ``$((...))`` arithmetic and ``$VAR`` words replaced by a
placeholder) and checked against the real parsers built in-process: ``stager.cli.build_parser()``
and ``tools/train.py``'s ``build_parser()`` (and torch's own torchrun parser). Each flag must be an
exact option string (argparse would otherwise accept abbreviations), and the whole argument list
must parse. The structure every script promises (a staging prologue with ``--json`` and an
exit-code check, an EXIT trap running ``stager clean``) is asserted too, and one script is run
end to end with a stand-in ``srun`` to show that a failed stage aborts the job with stage's exit code.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "tools" / "slurm").glob("*.sbatch"))
TERMINATORS = {";", ";;", "|", "||", "&", "&&", ">", ">>", "<", "(", ")", "2>", "2>&1"}
PLACEHOLDER = "1"  # parses as int, float and path alike


def logical_lines(text: str) -> list[str]:
    """Script lines with comments removed and backslash continuations joined."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return [re.sub(r"\$\(\(.*?\)\)", PLACEHOLDER, ln) for ln in out if ln.strip()]


def words(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def invocations(script: Path, program: str) -> list[list[str]]:
    """Argument lists following each ``program`` word (``stager`` or a path ending in ``train.py``)."""
    found = []
    for line in logical_lines(script.read_text()):
        toks = words(line)
        for i, tok in enumerate(toks):
            if tok == program or (program.endswith(".py") and tok.endswith(f"/{program}")):
                args = []
                for t in toks[i + 1 :]:
                    if t in TERMINATORS:
                        break
                    args.append(t)
                found.append(args)
    return found


# A word that is only an unquoted ``${..._ARGS:-}`` is a pass-through list of extra options set by the
# submitter (TRAIN_ARGS, docs/training.md): empty by default, so it is dropped before parsing.
PASS_THROUGH = re.compile(r"^\$\{?[A-Z_]*_ARGS(:-)?\}?$")


def substitute(args: list[str]) -> list[str]:
    """Replace shell expansions by a placeholder value (``--opt=$X`` keeps its option name)."""
    out = []
    for a in args:
        if PASS_THROUGH.match(a):
            continue
        if a.startswith("--") and "=" in a and "$" in a:
            out.append(a.split("=", 1)[0] + "=" + PLACEHOLDER)
        elif "$" in a:
            out.append(PLACEHOLDER)
        else:
            out.append(a)
    return out


def is_stage_command(line: str) -> bool:
    """True for a line that runs ``stager stage`` (not one that merely mentions it in a string)."""
    toks = words(line)
    return any(a == "stager" and b == "stage" for a, b in itertools.pairwise(toks))


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for act in parser._actions for s in act.option_strings}


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for act in parser._actions:
        if isinstance(act, argparse._SubParsersAction):
            return act.choices.get(name)
    return None


class ParseFailedError(Exception):
    pass


def parse_strict(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """parse_args without exiting; argparse's message becomes the exception text."""

    def fail(message: str) -> None:
        raise ParseFailedError(message)

    parser.error = fail  # type: ignore[method-assign]
    try:
        parser.parse_args(args)
    except SystemExit as exc:  # --help or similar
        raise ParseFailedError(f"exited with {exc.code}") from exc


def train_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    from tools.train import build_parser

    return build_parser()


def seg_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    from tools.train_seg import build_parser

    return build_parser()


def video_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    from tools.train_video import build_parser

    return build_parser()


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert res.returncode == 0, f"{script.name}: {res.stderr}"


def test_expected_scripts_exist() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"train_single_node.sbatch", "train_multi_node.sbatch", "train_independent.sbatch",
            "train_beeond.sbatch", "train_prefetch.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_stager_flags_accepted(script: Path) -> None:
    from stager.cli import build_parser

    parser = build_parser()
    calls = invocations(script, "stager")
    assert calls, f"{script.name}: no stager command found"
    for args in calls:
        cmd = args[0]
        sub = subparser(parser, cmd)
        assert sub is not None, f"{script.name}: `stager {cmd}` is not a registered stager command"
        known = option_strings(sub)
        for flag in flags_of(args[1:]):
            assert flag in known, f"{script.name}: `stager {cmd}` has no option {flag} (known: {sorted(known)})"
        try:
            parse_strict(sub, substitute(args[1:]))
        except ParseFailedError as exc:
            pytest.fail(f"{script.name}: `stager {' '.join(args)}` rejected: {exc}")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_train_flags_accepted(script: Path) -> None:
    programs = (("train.py", train_parser), ("train_seg.py", seg_parser), ("train_video.py", video_parser))
    calls = [(prog, make, args) for prog, make in programs for args in invocations(script, prog)]
    assert calls, f"{script.name}: no invocation of {', '.join(p for p, _ in programs)} found"
    for prog, make, args in calls:
        known = option_strings(make())
        for flag in flags_of(args):
            assert flag in known, f"{script.name}: {prog} has no option {flag}"
        try:
            parse_strict(make(), substitute(args))
        except ParseFailedError as exc:
            pytest.fail(f"{script.name}: `{prog} {' '.join(args)}` rejected: {exc}")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_torchrun_flags_accepted(script: Path) -> None:
    from torch.distributed.run import get_args_parser

    for args in invocations(script, "torchrun"):
        # torchrun's own options come before the training script.
        own = args[: next(i for i, a in enumerate(args) if a.endswith(".py"))]
        known = option_strings(get_args_parser())
        for flag in flags_of(own):
            assert flag in known, f"{script.name}: torchrun has no option {flag}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_prologue_and_epilogue_structure(script: Path) -> None:
    text = script.read_text()
    lines = logical_lines(text)
    stage_lines = [ln for ln in lines if is_stage_command(ln)]
    assert stage_lines, f"{script.name}: no `stager stage` prologue"
    for ln in stage_lines:
        assert re.search(r"\bsrun\b.*--ntasks-per-node=1\b", ln), f"{script.name}: one stage task per node: {ln}"
        assert "--json" in words(ln), f"{script.name}: stage should report --json: {ln}"
        assert "|| rc=$?" in ln, f"{script.name}: stage's exit code must be captured: {ln}"
    assert re.search(r'if \[ "\$rc" -ne 0 \]; then', text), f"{script.name}: no exit-code check after staging"
    assert re.search(r'exit "\$rc"', text), f"{script.name}: a failed stage must end the job with its code"
    assert re.search(r"^trap \w+ EXIT$", text, re.M), f"{script.name}: no EXIT trap for the epilogue"
    assert any(re.search(r"\bstager clean\b", ln) for ln in lines), f"{script.name}: epilogue lacks `stager clean`"
    # The trap must be installed before staging starts, so a failed or cancelled stage is cleaned.
    trap_at = next(i for i, ln in enumerate(lines) if ln.startswith("trap "))
    stage_at = next(i for i, ln in enumerate(lines) if is_stage_command(ln))
    assert trap_at < stage_at, f"{script.name}: trap set after staging"
    assert re.search(r"^set -uo pipefail$", text, re.M), f"{script.name}: expected `set -uo pipefail`"


def test_beeond_script_brackets_job_with_start_stop() -> None:
    text = (ROOT / "tools" / "slurm" / "train_beeond.sbatch").read_text()
    assert "beeond start -n" in text and "beeond stop -n" in text
    assert re.search(r"stager stage .*--shared", " ".join(logical_lines(text)))
    cleanup = text[text.index("cleanup() {") : text.index("trap cleanup EXIT")]
    assert "beeond stop" in cleanup, "BeeOND must be stopped in the EXIT trap"


SRUN_SHIM = """#!/bin/bash
# Stand-in for srun on a machine without Slurm: drop srun's own options, run the command once.
while [ $# -gt 0 ]; do
    case "$1" in
        --*) shift ;;
        *) break ;;
    esac
done
echo "srun-shim: $*" >> "$SHIM_LOG"
exec "$@"
"""


def test_failed_stage_aborts_job_with_its_exit_code(tmp_path: Path) -> None:
    """Run the single-node script with a stand-in srun and a missing dataset: stage fails with its
    usage exit code (2), the script exits with that code before training, and the trap ran clean."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # The `stager` console script of an installed checkout is `python -m stager`; use this checkout's.
    stager_bin = bindir / "stager"
    stager_bin.write_text(f'#!/bin/bash\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m stager "$@"\n')
    stager_bin.chmod(0o755)
    shim = bindir / "srun"
    shim.write_text(SRUN_SHIM)
    shim.chmod(0o755)
    repo = tmp_path / "repo"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "activate").write_text(f'export PATH="{bindir}:$PATH"\n')
    log = tmp_path / "srun.log"
    env = {
        **os.environ,
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_PER_TASK": "2",
        "SLURM_TMPDIR": str(tmp_path / "local"),
        "DATA": str(tmp_path / "no-such-dataset"),
        "VAL": str(tmp_path / "no-such-val"),
        "SHIM_LOG": str(log),
        "PATH": f"{bindir}:{os.environ['PATH']}",
    }
    (tmp_path / "local").mkdir()
    res = subprocess.run(["bash", str(ROOT / "tools" / "slurm" / "train_single_node.sbatch")], env=env,
                         cwd=repo, check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "failed with exit code 2" in res.stderr
    ran = log.read_text()
    assert "stager stage" in ran and "train.py" not in ran, ran
    assert "stager clean" in ran, "the EXIT trap did not run the epilogue"

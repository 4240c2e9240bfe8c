"""The docs work as written: every link and repository path they name exists, nothing points outside the
repository, shell loops over globs survive an empty match, and the install path they give works.

A newcomer follows the README and docs/ literally; a link to a moved file or to the developers' own
notes (outside the repository) is a dead end for them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *REPO.glob("tools/**/README.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
# Repository paths in prose or code: a top-level folder of this repository, then a path with a suffix or a
# trailing slash. `file.py:123`, `file.py::name` and `file.py#L3` name places inside a file.
REPO_PATH = re.compile(r"(?<![\w./$-])((?:stager|tools|tests|docs|\.ci)/[\w./*-]*[\w/*])")
FENCE = re.compile(r"^```")


def _doc_ids() -> list[str]:
    return [str(p.relative_to(REPO)) for p in DOCS]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("doc", _doc_ids())
def test_links_resolve(doc: str) -> None:
    path = REPO / doc
    dead = []
    for m in LINK.finditer(path.read_text()):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("mailto:"):
            continue  # a URL: not ours to check offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            dead.append(f"{target} (no such file)")
            continue
        if not dest.is_relative_to(REPO):
            dead.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not dead, f"{doc}: dead links: {dead}"


@pytest.mark.parametrize("doc", _doc_ids())
def test_repository_paths_exist(doc: str) -> None:
    path = REPO / doc
    named = {m.group(1).removesuffix("**") for m in REPO_PATH.finditer(path.read_text())}  # `**`: bold, not a glob
    missing = sorted(p for p in named if not (any(REPO.glob(p)) if "*" in p else (REPO / p).exists()))
    assert not missing, f"{doc} names repository paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", _doc_ids())
def test_nothing_points_outside_the_repository(doc: str) -> None:
    text = (REPO / doc).read_text()
    assert "../shared" not in text and "shared/HPC.md" not in text, (
        f"{doc} points into ../shared/, which users of the repository do not have")


def _shell_blocks(text: str, langs: tuple[str, ...] = ("bash", "sh", "shell", "")) -> list[str]:
    """The code blocks of ``text`` fenced with one of ``langs`` ("" is an unlabelled fence)."""
    blocks, cur, lang = [], None, ""
    for line in text.splitlines():
        if FENCE.match(line):
            if cur is None:
                cur, lang = [], line[3:].strip()
            else:
                if lang in langs:
                    blocks.append("\n".join(cur))
                cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


@pytest.mark.parametrize("doc", _doc_ids())
def test_glob_loops_survive_no_match(doc: str) -> None:
    """`for d in DIR/stager-*/` without nullglob runs once with the pattern itself when nothing matches:
    the cleanup then fails on a path that does not exist."""
    bad = []
    for block in _shell_blocks((REPO / doc).read_text()):
        for line in block.splitlines():
            if re.search(r"\bfor \w+ in [^;]*\*", line) and "nullglob" not in line and "nullglob" not in block:
                bad.append(line.strip())
    assert not bad, f"{doc}: glob loops without `shopt -s nullglob`: {bad}"


def _commands(doc: str, program: str) -> list[list[str]]:
    """Argument lists of each ``program`` invocation in the doc's shell blocks (as the Slurm script test reads them)."""
    from tests.test_slurm_scripts import TERMINATORS, logical_lines, words

    found = []
    for block in _shell_blocks((REPO / doc).read_text(), ("bash", "sh", "shell")):
        for line in logical_lines(block):
            try:
                toks = words(line)
            except ValueError:  # an unbalanced quote in an illustrative fragment
                continue
            for i, tok in enumerate(toks):
                if tok == program or (program.endswith(".py") and tok.endswith(f"/{program}")):
                    args = []
                    for t in toks[i + 1 :]:
                        if t in TERMINATORS:
                            break
                        args.append(t)
                    found.append(args)
    return found


@pytest.mark.parametrize("doc", _doc_ids())
def test_documented_flags_exist(doc: str) -> None:
    """Every ``--flag`` the docs pass to ``stager <cmd>`` or to ``tools/train*.py`` is one the real parser has
    (a doc that shows ``train.py --partition`` when train.py has no such flag fails for the reader who copies it)."""
    from stager.cli import build_parser
    from tests.test_slurm_scripts import option_strings, seg_parser, subparser, train_parser, video_parser

    wrong = []
    cli = build_parser()
    for args in _commands(doc, "stager"):
        if not args or args[0].startswith("-") or args[0] in ("...", "<cmd>"):
            continue
        sub = subparser(cli, args[0])
        if sub is None:
            wrong.append(f"stager {args[0]}: no such command")
            continue
        known = option_strings(sub)
        wrong += [f"stager {args[0]} {a}" for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known]
    for prog, make in (("train.py", train_parser), ("train_seg.py", seg_parser), ("train_video.py", video_parser)):
        known = option_strings(make())
        for args in _commands(doc, prog):
            wrong += [f"{prog} {a}" for a in args if a.startswith("--") and a.split("=")[0] not in known]
    assert not wrong, f"{doc}: documented flags the parsers do not have: {wrong}"


def test_first_training_example_is_the_tiny_one(tmp_path: Path) -> None:
    """docs/training.md's first command is what a newcomer runs first, on a laptop: it must finish as written
    (a ResNet-50 at batch 64 first would take half an hour on a CPU)."""
    from tests.test_slurm_scripts import logical_lines, words

    first = next(line for block in _shell_blocks((REPO / "docs" / "training.md").read_text(), ("bash",))
                 for line in logical_lines(block) if "tools/train.py" in line)
    argv = words(first)
    assert argv[0] == ".venv/bin/python", first
    argv = [sys.executable, *argv[1:]]
    argv[argv.index("--out") + 1] = str(tmp_path / "tiny")
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = next(line for line in res.stdout.splitlines() if '"event": "summary"' in line)
    steps = int(argv[argv.index("--max-steps") + 1])
    assert f'"steps": {steps},' in summary, summary


def test_readme_install_path_works_in_a_fresh_venv(tmp_path: Path) -> None:
    """README's "Installing into your own environment", as written, in a new virtual environment: the command
    runs, the extras' backends import, and an s3:// URL gets past the opener's backend check."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Installing into your own environment", 1)[1].split("\n## ", 1)[0]
    installs = [line.split("#")[0].strip() for block in _shell_blocks(section, ("bash",))
                for line in block.splitlines() if line.startswith("pip install")]
    assert installs == ["pip install -e .", "pip install -e '.[s3,http]'"], installs
    src = tmp_path / "checkout"  # a copy of the tracked files, as a clone has them (the checkout is left untouched)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # only what the venv has
    # The machine's own torch stays out of it: stager must install without torch.
    for cmd in installs:
        res = subprocess.run(f"{venv}/bin/{cmd}", shell=True, cwd=src, env=env, capture_output=True, text=True,
                             check=False)
        assert res.returncode == 0, f"{cmd}: {res.stderr[-3000:]}"
    probe = ("import s3fs, aiohttp, requests, stager; from stager.fs.open import require_backend; "
             "require_backend('s3://bucket/ds'); require_backend('https://host/ds'); print(stager.__file__)")
    res = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0 and res.stdout.startswith(str(src)), res.stderr
    res = subprocess.run([venv / "bin" / "stager", "--version"], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0 and res.stdout.startswith("stager "), res.stderr
    assert subprocess.run([venv / "bin" / "python", "-c", "import torch"], env=env, capture_output=True,
                          check=False).returncode != 0, "installing stager pulled torch"


# ---- the map: docs/architecture.md's tree names every module -----------------------------------------------
ENTRY = re.compile(r"^( *)([\w.{},]+(?:/|\.py))(?:\s{2,}|$)")


def _tree_entries() -> dict[str, str]:
    """``{path under stager/: its text}`` for each entry of docs/architecture.md's tree (the code block under
    "The tree"): a line that starts with a name ending in ``/`` or ``.py``, nested by indentation, with the
    lines indented below it that start no entry of their own."""
    text = (REPO / "docs" / "architecture.md").read_text().split("## The tree", 1)[1]
    block = text.split("```", 2)[1]
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, path) of the open directories
    current = None
    for line in block.splitlines()[1:]:
        m = ENTRY.match(line)
        if m is None:
            if current is not None:
                entries[current] += " " + line.strip()
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:  # the root (stager/)
            stack, current = [(0, "")], None
            continue
        current = (stack[-1][1] if stack else "") + name
        entries[current] = line[m.end(2):].strip()
        if name.endswith("/"):
            stack.append((indent, current))
    return entries


def _named(entries: dict[str, str], rel: str) -> bool:
    """``rel`` (``pack/sources/cifar.py``) has an entry, or each part of it is named in its nearest
    ancestor's entry as a word (``sources/ (... cifar ...)``)."""
    if rel in entries:
        return True
    parts = rel.removesuffix(".py").split("/")
    for depth in range(len(parts) - 1, 0, -1):
        anc = "/".join(parts[:depth]) + "/"
        if anc in entries:
            rest = parts[depth:]
            return all(re.search(rf"(?<![\w/]){re.escape(p)}(?![\w])", entries[anc]) for p in rest)
    return False


def test_the_map_names_every_module() -> None:
    """Every module under stager/ is named in docs/architecture.md's tree (its own line, or a word in its
    package's entry saying what it does): the map is how a newcomer finds code."""
    entries = _tree_entries()
    pkg = REPO / "stager"
    missing = [str(p.relative_to(pkg)) for p in sorted(pkg.rglob("*.py"))
               if p.name != "__init__.py" and not _named(entries, str(p.relative_to(pkg)))]
    assert not missing, f"modules docs/architecture.md's tree does not name (add one line each): {missing}"

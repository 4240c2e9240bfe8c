"""One mechanism each, checked on the source: a scan of every module of stager/ (AST, not grep; not
stager/testing/, the conformance suites whose assertions compare what a writer hashed).

* **Verified copies** (stager/fs/verified.py): no other module compares a running hash's digest
  with an expected checksum, or drives the copy engine's partial create and hash-while-copy loops
  (stager/fs/copy.py's ``open_partial``, ``copy_hashed``, ``copy_hashed_direct``) itself.
* **Exclusive creates** (stager/fs/safe.py, rule 4 of its docstring): no other module spells
  ``O_EXCL`` or opens a file with mode ``"x"``; they call ``create_exclusive``, ``open_exclusive``
  or ``SafeDir.create_file``.

Each scan is checked against the spellings it must find, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stager"
VERIFIED = PKG / "fs" / "verified.py"
SAFE = PKG / "fs" / "safe.py"
ENGINE = {"open_partial", "copy_hashed", "copy_hashed_direct"}  # fs/copy.py's partial create and loops


TESTING = PKG / "testing"  # conformance suites shipped for others to subclass: assertions, not mechanisms


def _modules() -> list[tuple[Path, ast.AST]]:
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PKG.rglob("*.py"))
            if TESTING not in p.parents]


def _called_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


# ---- verified copies -----------------------------------------------------------------------------
def _has_digest_call(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _called_name(n) in ("hexdigest", "digest") for n in ast.walk(node))


def _calls_a_hasher(node: ast.AST) -> bool:
    """``node`` calls one of stager's functions that hash a file or object and return its checksum
    (``fsync_and_hash``, ``hash_of``: a name ending in ``hash`` or starting with ``hash_``)."""
    names = (_called_name(n) or "" for n in ast.walk(node) if isinstance(n, ast.Call))
    return any(name.endswith("hash") or name.startswith("hash_") for name in names)


def _bound_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def digest_compares(tree: ast.AST) -> list[int]:
    """Lines comparing a running hash's digest: a comparison whose operands hold a ``.hexdigest()``
    (or ``.digest()``) call, or a name bound from one in the same function (or module), or a call of a
    function that returns a file's checksum (:func:`_calls_a_hasher`: ``fsync_and_hash(p) == (n, h)``)."""
    lines = []
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    for scope in scopes:
        names: set[str] = set()
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and _has_digest_call(n.value):
                for t in n.targets:
                    names |= _bound_names(t)
            elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None and _has_digest_call(n.value):
                names |= _bound_names(n.target)
        for n in ast.walk(scope):
            if isinstance(n, ast.Compare):
                operands = [n.left, *n.comparators]
                if any(_has_digest_call(o) or _calls_a_hasher(o) or _bound_names(o) & names for o in operands):
                    lines.append(n.lineno)
    return sorted(set(lines))


def engine_calls(tree: ast.AST) -> list[int]:
    """Lines calling the copy engine's partial create or hash-while-copy loops."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and _called_name(n) in ENGINE]


def test_no_other_hash_compare_or_partial_copy_in_stager() -> None:
    """Every comparison of a running hash with an expected checksum is fs/verified.py's, and only it
    drives the copy engine's partial create and hash-while-copy loops (fs/copy.py defines them)."""
    found = []
    for path, tree in _modules():
        if path == VERIFIED:
            continue
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{ln}: compares a hash digest (use stager.fs.verified)" for ln in digest_compares(tree)]
        found += [f"{rel}:{ln}: copies with the engine itself (use stager.fs.verified.copy_verified)"
                  for ln in engine_calls(tree)]
    assert not found, "\n".join(found)


def test_the_copy_scan_finds_what_it_looks_for() -> None:
    cases = ["if h.hexdigest() != want: pass",
             "def f(h, e):\n    got = h.hexdigest()\n    return None if got == e.hash else 'bad'",
             "def f(h, e):\n    n, got = 3, h.hexdigest()\n    if (n, got) != (e.bytes, e.hash):\n        raise X",
             "def f(h):\n    return (d := h.hexdigest()) in seen",
             "class C:\n    def f(self):\n        d: str = self._h.digest()\n        assert d == self.want",
             "def f(p, n, h, algo):\n    return fsync_and_hash(p, algo) == (n, h)",
             "def f(r, name, n, h, algo):\n    return r.hash_of(name, algo) == (n, h)"]
    for src in cases:
        assert digest_compares(ast.parse(src)), src
    assert not digest_compares(ast.parse("def f(h):\n    d = h.hexdigest()\n    return {'hash': d}"))
    assert not digest_compares(ast.parse("def f(m, rec):\n    return rec['digest'] == m.digest"))
    assert engine_calls(ast.parse("n = copy_hashed(f, fd, buf, h, limit=3)"))
    assert engine_calls(ast.parse("fd, direct = fs.copy.open_partial(tmp, direct=True)"))


# ---- exclusive creates ---------------------------------------------------------------------------
def _mode_arg(call: ast.Call) -> ast.AST | None:
    """The mode argument of ``open(path, mode)``, ``os.fdopen(fd, mode)`` or ``Path.open(mode)``."""
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    name = _called_name(call)
    plain = isinstance(call.func, ast.Name) or (isinstance(call.func, ast.Attribute) and name == "fdopen")
    at = 1 if plain else 0
    return call.args[at] if name in ("open", "fdopen") and len(call.args) > at else None


def exclusive_creates(tree: ast.AST) -> list[int]:
    """Lines spelling an exclusive create: ``O_EXCL`` (``os.O_EXCL`` or a bare name), or an open
    with a literal mode holding ``x``."""
    lines = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and n.attr == "O_EXCL") or (isinstance(n, ast.Name) and n.id == "O_EXCL"):
            lines.append(n.lineno)
        elif isinstance(n, ast.Call):
            mode = _mode_arg(n)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and "x" in mode.value:
                lines.append(n.lineno)
    return sorted(set(lines))


def test_exclusive_creates_only_through_fs_safe() -> None:
    """fs/safe.py is the one place that spells an exclusive create; everyone else calls it."""
    found = []
    for path, tree in _modules():
        if path == SAFE:
            continue
        found += [f"{path.relative_to(ROOT)}:{ln}: creates exclusively itself (use stager.fs.safe.create_exclusive)"
                  for ln in exclusive_creates(tree)]
    assert not found, "\n".join(found)
    assert exclusive_creates(ast.parse(SAFE.read_text())), "fs/safe.py is where the create is spelled"


def test_the_create_scan_finds_what_it_looks_for() -> None:
    cases = ["fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)",
             "from os import O_EXCL\nfd = open_(p, O_EXCL)",
             "f = open(tmp, 'xb')", "f = open(tmp, mode='x')", "f = Path(tmp).open('xb')",
             "f = os.fdopen(fd, 'xb')"]
    for src in cases:
        assert exclusive_creates(ast.parse(src)), src
    for src in ["f = open(tmp, 'wb')", "f = open(tmp)", "f = Path(tmp).open('rb')", "fd = os.open(p, os.O_RDONLY)",
                "s = 'O_EXCL in a docstring'"]:
        assert not exclusive_creates(ast.parse(src)), src

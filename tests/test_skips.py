"""A test that needs something this machine lacks skips with one line that says what is missing and how
to get it (issue 28): never a failure, never a bare "could not import". Checked on the test sources:
every ``pytest.importorskip`` and every ``skipif`` on a missing program (``shutil.which``) gives a
reason naming how to install it, and the set-up installs what the suite's own tests need.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HINTS = ("pip install", "apt-get install", "npm install", "make venv", "make cluster", "setup_venv", "docs/")
SOURCES = sorted(p for p in TESTS.rglob("*.py") if p.name != "test_skips.py")


def _text(node: ast.AST | None, consts: dict[str, str]) -> str | None:
    """The string a reason expression evaluates to, as far as it is written in the file (f-strings:
    their literal parts)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp):
        a, b = _text(node.left, consts), _text(node.right, consts)
        return None if a is None or b is None else a + b
    return None


def skip_reasons(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, what, reason)`` of every importorskip, and every skipif whose condition asks for a
    program with ``shutil.which``, in ``path``."""
    tree = ast.parse(path.read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        name = ast.unparse(n.func)
        reason = next((k.value for k in n.keywords if k.arg == "reason"), None)
        if name.endswith("importorskip"):
            out.append((n.lineno, f"importorskip({ast.unparse(n.args[0]) if n.args else ''})", _text(reason, consts)))
        elif name.endswith("mark.skipif") and n.args and "which(" in ast.unparse(n.args[0]):
            out.append((n.lineno, f"skipif({ast.unparse(n.args[0])})", _text(reason, consts)))
    return out


def test_every_skip_for_something_missing_says_how_to_get_it() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line}: {what} reason={reason!r}" for path in SOURCES
           for line, what, reason in skip_reasons(path) if reason is None or not any(h in reason for h in HINTS)]
    assert not bad, "a skip for a missing package must say how to install it: " + "; ".join(bad)


def test_the_set_up_installs_what_the_suites_skips_ask_for() -> None:
    """Every package a test may skip for, short of the heavy ones the docs leave to the user
    (tensorflow, horovod, DALI, mxnet), is installed by the project's set-up: a pyproject extra that
    tools/setup_venv.sh installs, a Debian package it or `make cluster` installs, or azurite (npm)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    setup = (ROOT / "tools" / "setup_venv.sh").read_text()
    installed_extras = set(re.findall(r"\.\[([\w,]+)\]", setup)[0].split(","))
    closure, todo = set(), list(installed_extras)
    while todo:  # extras that name other extras (stager[s3,http])
        e = todo.pop()
        if e in closure:
            continue
        closure.add(e)
        for req in extras.get(e, []):
            m = re.match(r"stager\[([\w,]+)\]", req)
            if m:
                todo += m.group(1).split(",")
    reqs = {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for e in closure for r in extras.get(e, [])}
    reqs |= {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    heavy = {"tensorflow", "horovod", "nvidia", "mxnet"}
    missing = []
    for path in SOURCES:
        for line, what, _ in skip_reasons(path):
            m = re.match(r"importorskip\('([\w.]+)'\)", what)
            if not m:
                continue
            module = m.group(1).split(".")[0]
            if module in heavy:
                continue
            dist = {"cv2": "opencv-python-headless"}.get(module, module).replace("_", "-")
            if dist not in reqs:
                missing.append(f"{path.name}:{line}: {module}")
    assert not missing, f"tests skip for packages the set-up does not install: {missing}"

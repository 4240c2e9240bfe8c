"""Formats and their capabilities come from one registry (stager/formats/registry.py), nowhere else.

Outside ``stager/formats/`` no code may name formats to decide something: no literal list of format
names (``("tar", "hdf5", ...)``), no branch on one (``fmt.name == "tar"``, ``m.format != "zarr"``),
and no ``hasattr``/``getattr`` probe of what a format, writer or reader can do: such code asks the
format's registry entry (``format_spec(name).fields``, ``fmt.spec.fragments``). Adding a format is then
one module, one registry entry and one conformance class, and this file checks the last part too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stager.formats import ADOPTED_FORMATS, ALL_FORMATS, FORMAT_NAMES, FORMAT_SPECS
from stager.testing.formats import FormatTests, ReaderTests

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stager"
NAMES = frozenset(ALL_FORMATS)
# Tables keyed by format that map the registry's formats to code in a layer above stager/formats
# (a scanner of `stager index`), each with the test that keeps it equal to what the registry says.
KEYED_TABLES = {("stager/index/api.py", "SCANNERS"): "test_every_adopted_format_has_its_scanner"}
_PROBED = re.compile(r"\b(fmt|format|formats|writer|reader|get_format|get_writer_format)\b", re.IGNORECASE)


def _format_names(nodes: list[ast.expr | None]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES]


def _assigned_name(tree: ast.Module, node: ast.Dict) -> str | None:
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is node:
            target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            return target.id if isinstance(target, ast.Name) else None
    return None


def name_lists(path: Path, rel: str | None = None) -> list[str]:
    """Where ``path`` (``rel`` to the repository) spells out formats by name or probes a format's abilities."""
    rel = rel or str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_format_names(list(node.elts))) >= 2:
            found.append(f"{where}: a list of format names {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and len(_format_names(list(node.keys))) >= 2:
            if (rel, _assigned_name(tree, node)) not in KEYED_TABLES:
                found.append(f"{where}: a table keyed by format names {ast.unparse(node)[:60]}")
        elif isinstance(node, ast.Compare) and _format_names([node.left, *node.comparators]):
            found.append(f"{where}: a branch on a format name {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
              and node.args and _PROBED.search(ast.unparse(node.args[0]))):
            found.append(f"{where}: a capability probe {ast.unparse(node)}")
    return found


SOURCES = sorted(p for p in PKG.rglob("*.py") if (PKG / "formats") not in p.parents)


def test_no_code_outside_the_formats_names_formats() -> None:
    found = [hit for path in SOURCES for hit in name_lists(path)]
    assert not found, "ask the format registry (stager/formats/registry.py) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    'KINDS = ("tar", "record", "parquet")',
    'ok = m.format != "tar"',
    'span = fmt in {"tar", "record"}',
    'table = {"tar": 1, "zarr": 2}',
    'f = hasattr(fmt, "open_fragment")',
    'h = getattr(writer, "field_bases", {})',
])
def test_the_check_sees_each_kind_of_name_list(code: str, tmp_path: Path) -> None:
    """The check above is not vacuous: each shape it forbids is found in a module."""
    probe = tmp_path / "probe.py"
    probe.write_text(code + "\n")
    assert name_lists(probe, "stager/probe.py"), code


def test_the_check_allows_asking_the_registry(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('span = format_spec(m.format).fields == "span"\nfrags = fmt.spec.fragments\n'
                     'KINDS = ("auto", *ADOPTED_FORMATS)\nhas = getattr(self, "x", None)\n')
    assert name_lists(probe, "stager/probe.py") == []


def _conformance_classes() -> list[type[ReaderTests]]:
    import tests.test_formats
    import tests.test_formats_adopted

    del tests
    out: list[type[ReaderTests]] = []
    todo: list[type[ReaderTests]] = [ReaderTests]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "format_name" in vars(cls):
            out.append(cls)
    return out


def test_every_registered_format_has_its_conformance_class() -> None:
    """A format is registered with a conformance class: writable ones run the whole FormatTests, the
    others ReaderTests (on containers another tool wrote)."""
    classes = _conformance_classes()
    assert {c.format_name for c in classes} == set(ALL_FORMATS)
    writers = {c.format_name for c in classes if issubclass(c, FormatTests)}
    assert writers == set(FORMAT_NAMES)


def test_every_adopted_format_has_its_scanner() -> None:
    from stager.index.api import SCANNERS

    assert tuple(SCANNERS) == ADOPTED_FORMATS


def test_registry_entries_are_consistent() -> None:
    """Names are unique and plain, suffixes distinct; what `stager index` adopts it can name a default
    label for; a format that writes fields or companions says how."""
    assert len(set(ALL_FORMATS)) == len(ALL_FORMATS) and all(re.fullmatch(r"[a-z][a-z0-9]*", n) for n in ALL_FORMATS)
    suffixes = [s.suffix for s in FORMAT_SPECS.values()]
    assert len(set(suffixes)) == len(suffixes)
    for spec in FORMAT_SPECS.values():
        # One module per format, named as the format; or, for a format whose codec is a package of its
        # own (stager/formats/squashfs/), one module of that package.
        assert spec.module == f"stager.formats.{spec.name}" or (
            spec.module.rpartition(".")[0] == f"stager.formats.{spec.name}"
            and (ROOT / "stager" / "formats" / spec.name / "__init__.py").is_file()), spec.module
        if spec.adopted:
            assert spec.label_key and all(s.startswith(".") for s in spec.adopt_suffixes)
        if spec.companion:
            assert spec.companion_name(f"shard-00000{spec.suffix}") not in (None, f"shard-00000{spec.suffix}")


def test_the_registry_loads_without_numpy_or_any_format() -> None:
    code = ("import sys, stager.formats; print('numpy' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('stager.formats.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "['stager.formats.registry']"]


def test_user_facing_lists_are_the_registry() -> None:
    """``stager pack --format`` and ``stager index --format`` offer exactly the registry's formats."""
    from stager.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "index" in a.choices)
    index_format = next(a for a in sub.choices["index"]._actions if "--format" in a.option_strings)
    assert tuple(index_format.choices) == ("auto", *ADOPTED_FORMATS)
    pack_format = next(a for a in sub.choices["pack"]._actions if "--format" in a.option_strings)
    assert "|".join(FORMAT_NAMES) in str(pack_format.help)

"""The architecture of docs/architecture.md, checked: which package may import which, and no cycles.

stager's units (top-level modules and packages) sit in layers; a unit may import units of lower
layers only, plus the few same-layer edges listed in ``SAME_LAYER``. Function-level (lazy) imports
count too: deferring an import does not make a layering violation acceptable. Imports must form no
cycle (a cycle means the shared layer is missing, STYLE.md), the lazy ones inside functions counted as
well (a cycle that runs through a function-level import is still a cycle, only hidden until that function
runs), and neither may they with the type-only ones (``if TYPE_CHECKING:``) counted: two modules that need
each other's types also share something that wants a module below both. The tree itself is
checked to stay small at the top: at most 12 modules directly in ``stager/``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "stager"

# Lowest first (docs/architecture.md, "Layers").
LAYERS: list[set[str]] = [
    {"stager", "errors", "redact", "lazy"},  # the version, the exception family, the one redaction of locations,
    # a module imported on first use (stager/lazy.py)
    # pure helpers: no file-system policy; formats.registry: which formats exist and what each can do
    # (stdlib only), below the manifest that checks a format's name and extents against it
    {"checksum", "progress", "world", "order", "decode", "formats.registry"},
    {"fs"},  # OS mechanics, no dataset concepts
    {"manifest", "receipt", "formats", "mix", "cache"},  # the on-disk contracts (mix: several datasets as one;
    # cache: the shard cache's layout and rules)
    {"pack", "index", "stage", "loader", "shardcheck", "summary", "advice",  # the stages of the data flow, siblings
     "testing"},  # conformance suites a new backend subclasses (testing/formats.py: FormatTests)
    {"prefetch"},  # beside training: the loader's schedule + stage's verified streaming copy
    {"commands", "cli", "__main__"},  # the command line
]
SAME_LAYER = {("errors", "redact"),  # every error message is redacted
              ("receipt", "manifest"), ("formats", "manifest"), ("commands", "cli"), ("__main__", "cli"),
              ("cache", "manifest"),  # the cache reads a manifest to pin a dataset by its source
              ("shardcheck", "index"),  # deep verify of an indexed set indexes the shard again
              ("pack", "index")}  # pack converts a RecordIO/LMDB source indexed in memory
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
# Modules that are a unit of their own inside a package: the package's lower layer (its registry).
SUBUNITS = {"stager.formats.registry": "formats.registry"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def unit_of(module: str) -> str:
    if module in SUBUNITS:
        return SUBUNITS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "stager"


def _import_nodes(tree: ast.Module, *, type_only: bool) -> list[ast.AST]:
    """Every import statement of ``tree``, at module level and inside functions and classes, but those
    under ``if TYPE_CHECKING:`` (which never run) only with ``type_only``."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test) and not type_only:
            todo.extend(n.orelse)
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    return out


def imports(path: Path, *, type_only: bool = True) -> set[str]:
    """The stager modules ``path`` imports (``from stager.x import y`` also counts ``stager.x.y``
    when that is a module), at module level and lazily inside functions. ``from pkg import submodule``
    inside ``pkg`` itself counts only the submodule: the package's ``__init__`` is already being
    imported (the relative-import idiom). ``type_only``: count the imports under ``if TYPE_CHECKING:``
    too."""
    me = module_name(path)
    nodes = _import_nodes(ast.parse(path.read_text()), type_only=type_only)
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.split(".")[0] == "stager")
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and n.module.split(".")[0] == "stager":
            subs = {f"{n.module}.{a.name}" for a in n.names}
            subs = {s for s in subs if (PKG.parent / (s.replace(".", "/") + ".py")).exists()
                    or (PKG.parent / s.replace(".", "/") / "__init__.py").exists()}
            out.update(subs)
            if not (subs and len(subs) == len(n.names) and me.startswith(n.module + ".")):
                out.add(n.module)
        elif isinstance(n, ast.ImportFrom) and n.level > 0:
            raise AssertionError(f"{path}: relative import; stager uses absolute imports")
    return out


SOURCES = sorted(PKG.rglob("*.py"))


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module_name(p)) for p in SOURCES}
    assert units <= set(LAYER_OF), f"units without a layer (add them to LAYERS): {sorted(units - set(LAYER_OF))}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_layers(path: Path) -> None:
    me = unit_of(module_name(path))
    bad = []
    for mod in sorted(imports(path)):
        other = unit_of(mod)
        if other == me:
            continue
        if LAYER_OF[other] < LAYER_OF[me] or (me, other) in SAME_LAYER:
            continue
        bad.append(f"{mod} (layer {LAYER_OF[other]} {other!r} from layer {LAYER_OF[me]} {me!r})")
    assert not bad, f"{path.relative_to(ROOT)} imports upward or sideways: {bad}"


@pytest.mark.parametrize("type_only", [False, True], ids=["runtime", "with-type-only"])
def test_imports_have_no_cycle(type_only: bool) -> None:
    """No cycle among the imports that run (module level and lazy, inside functions), nor with the
    type-only ones counted too."""
    graph: dict[str, set[str]] = defaultdict(set)
    names = {module_name(p): p for p in SOURCES}
    for mod, path in names.items():
        graph[mod] = {m for m in imports(path, type_only=type_only) if m in names and m != mod}
    # A package's __init__ importing its own submodules is how packages re-export: not a cycle by
    # itself, so edges from a package to its own children are kept but parent edges are implicit.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d):], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_top_of_the_tree_stays_small() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules directly in stager/: {top}; give families a package"


def test_the_cli_starts_without_numpy_or_torch() -> None:
    """Building the whole parser (what ``stager <any command> --help`` does) imports neither numpy
    nor torch nor any engine: each command imports its implementation in run(). Of the formats only
    their registry (stdlib only) is loaded, for the ``--format`` choices."""
    import subprocess
    import sys

    code = ("import sys; from stager.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'h5py', 'zarr', 'fsspec')"
            " or m.startswith(('stager.stage.', 'stager.pack.', 'stager.loader', 'stager.formats.', 'stager.index'))"
            " and m != 'stager.formats.registry'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_importing_pack_stage_or_decode_loads_no_image_library() -> None:
    """``stager pack``/``stage`` import ``stager.decode`` (JPEG header checks) but decode nothing until a
    decoder is first used: OpenCV and Pillow (~25 ms) stay unloaded; the default decoder still works."""
    import subprocess
    import sys

    code = ("import sys; import stager.decode, stager.pack, stager.stage, stager.pack.sources.checks; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cv2', 'PIL', 'simplejpeg')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
    code = "import stager.decode as d; print(d.backend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() in ("simplejpeg+cv2", "simplejpeg+pil", "pil"), out.stdout


def test_no_function_is_longer_than_100_lines() -> None:
    """Long orchestrators read as named phases (ruff's PLR0915/PLR0912 bound statements and branches;
    this bounds the lines, docstrings included)."""
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 100:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long

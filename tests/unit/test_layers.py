"""The package's layers (docs/development.md, "The map"): no import cycle, and no import up a layer.

Every import counts, also one inside a function: it ties the modules together all the same. Read
from the source tree with ``ast`` (nothing is imported), so a cycle fails here before it fails at
run time in one import order only.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "alpsck"

# Bottom to top. A module may import from its own layer and the ones below. A name is a module or
# a package prefix (the longest one that matches decides).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("alpsck._core", "alpsck.errors", "alpsck.job_env", "alpsck.handles", "alpsck.progress", "alpsck.options",
              "alpsck.out", "alpsck.__version__")),
    ("store", ("alpsck.store", "alpsck.tree")),
    ("state", ("alpsck.capture", "alpsck.fit", "alpsck.rng", "alpsck.data", "alpsck.staging", "alpsck.ranks",
               "alpsck.node_health")),
    ("checkpointer", ("alpsck.checkpointer", "alpsck.restore", "alpsck.memory", "alpsck.torch_save")),
    ("dcp", ("alpsck.dcp",)),
    ("integrations", ("alpsck.integrations",)),  # other frameworks' checkpoint hooks: the checkpointer, from outside
    # The apps, each its own rung: the job layer, the checkpoint tools, the reference training, the bench
    # (which measures the training), then the command line that assembles them all.
    ("slurm", ("alpsck.slurm",)),
    ("job_bridges", ("alpsck.integrations.lightning_job",)),  # a framework's loop as the job layer's training loop
    ("tools", ("alpsck.tools",)),
    ("examples", ("alpsck.examples",)),
    ("bench", ("alpsck.bench",)),
    ("apps", ("alpsck.cli", "alpsck.__main__", "alpsck")),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The alpsck modules ``name`` imports (``alpsck._core`` for the extension)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "alpsck":
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in mods or full == "alpsck._core":
                    out.add(full)
                elif target == "alpsck" and alias.name == "__version__":
                    out.add("alpsck.__version__")  # a constant of the package's __init__, which every import runs first
                elif target in mods:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
    out.discard(name)
    return out


def _layer(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level >= 0, f"{module} is in no layer: add it to LAYERS (and to the map in docs/development.md)"
    return level


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_and_an_import_up_a_layer() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _layer("alpsck.store.picker") < _layer("alpsck.checkpointer") < _layer("alpsck.tools.prune")
    assert _layer("alpsck.slurm.cli") < _layer("alpsck.cli")  # the longest prefix decides
    # The apps' rungs: a back-arrow among them (tools importing bench, slurm importing tools) fails too.
    assert (_layer("alpsck.dcp.writer") < _layer("alpsck.slurm.runner") < _layer("alpsck.tools.plot")
            < _layer("alpsck.examples.llama.train") < _layer("alpsck.bench.overhead") < _layer("alpsck.cli"))
    assert _layer("alpsck.torch_save") < _layer("alpsck.examples.llama.train")


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    up = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
          for m, targets in sorted(_graph().items()) for t in sorted(targets) if _layer(t) > _layer(m)]
    assert up == []


def test_the_top_of_the_package_stays_small() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 16, top


# The one durable small-file write (store/durable.py). Whole files that are not small (a checkpoint, an
# export, a promoted copy, a converted DCP checkpoint, a memory checkpoint sent to another node, a file written
# through alpsck://) are streamed by their own units; the bench measures its peers' own writes. Anything else
# that fsyncs or renames a file into place asks store/durable.
_DURABLE = "alpsck/store/durable.py"
_BIG_FILE_WRITERS = ("alpsck/torch_save.py", "alpsck/tools/export.py", "alpsck/tools/export_dirs.py", "alpsck/tools/promote.py",
                     "alpsck/dcp/convert.py", "alpsck/memory/wire.py", "alpsck/store/summed.py")


def test_one_durable_small_file_write() -> None:
    found = []
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE.parent).as_posix()
        if rel == _DURABLE or rel in _BIG_FILE_WRITERS or rel.startswith("alpsck/bench/"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
                    and node.func.attr in ("fsync", "fdatasync", "replace", "rename")):
                found.append(f"{rel}:{node.lineno} os.{node.func.attr}")
    assert found == [], "write small files through alpsck.store.durable (replace_durably, append_durably)"

"""The import graph of src/tapescope runs one way: no circle, and no import from a layer to a higher one.

Every `import` and `from ... import` counts, at module level or inside a function (a function's
import runs later, but it ties the modules together all the same). Importing `a.b.c` also runs
`a/__init__.py` and `a/b/__init__.py`, so an import reaches every package above the module too.

The layers, lowest first, are written once, in LAYERS: a module belongs to the layer of the
longest prefix that names it. A module may import from its own layer or any lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first. docs/architecture.md draws the flow: options -> capture -> records -> analysis ->
# report, with the Profile (api) above the renderers it calls, and the applications above it.
LAYERS = (
    # Leaves every stage reads: torch's private names, the error types, the device catalogue.
    ("base", ("tapescope.torch_compat", "tapescope.errors", "tapescope.native_logs",
              "tapescope.loading", "tapescope.version", "tapescope.devices")),
    # The value types an option holds (a checkpointing policy, a mesh, sizes, allocator settings).
    ("option values", ("tapescope.values", "tapescope.losses")),
    ("options", ("tapescope.options", "tapescope.option_table")),
    ("capture", ("tapescope.capture",)),
    ("analysis", ("tapescope.analysis",)),
    # Example models; distributed's TP presets know their layers.
    ("zoo", ("tapescope.zoo",)),
    # A fake world of ranks: one CaptureSession per rank class, and their analyses.
    ("distributed", ("tapescope.distributed",)),
    ("report", ("tapescope.report",)),
    ("api", ("tapescope.api",)),
    # What is built on profiles: fit, fit --gpus, the checkpointing planner, sweeps, validation.
    ("applications", ("tapescope.fit", "tapescope.layouts", "tapescope.sweeps",
                      "tapescope.checkpointing", "tapescope.validate", "tapescope.calibration",
                      "tapescope.layout_search")),
    # The command line, and the package's own lazy facade.
    ("cli", ("tapescope.cli", "tapescope")),
)


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((SRC / "tapescope").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _known(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges() -> list[tuple[str, str, str]]:
    """(importer, imported, "file:line") for every tapescope -> tapescope import."""
    modules = _modules()
    edges = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        where_file = path.relative_to(SRC.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name`, the module.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            else:
                continue
            for target in targets:
                target = _known(target, modules) if target.startswith("tapescope") else None
                if target is None:
                    continue
                # The packages above the target run first (the root's __init__ imports lazily).
                if target != name:
                    edges.append((name, target, f"{where_file}:{node.lineno}"))
                for i in range(2, target.count(".") + 1):
                    parent = ".".join(target.split(".")[:i])
                    if not name.startswith(parent + "."):  # not already running
                        edges.append((name, parent, f"{where_file}:{node.lineno}"))
    return edges


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} belongs to no layer: add it to LAYERS"
    return layer


def test_every_module_has_a_layer():
    for name in _modules():
        layer_of(name)


def test_no_import_runs_up_a_layer():
    bad = []
    for a, b, where in import_edges():
        la, lb = layer_of(a), layer_of(b)
        if lb > la:
            bad.append(f"{where}: {a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(set(bad)))


def test_no_import_circle():
    graph: dict[str, dict[str, str]] = {}
    for a, b, where in import_edges():
        graph.setdefault(a, {}).setdefault(b, where)
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    lines = []
    for component in circles:
        members = set(component)
        lines.append("circle: " + ", ".join(component))
        lines += [f"  {graph[a][b]}: {a} -> {b}" for a in component for b in sorted(graph.get(a, {}))
                  if b in members]
    assert not circles, "import circles:\n" + "\n".join(lines)


# ---- private PyTorch names live in torch_compat.py alone ---------------------------------------

# Public by convention though spelled with an underscore (torch_compat's docstring says why):
# `torch._check` is the documented input check of meta kernels and fake kernels; `torch.ops.*`
# are operator names (aten's `_local_scalar_dense` is an op, not a private Python name).
_PUBLIC_BY_CONVENTION = ("torch._check",)


def _private(dotted: str) -> bool:
    """A `_`-prefixed component (not a dunder) in a dotted name under torch."""
    parts = dotted.split(".")
    if parts[0] != "torch" or dotted.startswith("torch.ops.") or dotted in _PUBLIC_BY_CONVENTION:
        return False
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _dotted(node) -> str | None:
    """`torch.a.b` of an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def private_torch_uses(path: Path) -> list[str]:
    """Every private torch module or name `path` imports, names (`torch._C.x`), or imports by a
    literal string (`importlib.import_module("torch._x")`), as "line: name"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):  # `torch.a._b`, and its prefix `torch.a` too
            names = [_dotted(node) or ""]
        elif (isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module",
                                                                     "import_module")
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        found += [f"{node.lineno}: {n}" for n in names if _private(n)]
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_private_torch_names_only_in_torch_compat():
    bad = []
    for path in sorted((SRC / "tapescope").rglob("*.py")):
        if path.name == "torch_compat.py" and path.parent.name == "tapescope":
            continue
        bad += [f"{path.relative_to(SRC.parent)}:{use}" for use in private_torch_uses(path)]
    assert not bad, ("private PyTorch names outside torch_compat.py (export them from there: a "
                     "name, a small function, or (module, name) for an attribute that is "
                     "patched):\n" + "\n".join(bad))


def test_the_private_name_check_sees_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch._dynamo\nfrom torch.utils import _pytree\n"
                   "from torch.fx import _symbolic_trace as s\nx = torch.cuda._lazy_init\n"
                   "importlib.import_module('torch.distributed._tools')\n"
                   "ok = torch._check, torch.ops.aten._to_copy, torch.__version__\n"
                   "from torch.nn import functional\n")
    assert [u.split(": ")[0] for u in private_torch_uses(src)] == ["1", "2", "3", "4", "5"]

"""fastpipe's layering, checked from the source (ast) and by importing it.

(a) The pure-data layer -- the validate rule modules (everything
    ``fastpipe.validate.rules.validate_structure`` reaches) and ``fastpipe/format/**`` --
    imports nothing, directly or through other fastpipe modules, from the layers above
    it: payloads, weights, comm, runtime, lowering, CLI, session, serving, builder,
    kernels. Imports inside functions count. ``import fastpipe.validate`` plus
    ``validate_structure`` also loads none of them when actually run.
(b) Only ``fastpipe/torch_compat.py`` imports or names a private torch API (a dotted
    ``torch...`` path with a ``_name`` component: ``torch._ops``, ``torch._subclasses``,
    ``torch._dynamo``, ``torch._C``, ``torch.fx._lazy_graph_module``, also as a string such
    as a logger name). Operator names under ``torch.ops`` (``torch.ops.aten._unsafe_view``)
    are not private modules and are fine.
(c) No import cycle among fastpipe modules. The graph has an edge for every ``import`` /
    ``from ... import`` statement, inside functions too, to the module it names:
    ``from fastpipe.lower.program import X`` -> fastpipe.lower.program; ``from
    fastpipe.lower import X`` -> fastpipe.lower (its ``__init__``), or to
    ``fastpipe.lower.X`` when X is a submodule. No implicit edge to parent packages (that
    would flag every package whose ``__init__`` re-exports its submodules).
(d) Every fastpipe module imports (pkgutil.walk_packages, all but ``fastpipe.__main__``),
    and every fastpipe module (and name from it) an import statement names exists, inside
    functions too, where importing the module would not notice.
"""
from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fastpipe"

# The layers the pure-data layer must not reach.
ABOVE_PURE_DATA = (
    "fastpipe.payload", "fastpipe.weights", "fastpipe.comm", "fastpipe.runtime", "fastpipe.lower",
    "fastpipe.cli", "fastpipe.session", "fastpipe.serving", "fastpipe.builder",
    "fastpipe.build", "fastpipe.kernels",
)
# validate_structure and the rule modules it runs; the closure below also covers anything they import.
VALIDATE_RULES = (
    "fastpipe.validate.rules", "fastpipe.validate.structure", "fastpipe.validate.comm_groups",
    "fastpipe.validate.dataflow", "fastpipe.validate.order", "fastpipe.validate.metadata",
)
TORCH_COMPAT = "fastpipe.torch_compat"


# ----------------------------------------------------------------------------- reading the source
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    return {_module_name(f): f for f in sorted(PKG.rglob("*.py")) if "__pycache__" not in f.parts}


def _parse(path: Path) -> ast.Module | str:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as e:
        return f"{type(e).__name__}: {e}"


FILES = _files()
_PARSED = {name: _parse(f) for name, f in FILES.items()}
PARSE_ERRORS = {name: t for name, t in _PARSED.items() if isinstance(t, str)}
TREES = {name: (ast.Module(body=[], type_ignores=[]) if isinstance(t, str) else t) for name, t in _PARSED.items()}


def test_every_module_parses():
    assert not PARSE_ERRORS, "\n".join(f"{FILES[m]}: {e}" for m, e in sorted(PARSE_ERRORS.items()))


def _where(mod: str, line: int) -> str:
    return f"{FILES[mod].relative_to(ROOT)}:{line}"


@dataclass(frozen=True)
class Imported:
    target: str     # the module the statement names (a submodule where `from pkg import sub` names one)
    line: int
    names: tuple[str, ...] = ()   # for `from X import a, b`: a, b


def _resolve_relative(mod: str, level: int, name: str | None) -> str:
    package = mod if FILES[mod].name == "__init__.py" else mod.rpartition(".")[0]
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(mod: str) -> list[Imported]:
    """Every import statement of a module (at any depth: functions, classes, if/try blocks)."""
    out = []
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import):
            out += [Imported(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(mod, node.level, node.module) if node.level else node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                if a.name != "*" and sub in FILES:
                    out.append(Imported(sub, node.lineno))
                else:
                    out.append(Imported(base, node.lineno, (a.name,)))
    return out


IMPORTS = {mod: imports_of(mod) for mod in FILES}


def _graph() -> dict[str, dict[str, int]]:
    """module -> {fastpipe module it imports: first line}"""
    g: dict[str, dict[str, int]] = {}
    for mod, imps in IMPORTS.items():
        g[mod] = {}
        for imp in imps:
            if imp.target in FILES and imp.target != mod:
                g[mod].setdefault(imp.target, imp.line)
    return g


GRAPH = _graph()


def _is_under(mod: str, packages) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def _path_to_forbidden(start: str) -> list[str] | None:
    """The shortest chain of imports from `start` to a module above the pure-data layer."""
    prev: dict[str, str | None] = {start: None}
    queue = [start]
    for mod in queue:
        targets = [imp.target for imp in IMPORTS[mod]]
        for t in [x for x in targets if _is_under(x, ABOVE_PURE_DATA)] + [x for x in GRAPH[mod]]:
            if t in prev:
                continue
            prev[t] = mod
            if _is_under(t, ABOVE_PURE_DATA):
                chain = [t]
                while prev[chain[-1]] is not None:
                    chain.append(prev[chain[-1]])
                return chain[::-1]
            if t in GRAPH:
                queue.append(t)
    return None


def _show_chain(chain: list[str]) -> str:
    steps = [chain[0]]
    for a, b in itertools.pairwise(chain):
        line = next(imp.line for imp in IMPORTS[a] if imp.target == b)
        steps.append(f"-> {b} ({_where(a, line)})")
    return " ".join(steps)


# ----------------------------------------------------------------------------- (a) pure-data layer
PURE_DATA = sorted(set(VALIDATE_RULES) | {m for m in FILES if _is_under(m, ("fastpipe.format",))})


def test_the_pure_data_modules_exist():
    missing = [m for m in VALIDATE_RULES if m not in FILES]
    assert not missing, f"rule modules named by this test are gone: {missing}"


@pytest.mark.parametrize("mod", PURE_DATA)
def test_pure_data_layer_imports_nothing_above_it(mod):
    chain = _path_to_forbidden(mod)
    assert chain is None, f"{mod} reaches {chain[-1]}: {_show_chain(chain)}"


def test_validate_structure_loads_no_layer_above_it():
    """Run it: import fastpipe.validate, read and check a pipeline, list what got imported."""
    code = (
        "import json, sys\n"
        "from fastpipe.format import read_pipeline\n"
        "from fastpipe.validate import validate_structure\n"
        f"validate_structure(read_pipeline({str(ROOT / 'graphs' / 'tp_mlp' / 'pipeline.json')!r}))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fastpipe'))))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    above = [m for m in loaded if _is_under(m, ABOVE_PURE_DATA)]
    assert not above, f"import fastpipe.validate + validate_structure loaded {above}"


# ----------------------------------------------------------------------------- (b) private torch
_TORCH_PATH = re.compile(r"torch(\.\w+)+")


def _private_prefix(dotted: str) -> str | None:
    """`torch._ops.OpOverload` -> "torch._ops"; None for a public path or an operator name."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return None
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[: i + 1])
    return None


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def private_torch_uses(mod: str) -> list[tuple[int, str]]:
    """(line, private path) for every import, attribute chain or dotted string naming one."""
    return _private_torch(TREES[mod])


def _private_torch(tree: ast.Module) -> list[tuple[int, str]]:
    aliases: dict[str, str] = {}     # local name -> the torch path it is bound to
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "torch":
                    continue
                if (p := _private_prefix(a.name)) is not None:
                    found.add((node.lineno, p))
                aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if (p := _private_prefix(full)) is not None:
                    found.add((node.lineno, p))
                aliases[a.asname or a.name] = full
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain and chain[0] in aliases:
                dotted = ".".join([aliases[chain[0]], *chain[1:]])
                if (p := _private_prefix(dotted)) is not None:
                    found.add((node.lineno, p))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and _TORCH_PATH.fullmatch(node.value) and (p := _private_prefix(node.value)) is not None):
            found.add((node.lineno, p))
    return sorted(found)


def test_private_torch_only_in_torch_compat():
    bad = [f"{_where(mod, line)}: {name}" for mod in FILES if mod != TORCH_COMPAT
           for line, name in private_torch_uses(mod)]
    assert not bad, ("private torch APIs outside fastpipe/torch_compat.py (take them from there):\n  "
                     + "\n  ".join(bad))


def test_the_private_torch_check_sees_what_it_should():
    """The detector itself: on fastpipe.torch_compat (which may), and on each spelling it looks for."""
    names = {name for _, name in private_torch_uses(TORCH_COMPAT)}
    assert {"torch._ops", "torch._subclasses", "torch._dynamo", "torch.fx._lazy_graph_module"} <= names
    lines = (
        "import logging",                                                   # 1
        "import torch",                                                     # 2
        "import torch.fx as fx",                                            # 3
        "from torch import _C",                                             # 4
        "from torch._subclasses.fake_tensor import FakeTensorMode",         # 5
        "def f(x):",                                                        # 6
        '    """torch._ops in a docstring is prose"""',                     # 7
        "    import torch._dynamo",                                         # 8
        "    logging.getLogger('torch._subclasses.fake_tensor')",           # 9
        "    y = torch.ops.aten._unsafe_view.default(x, [1])",              # 10
        "    fx._lazy_graph_module",                                        # 11
        "    return isinstance(y, torch._ops.OpOverload), torch.Tensor.__init__, x._base",  # 12
    )
    src = "\n".join(lines)
    assert _private_torch(ast.parse(src)) == [
        (4, "torch._C"), (5, "torch._subclasses"), (8, "torch._dynamo"), (9, "torch._subclasses"),
        (11, "torch.fx._lazy_graph_module"), (12, "torch._ops"),
    ]


# ----------------------------------------------------------------------------- (c) import cycles
def _sccs(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _cycle_in(comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a module chain."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue = [start]
    for mod in queue:
        for t in sorted(GRAPH[mod]):
            if t == start:
                chain = [start, mod]
                while chain[-1] != start:
                    chain.append(prev[chain[-1]])
                return chain[::-1]
            if t in members and t not in prev:
                prev[t] = mod
                queue.append(t)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def _show_cycle(chain: list[str]) -> str:
    steps = [chain[0]]
    for a, b in itertools.pairwise(chain):
        steps.append(f"-> {b} ({_where(a, GRAPH[a][b])})")
    return " ".join(steps)


def test_no_import_cycles():
    cycles = [c for c in _sccs(GRAPH) if len(c) > 1]
    msg = "\n".join(f"  {len(c)} modules: {', '.join(c)}\n    e.g. {_show_cycle(_cycle_in(c))}" for c in cycles)
    assert not cycles, f"import cycles among fastpipe modules:\n{msg}"


def test_the_cycle_finder_finds_cycles():
    g = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e": 1}}
    assert sorted(c for c in _sccs(g) if len(c) > 1) == [["a", "b", "c"]]


# ----------------------------------------------------------------------------- (d) everything imports
def _top_level_names(mod: str) -> set[str] | None:
    """Names a module binds at import time (None: it has a module __getattr__ or a star import)."""
    names: set[str] = set()
    todo = list(TREES[mod].body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    return None
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for h in getattr(node, "handlers", []):
                todo += h.body
    return names


def test_every_imported_fastpipe_module_exists():
    """`import fastpipe.x` / `from fastpipe.x import y` anywhere (inside functions too) names a module
    that exists, and y is a submodule of fastpipe.x or a name fastpipe.x binds."""
    bad = []
    for mod, imps in IMPORTS.items():
        for imp in imps:
            if not _is_under(imp.target, ("fastpipe",)):
                continue
            if imp.target not in FILES:
                bad.append(f"{_where(mod, imp.line)}: {imp.target} (no such module)")
                continue
            defined = _top_level_names(imp.target)
            missing = [n for n in imp.names if defined is not None and n not in defined]
            if missing:
                bad.append(f"{_where(mod, imp.line)}: {', '.join(missing)} (not in {imp.target})")
    assert not bad, "imports of fastpipe modules that do not exist:\n  " + "\n  ".join(bad)


_IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
import fastpipe
failed, names = {}, []
def onerror(name):
    failed[name] = traceback.format_exception_only(*sys.exc_info()[:2])[-1].strip()
for info in pkgutil.walk_packages(fastpipe.__path__, "fastpipe.", onerror=onerror):
    names.append(info.name)
    if info.name == "fastpipe.__main__" or info.name in failed:
        continue
    try:
        importlib.import_module(info.name)
    except BaseException as e:
        failed[info.name] = f"{type(e).__name__}: {e}".splitlines()[0]
print(json.dumps({"names": names, "failed": failed}))
"""


@pytest.fixture(scope="module")
def import_all():
    run = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_module_imports(import_all):
    failed = import_all["failed"]
    assert not failed, "modules that do not import:\n  " + "\n  ".join(f"{k}: {v}" for k, v in sorted(failed.items()))


def test_walk_packages_sees_every_file(import_all):
    walked = set(import_all["names"]) | {"fastpipe"}
    assert walked == set(FILES), (f"on disk, not walked: {sorted(set(FILES) - walked)}; "
                                  f"walked, not on disk: {sorted(walked - set(FILES))}")


def test_import_graph_follows_the_stated_edges():
    """The edge rules of (c), on this repository's own modules."""
    by_target = defaultdict(list)
    for imp in IMPORTS["fastpipe.validate.rules"]:
        by_target[imp.target].append(imp.line)
    assert "fastpipe.validate.structure" in by_target          # from fastpipe.validate.structure import ...
    assert "fastpipe.validate" not in GRAPH["fastpipe.validate.rules"]   # no implicit parent edge
    assert "fastpipe.format.strict_json" in GRAPH["fastpipe.format"]     # from fastpipe.format import strict_json


# ---------------------------------------------------------------------------------- (e) the layer table
# docs/architecture.md's table: a module may import only from its own layer or below.
LAYERS = [
    (0, ("fastpipe.errors", "fastpipe.dtypes", "fastpipe.atomic", "fastpipe.torch_compat", "fastpipe.options",
         "fastpipe.compute_handlers", "fastpipe.compare")),
    (1, ("fastpipe.format",)),
    (2, VALIDATE_RULES + ("fastpipe.payload", "fastpipe.weights", "fastpipe.comm", "fastpipe.kernels")),
    (3, ("fastpipe.validate",)),
    (4, ("fastpipe.lower", "fastpipe.builder")),
    (5, ("fastpipe.runtime",)),
    (6, ("fastpipe.session", "fastpipe.session_warmup", "fastpipe.serving", "fastpipe.server", "fastpipe.model_io",
         "fastpipe.random_inputs", "fastpipe.summary")),
    (7, ("fastpipe.cli", "fastpipe.__main__", "fastpipe")),
]


def layer_of(mod: str) -> int:
    """The layer of the most specific entry that names `mod` or a package above it."""
    best = None
    for layer, names in LAYERS:
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (layer, name)
    assert best is not None, f"{mod} is in no layer of the table"
    return best[0]


def test_imports_follow_the_layer_table():
    bad = [f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)}) at {_where(mod, line)}"
           for mod, deps in GRAPH.items() for dep, line in deps.items() if layer_of(dep) > layer_of(mod)]
    assert not bad, "imports against docs/architecture.md's layers:\n  " + "\n  ".join(bad)


def test_the_layer_table_sees_an_upward_import():
    assert layer_of("fastpipe.validate.rules") == 2 and layer_of("fastpipe.validate.files") == 3
    assert layer_of("fastpipe.runtime.passes.fuse") > layer_of("fastpipe.lower.check") > layer_of("fastpipe.format.parse")
    assert layer_of("fastpipe") == 7 and layer_of("fastpipe.cli.main") == 7


def test_model_families_are_compared_only_in_their_registry():
    """No module outside fastpipe/builder/hf/families/ switches on a model family's name (``family ==``,
    ``!=``, ``in``, ``not in``, or a lookup ``X[family]``): what differs between families is a field of
    their FamilySpec (fastpipe.builder.hf.families), which the generic machinery asks."""
    families = PKG / "builder" / "hf" / "families"

    def names_family(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "family")
                or (isinstance(node, ast.Attribute) and node.attr == "family"))

    def switches(tree: ast.AST) -> list[int]:
        lines = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                if any(names_family(x) for x in [node.left, *node.comparators]):
                    lines.append(node.lineno)
            elif isinstance(node, ast.Subscript) and names_family(node.slice):
                lines.append(node.lineno)
        return lines

    probe = ast.parse('if family == "bert": pass\nif plan.family not in ("a",): pass\nx = LAYERS[family]\n'
                      'for family in fams: pass\ny = spec.name == "bert"')
    assert switches(probe) == [1, 2, 3]
    pattern = re.compile(r"\bfamily\s*(==|!=)|\bfamily\s+(not\s+)?in\s*\(")
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == families or families in path.parents:
            continue
        text = path.read_text()
        lines = set(switches(ast.parse(text)))
        lines |= {i for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)}
        bad += [f"{path.relative_to(ROOT)}:{i}" for i in sorted(lines)]
    assert not bad, "a model family switched on outside fastpipe/builder/hf/families/:\n  " + "\n  ".join(bad)


PROCESSOR_NAMES = ("reference", "region", "cpu", "cuda", "dist")
REGISTRY = "fastpipe.runtime.processors.registry"


def _processor_switches(tree: ast.AST) -> list[int]:
    """Lines comparing something named like a processor (`processor`, `.processor`, `args.processor`)
    with a processor's name as a string (==, !=, in, not in, a tuple or set of names too)."""
    def names_processor(node) -> bool:
        return ((isinstance(node, ast.Name) and "processor" in node.id)
                or (isinstance(node, ast.Attribute) and "processor" in node.attr))

    def names_a_processor(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in PROCESSOR_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_a_processor(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names_processor(x) for x in sides) and any(names_a_processor(x) for x in sides):
                lines.append(node.lineno)
    return lines


def test_processors_are_compared_by_name_only_in_the_registry():
    """Only the registry knows processors by name: the session, the options, the CLI and every other
    module ask it (processor_class, choose_processor, runs_per_rank) or read a processor's class attributes."""
    probe = ast.parse('if self.processor == "dist": pass\nif args.processor not in ("auto", "dist"): pass\n'
                      'if d.type == "cuda": pass\nif name == AUTO: pass')
    assert _processor_switches(probe) == [1, 2]
    bad = [f"{FILES[m].relative_to(ROOT)}:{line}" for m in sorted(FILES) if m != REGISTRY
           for line in _processor_switches(TREES[m])]
    assert not bad, "a processor compared by name outside its registry:\n  " + "\n  ".join(bad)


def test_the_session_reaches_processors_only_through_the_registry():
    """fastpipe.session imports from fastpipe.runtime only the flow's steps (binding, the fusion pass,
    the processor base and registry, the compile cache): never a processor's own module."""
    flow = {"fastpipe.runtime.binding.bind", "fastpipe.runtime.binding.device_map", "fastpipe.runtime.binding.index_bounds",
            "fastpipe.runtime.binding.state", "fastpipe.runtime.passes.fuse", "fastpipe.runtime.passes",
            "fastpipe.runtime.processors.base", REGISTRY, "fastpipe.runtime.compiling.compile_cache"}
    for mod in ("fastpipe.session", "fastpipe.session_warmup"):
        runtime = {i.target for i in IMPORTS[mod] if i.target.startswith("fastpipe.runtime")}
        processors = {t for t in runtime if t.startswith("fastpipe.runtime.processors.")} - {REGISTRY, "fastpipe.runtime.processors.base"}
        assert not processors, f"{mod} imports a processor module: {sorted(processors)}"
        if mod == "fastpipe.session":
            assert runtime <= flow, f"fastpipe.session imports runtime modules outside the flow: {sorted(runtime - flow)}"

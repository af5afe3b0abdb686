"""Import structure of ``megatron/`` and ``zb_pipeline/``, read from the source (nothing is imported).

The graph has one node per module (``pkg/__init__.py`` is ``pkg``) and an edge for every ``import``/``from``
statement anywhere in the file: at module level, inside functions, and under ``if TYPE_CHECKING:`` (a type-only
import is still a dependency of the design; two modules that name each other's types share something that
belongs in a third).  ``from pkg import name`` where ``pkg/name`` is a module is an edge to that submodule,
otherwise to ``pkg`` itself.  Importing ``pkg.sub`` also runs ``pkg/__init__``: that is an edge too, unless the
importer is itself inside ``pkg`` (its own package is initialised, or initialising, before it runs; counting that
would make every ``__init__`` that re-exports its submodules a cycle).  ``importlib.import_module`` with a computed
name (the schedule registry's plug-ins) is not seen.

Rules checked:

(a) no cycle among modules (each failure prints one cycle as ``a -> b -> a`` with file:line of every edge);
(b) no module uses a private name (``_x``, not a dunder) of another module: ``from m import _x``, or ``alias._x``
    where ``alias`` is a module imported by name.  A private *module* (``pkg/_x.py`` or a compiled ``pkg._x``
    extension) is private to its package: modules inside ``pkg`` may import it (its typed wrapper does);
(c) ``zb_pipeline`` never imports ``megatron``, and nothing in ``zb_pipeline.schedule`` reaches
    ``zb_pipeline.runtime``, directly or through other modules.

The checker is tested on small synthetic packages first, so a pass on the real tree means something.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron", "zb_pipeline")


# --------------------------------------------------------------------------------------------- the checker
@dataclass(frozen=True)
class Import:
    """One imported thing: ``target`` is a project module; ``name`` the attribute taken from it (None: the module)."""

    importer: str
    target: str
    name: str | None
    file: str  # relative to the root, with forward slashes
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class Tree:
    """The modules of ``packages`` under ``root`` and what each imports from the others."""

    def __init__(self, root: Path, packages: Iterable[str]) -> None:
        self.root = root
        self.modules: dict[str, Path] = {}
        self.extensions: set[str] = set()  # compiled modules (built or declared in setup.py's CPP_EXTENSIONS)
        for pkg in packages:
            for path in sorted((root / pkg).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
            for path in (root / pkg).rglob("*.so"):
                self.extensions.add(".".join(path.relative_to(root).parts[:-1] + (path.name.split(".")[0],)))
        self.extensions |= _declared_extensions(root / "setup.py")
        self.packages = tuple(packages)
        self.imports: list[Import] = [imp for m in sorted(self.modules) for imp in self._imports_of(m)]

    def is_module(self, name: str) -> bool:
        return name in self.modules or name in self.extensions

    def is_package(self, module: str) -> bool:
        return self.modules[module].name == "__init__.py"

    def is_ours(self, name: str) -> bool:
        return name.split(".")[0] in self.packages

    def _imports_of(self, module: str) -> list[Import]:
        path = self.modules[module]
        file = path.relative_to(self.root).as_posix()
        tree = ast.parse(path.read_text(), filename=file)
        out: list[Import] = []
        aliases: dict[str, str] = {}  # local name -> project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if not self.is_ours(a.name):
                        continue
                    target = self._longest_module(a.name)
                    if target is not None:
                        out.append(Import(module, target, None, file, node.lineno))
                    bound = a.asname or a.name.split(".")[0]
                    aliases[bound] = a.name if a.asname else bound
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(module, node.module, node.level)
                if not self.is_ours(base):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if self.is_module(sub):
                        out.append(Import(module, sub, None, file, node.lineno))
                        aliases[a.asname or a.name] = sub
                    elif self.is_module(base):
                        out.append(Import(module, base, a.name, file, node.lineno))
        for node in ast.walk(tree):  # alias._private: a private name used through an imported module
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                chain = _dotted(node.value)
                if chain is None or chain.split(".")[0] not in aliases:
                    continue
                head, _, rest = chain.partition(".")
                target = aliases[head] + (f".{rest}" if rest else "")
                if self.is_module(target) and target != module:
                    out.append(Import(module, target, node.attr, file, node.lineno))
        return out

    def _longest_module(self, dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if self.is_module(".".join(parts[:n])):
                return ".".join(parts[:n])
        return None

    def _absolute(self, module: str, name: str | None, level: int) -> str:
        if level == 0:
            return name or ""
        parts = module.split(".")
        if not self.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([name] if name else []))

    # ---------------------------------------------------------------------------------------- the graph
    def graph(self) -> dict[str, dict[str, Import]]:
        """module -> {imported project module -> the first statement importing it}.

        Importing ``q.r.s`` also runs ``q/__init__`` and ``q/r/__init__``: an edge to each such package that does
        not contain the importer (its own packages are already initialised, or initialising, when it runs)."""
        g: dict[str, dict[str, Import]] = {m: {} for m in self.modules}
        for imp in self.imports:
            if imp.target in self.modules and imp.target != imp.importer:
                g[imp.importer].setdefault(imp.target, imp)
            parts = imp.target.split(".")
            for n in range(1, len(parts)):
                package = ".".join(parts[:n])
                inside = imp.importer == package or imp.importer.startswith(package + ".")
                if package in self.modules and not inside:
                    g[imp.importer].setdefault(package, Import(imp.importer, package, None, imp.file, imp.line))
        return g

    def cycles(self) -> list[list[Import]]:
        """For each strongly connected component of more than one module, the shortest cycle through each of its
        modules (as its edges; the same cycle found from two of its modules is listed once)."""
        g = self.graph()
        out: list[list[Import]] = []
        seen: set[frozenset[tuple[str, str]]] = set()
        for component in sorted(_strongly_connected(g), key=min):
            if len(component) < 2:
                continue
            for start in sorted(component):
                cycle = _cycle_through(g, start, component)
                key = frozenset((imp.importer, imp.target) for imp in cycle)
                if key not in seen:
                    seen.add(key)
                    out.append(cycle)
        return out

    def private_uses(self) -> list[Import]:
        bad = []
        for imp in self.imports:
            name = imp.name
            if name is None:  # a module: private components are allowed inside their package
                parts = imp.target.split(".")
                for i, part in enumerate(parts):
                    package = ".".join(parts[:i])
                    if is_private(part) and not (imp.importer == package or imp.importer.startswith(package + ".")):
                        bad.append(imp)
                        break
            elif is_private(name):
                bad.append(imp)
        return bad

    def reachable(self, start: str) -> dict[str, list[Import]]:
        """Every module reachable from ``start`` -> the chain of imports that reaches it."""
        g = self.graph()
        seen: dict[str, list[Import]] = {start: []}
        todo = [start]
        while todo:
            m = todo.pop()
            for target, imp in sorted(g[m].items()):
                if target not in seen:
                    seen[target] = seen[m] + [imp]
                    todo.append(target)
        return seen


def _declared_extensions(setup_py: Path) -> set[str]:
    if not setup_py.exists():
        return set()
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "CPP_EXTENSIONS" for t in targets):
                return set(ast.literal_eval(node.value))
    return set()


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner is not None else None
    return None


def _strongly_connected(g: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes, but recursion depth is not worth risking)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.add(m)
                    if m == node:
                        break
                components.append(component)
    return components


def _cycle_through(g: dict[str, dict[str, Import]], start: str, component: set[str]) -> list[Import]:
    """The shortest cycle from ``start`` back to itself inside ``component`` (breadth first)."""
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for target, imp in sorted(g[m].items()):
                if target == start:
                    return paths[m] + [imp]
                if target in component and target not in paths:
                    paths[target] = paths[m] + [imp]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component")  # cannot happen for a real component


def describe(chain: list[Import]) -> str:
    if not chain:
        return ""
    steps = " -> ".join([chain[0].importer] + [imp.target for imp in chain])
    return f"{steps}  ({', '.join(imp.where for imp in chain)})"


def describe_private(imp: Import) -> str:
    what = f"{imp.target}.{imp.name}" if imp.name else imp.target
    return f"{imp.where}: {imp.importer} uses private {what}"


# ------------------------------------------------------------------------------------- the checker itself
def _package(tmp_path: Path, files: dict[str, str]) -> Tree:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Tree(tmp_path, ("pkg",))


def test_checker_sees_function_level_and_submodule_imports(tmp_path: Path) -> None:
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",  # a submodule through `from package import name`
            "pkg/b.py": "def f():\n    from pkg.c import g\n",  # function level
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\ng = 1\n",
        },
    )
    (cycle,) = tree.cycles()
    assert describe(cycle).startswith("pkg.a -> pkg.b -> pkg.c -> pkg.a  (pkg/a.py:1, pkg/b.py:2, pkg/c.py:3)")


def test_checker_ignores_packages_importing_their_own_submodules(tmp_path: Path) -> None:
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub.x import X\n",
            "pkg/sub/__init__.py": "from .x import X\n",
            "pkg/sub/x.py": "import pkg.sub.y as y\nX = y.Y\n",
            "pkg/sub/y.py": "Y = 1\n__all__ = ['Y']\n",
        },
    )
    assert tree.cycles() == []
    assert tree.private_uses() == []
    assert set(tree.graph()["pkg"]) == {"pkg.sub", "pkg.sub.x"}  # importing pkg.sub.x runs pkg/sub/__init__


def test_checker_sees_a_cycle_through_another_packages_init(tmp_path: Path) -> None:
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/config/__init__.py": "from pkg.config.sizes import SIZES\n",
            "pkg/config/errors.py": "class E(Exception): ...\n",
            "pkg/config/sizes.py": "from pkg.model.config import Model\nSIZES = {}\n",
            "pkg/model/__init__.py": "",
            "pkg/model/config.py": "from pkg.config.errors import E\nclass Model: ...\n",
        },
    )
    assert [describe(c) for c in tree.cycles()] == [
        "pkg.config -> pkg.config.sizes -> pkg.model.config -> pkg.config  "
        "(pkg/config/__init__.py:1, pkg/config/sizes.py:1, pkg/model/config.py:1)"
    ]


def test_checker_flags_private_names_but_not_dunders_or_package_private_modules(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # a compiled private module
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import _hidden, __version__, public\n",
            "pkg/a.py": "_hidden = 1\n__version__ = '1'\npublic = 2\n",
            "pkg/b.py": "from . import a\nfrom pkg import _ext\nx = a._hidden\ny = a.public\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from pkg import _ext\nimport pkg.a as m\nz = m._hidden\n",
            "other/__init__.py": "from pkg import _ext\n",  # not scanned: only pkg is
        },
    )
    found = sorted(describe_private(imp) for imp in tree.private_uses())
    assert found == [
        "pkg/__init__.py:1: pkg uses private pkg.a._hidden",
        "pkg/b.py:3: pkg.b uses private pkg.a._hidden",
        "pkg/sub/c.py:3: pkg.sub.c uses private pkg.a._hidden",
    ]


def test_checker_follows_relative_imports_and_reports_reach_chains(tmp_path: Path) -> None:
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/p.py": "from ..mid import q\n",
            "pkg/mid.py": "def f():\n    from .high import r\n",
            "pkg/high.py": "",
        },
    )
    chain = tree.reachable("pkg.low.p")["pkg.high"]
    assert describe(chain) == "pkg.low.p -> pkg.mid -> pkg.high  (pkg/low/p.py:1, pkg/mid.py:2)"


# ------------------------------------------------------------------------------------------ the real tree
@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(ROOT, PACKAGES)


def test_no_import_cycles(tree: Tree) -> None:
    cycles = tree.cycles()
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s):\n" + "\n".join(describe(c) for c in cycles), pytrace=False)


def test_no_private_names_imported_from_other_modules(tree: Tree) -> None:
    bad = tree.private_uses()
    if bad:
        lines = "\n".join(describe_private(i) for i in bad)
        pytest.fail(f"{len(bad)} private cross-module use(s):\n{lines}", pytrace=False)


def test_zb_pipeline_never_imports_megatron(tree: Tree) -> None:
    bad = [imp for imp in tree.imports if imp.importer.startswith("zb_pipeline") and imp.target.startswith("megatron")]
    if bad:
        pytest.fail("zb_pipeline imports megatron:\n" + "\n".join(f"{i.where}: {i.target}" for i in bad), pytrace=False)


def test_schedule_never_reaches_runtime(tree: Tree) -> None:
    bad = []
    for module in tree.modules:
        if module == "zb_pipeline.schedule" or module.startswith("zb_pipeline.schedule."):
            reach = tree.reachable(module)
            hits = [t for t in reach if t == "zb_pipeline.runtime" or t.startswith("zb_pipeline.runtime.")]
            if hits:
                first = min(
                    hits, key=lambda t: (len(reach[t]), tree.is_package(t), t)
                )  # nearest, a module over an init
                bad.append(describe(reach[first]))
    if bad:
        pytest.fail("zb_pipeline.schedule reaches zb_pipeline.runtime:\n" + "\n".join(sorted(bad)), pytrace=False)

"""The shape of the code, checked: no import cycle among the project's modules (imports
inside functions count; ``if TYPE_CHECKING:`` ones do not), and packages reach each other
only through their faces (``__init__``) or public modules — never another package's
private (``_``-prefixed) module (a sub-package is inside its parent: ``stores.sqlite``
uses ``stores._types``)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("prismd", "adapters", "stores")


def _modules() -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def _imports(module: str) -> list[str]:
    """The project modules ``module`` imports (a package face counts as its ``__init__``)."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    out: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return [t for t in out if t in MODULES and t != module]


def test_the_scan_sees_the_whole_project() -> None:
    assert {"prismd.runtime._turn", "prismd.journal._protocol", "stores.sqlite"} <= set(MODULES)
    assert "prismd.journal._journal" in _imports("prismd.journal._protocol")


def test_no_import_cycle_among_the_project_modules() -> None:
    graph = {module: set(_imports(module)) for module in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert cycles == []


def _package(module: str) -> str:
    return module if MODULES[module][1] else module.rpartition(".")[0]


def test_packages_use_each_other_through_their_faces() -> None:
    crossings = []
    for module in sorted(MODULES):
        mine = _package(module)
        for target in _imports(module):
            theirs = _package(target)
            if theirs == mine or theirs.startswith(mine + "."):
                continue
            if mine.startswith(theirs + "."):
                continue  # a sub-package is inside its parent (stores.sqlite uses stores._types)
            if any(part.startswith("_") for part in target.split(".")):
                crossings.append(f"{module} -> {target}")
    assert crossings == []


# Shields whose bound lives elsewhere, each with the reason it cannot hang.
BOUNDED_ELSEWHERE = {
    # The job is inside a transaction (or leads one) whose statements and COMMIT run to
    # their end, the writer thread's part never abandoned: the wait ends with that
    # transaction (and the store's busy timeout bounds its BEGIN). ``aclose`` waits for
    # the last such transaction; the writes queued behind it fail at once.
    ("stores/sqlite/_engine.py", "write"),
    ("stores/sqlite/_engine.py", "aclose"),
    # Driver.aclose bounds itself (CLOSE_BUDGET_S, then terminates the connections).
    ("stores/postgres/_driver.py", "open_driver"),
    ("stores/postgres/_store.py", "aclose"),
}


def _unbounded_shields(path: Path) -> list[tuple[str, int]]:
    """``with trio.CancelScope(shield=True)`` with no ``deadline=`` and no
    ``move_on_after``/``fail_after`` in the same ``with``, by enclosing function."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, (ast.With, ast.AsyncWith)):
                calls = [ast.unparse(item.context_expr) for item in child.items]
                shielded = [c for c in calls if "CancelScope(" in c and "shield=True" in c]
                bounded = any("deadline=" in c for c in shielded) or any(
                    "move_on_after(" in c or "fail_after(" in c for c in calls
                )
                if shielded and not bounded:
                    found.append((name, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_every_shield_is_bounded() -> None:
    """Cleanup is shielded only under a deadline (``move_on_after(…, shield=True)``, a
    ``deadline=``), so no stop, close or drain can wait forever on a peer or a store."""
    unbounded = []
    for path, _is_package in MODULES.values():
        relative = path.relative_to(REPO).as_posix()
        for function, line in _unbounded_shields(path):
            if (relative, function) not in BOUNDED_ELSEWHERE:
                unbounded.append(f"{relative}:{line} in {function}")
    assert unbounded == []
    # The allowance list names only shields that exist (it cannot go stale silently).
    present = {
        (path.relative_to(REPO).as_posix(), function)
        for path, _ in MODULES.values()
        for function, _line in _unbounded_shields(path)
    }
    assert present >= BOUNDED_ELSEWHERE

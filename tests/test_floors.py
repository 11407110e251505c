"""The house's floors only go down (docs/architecture.md).

references -> kernels (kernels/runtime first, then the kernel modules) -> tuning -> model -> harness: a module
imports only its own floor and the floors below it; no module circle (imports inside functions count); no
``_private`` name of one module imported or read by another; no package file over 800 lines and no host
function over 80 lines (``@jit`` kernels exempt). Read from the source with ``ast``: nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top folder -> (floor, import package)
FOLDERS = {"references": 1, "kernels": 2, "tuning": 3, "model": 4, "harness": 5}
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[:2] == ["harness", "testing"]:
        parts = ["testing"] + parts[2:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["tritune"] + parts)


def package_files() -> list[Path]:
    return sorted(p for f in FOLDERS for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def floor(mod: str) -> tuple[int, int]:
    """(floor, sub-floor) of a module: kernels/runtime sits under the kernel modules."""
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top == "testing":
        return FOLDERS["harness"], 0
    base = FOLDERS.get(top, 0)
    if top == "kernels":
        return base, 0 if parts[2:3] == ["runtime"] else 1
    return base, 0


class Imports(ast.NodeVisitor):
    """Every import of a tritune module (module-level or not), and every ``_name`` taken from one."""

    def __init__(self, mod: str, is_pkg: bool, modules: set[str]):
        self.mod, self.modules = mod, modules
        self.pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
        self.edges: set[str] = set()
        self.private: list[str] = []
        self.aliases: dict[str, str] = {}

    def resolve(self, name: str) -> str | None:
        """The longest prefix of ``name`` that is a module of the package."""
        parts = name.split(".")
        for i in range(len(parts), 1, -1):
            cand = ".".join(parts[:i])
            if cand in self.modules:
                return cand
        return None

    def visit_Import(self, node):
        for a in node.names:
            if a.name.startswith("tritune."):
                tgt = self.resolve(a.name)
                if tgt:
                    self.edges.add(tgt)
                    if a.asname:
                        self.aliases[a.asname] = tgt

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.pkg.split(".")[: len(self.pkg.split(".")) - node.level + 1]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        if not src.startswith("tritune"):
            return
        for a in node.names:
            sub = f"{src}.{a.name}"
            if sub in self.modules:
                self.edges.add(sub)
                self.aliases[a.asname or a.name] = sub
            else:
                tgt = self.resolve(src) if src != "tritune" else None
                if tgt:
                    self.edges.add(tgt)
                    if a.name.startswith("_") and not a.name.startswith("__") and tgt != self.mod:
                        self.private.append(f"{self.mod} imports {a.name} from {tgt}")

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            tgt = self.aliases[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") and tgt != self.mod:
                self.private.append(f"{self.mod} reads {node.attr} of {tgt}")
        self.generic_visit(node)


def scan():
    files = package_files()
    modules = {module_name(p) for p in files}
    graph, private, upward = {}, [], []
    for p in files:
        mod = module_name(p)
        v = Imports(mod, p.name == "__init__.py", modules)
        v.visit(ast.parse(p.read_text(), str(p)))
        graph[mod] = v.edges - {mod}
        private += v.private
        for tgt in graph[mod]:
            if floor(tgt) > floor(mod):
                upward.append(f"{mod} -> {tgt}")
    return graph, private, upward


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def is_jit(fn: ast.AST) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target).split(".")[-1] == "jit":
            return True
    return False


def long_functions() -> list[str]:
    out = []
    for p in package_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_jit(node):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_upward_import():
    _, _, upward = scan()
    assert not upward, "imports that go up a floor:\n" + "\n".join(sorted(upward))


def test_no_module_circle():
    graph, _, _ = scan()
    found = circles(graph)
    assert not found, "module circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_across_modules():
    _, private, _ = scan()
    assert not private, "private names used across modules:\n" + "\n".join(sorted(set(private)))


def test_package_files_are_small():
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in package_files()
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, f"package files over {MAX_FILE_LINES} lines:\n" + "\n".join(big)


def test_host_functions_are_short():
    found = long_functions()
    assert not found, f"host functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_no_lab_paths(folder):
    """Nothing in the package imports or cites the lab (run logs live in git history, not the product)."""
    lab = "lab" + "/"   # spelled apart, so that `git grep` for lab paths finds none in the tree
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py") if lab in p.read_text()]
    assert not hits, f"files citing {lab} paths: {hits}"


def test_every_package_folder_is_installed():
    """A folder with an ``__init__.py`` that pyproject does not list is missing from a non-editable install
    (an editable one finds it anyway): CI installs as users do."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for init in (p for f in FOLDERS for p in (ROOT / f).rglob("__init__.py") if "__pycache__" not in p.parts):
        rel = init.parent.relative_to(ROOT).as_posix()
        found.add(dirs.get(rel) or module_name(init))
    assert found <= listed, f"packages missing from pyproject: {sorted(found - listed)}"

"""The project's modules import one another one way: no import cycle among them, counting the
imports inside functions too (an import moved into a function still closes the cycle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fairseq_qknorm", "fairseq_qknorm_cli", "experiments", "benchmarks")


def project_modules():
    """{dotted name: path} of every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(name, path, modules):
    """The project modules that the module `name` imports anywhere in its source."""

    def known(dotted):  # the longest project module that `dotted` names or lies in
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from package import module` imports the module; `from module import name`, the module
            found.update(known(f"{base}.{alias.name}") or known(base) for alias in node.names)
    return found - {"", name}


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import a\n")
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]


def test_no_import_cycle_among_the_projects_modules():
    modules = project_modules()
    assert "experiments.gl_en_2x2_records" in modules and "fairseq_qknorm.qknorm_attention" in modules
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert cycles(graph) == []

"""The layout a reader meets: the paper's files on top, the toy study's machinery and the plumbing
around a run in packages of their own, imports that run one way, and the reading budgets."""
import ast
import os

from conftest import ROOT

PACKAGES = ("plumbing", "study")
ENTRY_POINTS = ("reproduce", "toy", "results")  # the commands of the toy study


def sources():
    """module name -> parsed source of every module of the project (not the tests or bench)."""
    found = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
    for package in PACKAGES:
        for f in os.listdir(os.path.join(ROOT, package)):
            if f.endswith(".py") and f != "__init__.py":
                found[f"{package}.{f[:-3]}"] = os.path.join(package, f)
    return {name: ast.parse(open(os.path.join(ROOT, path)).read()) for name, path in found.items()}


def imports(tree, project):
    """(module imported, names taken from it) of every import of the project in tree, in a
    function or not: `from plumbing import cli` imports plumbing.cli."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names if a.name in project]
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in project]
            out += [(s, ()) for s in subs]
            if node.module in project:
                out.append((node.module, tuple(a.name for a in node.names)))
    return out


def unit(module):
    """A package counts as one unit of the layout, a top-level module as one of its own."""
    return module.split(".")[0]


def test_the_top_level_holds_the_papers_files_and_the_commands():
    top = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(top) <= 13, top
    for name in ("model", "lora", "sample", "train", "data", "sft", "rl", "opd", "evaluate", "drift", *ENTRY_POINTS):
        assert name in top, name


def test_imports_run_one_way_between_the_packages_and_the_modules():
    trees = sources()
    project = set(trees) | set(PACKAGES)
    graph = {name: {m for m, _ in imports(tree, project)} for name, tree in trees.items()}
    # the plumbing imports nothing of the project outside itself
    for name, imported in graph.items():
        if name.startswith("plumbing."):
            assert all(m.startswith("plumbing") for m in imported), (name, imported)
    # the paper's files never reach into the study; the study never into its commands
    for name, imported in graph.items():
        if "." not in name and name not in ENTRY_POINTS:
            assert not any(m.startswith("study") for m in imported), (name, imported)
        if name.startswith("study."):
            assert not set(imported) & set(ENTRY_POINTS), (name, imported)
    # and no circle, module by module or unit by unit
    units = {}
    for name, imported in graph.items():
        units.setdefault(unit(name), set()).update(unit(m) for m in imported if unit(m) != unit(name))
    for edges in (graph, units):
        state = {}

        def visit(node, path):
            assert state.get(node) != "open", f"import circle: {' -> '.join(path + [node])}"
            if state.get(node) is None:
                state[node] = "open"
                for nxt in edges.get(node, ()):
                    visit(nxt, path + [node])
                state[node] = "done"
        for node in edges:
            visit(node, [])


def test_no_module_takes_a_name_through_another_modules_namespace():
    """`M.InputError` would read as model.py's own; a name is used from the module that defines it."""
    trees = sources()
    project = set(trees)
    defined = {}
    for name, tree in trees.items():
        own = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
                own.update(e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts)
        defined[name] = own
    for name, tree in trees.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in project})
            elif isinstance(node, ast.ImportFrom) and node.module:
                aliases.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in project})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module = aliases[node.value.id]
                assert node.attr in defined[module], f"{name}: {node.value.id}.{node.attr} is not {module}'s own"


def test_the_reading_budgets():
    """Lines of at most 100 characters; no function over 60 lines or 8 parameters; the budgets of
    DEVELOPERS.md; each training loop on one screen."""
    budgets = {"model": 500, "sample": 250, "lora": 350, "sft": 250, "rl": 250, "opd": 250}
    for name, tree in sources().items():
        path = os.path.join(ROOT, *name.split(".")) + ".py"
        lines = open(path).read().splitlines()
        assert len(lines) <= budgets.get(name, 450), (name, len(lines))
        assert all(len(line) <= 100 for line in lines), name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                n -= bool(a.args) and a.args[0].arg in ("self", "cls")
                assert n <= 8, f"{name}.{node.name} takes {n} parameters"
                assert node.end_lineno - node.lineno + 1 <= 60, f"{name}.{node.name}"
        if name in ("sft", "rl", "opd"):
            loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and "run.steps" in ast.unparse(n.iter))
            assert loop.end_lineno - loop.lineno + 1 <= 40, name

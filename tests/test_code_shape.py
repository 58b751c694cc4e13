"""The shape every module of src/ keeps (shared/STYLE.md): functions of at most 60 lines
(decorators and docstring included) and 8 parameters (`self` and `cls` not counted), module
docstrings of at most 20 lines, and no component importing a loop or the command line."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stabledrl"
MAX_LINES, MAX_PARAMS, MAX_DOC = 60, 8, 20
LOOPS = {"stabledrl.train", "stabledrl.sft", "stabledrl.evaluate", "stabledrl.cli", "stabledrl.training_run"}
ENTRY = {"train.py", "sft.py", "cli.py", "training_run.py", "__main__.py"}  # the loops and the command line


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def shape_problems(path: Path) -> list[str]:
    """What in one module breaks the limits, one line each."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(SRC.parent) if SRC in path.parents else path.name
    out = []
    doc = ast.get_docstring(tree, clean=False)
    if doc and len(doc.splitlines()) > MAX_DOC:
        out.append(f"{where}: module docstring of {len(doc.splitlines())} lines")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - first + 1
            if lines > MAX_LINES:
                out.append(f"{where}:{first} {node.name}: {lines} lines")
            if _params(node) > MAX_PARAMS:
                out.append(f"{where}:{first} {node.name}: {_params(node)} parameters")
    return out


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:  # `from stabledrl import train` too
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_the_shape_checker_finds_what_it_looks_for(tmp_path):
    # a function of 61 lines and 9 parameters, a 21-line module docstring
    body = "\n".join(f"    x{i} = {i}" for i in range(59))  # with the def line and the docstring: 61 lines
    bad = tmp_path / "probe.py"
    bad.write_text('"""' + "line\n" * 21 + '"""\n\n\n@staticmethod\ndef f(a, b, c, d, e, g, h, i, j):\n    """Doc."""\n'
                   + body + "\n\n\ndef ok(a, b, c, d, e, g, h, i):\n    return a\n")
    assert shape_problems(bad) == ["probe.py: module docstring of 21 lines", "probe.py:25 f: 62 lines",
                                   "probe.py:25 f: 9 parameters"]
    # self does not count
    assert _params(ast.parse("def m(self, a, b, c, d, e, f, g, h): pass").body[0]) == 8


def test_every_module_of_src_keeps_the_limits():
    problems = [p for path in _modules() for p in shape_problems(path)]
    assert not problems, "\n".join(problems)


def test_no_component_imports_a_loop_or_the_command_line():
    offenders = [f"{p.relative_to(SRC.parent)} imports {sorted(_imports(p) & LOOPS)}"
                 for p in _modules() if p.name not in ENTRY and _imports(p) & LOOPS]
    assert not offenders, "\n".join(offenders)

"""The shape every module of src/ keeps (shared/STYLE.md), for a reader: no function to scroll
through (at most 60 lines of code: decorators and body, its docstring not counted), at most 8
parameters (`self` and `cls` not counted), no out-parameters (a function returns what it
computes instead of writing into a dict or list it was given; a tensor written in place, a
buffer, is the exception), module docstrings of at most 20 lines, and no component importing a
loop or the command line."""

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


def _docstring_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


_MUTATORS = {"update", "setdefault", "append", "extend", "insert", "pop", "popitem", "clear", "add", "discard",
             "remove"}


def out_parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters `fn` writes into: `p[k] = v`, `p[k] += v`, or a mutating method call
    (`p.update(...)`, `p.append(...)`, ...), for each parameter p not annotated as a tensor."""
    a = fn.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
              if x.arg not in ("self", "cls") and "Tensor" not in ast.unparse(x.annotation or ast.Constant(""))}
    found = []
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        found += [t.value.id for t in targets
                  if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in params]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in params):
            found.append(node.func.value.id)
    return sorted(set(found))


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
            lines = node.end_lineno - first + 1 - _docstring_lines(node)
            if lines > MAX_LINES:
                out.append(f"{where}:{first} {node.name}: {lines} lines")
            if _params(node) > MAX_PARAMS:
                out.append(f"{where}:{first} {node.name}: {_params(node)} parameters")
            for name in out_parameters(node):
                out.append(f"{where}:{first} {node.name}: writes into its parameter {name}")
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
    # a function of 61 lines of code (and a docstring of 3, not counted) and 9 parameters, a 21-line module docstring
    body = "\n".join(f"    x{i} = {i}" for i in range(59))  # with the decorator and the def line: 61 lines
    bad = tmp_path / "probe.py"
    bad.write_text('"""' + "line\n" * 21 + '"""\n\n\n@staticmethod\ndef f(a, b, c, d, e, g, h, i, j):\n    """Doc\n\n    more."""\n'
                   + body + "\n\n\ndef ok(a, b, c, d, e, g, h, i):\n    \"\"\"Doc.\"\"\"\n" + body[:-len("\n    x58 = 58")]
                   + "\n    return a\n")  # 60 lines of code: within the limit
    assert shape_problems(bad) == ["probe.py: module docstring of 21 lines", "probe.py:25 f: 61 lines",
                                   "probe.py:25 f: 9 parameters"]
    # self does not count
    assert _params(ast.parse("def m(self, a, b, c, d, e, f, g, h): pass").body[0]) == 8


def test_an_out_parameter_is_found_and_a_returned_value_or_a_tensor_buffer_is_not():
    def found(src: str) -> list[str]:
        return out_parameters(ast.parse(src).body[0])

    assert found("def f(row, xs, d):\n    row['a'] = 1\n    xs.append(2)\n    d['n'] += 1") == ["d", "row", "xs"]
    assert found("def f(row):\n    row.update(a=1)") == ["row"]
    assert found("def f(row):\n    out = {**row, 'a': 1}\n    return out") == []
    assert found("def f(run):\n    run.counters['n'] += 1") == []  # the run's own state, by its attribute
    assert found("def f(x: torch.Tensor):\n    x[0] = 1") == []
    assert found("def f(self, row):\n    self.d['a'] = row") == []


def test_every_module_of_src_keeps_the_limits():
    problems = [p for path in _modules() for p in shape_problems(path)]
    assert not problems, "\n".join(problems)


def test_no_component_imports_a_loop_or_the_command_line():
    offenders = [f"{p.relative_to(SRC.parent)} imports {sorted(_imports(p) & LOOPS)}"
                 for p in _modules() if p.name not in ENTRY and _imports(p) & LOOPS]
    assert not offenders, "\n".join(offenders)

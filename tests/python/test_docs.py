"""Every public name of torchleaf has a docstring a reader can learn from.

The API reference (docs/api/python.md) is generated from these docstrings by
Sphinx's autodoc with napoleon, Google style. For each name in
``torchleaf.__all__`` (and each public method of ``LeafFunction``) this test
requires a docstring with:

* ``Args:`` naming every parameter, where the callable takes any;
* ``Returns:`` where it returns a value, ``Yields:`` where it is a generator
  (a context manager);
* ``Raises:`` where it raises (a ``raise`` in its body, or known to raise
  from the C++ core or at decoration: ``_RAISES`` below);
* ``Example:`` or ``Examples:`` for functions, methods and classes a user
  calls (not for a refusal, which only raises: ``_NO_EXAMPLE``).

``cmake_prefix_path`` is a string: its documentation is the ``#:`` comment
above its assignment (what autodoc reads). ``torchleaf.config``'s flags are
not objects: the module docstring lists them under ``Attributes:``.
"""

import ast
import inspect
import re
import textwrap

import pytest

import torchleaf

_CANONICAL = {"Arguments": "Args", "Examples": "Example", "Notes": "Note"}
_SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Examples?|Attributes|Note|Notes):\s*$")

# Callables that raise LeafFunctionError without a `raise` statement of their
# own: at decoration (LeafFunction.__init__) or from the C++ core.
_RAISES = {"leaf_function", "load_library"}
# A refusal (it only raises) needs no example.
_NO_EXAMPLE = {"register_multi_grad_hook"}


def _sections(doc):
    """{section name: its text} of a Google-style docstring."""
    found, current = {}, None
    for line in inspect.cleandoc(doc).splitlines():
        m = _SECTION.match(line.strip()) if not line.startswith((" ", "\t")) else None
        if m:
            current = _CANONICAL.get(m.group(1), m.group(1))
            found[current] = ""
        elif current is not None:
            found[current] += line + "\n"
    return found


def _documented_params(args_text):
    """The parameter names an Args section documents (``name:``,
    ``name (type):``, and ``a, b:`` for several at once)."""
    names = set()
    for line in args_text.splitlines():
        m = re.match(r"^\s{1,8}([\w*][\w*, ]*?)\s*(\([^)]*\))?:\s", line + " ")
        if m:
            names.update(n.strip().lstrip("*") for n in m.group(1).split(","))
    return names


def _own_statements(fn):
    """The function's body without nested function and class definitions."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _needs(fn, name):
    """Which sections `fn`'s docstring needs."""
    needs = set() if name in _NO_EXAMPLE else {"Example"}
    target = inspect.unwrap(fn)
    params = [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.name not in ("self", "cls")
    ]
    if params:
        needs.add("Args")
    stmts = _own_statements(target) or []
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in stmts):
        needs.add("Yields")
    elif any(isinstance(n, ast.Return) and n.value is not None and not (
            isinstance(n.value, ast.Constant) and n.value.value is None) for n in stmts):
        needs.add("Returns")
    if any(isinstance(n, ast.Raise) for n in stmts) or name in _RAISES:
        needs.add("Raises")
    return needs, params


def _public_callables():
    for name in torchleaf.__all__:
        obj = getattr(torchleaf, name)
        if inspect.isfunction(obj):
            yield name, obj
    yield "config.patch", torchleaf.config.patch
    for name, member in vars(torchleaf.LeafFunction).items():
        if not name.startswith("_") and inspect.isfunction(member):
            yield f"LeafFunction.{name}", member


def _problems(name, fn):
    doc = inspect.getdoc(fn)
    if not doc:
        return ["no docstring"]
    needs, params = _needs(fn, name.split(".")[-1])
    have = _sections(doc)
    problems = [f"no {section}: section" for section in sorted(needs - set(have))]
    if "Args" in have:
        missing = [p for p in params if p not in _documented_params(have["Args"])]
        if missing:
            problems.append(f"Args: does not document {missing}")
    return problems


@pytest.mark.parametrize("name", [n for n, _ in _public_callables()])
def test_public_callable_has_a_complete_docstring(name):
    fn = dict(_public_callables())[name]
    problems = _problems(name, fn)
    assert not problems, f"torchleaf.{name}: " + "; ".join(problems)


def test_public_classes_have_docstrings_with_examples():
    for cls in (torchleaf.LeafFunction, torchleaf.LeafFunctionError):
        doc = inspect.getdoc(cls)
        assert doc, f"torchleaf.{cls.__name__}: no docstring"
    # A user meets LeafFunction first: its docstring shows one in use.
    assert "Example" in _sections(inspect.getdoc(torchleaf.LeafFunction)), (
        "torchleaf.LeafFunction: no Example: section"
    )


def test_config_documents_its_flags():
    doc = torchleaf.config.__doc__ or ""
    sections = _sections(doc)
    assert "Attributes" in sections, "torchleaf.config: no Attributes: section listing its flags"
    documented = _documented_params(sections["Attributes"])
    flags = {"validate_outputs", "check_escaped_gradients"}
    assert flags <= documented, f"torchleaf.config: Attributes: does not document {sorted(flags - documented)}"


def test_cmake_prefix_path_has_a_doc_comment():
    source = inspect.getsource(torchleaf)
    lines = source.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("cmake_prefix_path =")]
    comment = []
    while i > 0 and lines[i - 1].startswith("#:"):
        i -= 1
        comment.append(lines[i])
    assert comment, "torchleaf.cmake_prefix_path: no #: comment above its assignment"


def test_every_public_name_is_checked():
    """A name added to __all__ must be covered above (or added here)."""
    covered = {n for n, _ in _public_callables()} | {"LeafFunction", "LeafFunctionError", "config",
                                                      "cmake_prefix_path"}
    assert set(torchleaf.__all__) <= covered, sorted(set(torchleaf.__all__) - covered)

"""The module map: every public module of perflab says where the course uses it, and says it right.

Each module's docstring ends with a paragraph naming the notebooks that use it, as d2l's "Defined in"
does: ``Used in: lecture 03 (data loading), lab 03, lab 10.`` (``lectures 01-08`` names a range). A
module that no notebook uses names the modules (or files) that do: ``Used by perflab.capstone and
perflab.grading.`` Both are checked against the code itself: the notebooks' code cells and the
modules' sources are parsed, and every import of a perflab module, every name taken from one and
every ``perflab.x.y`` attribute path counts. A name taken from a package counts for the module that
defines it too: ``from perflab.data import char_corpus`` uses ``perflab.data.text``.

Every public module also lists its public API in ``__all__``: names that exist, and every public
name that a notebook, a test, a tool or another module takes from it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import warnings
from collections import defaultdict
from functools import cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib"
NOT_MODULES = {"__main__", "conftest"}  # the command line, and pytest's fixtures for the doctests


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIB).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def public_modules() -> dict[str, Path]:
    """perflab's importable modules, packages included, without private ones (``_x``)."""
    modules = {}
    for path in sorted((LIB / "perflab").rglob("*.py")):
        name = _module_name(path)
        if path.stem in NOT_MODULES or any(part.startswith("_") for part in name.split(".")):
            continue
        modules[name] = path
    return modules


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _deprecated(path: Path) -> bool:
    """A shim left at an old module path for one release: it re-exports, and no chapter should use it."""
    return _docstring(path).startswith("Deprecated")


@cache
def chapters() -> dict[str, Path]:
    """``"lecture 03"`` or ``"lab 03"`` -> its notebook (a lab's source, in solutions/)."""
    found = {f"lecture {path.name[:2]}": path for path in sorted((ROOT / "lectures").glob("[0-9][0-9]_*.ipynb"))}
    for path in sorted((ROOT / "solutions").glob("lab[0-9][0-9]_*/lab[0-9][0-9]_*.ipynb")):
        found[f"lab {path.name[3:5]}"] = path
    return found


def _topic(chapter: str) -> str:
    """``lectures/03_data_loading.ipynb`` -> ``"data loading"``."""
    return chapters()[chapter].stem[3:].replace("_", " ")


def _as_python(source: str) -> str:
    """A code cell as plain Python: a cell magic's line dropped (``%%writefile`` keeps its body, a script),
    line magics and shell lines made ``pass``."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        lines = lines[1:]
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in lines)


def _notebook_trees(path: Path) -> list[ast.AST]:
    trees = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            try:
                trees.append(ast.parse(_as_python(cell.source)))
            except SyntaxError as error:
                raise AssertionError(f"{path.relative_to(ROOT)}, code cell {index}: cannot parse: {error}") from None
    return trees


def _is_module(name: str) -> bool:
    return name in public_modules() or (name.startswith("perflab.") and (LIB / f"{name.replace('.', '/')}.py").exists())


def _defining_module(module: str, name: str) -> str | None:
    """Where a function or class taken from ``module`` is defined, when that is another perflab module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        value = getattr(importlib.import_module(module), name, None)
    if inspect.isclass(value) or inspect.isfunction(value):
        defined_in = value.__module__
        if defined_in != module and _is_module(defined_in):
            return defined_in
    return None


class Uses:
    """The perflab modules a piece of code uses, and the names it takes from each.

    ``imported``: names taken with ``from perflab.x import name``; ``read``: names read as
    ``perflab.x.name`` (a test may read or patch a module's internals that way, a notebook uses them).
    """

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.imported: dict[str, set[str]] = defaultdict(set)
        self.read: dict[str, set[str]] = defaultdict(set)
        self.aliases: dict[str, str] = {}  # local name -> the perflab module it is bound to, across a notebook's cells

    def take(self, module: str, name: str, *, imported: bool) -> str | None:
        """``name`` taken from ``module``; returns the submodule it is, if it is one."""
        self.modules.add(module)
        if _is_module(f"{module}.{name}"):
            self.modules.add(f"{module}.{name}")
            return f"{module}.{name}"
        (self.imported if imported else self.read)[module].add(name)
        defined_in = _defining_module(module, name)
        if defined_in:
            self.modules.add(defined_in)
        return None

    def add(self, tree: ast.AST) -> None:
        aliases = self.aliases
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "perflab":
                        parts = alias.name.split(".")
                        self.modules.update(".".join(parts[: i + 1]) for i in range(len(parts)))
                        aliases[alias.asname or "perflab"] = alias.name if alias.asname else "perflab"
            elif (
                isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "perflab"
            ):
                for alias in node.names:
                    if alias.name == "*":
                        self.modules.add(node.module)
                        continue
                    submodule = self.take(node.module, alias.name, imported=True)
                    if submodule:
                        aliases[alias.asname or alias.name] = submodule
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            path, base = [], node
            while isinstance(base, ast.Attribute):
                path.append(base.attr)
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in aliases):
                continue
            module = aliases[base.id]
            for attribute in reversed(path):
                submodule = self.take(module, attribute, imported=False)
                if submodule is None:
                    break
                module = submodule


@cache
def chapter_uses() -> dict[str, Uses]:
    found = {}
    for chapter, path in chapters().items():
        uses = Uses()
        for tree in _notebook_trees(path):
            uses.add(tree)
        found[chapter] = uses
    return found


@cache
def file_uses(path: Path) -> Uses:
    uses = Uses()
    uses.add(ast.parse(path.read_text()))
    return uses


def _python_files() -> list[Path]:
    """Every Python file of the repository that may take names from perflab."""
    files = [*(LIB / "perflab").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "tools").glob("*.py")]
    return sorted([*files, *ROOT.glob("*.py")])


def used_in(module: str) -> set[str]:
    """The chapters whose notebooks use ``module``."""
    return {chapter for chapter, uses in chapter_uses().items() if module in uses.modules}


def _map_paragraph(module: str) -> str:
    """The docstring's last paragraph, on one line."""
    paragraphs = [p for p in re.split(r"\n\s*\n", _docstring(public_modules()[module])) if p.strip()]
    return " ".join(paragraphs[-1].split()) if paragraphs else ""


# "lecture 03 (data loading)", "lab 10", "lectures 01-08", "labs 01, 02 and 04-06": a kind, then numbers or
# ranges of numbers, each lecture number optionally followed by its topic in parentheses.
_CHAPTER_TOKEN = re.compile(r"\((?P<topic>[^)]*)\)|\b(?P<kind>lecture|lab)s?\b|\b(?P<first>\d\d)(?:-(?P<last>\d\d))?\b")


def _named_chapters(text: str) -> set[str]:
    named, kind, previous = set(), None, None
    for token in _CHAPTER_TOKEN.finditer(text):
        if token["kind"]:
            kind, previous = token["kind"], None
        elif token["first"]:
            assert kind, f"{token[0]} follows no 'lecture' or 'lab' in {text!r}"
            numbers = range(int(token["first"]), int(token["last"] or token["first"]) + 1)
            previous = [f"{kind} {number:02d}" for number in numbers]
            for chapter in previous:
                assert chapter in chapters(), f"{chapter} is named, but there is no such notebook"
            named.update(previous)
        elif previous:
            assert len(previous) == 1 and previous[0].startswith("lecture"), f"({token['topic']}) after {previous}"
            assert token["topic"] == _topic(previous[0]), f"{previous[0]} is about {_topic(previous[0])!r}"
    return named


def _user_sources(user: str) -> list[Path]:
    """The files of a "Used by" entry: a module, every module of a package, or a file of the repository."""
    if user.endswith(".py"):
        return [ROOT / user]
    modules = [path for name, path in public_modules().items() if name == user or name.startswith(f"{user}.")]
    main = LIB / "perflab" / "__main__.py"
    return modules + ([main] if user == "perflab.__main__" else [])


def _mentions(path: Path, module: str) -> bool:
    """``path`` imports ``module``, or names it in a string: a process it starts with ``-m module``."""
    tree = ast.parse(path.read_text())
    if module in file_uses(path).modules:
        return True
    return any(isinstance(node, ast.Constant) and node.value == module for node in ast.walk(tree))


MAPPED = sorted(name for name, path in public_modules().items() if not _deprecated(path))


def test_every_chapter_is_found_and_parsed():
    assert {c.split()[0] for c in chapters()} == {"lecture", "lab"}
    assert all(uses.modules for uses in chapter_uses().values())


@pytest.mark.parametrize("module", MAPPED)
def test_the_docstring_says_where_the_course_uses_the_module(module):
    line = _map_paragraph(module)
    chapters_using = used_in(module)
    if chapters_using:
        assert line.startswith("Used in: ") and line.endswith("."), (
            f"{module} is used in {', '.join(sorted(chapters_using))}: its docstring should end with "
            f"'Used in: ...', not {line!r}"
        )
        named = _named_chapters(line)
        assert named - chapters_using == set(), f"{module}'s docstring names chapters that do not use it"
        assert chapters_using - named == set(), f"{module} is used in chapters its docstring does not name"
    else:
        assert line.startswith("Used by ") and line.endswith("."), (
            f"no notebook uses {module}: its docstring should end with 'Used by perflab.x ...', not {line!r}"
        )
        users = re.findall(r"perflab(?:\.\w+)+|[\w/]+\.py\b", line.removeprefix("Used by "))
        assert users, f"{module}: 'Used by' names no module or file"
        for user in users:
            sources = _user_sources(user)
            assert sources and all(path.exists() for path in sources), f"{module}: no module or file {user}"
            assert any(_mentions(path, module) for path in sources if path != public_modules()[module]), (
                f"{module}'s docstring says {user} uses it, but {user} does not import it"
            )


def _import(module: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the deprecated shims warn on import
        return importlib.import_module(module)


@pytest.mark.parametrize("module", sorted(public_modules()))
def test_all_lists_names_that_exist(module):
    imported = _import(module)
    names = getattr(imported, "__all__", None)
    assert isinstance(names, list) and names, f"{module} has no __all__"
    assert len(set(names)) == len(names), f"{module}.__all__ lists a name twice"
    assert [name for name in names if name.startswith("_")] == []
    assert [name for name in names if not hasattr(imported, name)] == [], f"{module}.__all__ names what it lacks"


def _deprecated_name(module, name: str) -> bool:
    """A name kept for one release under its old spelling: importable, but not part of the API."""
    return (getattr(getattr(module, name, None), "__doc__", None) or "").startswith("Deprecated")


@pytest.mark.parametrize("module", sorted(public_modules()))
def test_all_lists_every_public_name_taken_from_the_module(module):
    imported = _import(module)
    listed = set(getattr(imported, "__all__", ()))
    takers = defaultdict(list)
    # Imports anywhere; names read off the module in notebooks, where learners use them (tests may patch internals).
    taken = {str(path.relative_to(ROOT)): file_uses(path).imported for path in _python_files()}
    for chapter, uses in chapter_uses().items():
        taken[str(chapters()[chapter].relative_to(ROOT))] = {
            taken_from: uses.imported.get(taken_from, set()) | uses.read.get(taken_from, set())
            for taken_from in {*uses.imported, *uses.read}
        }
    for source, names in taken.items():
        for name in names.get(module, ()):
            if not name.startswith("_") and name not in listed and not _deprecated_name(imported, name):
                takers[name].append(source)
    assert dict(takers) == {}, f"public names taken from {module} that its __all__ leaves out"

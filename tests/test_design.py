"""DESIGN.md draws the pipeline: its stages and passes are the pass tables'."""

import pathlib
import re

from slcompile.pipeline import all_passes

DESIGN = pathlib.Path(__file__).parent.parent / "DESIGN.md"


def drawn_stages() -> dict[str, list[str]]:
    """stage -> the passes DESIGN.md's pipeline drawing lists for it, in order."""
    drawing = DESIGN.read_text().split("## The pipeline", 1)[1].split("```")[1]
    stages: dict[str, list[str]] = {}
    stage = None
    for line in drawing.splitlines():
        match = re.match(r"\s*\|\s*(?:(\w+):)?\s*(.*)", line)
        if match is None:
            stage = None
            continue
        if match.group(1):
            stage = match.group(1)
            stages[stage] = []
        if stage is not None:
            stages[stage] += [name for name in re.split(r",\s*", match.group(2).strip()) if name]
    return stages


def test_design_draws_every_stage_and_pass_in_the_tables_order():
    tables: dict[str, list[str]] = {}
    for declared in all_passes():
        tables.setdefault(declared.stage, []).append(declared.name)
    assert drawn_stages() == tables


def test_no_module_of_the_package_is_over_800_lines():
    package = DESIGN.parent / "slcompile"
    long = {str(path.relative_to(package)): count for path in package.rglob("*.py")
            if (count := len(path.read_text().splitlines())) > 800}
    assert long == {}


_CONTAINERS = {"dict", "list", "set", "deque", "defaultdict", "OrderedDict", "Counter", "count", "local",
               "WeakValueDictionary", "WeakKeyDictionary", "WeakIdKeyDictionary", "WeakSet"}


def _process_state(source: str) -> set[str]:
    """The module-level names of a module's source bound to a mutable container, or
    rebound by a function (`global`)."""
    import ast

    tree = ast.parse(source)
    names = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).rsplit(".", 1)[-1] in _CONTAINERS)
        names |= {target.id for target in targets if mutable and isinstance(target, ast.Name)
                  and target.id != "__all__"}
    return names


def _listed_state() -> dict[str, set[str]]:
    """module path -> the names DESIGN.md's "Process-wide state" lists for it."""
    section = DESIGN.read_text().split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    for item in re.split(r"\n- ", section)[1:]:
        match = re.match(r"([\w/]+\.py): (.+?) —", " ".join(item.split()))
        assert match, f"not a `module.py: NAMES — why` item: {item!r}"
        listed[match.group(1)] = set(re.split(r",\s*", match.group(2)))
    return listed


def test_process_wide_state_is_the_listed_state():
    import importlib

    package = DESIGN.parent / "slcompile"
    listed = _listed_state()
    unlisted = {str(path.relative_to(package)): names - listed.get(str(path.relative_to(package)), set())
                for path in sorted(package.rglob("*.py")) if (names := _process_state(path.read_text()))}
    assert {module: names for module, names in unlisted.items() if names} == {}
    # ... and what is listed is there (objects of the package's own classes among them).
    for module, names in listed.items():
        found = importlib.import_module("slcompile." + module[:-3].replace("/", "."))
        assert {name for name in names if not hasattr(found, name)} == set(), module


def test_process_state_scan_sees_containers_and_globals():
    source = ("import itertools\nTABLE = frozenset({1})\nCACHE = {}\nN = itertools.count()\nX = None\n"
              "def f():\n    global X\n    X = 1\n")
    assert _process_state(source) == {"CACHE", "N", "X"}

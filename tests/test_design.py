"""DESIGN.md draws the pipeline: its stages and passes are the pass tables'; the
layering it draws holds in the package's imports: no circle, no arrow back up."""

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


def _package_imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at its top or inside a function
    (`slcompile.runtime.weights`; a package is its `__init__`)."""
    import ast

    package = DESIGN.parent / "slcompile"

    def name_of(path: pathlib.Path) -> str:
        parts = path.relative_to(package.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name_of(path): path for path in package.rglob("*.py")}
    imports: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
                    parent = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                    base = f"{parent}.{base}" if base else parent
                # `from slcompile.runtime import ops` imports the module `ops`.
                found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                             for alias in node.names)
        imports[module] = {name for name in found if name in paths and name != module}
    return imports


def test_no_module_imports_the_private_names_of_another_folder():
    """A name with a leading underscore is its folder's own: a module of another
    folder of the package (or of its top) that needs it gets it under a public name."""
    import ast

    package = DESIGN.parent / "slcompile"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("slcompile")):
                continue
            target = package.parent.joinpath(*node.module.split("."))
            folder = target if target.is_dir() else target.parent
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private and folder != path.parent:
                found.append(f"{path.relative_to(package)}: from {node.module} import {', '.join(private)}")
    assert found == []


def _room(module: str) -> str:
    """The folder of the package a module is in, or the module itself at its top:
    `slcompile.runtime.weights` -> "runtime", `slcompile.config` -> "config"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _circles(arrows: set[tuple[str, str]]) -> list[list[str]]:
    import networkx

    graph = networkx.DiGraph(sorted(arrows))
    return sorted(sorted(circle) for circle in networkx.strongly_connected_components(graph) if len(circle) > 1)


def test_no_module_imports_itself_back_through_others():
    arrows = {(module, imported) for module, found in _package_imports().items() for imported in found}
    assert _circles(arrows) == []


def test_the_rooms_imports_run_one_way():
    """A folder of the package, or a module at its top, never imports one that imports
    it back, through any of their modules (the layering DESIGN.md draws, read from
    the code): such an arrow runs back up the layers."""
    imports = _package_imports()
    arrows = {(module, imported) for module, found in imports.items() for imported in found
              if _room(module) != _room(imported)}
    circles = _circles({(_room(module), _room(imported)) for module, imported in arrows})
    assert {" <-> ".join(circle): sorted(f"{module} -> {imported}" for module, imported in arrows
                                         if _room(module) in circle and _room(imported) in circle)
            for circle in circles} == {}


# (room, room it never imports, why); rooms as `_room` names them.
_NEVER = (
    *((stage, "viz", "the pass manager draws its dumps with what the backend hands it (backends/dumps.py)")
      for stage in ("passes", "analysis", "schedules", "pipeline", "plans", "config", "vocabulary")),
    ("schedules", "passes", "a policy reads the block graph from analysis/blocks.py"),
    *(("runtime", room, "what compiling reads of the runtime is made above it (facts.py)")
      for room in ("config", "facts", "passes", "schedules", "pipeline", "backends")),
)


def test_the_layers_never_import_what_sits_above_them():
    imports = _package_imports()
    found = [f"{module} -> {imported}: {why}" for below, above, why in _NEVER
             for module, imported_modules in imports.items() if _room(module) == below
             for imported in imported_modules if _room(imported) == above]
    assert found == []


def test_the_import_scan_sees_lazy_and_package_imports():
    imports = _package_imports()
    assert "slcompile.runtime.weights" in imports["slcompile.runtime.gathering"]
    assert "slcompile.schedules.policies" in imports["slcompile.config"]  # inside a function
    assert "slcompile.defaults" in imports["slcompile.hf"]  # `from slcompile import defaults`


# Classes of the package that may take a base class of the package that is not an
# exception: `_ReleasedTensor` (and each `Released...` class `_released_class` makes)
# takes `_ReleasedMixin` because torch dispatches on a tensor's own class, so a
# released parameter's `__torch_function__` can only come from its class's bases
# (held in another object it would not be called), and the parameter must stay an
# instance of its own class (`nn.Parameter`, a user's subclass); the mixin reads no
# attribute of its host, only the module's registry.
_BASES_ALLOWED = {("runtime/weights.py", "_ReleasedTensor", "runtime/weights.py", "_ReleasedMixin")}


def _package_bases() -> set[tuple[str, str, str, str]]:
    """(module, class, base's module, base) for each base class defined in the package
    of a class of the package, read with `ast`; modules as paths in the package."""
    import ast

    package = DESIGN.parent / "slcompile"
    trees = {str(path.relative_to(package)): ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}

    def path_of(dotted: str) -> str | None:
        parts = dotted.split(".")[1:]
        for path in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
            if path in trees:
                return path
        return None

    def bound(module: str) -> dict[str, tuple[str, str | None]]:
        """Name -> (module, name in it) for what the module imports from the package,
        (module, None) for a module imported whole."""
        names = {}
        for node in ast.walk(trees[module]):
            if isinstance(node, ast.ImportFrom):
                parent = module.rsplit("/", 1)[0].replace("/", ".") if "/" in module else ""
                for _ in range(node.level - 1):
                    parent = parent.rsplit(".", 1)[0] if "." in parent else ""
                base = node.module or ""
                if node.level:
                    base = ".".join(p for p in ("slcompile", parent, base) if p)
                if not base.startswith("slcompile"):
                    continue
                for alias in node.names:
                    whole = path_of(f"{base}.{alias.name}")
                    target = (whole, None) if whole else (path_of(base), alias.name)
                    if target[0] is not None:
                        names[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("slcompile") and alias.asname and path_of(alias.name):
                        names[alias.asname] = (path_of(alias.name), None)
        return names

    classes = {(module, node.name) for module, tree in trees.items()
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def resolve(module: str, name: str, depth: int = 0) -> tuple[str, str] | None:
        if (module, name) in classes:
            return module, name
        target = bound(module).get(name)
        if target is None or target[1] is None or depth > 4:
            return None
        return resolve(target[0], target[1], depth + 1)

    found = set()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                base = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(base, ast.Name):
                    where = resolve(module, base.id)
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                    holder = bound(module).get(base.value.id)
                    where = resolve(holder[0], base.attr) if holder and holder[1] is None else None
                else:
                    where = None
                if where is not None:
                    found.add((module, node.name, *where))
    return found


def test_no_class_of_the_package_takes_its_methods_from_another_class_of_it():
    """Composition, not mixins: a class of the package inherits from another of the
    package only as an exception (its errors' hierarchy), or as listed above."""
    import importlib

    def is_exception(module: str, name: str) -> bool:
        found = importlib.import_module("slcompile." + module.removesuffix(".py").removesuffix("/__init__")
                                        .replace("/", "."))
        return isinstance(getattr(found, name), type) and issubclass(getattr(found, name), Exception)

    bases = _package_bases()
    mixed = sorted(f"{module}: {name}({base_module}: {base})" for module, name, base_module, base in bases
                   if (module, name, base_module, base) not in _BASES_ALLOWED and not is_exception(base_module, base))
    assert mixed == []
    # ... and the scan sees both kinds: the exceptions, and what is allowed.
    assert ("runtime/errors.py", "DiskFullError", "errors.py", "OffloadError") in bases
    assert _BASES_ALLOWED <= bases


def test_no_class_of_the_package_is_over_600_lines():
    """A class is one responsibility a reader holds at once: none is over 600 lines
    (with the classes it inherits from the package, which the test above limits)."""
    import ast

    package = DESIGN.parent / "slcompile"
    lengths = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lengths[f"{path.relative_to(package)}: {node.name}"] = node.end_lineno - node.lineno + 1
    inherited = {f"{module}: {name}": lengths[f"{base_module}: {base}"] for module, name, base_module, base
                 in _package_bases() if f"{base_module}: {base}" in lengths}
    long = {name: total for name, length in lengths.items()
            if (total := length + inherited.get(name, 0)) > 600}
    assert long == {}
    assert lengths["optim/optimizer.py: OffloadedOptimizer"] > 300  # the scan sees the classes

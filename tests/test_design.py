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

"""The pictures in the pass dumps: each dumped graph drawn as DOT.

The pass manager (`slcompile.passes.manager`) writes a dump's text itself and draws
its graphs with the function its settings hold, since compiling's stages do not
import the pictures (`slcompile.viz`). What runs the passes (the backend, `explain`,
`tune`) runs them inside `drawing_dumps()`, which hands it `draw_graph`; the
directory and the passes disabled stay the enclosing scope's (by default
`SLC_DUMP_DIR` and `SLC_DISABLE`).
"""

from __future__ import annotations

import contextlib

import torch.fx

from slcompile.passes.manager import PassSettings, pass_settings

__all__ = ["draw_graph", "drawing_dumps"]


def draw_graph(gm: torch.fx.GraphModule, title: str) -> str:
    """`gm` as DOT source, its detail chosen by its size (`slcompile.viz.dot.graph_to_dot`)."""
    from slcompile.viz.dot import graph_to_dot  # graphviz is imported once a dump is drawn

    return graph_to_dot(gm, title=title, detail="auto")


def drawing_dumps() -> contextlib.AbstractContextManager[PassSettings]:
    """A `pass_settings` scope in which the dumps draw their graphs (`draw_graph`);
    usable as a decorator too."""
    return pass_settings(draw=draw_graph)

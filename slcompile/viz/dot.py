"""An FX graph as Graphviz DOT, nodes grouped by block and sub-batch.

Uses the `graphviz` package to write the DOT source (no `dot` program needed to write
it; rendering to SVG/PNG needs the program).
"""

from __future__ import annotations

import collections

import graphviz
import torch.fx

from slcompile.meta import get_slc_meta

__all__ = ["graph_to_dot"]

_ROLE_COLORS = {"split": "lightblue", "combine": "lightsalmon"}


def graph_to_dot(gm: torch.fx.GraphModule, title: str = "graph") -> str:
    """DOT source for `gm`: one cluster per block/sub-batch tag, inserted nodes filled."""
    dot = graphviz.Digraph(name=title, graph_attr={"rankdir": "TB", "label": title}, node_attr={"shape": "box", "fontsize": "10"})
    clusters: dict[str, list[torch.fx.Node]] = collections.defaultdict(list)
    for node in gm.graph.nodes:
        meta = get_slc_meta(node)
        clusters[meta.tag if meta is not None else ""].append(node)
    for tag, nodes in clusters.items():
        target = dot
        if tag:
            with dot.subgraph(name=f"cluster_{tag}", graph_attr={"label": tag}) as sub:
                for node in nodes:
                    _add_node(sub, node)
            continue
        for node in nodes:
            _add_node(target, node)
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            dot.edge(inp.name, node.name)
    return dot.source


def _add_node(dot, node: torch.fx.Node) -> None:
    meta = get_slc_meta(node)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    attrs = {"label": f"{node.name}\\n{node.op}: {target}"}
    if meta is not None and meta.role in _ROLE_COLORS:
        attrs.update(style="filled", fillcolor=_ROLE_COLORS[meta.role])
    dot.node(node.name, **attrs)

"""An FX graph as Graphviz DOT: nodes grouped by block and sub-batch, inserted nodes
highlighted.

Where it sits: the per-pass dumps (`SLC_DUMP_DIR`) draw the rewritten Dynamo graph
after each pass; the CLI draws the AOTAutograd forward and backward graphs of a
`CompileReport` (`report.graphs`), the graphs that are compiled.

Needs: nodes tagged with `SlcMeta`; roles come from `viz.roles.classify_nodes`.
Guarantees:
- One cluster per block (`blk3`, holding the work its sub-batches share: weight
  fetches, gradient sums) with one nested cluster per sub-batch (`blk3.sb1`); prefix
  and suffix likewise. Clusters appear in program order, which is the schedule's:
  a block's sub-batch clusters are written in the order they run, each starts a
  rank after the one run before it (an invisible edge between their first nodes:
  left to right in "summary", top to bottom in "ops", a staircase that dot does not
  reorder), and each is labelled with its turn (`sb1 · runs 1/2`), so two schedules
  that order sub-batches differently draw differently.
- Every transfer node is labelled with the bytes its transfer moves
  (`viz.roles.transfer_bytes`: the stored or loaded tensor, not the token that the
  issue or wait node returns); a summary box adds up those of its members.
- Inserted nodes are filled by role (split, combine, load, store, wait, free); the
  legend under the title says which colour is which.
- Transfer nodes are outlined in the colour of the stream they run on
  (`passes.annotate_streams`: `STREAM_COLORS`, issue and wait alike; a summary box
  takes its members' stream); an "ops" node names it in its tooltip. The legend
  lists the streams drawn. Nodes without a stream run on the default (compute) stream.
- Two levels of detail. "ops": one DOT node per graph node (top to bottom); graph
  inputs that belong to no block (parameters), the output and region markers are
  left out, they would draw an edge from or to everything. "summary" (left to
  right): one node per (block, sub-batch) cluster saying how many ops it runs and
  which, and one node per kind of inserted node in a cluster (`load ×12`); a cluster
  whose work runs in two separate stretches that depend on each other gets one node
  per stretch ("part 1/2"), so the picture stays acyclic. The names of the graph
  nodes a summary node stands for are in its `tooltip`. "auto" picks "summary" above
  `AUTO_SUMMARY_NODES` drawn nodes, where "ops" stops being readable (and `dot`
  takes minutes to lay it out).
- Writing DOT needs only the `graphviz` package; `render` also writes SVG/PNG when
  the Graphviz `dot` program is installed, and says so when it is not.
"""

from __future__ import annotations

import collections
import html
import logging
import pathlib
import re
import shutil
import subprocess
from collections.abc import Sequence
from types import MappingProxyType

import graphviz
import torch
import torch.fx

from slcompile.meta import parse_tag
from slcompile.passes.annotate_streams import COMM, COPY, STREAMS, transfer_stream
from slcompile.viz.roles import (
    INSERTED_ROLES,
    NodeRole,
    classify_nodes,
    cluster_parent,
    fetched_weight_bytes,
    format_bytes,
    short_key,
    short_op_name,
    transfer_bytes,
)
from slcompile.vocabulary import is_stash, is_stash_wait, is_unstash, is_unstash_wait, stash_key_of

__all__ = [
    "graph_to_dot",
    "graph_digraph",
    "render",
    "dot_available",
    "ROLE_COLORS",
    "STREAM_COLORS",
    "AUTO_SUMMARY_NODES",
    "RENDER_TIMEOUT",
    "DETAILS",
]

log = logging.getLogger(__name__)

AUTO_SUMMARY_NODES = 160
RENDER_TIMEOUT = 120.0
DETAILS = ("auto", "ops", "summary")

ROLE_COLORS = MappingProxyType({
    "split": "#9ecae1",
    "combine": "#fdae6b",
    "load": "#ffe45c",
    "store": "#c994c7",
    "wait": "#d9d9d9",
    "free": "#f0f0f0",
})
# The outline of a transfer node, by the stream it runs on.
STREAM_COLORS = MappingProxyType({COPY: "#c51b7d", COMM: "#01665e"})
_STREAM_PEN = "2.5"
# An invisible edge that ranks a node with no drawn inputs (a block's weight fetches)
# after the work that runs before it, instead of at the top beside the first block.
_ANCHOR = MappingProxyType({"style": "invis"})
_SUBBATCH_COLORS = ("#3182bd", "#31a354", "#e6550d", "#756bb1", "#636363", "#d6616b", "#8c6d31", "#17becf")
_REGION_FILL = MappingProxyType({"prefix": "#eef5ee", "suffix": "#eef5ee", "block": "#f3f3f3"})
# Ops that only rename or pick a value; summaries count them apart from real work.
_BOOKKEEPING = frozenset({"getitem", "view", "unsafe_view", "reshape", "t", "transpose", "permute", "expand",
                           "detach", "alias", "squeeze", "unsqueeze", "clone", "split", "slice"})
_ABBREVIATIONS = (("scaled_dot_product_flash_attention_for_cpu", "sdpa"),
                  ("scaled_dot_product_flash_attention", "sdpa"),
                  ("scaled_dot_product_efficient_attention", "sdpa"),
                  ("scaled_dot_product", "sdpa"),
                  ("native_layer_norm", "layer_norm"))


def graph_to_dot(
    gm: torch.fx.GraphModule, title: str = "graph", detail: str = "ops", block_paths: Sequence[str] = ()
) -> str:
    """DOT source of `gm`; see `graph_digraph`."""
    return graph_digraph(gm, title, detail, block_paths).source


def graph_digraph(
    gm: torch.fx.GraphModule, title: str = "graph", detail: str = "ops", block_paths: Sequence[str] = ()
) -> graphviz.Digraph:
    """`gm` as a `graphviz.Digraph`, clustered by block and sub-batch.

    Args:
        gm: a tagged graph (Dynamo graph after a pass, or an AOTAutograd graph).
        title: the picture's title.
        detail: "ops", "summary" or "auto" (see the module docstring).
        block_paths: the module path of each block, by block index, for cluster labels.

    Returns:
        the digraph; `.source` is the DOT text.
    """
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {', '.join(DETAILS)}, got {detail!r}")
    roles = classify_nodes(gm)
    nodes = [n for n in gm.graph.nodes if roles[n.name].role != "marker"]
    if detail == "auto":
        detail = "summary" if len(nodes) > AUTO_SUMMARY_NODES else "ops"
    builder = _Builder(title, roles, block_paths, streams={transfer_stream(n) for n in nodes} - {None},
                       weight_bytes=fetched_weight_bytes(gm))
    if detail == "ops":
        builder.add_ops(nodes)
    else:
        builder.add_summary(nodes)
    return builder.finish(detail, len(nodes))


def dot_available() -> bool:
    """True when the Graphviz `dot` program is on the PATH."""
    return shutil.which("dot") is not None


def render(
    source: str | graphviz.Digraph,
    stem: str | pathlib.Path,
    formats: Sequence[str] = ("svg", "png"),
    timeout: float = RENDER_TIMEOUT,
) -> list[pathlib.Path]:
    """Writes `stem.dot`, and `stem.<format>` for each format when `dot` is installed.

    Args:
        source: DOT text or a digraph.
        stem: the path without suffix (`out/forward`).
        formats: Graphviz output formats.
        timeout: seconds `dot` may take per format; a layout that takes longer (an
            "ops" picture of thousands of nodes) is abandoned with a warning.

    Returns:
        the paths written, the .dot file first.
    """
    stem = pathlib.Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    text = source.source if isinstance(source, graphviz.Digraph) else source
    dot_path = stem.with_suffix(".dot")
    dot_path.write_text(text)
    written = [dot_path]
    program = shutil.which("dot")
    if program is None:
        log.warning("Graphviz `dot` is not installed: wrote %s only (apt-get install graphviz to render)", dot_path)
        return written
    for fmt in formats:
        out = stem.with_suffix(f".{fmt}")
        try:
            subprocess.run([program, f"-T{fmt}", "-o", str(out), str(dot_path)], check=True, timeout=timeout,
                           capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            log.warning("dot took more than %.0f s to lay out %s; use the summary detail for big graphs", timeout, dot_path)
            out.unlink(missing_ok=True)
            break
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"dot could not render {dot_path}: {err.stderr.strip()}") from err
        written.append(out)
    return written


class _Builder:
    """Collects nodes per cluster, then nests the clusters and writes the digraph."""

    def __init__(self, title: str, roles: dict[str, NodeRole], block_paths: Sequence[str], streams=frozenset(),
                 weight_bytes: dict[str, int] | None = None):
        self.title = title
        self.roles = roles
        self.block_paths = tuple(block_paths)
        self.members: dict[str | None, list[tuple[str, dict]]] = collections.defaultdict(list)
        self.edges: list[tuple[str, str, dict]] = []
        self.cluster_order: list[str] = []
        self.saved_inputs: dict[str | None, int] = collections.Counter()
        self.streams = streams  # the streams of the transfers drawn
        self.weight_bytes = weight_bytes or {}  # stored weight key -> bytes, for loads issued ahead

    # -- nodes ---------------------------------------------------------------
    def _place(self, cluster: str | None, node_id: str, attrs: dict, orders: bool = True) -> None:
        """Puts a DOT node in `cluster`; `orders`: the cluster is drawn in the order of
        its first such node (saved inputs come first in a graph but run nowhere)."""
        if cluster is not None and orders:
            for tag in filter(None, (cluster_parent(cluster), cluster)):
                if tag not in self.cluster_order:
                    self.cluster_order.append(tag)
        self.members[cluster].append((node_id, attrs))

    def add_ops(self, nodes: list[torch.fx.Node]) -> None:
        # Parameters and the output would each draw an edge from or to everything.
        nodes = [n for n in nodes if n.op != "output" and not (n.op == "placeholder" and self.roles[n.name].cluster is None)]
        drawn = {n.name for n in nodes}
        for node in nodes:
            role = self.roles[node.name]
            self._place(role.cluster, node.name, _op_attrs(node, role, self.weight_bytes), orders=node.op != "placeholder")
        previous = None
        for node in nodes:
            anchored = False
            for source in node.all_input_nodes:
                if source.name in drawn:
                    self.edges.append((source.name, node.name, {}))
                    anchored = anchored or source.op != "placeholder"
            if node.op == "call_function":
                if not anchored and previous is not None:
                    self.edges.append((previous.name, node.name, _ANCHOR))
                previous = node

    def add_summary(self, nodes: list[torch.fx.Node]) -> None:
        group_of = self._summary_groups(nodes)
        groups: dict[tuple, list[torch.fx.Node]] = {}
        for node in nodes:
            if node.name in group_of:
                groups.setdefault(group_of[node.name], []).append(node)
        visits = collections.Counter(key[:3] for key in groups)
        ids = {key: _summary_id(key) for key in groups}
        position = {node.name: i for i, node in enumerate(nodes)}
        order = sorted(groups, key=lambda key: position[groups[key][0].name])
        for key in order:
            self._place(key[0], ids[key], self._summary_attrs(key, groups[key], visits[key[:3]]))
        seen = set()
        for node in nodes:
            if node.name not in group_of:
                continue
            for source in node.all_input_nodes:
                if source.name in group_of and group_of[source.name] != group_of[node.name]:
                    edge = (ids[group_of[source.name]], ids[group_of[node.name]])
                    if edge not in seen:
                        seen.add(edge)
                        self.edges.append((*edge, {}))
        has_input = {target for _, target in seen}
        has_output = {source for source, _ in seen}
        for before, key in zip(order, order[1:]):
            if ids[key] not in has_input:
                self.edges.append((ids[before], ids[key], _ANCHOR))
        # A block's last work (its gradient sums feed only the graph's output) ranks
        # before the next region starts, so region clusters never overlap and the
        # picture does not fall into a staircase.
        first_of: dict[str, tuple] = {}
        sinks: dict[str, list[tuple]] = collections.defaultdict(list)
        for key in order:
            first_of.setdefault(_region_head(key[0]), key)
            if ids[key] not in has_output:
                sinks[_region_head(key[0])].append(key)
        regions = list(first_of)
        for here, after in zip(regions, regions[1:]):
            for sink in sinks[here]:
                self.edges.append((ids[sink], ids[first_of[after]], _ANCHOR))

    def _summary_groups(self, nodes: list[torch.fx.Node]) -> dict[str, tuple]:
        """Node name -> its summary group: (cluster, role, op, part).

        Compute nodes group by cluster, inserted nodes by (cluster, role, op). A node
        starts a new part of its group only when joining the current part would make
        the collapsed picture cyclic: when one of its inputs comes from a group that
        itself depends on that part (the backward's suffix runs shared work before
        and after its sub-batches).
        """
        group_of: dict[str, tuple] = {}
        part: dict[tuple, int] = collections.Counter()
        inputs_of: dict[tuple, set[tuple]] = collections.defaultdict(set)
        for node in nodes:
            role = self.roles[node.name]
            if node.op == "output" or (role.role == "input" and role.cluster is None):
                continue  # parameters and outputs: an edge from or to everything
            if role.role == "input":  # a saved value: counted with its cluster, drawn nowhere
                self.saved_inputs[role.cluster] += 1
                continue
            if role.role in INSERTED_ROLES:
                base = (role.cluster, role.role, _spill_label(node) or short_op_name(node))
            else:
                base = (role.cluster, "compute", "")
            sources = {group_of[i.name] for i in node.all_input_nodes if i.name in group_of}
            group = (*base, part[base])
            if _reaches(sources - {group}, group, inputs_of):
                part[base] += 1
                group = (*base, part[base])
            inputs_of[group] |= sources - {group}
            group_of[node.name] = group
        return group_of

    def _summary_attrs(self, key: tuple, members: list[torch.fx.Node], visits: int) -> dict:
        cluster, role, op, visit = key
        names = " ".join(n.name for n in members)
        if role == "compute":
            counts = collections.Counter(_abbreviate(short_op_name(n)) for n in members if n.op == "call_function")
            work = [(name, c) for name, c in counts.most_common() if name not in _BOOKKEEPING]
            ops_line = " · ".join(f"{c} {name}" for name, c in work[:3]) + (" · …" if len(work) > 3 else "")
            saved = self.saved_inputs[cluster] if visit == 0 else 0
            total = sum(counts.values())
            head = f"{total} op{'s' * (total != 1)}" + (f", reads {saved} saved" if saved else "")
            if visits > 1:
                head = f"part {visit + 1}/{visits}: {head}"
            label = "\n".join(filter(None, (head, ops_line)))
            return {"label": label, "tooltip": names, "shape": "box", "style": "rounded"}
        total = sum(transfer_bytes(n, self.weight_bytes) for n in members)
        label = f"{role} ×{len(members)}\n{op}" + (f"\n{format_bytes(total)}" if total else "")
        attrs = {"label": label, "tooltip": names, "shape": "box", "style": "filled,rounded",
                 "fillcolor": ROLE_COLORS[role]}
        streams = {transfer_stream(n) for n in members}
        if len(streams) == 1:
            attrs.update(_stream_attrs(streams.pop()))
        return attrs

    # -- the digraph ---------------------------------------------------------
    def finish(self, detail: str, nodes: int) -> graphviz.Digraph:
        dot = graphviz.Digraph(
            name=re.sub(r"\W", "_", self.title),
            graph_attr={"rankdir": "LR" if detail == "summary" else "TB", "label": self._legend(detail, nodes), "labelloc": "t",
                        "fontname": "Helvetica", "fontsize": "14", "newrank": "true", "nodesep": "0.25",
                        "ranksep": "0.35"},
            node_attr={"shape": "box", "fontsize": "10", "fontname": "Helvetica", "height": "0.3"},
            edge_attr={"arrowsize": "0.6", "color": "#555555"},
        )
        for node_id, attrs in self.members.get(None, ()):
            dot.node(node_id, **attrs)
        for tag in self.members:
            for name in filter(None, (tag and cluster_parent(tag), tag)):
                if name not in self.cluster_order:
                    self.cluster_order.append(name)
        for tag in self.cluster_order:
            if cluster_parent(tag) is None:
                self._add_cluster(dot, tag)
        for source, target, attrs in self.edges:
            dot.edge(source, target, **attrs)
        for row in self._subbatch_rows():
            # Each sub-batch box starts a rank after the one run before it: ranks are
            # the order dot keeps; within a rank it reorders boxes to save crossings
            # (and ignores edges that would order boxes of different clusters).
            for before, after in zip(row, row[1:]):
                dot.edge(before, after, style="invis")
        return dot

    def _subbatch_rows(self) -> list[list[str]]:
        """Per region, the first node of each sub-batch cluster, in the order they run."""
        rows: dict[str, list[str]] = collections.defaultdict(list)
        for tag in self._run_order():
            members = self.members.get(tag)
            if members:
                rows[cluster_parent(tag)].append(members[0][0])
        return [row for row in rows.values() if len(row) > 1]

    def _run_order(self) -> list[str]:
        """The sub-batch clusters in the order they first run (program order)."""
        return [tag for tag in self.cluster_order if cluster_parent(tag) is not None]

    def _add_cluster(self, parent, tag: str) -> None:
        region, block, subbatch = parse_tag(tag)
        with parent.subgraph(name=f"cluster_{tag}") as sub:
            if subbatch is None:
                label = tag
                if block is not None and block < len(self.block_paths):
                    label = f"{tag}  ({self.block_paths[block]})"
                sub.attr(label=label, style="filled,rounded", fillcolor=_REGION_FILL[region], color="#999999",
                         fontsize="12", labeljust="l")
            else:
                color = _SUBBATCH_COLORS[subbatch % len(_SUBBATCH_COLORS)]
                siblings = [t for t in self._run_order() if cluster_parent(t) == cluster_parent(tag)]
                label = f"sb{subbatch}" + (f" · runs {siblings.index(tag) + 1}/{len(siblings)}" if len(siblings) > 1 else "")
                sub.attr(label=label, style="rounded,filled", fillcolor="white", color=color,
                         fontcolor=color, penwidth="1.5", fontsize="11", labeljust="l")
            for node_id, attrs in self.members.get(tag, ()):
                sub.node(node_id, **attrs)
            # Sub-batches in the order they run, so two orders draw differently.
            for child in [child for child in self.cluster_order if cluster_parent(child) == tag]:
                self._add_cluster(sub, child)

    def _legend(self, detail: str, nodes: int) -> str:
        roles_seen = collections.Counter(r.role for r in self.roles.values())
        cells = "".join(
            f'<td bgcolor="{color}" border="1"> {role} </td>'
            for role, color in ROLE_COLORS.items()
            if roles_seen[role]
        )
        hidden = sum(1 for r in self.roles.values() if r.role == "input" and r.cluster is None)
        note = (f"{nodes} nodes as {'one box per op' if detail == 'ops' else 'one box per sub-batch'}; "
                f"not drawn: {hidden} graph inputs, the output"
                + (f", {roles_seen['marker']} region markers" if roles_seen["marker"] else "")
                + (", saved inputs (counted per box)" if detail == "summary" and roles_seen["input"] > hidden else ""))
        legend = f'<tr><td border="0">inserted:</td>{cells}</tr>' if cells else ""
        streams = "".join(
            f'<td border="2" color="{STREAM_COLORS[stream]}"> {stream}: {html.escape(STREAMS[stream])} </td>'
            for stream in STREAM_COLORS if stream in self.streams
        )
        if streams:
            legend += f'<tr><td border="0">streams:</td>{streams}<td border="1"> default: compute </td></tr>'
        return (
            f'<<table border="0" cellspacing="3" cellpadding="3">'
            f'<tr><td border="0" colspan="8"><b>{html.escape(self.title)}</b></td></tr>'
            f'<tr><td border="0" colspan="8">{html.escape(note)}</td></tr>'
            f"{legend}</table>>"
        )


def _op_attrs(node: torch.fx.Node, role: NodeRole, weight_bytes: dict[str, int]) -> dict:
    if node.op == "placeholder":
        return {"label": f"{node.name}\n{_shape(node)}", "shape": "ellipse", "color": "#888888",
                "fontcolor": "#555555"}
    if node.op == "output":
        return {"label": "output", "shape": "octagon"}
    op = _abbreviate(short_op_name(node))
    spill = _spill_label(node)
    if spill is not None:
        label = f"{spill}\n{format_bytes(transfer_bytes(node, weight_bytes))}"
    elif role.role in ("load", "store", "wait", "free") and len(node.args) > 1 and isinstance(node.args[1], str):
        label = f"{op}\n{short_key(node.args[1])}\n{format_bytes(transfer_bytes(node, weight_bytes))}"
    else:
        label = f"{node.name}: {op}\n{_shape(node)}" if op != node.name else f"{node.name}\n{_shape(node)}"
    attrs = {"label": label.strip()}
    if role.role in ROLE_COLORS:
        attrs.update(style="filled", fillcolor=ROLE_COLORS[role.role])
    stream = transfer_stream(node)
    if stream in STREAM_COLORS:
        attrs.update(_stream_attrs(stream), tooltip=f"{node.name} on the {stream} stream")
    return attrs


def _spill_label(node: torch.fx.Node) -> str | None:
    """`spill of blk1.sb0 output` for the transfer nodes of a spilled boundary
    activation (`spill`, `spill wait`, `fill`, `fill wait`), else None: they are
    stash and unstash calls, whose op names would not say whose output moves."""
    parsed = stash_key_of(node)
    if parsed is None or not parsed.spills:
        return None
    step = next(step for step, calls in (("spill", is_stash), ("spill wait", is_stash_wait), ("fill", is_unstash),
                                         ("fill wait", is_unstash_wait)) if calls(node))
    owner = ".".join(parsed.name.split(".")[:2])
    return f"{step} of {owner} output"


def _stream_attrs(stream: str | None) -> dict:
    """The outline of a node on `stream` (none on the default stream)."""
    if stream not in STREAM_COLORS:
        return {}
    return {"color": STREAM_COLORS[stream], "penwidth": _STREAM_PEN}


def _shape(node: torch.fx.Node) -> str:
    value = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"[{', '.join(str(s) for s in value.shape)}] {dtype}"
    return ""


def _abbreviate(name: str) -> str:
    for long, short in _ABBREVIATIONS:
        if name.startswith(long):
            return short
    return name


def _reaches(starts: set[tuple], wanted: tuple, inputs_of: dict[tuple, set[tuple]]) -> bool:
    """True when `wanted` is among `starts` or their transitive input groups."""
    stack, seen = list(starts), set()
    while stack:
        group = stack.pop()
        if group == wanted:
            return True
        if group not in seen:
            seen.add(group)
            stack.extend(inputs_of.get(group, ()))
    return False


def _region_head(cluster: str | None) -> str:
    return (cluster or "").split(".", 1)[0]


def _summary_id(key: tuple) -> str:
    cluster, role, op, visit = key
    return re.sub(r"\W", "_", f"{role}_{op}_{cluster or 'top'}_{visit}")

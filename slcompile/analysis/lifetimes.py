"""Symbolic lifetimes of the values of a compiled (AOTAutograd) graph, and the memory
they hold at every step.

Needs a graph whose nodes carry `meta["val"]` (AOTAutograd's forward, backward and
inference graphs do); never changes it. Each tensor value gets its size in bytes as a
sympy expression of the graph's size symbols (a dynamic batch is a symbol; static
sizes are numbers), its first and last use in node order, its kind and its tier.
Generated FX code drops a value right after its last use, so node order is the order
memory is released. Views count as their base: a view costs nothing and keeps its
base alive until the view's last use.

The step's memory (peaks, per-node live bytes with prefetch and what the caller
holds) is computed from these tables in one place, `slcompile.analysis.memory`.

Kinds: "weight" (parameters, fetched weights), "activation" (intermediates),
"saved" (forward outputs kept for the backward), "input" (other graph inputs),
"gradient" (backward outputs). Graph inputs are held by the caller for the whole
call; they are reported apart (`held`), so a peak can be taken with or without them.
"""

from __future__ import annotations

import dataclasses
import fractions
import operator
from collections.abc import Iterable, Mapping

import sympy
import torch
import torch.fx

__all__ = [
    "Value", "LifetimeTable", "StepLifetimes", "analyze_lifetimes", "analyze_training_step", "tensor_bytes",
    "max_of",
]


@dataclasses.dataclass(frozen=True)
class Value:
    """One tensor value of the graph.

    Attributes:
        name: the node that makes it.
        bytes: its size, a sympy expression of the graph's size symbols.
        first_use: index of the node that makes it.
        last_use: index of the last node that reads it (or of the output node).
        kind: "weight", "activation", "saved", "input" or "gradient".
        tier: where it rests while live ("device" for everything a graph computes).
    """

    name: str
    bytes: sympy.Expr
    first_use: int
    last_use: int
    kind: str
    tier: str = "device"


def _integers(sizes: Mapping[sympy.Symbol, int] | None) -> dict[sympy.Symbol, sympy.Integer]:
    """`sizes` for `xreplace`, which substitutes every symbol at once (`subs` goes one
    symbol at a time, and a `Max` of sizes re-sorts its arguments at each)."""
    return {symbol: sympy.Integer(value) for symbol, value in (sizes or {}).items()}


@dataclasses.dataclass(frozen=True)
class LifetimeTable:
    """The result of `analyze_lifetimes`.

    Attributes:
        values: every tensor value made by the graph (views excluded).
        held: graph inputs, held by the caller for the whole call.
        resident: per node index, bytes of made values alive at that node.
        symbols: the size symbols the expressions use.
        user_output_bytes: bytes of the outputs handed to the caller (not saved for
            the backward); they stay alive after the graph returns.
    """

    values: tuple[Value, ...]
    held: tuple[Value, ...]
    resident: tuple[sympy.Expr, ...]
    symbols: tuple[sympy.Symbol, ...]
    user_output_bytes: sympy.Expr = sympy.Integer(0)

    def peak(self, sizes: Mapping[sympy.Symbol, int] | None = None, *, include_held: bool = False) -> int:
        """The largest resident bytes over the graph, for concrete sizes."""
        subs = _integers(sizes)
        peak = max((int(sympy.sympify(expr).xreplace(subs)) for expr in self.resident), default=0)
        if include_held:
            peak += sum(int(sympy.sympify(v.bytes).xreplace(subs)) for v in self.held)
        return peak

    def peak_expression(self) -> sympy.Expr:
        """The peak as one expression: the max over the distinct resident sizes."""
        return max_of(self.resident)

    def total(self, kind: str, sizes: Mapping[sympy.Symbol, int] | None = None) -> int:
        """Bytes of all values of one kind (made or held), for concrete sizes."""
        subs = _integers(sizes)
        return sum(int(sympy.sympify(v.bytes).xreplace(subs)) for v in (*self.values, *self.held) if v.kind == kind)


def max_of(exprs: Iterable[sympy.Expr]) -> sympy.Expr:
    """`sympy.Max` of byte counts, without those another one bounds. Each is a sum of
    terms, a number times a product of sizes (symbols, a sub-batch's `s // K`, pages
    rounded up), none negative: one whose every coefficient is at most another's is
    at most that one. (sympy's own comparison of hundreds of them takes minutes.)"""
    distinct = list(dict.fromkeys(exprs))
    if len(distinct) <= 1:
        return next(iter(distinct), sympy.Integer(0))
    terms = {e: _terms(e) for e in distinct}
    if any(not c.is_Rational for coefficients in terms.values() for c in coefficients.values()):
        return sympy.Max(*distinct)
    # Compared as Python numbers: sympy's comparisons cost microseconds each.
    terms = {e: {m: int(c.p) if c.q == 1 else fractions.Fraction(int(c.p), int(c.q))
                 for m, c in coefficients.items()}
             for e, coefficients in terms.items()}
    kept: list[sympy.Expr] = []
    # Largest first: a term is dropped when one already kept bounds it. (Ties keep
    # the order given; `sympy.Max` prints its arguments in its own order.)
    for expr in sorted(distinct, key=lambda e: -sum(terms[e].values())):
        mine = terms[expr]
        if not any(all(theirs.get(m, 0) >= mine.get(m, 0) for m in {*mine, *theirs})
                   for theirs in (terms[other] for other in kept)):
            kept.append(expr)
    # None of the kept terms bounds another: nothing is left for sympy to simplify.
    return sympy.Max(*kept, evaluate=False) if len(kept) > 1 else kept[0]


def _terms(expr: sympy.Expr) -> dict[sympy.Expr, sympy.Expr]:
    """`expr` as {monomial: coefficient}; expanded only where it is not already a
    sum of monomials (the byte counts made here mostly are)."""
    terms = expr.as_coefficients_dict()
    if any(term.is_Add for term in terms):
        terms = sympy.expand(expr).as_coefficients_dict()
    return dict(terms)


def tensor_bytes(value: torch.Tensor) -> sympy.Expr:
    """numel * itemsize, symbolic where the shape is."""
    size = sympy.Integer(value.element_size())
    for dim in value.shape:
        size *= dim.node.expr if isinstance(dim, torch.SymInt) else sympy.Integer(int(dim))
    return sympy.expand(size)


def analyze_lifetimes(
    gm: torch.fx.GraphModule,
    graph_kind: str,
    num_saved: int = 0,
    weight_inputs: frozenset[int] = frozenset(),
    inputs_freed: bool | None = None,
    input_buffers: Mapping[str, tuple[str, sympy.Expr] | None] | None = None,
    output_order: list | None = None,
    load_granularity: int = 1,
    load_overhead: int = 0,
) -> LifetimeTable:
    """Lifetimes of `gm`'s values.

    Args:
        gm: an AOTAutograd graph.
        graph_kind: "forward", "backward" or "inference".
        num_saved: for a forward graph, how many of its last outputs are saved for
            the backward (the rest are user outputs).
        weight_inputs: positions of the graph inputs that are parameters.
        inputs_freed: whether the graph drops its inputs at their last use (the
            backward does: AOTAutograd hands it the saved tensors in a list it
            clears); default: only for the backward.
        input_buffers: placeholder name -> (buffer name, bytes) of the memory it
            views, or None for memory the caller holds (a parameter). Inputs that
            view one buffer count its bytes once, alive until the last of them is
            read. Default: every input is its own buffer.
        output_order: the forward's outputs with the user outputs first and the
            saved ones last, when the graph does not order them so.
        load_granularity: tensors loaded from a tier (fetched weights, reloaded
            activations) take their size rounded up to this (the page, for loads
            that read files with O_DIRECT straight into memory).
        load_overhead: bytes each loaded tensor takes beyond that (the alignment
            slack of `buffers_seen_by_profiler`).

    Returns:
        the LifetimeTable.
    """
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    flat_outputs = output_order or [n for n in _flat_outputs(nodes[-1]) if isinstance(n, torch.fx.Node)]
    # Aliases: a view (or a getitem of a multi-output op) lives on its base.
    base = _bases(nodes)
    # Outputs are named by their bases: a saved view keeps its base saved.
    saved = {base[n] for n in flat_outputs[len(flat_outputs) - num_saved :]} if num_saved else set()
    returned = {base[n] for n in flat_outputs}
    last_use: dict[torch.fx.Node, int] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            root = base[inp]
            last_use[root] = max(last_use.get(root, -1), index[node])

    placeholders = [n for n in nodes if n.op == "placeholder"]
    weights = {placeholders[i] for i in weight_inputs if i < len(placeholders)}
    values, held, symbols = [], [], set()
    shared: dict[str, list] = {}
    fetch_op = getattr(getattr(torch.ops, "slc", None), "fetch_weight", None)
    for node in nodes:
        if base[node] is not node or node.op == "output":
            continue
        size = _node_bytes(node)
        if size is None:
            continue
        if isinstance(node.meta.get("val"), (list, tuple)):
            # A multi-output op: each output its getitem picks is a value of its own;
            # the ones nobody picks die at once.
            picked = {u.args[1] for u in node.users if u.target is operator.getitem}
            size = sympy.expand(sum(
                (tensor_bytes(v) for i, v in enumerate(node.meta["val"])
                 if isinstance(v, torch.Tensor) and i not in picked),
                sympy.Integer(0),
            ))
        symbols |= size.free_symbols
        if node.op == "placeholder":
            kind = "weight" if node in weights else ("saved" if graph_kind == "backward" else "input")
            freed = inputs_freed or (inputs_freed is None and graph_kind == "backward")
            if input_buffers is not None and node.name in input_buffers:
                buffer = input_buffers[node.name]
                if buffer is None:
                    held.append(Value(node.name, size, 0, len(nodes) - 1, "weight"))
                else:
                    name, buffer_bytes = buffer
                    shared.setdefault(name, []).append((node, buffer_bytes))
                continue
            if freed and kind != "weight":
                values.append(Value(node.name, size, 0, last_use.get(node, 0), kind))
            else:
                held.append(Value(node.name, size, 0, len(nodes) - 1, kind))
            continue
        if node.target in _loads():
            if load_granularity > 1:
                size = sympy.ceiling(size / load_granularity) * load_granularity
            size += load_overhead
        if fetch_op is not None and node.target is getattr(fetch_op, "default", None):
            kind = "weight"
        elif node in saved:
            kind = "saved"
        elif graph_kind == "backward" and node in returned:
            kind = "gradient"
        else:
            kind = "activation"
        start = index[node]
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            start = index[node.args[0]]  # made by the multi-output op it picks from
        elif node.target in _issued_by_first_arg():
            # The memory is taken when the load is issued, not when it is waited for.
            start = index.get(node.args[0], start)
        values.append(Value(node.name, size, start, last_use.get(node, index[node]), kind))

    for name, readers in shared.items():
        last = max(last_use.get(node, 0) for node, _ in readers)
        values.append(Value(name, readers[0][1], 0, last, "saved"))
    # A sweep over the nodes: a value joins at its first use and leaves after its last.
    change: dict[int, sympy.Expr] = {}
    for v in values:
        change[v.first_use] = change.get(v.first_use, sympy.Integer(0)) + v.bytes
        change[v.last_use + 1] = change.get(v.last_use + 1, sympy.Integer(0)) - v.bytes
    resident, running = [], sympy.Integer(0)
    for i in range(len(nodes)):
        if i in change:
            # Sums of sums of monomials: sympy collects them as it adds (no expand).
            running = running + change[i]
        resident.append(running)
    user = {base[n] for n in flat_outputs[: len(flat_outputs) - num_saved]} - saved
    returned_bytes = sympy.expand(sum((v.bytes for v in values if any(v.name == u.name for u in user)), sympy.Integer(0)))
    return LifetimeTable(
        tuple(values), tuple(held), tuple(resident), tuple(sorted(symbols, key=str)), returned_bytes
    )



def _loads() -> tuple:
    """Ops whose result is memory a tier's load filled."""
    from slcompile import vocabulary

    return (vocabulary.UNSTASH_WAIT, vocabulary.FETCH_WEIGHT)


def _issued_by_first_arg() -> tuple:
    """Ops that return the memory of a load their first argument issued."""
    from slcompile import vocabulary

    return (vocabulary.UNSTASH_WAIT,)


def _node_bytes(node: torch.fx.Node) -> sympy.Expr | None:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, (list, tuple)):
        parts = [tensor_bytes(v) for v in value if isinstance(v, torch.Tensor)]
        return sympy.expand(sum(parts, sympy.Integer(0))) if parts else None
    return None


@dataclasses.dataclass(frozen=True)
class StepLifetimes:
    """Lifetimes of one training step: the forward, then the backward.

    Attributes:
        forward: the forward graph's table.
        backward: the backward graph's table; saved tensors are its inputs, counted
            once per forward buffer and freed at their last use.
    """

    forward: LifetimeTable
    backward: LifetimeTable


def analyze_training_step(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    weight_inputs: frozenset[int] = frozenset(),
    load_granularity: int = 1,
    load_overhead: int = 0,
) -> StepLifetimes:
    """Lifetimes of a partitioned forward and backward pair.

    The backward's inputs are the forward's saved outputs and the tangents; saved
    outputs that view one forward buffer share it.
    """
    bw_inputs = [n for n in backward.graph.nodes if n.op == "placeholder"]
    fw_nodes = list(forward.graph.nodes)
    by_name = {n.name: n for n in fw_nodes}
    # AOTAutograd names each saved input of the backward after the forward node it
    # is (saved SymInts come first among the backward's inputs, last among the
    # forward's outputs, so positions do not line up).
    outputs = [o for o in _flat_outputs(fw_nodes[-1]) if isinstance(o, torch.fx.Node)]
    # A random op the backward recomputes has its generator state saved, under
    # another name in the backward (see `_saved_rng_states`).
    rng_states = _saved_rng_states(outputs, bw_inputs)
    saved_inputs = [n for n in bw_inputs if n.name in by_name or n.name in rng_states]
    saved_names = {n.name for n in saved_inputs} | {o.name for o in rng_states.values()}
    user_first = [o for o in outputs if o.name not in saved_names] + [o for o in outputs if o.name in saved_names]
    fw_table = analyze_lifetimes(
        forward, "forward", num_saved=len(outputs) - sum(o.name not in saved_names for o in outputs),
        weight_inputs=weight_inputs, output_order=user_first, load_granularity=load_granularity,
        load_overhead=load_overhead,
    )
    bases = _bases(fw_nodes)
    made = {v.name: v.bytes for v in fw_table.values}
    buffers: dict[str, tuple[str, sympy.Expr] | None] = {}
    for bw_input in saved_inputs:
        base = bases[rng_states.get(bw_input.name) or by_name[bw_input.name]]
        buffers[bw_input.name] = (base.name, made[base.name]) if base.name in made else None
    bw_table = analyze_lifetimes(backward, "backward", input_buffers=buffers, load_granularity=load_granularity,
                                 load_overhead=load_overhead)
    return StepLifetimes(fw_table, bw_table)


def _saved_rng_states(fw_outputs: list, bw_inputs: list) -> dict:
    """The backward's inputs that are generator states the forward saved, each with
    the forward output it is.

    When torch's partitioner recomputes a random op in the backward (torch 2.13 does
    for the CPU attention kernel, even without dropout; 2.15 does not), the forward
    runs it under `run_and_save_rng_state` and returns the state, and the backward
    takes it as the input `rng_state_output_<i>`, the i-th of the forward's states,
    not under the forward node's name. Matched by name alone it would be a user
    output held through the backward and a second buffer in the backward besides."""
    states = [
        o for o in fw_outputs
        if o.target is operator.getitem and o.args[1] == 0 and isinstance(o.args[0], torch.fx.Node)
        and getattr(o.args[0].target, "__name__", None) == "run_and_save_rng_state"
    ]
    inputs = [n for n in bw_inputs if n.name.startswith("rng_state_output_")]
    return dict(zip((n.name for n in inputs), states)) if len(inputs) == len(states) else {}


def _flat_outputs(output: torch.fx.Node) -> list:
    if output.op != "output":
        return []
    flat = []
    for item in output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    return flat


def _bases(nodes) -> dict:
    base = {}
    for node in nodes:
        root = node
        if node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
            source = node.args[0]
            aliases = getattr(node.target, "is_view", False)
            if node.target is operator.getitem:
                # An output of a multi-output op owns its memory, unless the op
                # returns views (split, unbind).
                aliases = getattr(source.target, "is_view", False) or source.op != "call_function"
            if aliases:
                root = base.get(source, source)
        base[node] = root
    return base

"""Fixtures for the pass-by-pass tests: a two-block MLP, its Dynamo graph, the graphs
each stage hands the next, and a compact printer for expected-graph strings."""

from __future__ import annotations

import copy
import difflib

import pytest
import torch
import torch.nn as nn
import torch.fx

from slcompile.config import SpeedLoaderConfig
from slcompile.facts import process_facts
from slcompile.meta import get_slc_meta
from slcompile.pipeline import run_pipeline

WIDTH, BATCH = 8, 4


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class TwoBlockMLP(nn.Module):
    """embed -> layers.0 -> layers.1 -> head -> sum: a prefix, two blocks, a suffix."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


@pytest.fixture
def mlp():
    """(model, input)."""
    torch.manual_seed(0)
    return TwoBlockMLP(), torch.randn(BATCH, WIDTH)


@pytest.fixture
def dynamo_graph(mlp):
    """(Dynamo graph, its example inputs: the model's parameters and the input)."""
    model, x = mlp
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(x)
    return captured[0]


@pytest.fixture
def pipeline(dynamo_graph):
    """`pipeline(stop_after, **options)`: the PipelineState after that Dynamo pass.
    The suffix runs per sub-batch unless `suffix` says otherwise: the expected graphs
    show each pass on per-sub-batch work and partial sums throughout."""

    def run(stop_after: str, **options):
        gm, example_inputs = dynamo_graph
        config = SpeedLoaderConfig.from_options(
            {"num_subbatches": 2, "lowering": "aot_eager", "suffix": "subbatches", **options})
        return run_pipeline(copy.deepcopy(gm), example_inputs, config, facts=process_facts(config, example_inputs),
                            stop_after=stop_after)

    return run


@pytest.fixture
def partitioned(pipeline):
    """`partitioned(**options)`: (forward, backward, PipelineState) AOTAutograd makes
    of the interleaved graph, before any pass of the later stages."""
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    def run(**options):
        state = pipeline("interleave", **options)
        graphs = {}

        def partition(joint, joint_inputs, **kwargs):
            graphs["forward"], graphs["backward"] = default_partition(joint, joint_inputs, **kwargs)
            return graphs["forward"], graphs["backward"]

        aot_module_simplified(
            state.gm, list(state.example_inputs), fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition
        )
        return graphs["forward"], graphs["backward"], state

    return run


def short_name(name: str) -> str:
    """A Dynamo parameter placeholder by its module path: `layers.0.linear.weight`."""
    if not name.startswith("l_self_modules_"):
        return name
    path = name[len("l_self_modules_"):].rstrip("_")
    return path.replace("_modules_", ".").replace("_parameters_", ".")


def _arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return short_name(arg.name)
    if isinstance(arg, (list, tuple)):
        return "[" + ", ".join(_arg(a) for a in arg) + "]"
    return repr(arg)


def graph_lines(gm: torch.fx.GraphModule) -> list[str]:
    """One line per call and the output: `name = op(args)  # tag`."""
    lines = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            op = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
            meta = get_slc_meta(node)
            tag = f"  # {meta.tag}" if meta is not None else ""
            lines.append(f"{node.name} = {op}({', '.join(_arg(a) for a in node.args)}){tag}")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
    return lines


def tag_runs(gm: torch.fx.GraphModule) -> str:
    """The slc tags of the graph's ops in order, one per run."""
    runs = []
    for node in gm.graph.nodes:
        meta = get_slc_meta(node) if node.op == "call_function" else None
        if meta is not None and (not runs or runs[-1] != meta.tag):
            runs.append(meta.tag)
    return " ".join(runs)


def diff_lines(before: list[str], after: list[str]) -> str:
    """What a pass changed: the lines removed (-) and added (+)."""
    changed = difflib.unified_diff(before, after, lineterm="", n=0)
    return "\n".join(line for line in changed if not line.startswith(("---", "+++", "@@")))


@pytest.fixture
def printer():
    """The printers, as a namespace: `printer.lines`, `printer.tags`, `printer.diff`,
    `printer.name`."""

    class Printer:
        lines = staticmethod(graph_lines)
        name = staticmethod(short_name)
        tags = staticmethod(tag_runs)
        diff = staticmethod(diff_lines)

    return Printer


def weight_key(stored: str):
    """The fetch key of a weight in these tests' graphs: streamer `w0`, whatever
    streamers the process made before."""
    from slcompile.vocabulary import WeightKey

    return WeightKey("w0", stored)


@pytest.fixture
def streamed(pipeline):
    """`streamed(**options)`: the interleaved MLP with its block weights fetched by
    `stream_weights` (keys `w0|layers.0.linear.weight@fwd`), and the graphs
    AOTAutograd makes of it: a namespace with `state`, `weights` (the
    `StreamedWeights`), `joint` (a copy of the joint graph before any tag),
    `forward` and `backward` (partitioned after `tag_fetch_views`, as the pipeline
    does)."""
    from types import SimpleNamespace

    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition

    from slcompile.passes.stream_weights import stream_weights, tag_fetch_views

    def run(**options):
        state = pipeline("interleave", **options)
        gm, weights = stream_weights(
            state.gm, state.blocks, state.inputs, lambda name, value: short_name(name), weight_key,
            fetch_groups=state.schedule.fetch_groups(),
        )
        graphs = {}

        def partition(joint, joint_inputs, **kwargs):
            graphs["joint"] = copy.deepcopy(joint)
            tag_fetch_views(joint.graph)
            graphs["forward"], graphs["backward"] = default_partition(joint, joint_inputs, **kwargs)
            graphs["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
            return graphs["forward"], graphs["backward"]

        aot_module_simplified(
            gm, list(state.example_inputs), fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition
        )
        return SimpleNamespace(state=state, weights=weights, **graphs)

    return run

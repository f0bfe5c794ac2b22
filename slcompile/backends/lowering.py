"""Lower a (rewritten) Dynamo graph with AOTAutograd and Inductor or aot_eager.

Inductor runs with `reorder_for_peak_memory` off: that pass moves block kernels out of
layer-major order in the backward. The option is patched around every inner compile
(the backward may compile later than the forward), and it is part of Inductor's cache
key, so a cached graph compiled with other options is never served. Every AOTAutograd
graph handed to the inner compiler is recorded in the CompileReport, so tests and
`explain` can read the forward and backward order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.report import CompileReport

__all__ = ["lower", "INDUCTOR_PATCHES"]

log = logging.getLogger(__name__)

INDUCTOR_PATCHES = {"reorder_for_peak_memory": False}


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], lowering: str, report: CompileReport) -> Callable:
    """Compiles `gm` with the chosen lowering; records the AOT graphs in `report`."""
    if lowering == "aot_eager":
        return _aot_eager(gm, example_inputs, report)
    if lowering == "inductor":
        return _inductor(gm, example_inputs, report)
    raise ValueError(f"unknown lowering {lowering!r}")


def _aot_eager(gm, example_inputs, report):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def observed(kind: str):
        def compiler(graph: torch.fx.GraphModule, inputs):
            report.record_graph(kind, graph)
            return boxed_nop(graph, inputs)

        return compiler

    backend = aot_autograd(
        fw_compiler=observed("forward"),
        bw_compiler=observed("backward"),
        inference_compiler=observed("inference"),
    )
    return backend(gm, example_inputs)


def _inductor(gm, example_inputs, report):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: torch.fx.GraphModule, inputs, **kwargs):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        report.record_graph(kind, graph)
        with inductor_config.patch(INDUCTOR_PATCHES):
            return compile_fx_inner(graph, inputs, **kwargs)

    with inductor_config.patch(INDUCTOR_PATCHES):
        return compile_fx(gm, example_inputs, inner_compile=inner)

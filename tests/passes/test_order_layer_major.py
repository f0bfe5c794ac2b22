"""order_layer_major alone on the partitioned graphs of a two-block MLP: graphs
interleaved layer-major are put into a sample-major schedule's order, and back."""

import copy

import torch
from expecttest import assert_expected_inline

from slcompile.config import SpeedLoaderConfig
from slcompile.passes.order_layer_major import order_layer_major
from slcompile.schedules.policies import plan_schedule


def _run(forward, backward, example_inputs):
    """(loss, gradients) of the forward and backward graphs, called as AOTAutograd does."""
    outputs = torch.fx.Interpreter(forward).run(*example_inputs)
    loss, saved = outputs[0], outputs[1:]
    grads = torch.fx.Interpreter(backward).run(*saved, torch.ones_like(loss))
    return loss, [g for g in grads if g is not None]


def test_order_layer_major_reorders_into_the_schedule(partitioned, printer, mlp):
    forward, backward, state = partitioned()
    reference = _run(copy.deepcopy(forward), copy.deepcopy(backward), state.example_inputs)
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "schedule": "grad_accumulation"})
    sample_major = plan_schedule(state.blocks, config)
    lines = [f"before fwd: {printer.tags(forward)}", f"before bwd: {printer.tags(backward)}"]
    _, moved_forward = order_layer_major(forward, "fwd", sample_major)
    _, moved_backward = order_layer_major(backward, "bwd", sample_major)
    lines += [f"after fwd: {printer.tags(forward)}", f"after bwd: {printer.tags(backward)}"]
    assert_expected_inline("\n".join(lines), """\
before fwd: prefix.sb0 prefix.sb1 blk0.sb0 blk0.sb1 blk1.sb0 blk1.sb1 suffix.sb0 suffix.sb1 suffix
before bwd: suffix.sb1 suffix.sb0 blk1.sb1 blk1.sb0 blk0.sb1 blk0.sb0 prefix.sb1 prefix.sb0
after fwd: prefix.sb0 blk0.sb0 blk1.sb0 suffix.sb0 prefix.sb1 blk0.sb1 blk1.sb1 suffix.sb1 suffix
after bwd: suffix.sb1 blk1.sb1 blk0.sb1 prefix.sb1 suffix.sb0 blk1.sb0 blk0.sb0 prefix.sb0""")
    assert moved_forward > 0 and moved_backward > 0
    forward.graph.lint()
    backward.graph.lint()
    forward.recompile()
    backward.recompile()

    # Same values in the new order, and the same as eager.
    loss, grads = _run(forward, backward, state.example_inputs)
    torch.testing.assert_close(loss, reference[0])
    for got, want in zip(grads, reference[1]):
        torch.testing.assert_close(got, want)
    model, x = mlp
    torch.testing.assert_close(loss, model(x))
    eager = torch.autograd.grad(model(x), [p for p in state.example_inputs if p.requires_grad])
    torch.testing.assert_close(grads, list(eager))


def test_order_layer_major_keeps_a_graph_already_in_order(partitioned, printer):
    forward, backward, state = partitioned()
    before = printer.lines(forward)
    _, moved = order_layer_major(forward, "fwd", state.schedule)
    assert moved == 0 and printer.lines(forward) == before

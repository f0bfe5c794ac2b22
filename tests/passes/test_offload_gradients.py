"""offload_gradients alone on the partitioned graphs of a two-block MLP whose block
weights are fetched: the gradients an offloaded optimizer takes are stored from the
backward right after they are final (or per sub-batch share, as the schedule says),
waited for before the next block's stores, and no longer returned."""

import torch
from expecttest import assert_expected_inline

from slcompile.config import SpeedLoaderConfig
from slcompile.passes.offload_gradients import offload_gradients
from slcompile.passes.stream_weights import place_prefetches
from slcompile.schedules.policies import plan_schedule
from slcompile.vocabulary import GradientKey


def _gradient_key(stored: str) -> str:
    return GradientKey("g0", stored).format()


def _weights_only(stored: str) -> bool:
    return stored.endswith("weight")


def test_offload_gradients_stores_each_block_weight_gradient_once(streamed, printer):
    graphs = streamed()
    place_prefetches(graphs.forward, graphs.backward, live_blocks=2)
    before = printer.lines(graphs.backward)
    _, report = offload_gradients(graphs.forward, graphs.backward, _gradient_key, _weights_only)
    assert_expected_inline(printer.diff(before, printer.lines(graphs.backward)), """\
+offload_grad_default = offload_grad.default(add_4, 'g0|layers.1.linear.weight')  # blk1
-fetch_issue_default_1 = fetch_issue.default('w0|layers.0.linear.weight@fwd')  # blk0
+wait_default = wait.default(offload_grad_default, [add_4])  # blk1
+offload_grad_default_1 = offload_grad.default(add_6, 'g0|layers.0.linear.weight')  # blk0
-return [add_8, add_7, None, add_6, add_5, add_4, add_3, add_2, add_1]
+wait_default_1 = wait.default(offload_grad_default_1, [add_6])  # blk0
+return [add_8, add_7, None, None, add_5, None, add_3, add_2, add_1]""")
    assert_expected_inline(str(report), """GradientReport(stores=((1, 'layers.1.linear.weight', 256), (0, 'layers.0.linear.weight', 256)), bytes=512, kept=(('layers.0.linear.bias', 'no offloaded optimizer takes it'), ('layers.1.linear.bias', 'no offloaded optimizer takes it')), deferred_issues={'layers.0.linear.weight': ('w0|layers.0.linear.weight@fwd',)}, refused=None)""")


def test_offload_gradients_stores_each_subbatch_share_where_the_schedule_says(streamed, printer):
    graphs = streamed(schedule="grad_accumulation")
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "schedule": "grad_accumulation"})
    schedule = plan_schedule(graphs.state.blocks, config, weights_streamed=True, gradients_offloaded=True)
    before = printer.lines(graphs.backward)
    _, report = offload_gradients(graphs.forward, graphs.backward, _gradient_key, _weights_only, schedule)
    assert_expected_inline(printer.diff(before, printer.lines(graphs.backward)), """\
+offload_grad_default = offload_grad.default(t_15, 'g0|layers.1.linear.weight')  # blk1.sb1
+wait_default = wait.default(offload_grad_default, [t_15])  # blk1.sb1
+offload_grad_default_1 = offload_grad.default(t_19, 'g0|layers.0.linear.weight')  # blk0.sb1
-add_4 = add.Tensor(t_15, t_30)
+wait_default_1 = wait.default(offload_grad_default_1, [t_19])  # blk0.sb1
+offload_grad_default_2 = offload_grad.default(t_30, 'g0|layers.1.linear.weight')  # blk1.sb0
-add_6 = add.Tensor(t_19, t_34)
+wait_default_2 = wait.default(offload_grad_default_2, [t_30])  # blk1.sb0
+offload_grad_default_3 = offload_grad.default(t_34, 'g0|layers.0.linear.weight')  # blk0.sb0
-return [add_8, add_7, None, add_6, add_5, add_4, add_3, add_2, add_1]
+wait_default_3 = wait.default(offload_grad_default_3, [t_34])  # blk0.sb0
+return [add_8, add_7, None, None, add_5, None, add_3, add_2, add_1]""")
    assert_expected_inline(f"{report.shares()} {report.bytes} B", """{'layers.1.linear.weight': 2, 'layers.0.linear.weight': 2} 1024 B""")


def test_a_forward_with_a_recomputed_random_op_still_stores_its_gradients(streamed):
    """A random op recomputed in the backward (CUDA's flash attention under block
    recompute) makes AOTAutograd add a generator input to the forward, after the
    others, that the backward returns no gradient for: the gradients are stored
    as without it."""
    graphs = streamed()
    place_prefetches(graphs.forward, graphs.backward, live_blocks=2)
    last = list(graphs.forward.graph.find_nodes(op="placeholder"))[-1]
    with graphs.forward.graph.inserting_after(last):
        state = graphs.forward.graph.placeholder("fwd_rng_state_0")
    state.meta["val"] = torch.Generator()
    _, report = offload_gradients(graphs.forward, graphs.backward, _gradient_key, _weights_only)
    assert report.refused is None
    assert [(block, stored) for block, stored, _ in report.stores] == [(1, "layers.1.linear.weight"),
                                                                     (0, "layers.0.linear.weight")]
    assert list(graphs.backward.graph.output_node().args[0]).count(None) == 3

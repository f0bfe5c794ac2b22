"""interleave alone: the Dynamo graph of a two-block MLP over two sub-batches."""

import torch
from expecttest import assert_expected_inline


def test_interleave_runs_each_block_over_both_subbatches(pipeline, printer, mlp):
    state = pipeline("interleave")
    assert_expected_inline("\n".join(printer.lines(state.gm)), """\
l_x__sb0 = narrow(l_x_, 0, 0, 2)  # prefix.sb0
x_sb0 = linear(l_x__sb0, embed.weight, embed.bias)  # prefix.sb0
l_x__sb1 = narrow(l_x_, 0, 2, 2)  # prefix.sb1
x_sb1 = linear(l_x__sb1, embed.weight, embed.bias)  # prefix.sb1
linear_1_sb0 = linear(x_sb0, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb0
x_1_sb0 = relu(linear_1_sb0)  # blk0.sb0
linear_1_sb1 = linear(x_sb1, layers.0.linear.weight, layers.0.linear.bias)  # blk0.sb1
x_1_sb1 = relu(linear_1_sb1)  # blk0.sb1
linear_2_sb0 = linear(x_1_sb0, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb0
x_2_sb0 = relu(linear_2_sb0)  # blk1.sb0
linear_2_sb1 = linear(x_1_sb1, layers.1.linear.weight, layers.1.linear.bias)  # blk1.sb1
x_2_sb1 = relu(linear_2_sb1)  # blk1.sb1
linear_3_sb0 = linear(x_2_sb0, head.weight, head.bias)  # suffix.sb0
sum_1_partial_sb0 = sum(linear_3_sb0)  # suffix.sb0
linear_3_sb1 = linear(x_2_sb1, head.weight, head.bias)  # suffix.sb1
sum_1_partial_sb1 = sum(linear_3_sb1)  # suffix.sb1
sum_1 = add(sum_1_partial_sb0, sum_1_partial_sb1)  # suffix
return [sum_1]""")
    model, x = mlp
    torch.testing.assert_close(state.gm(*state.example_inputs)[0], model(x))


def test_interleave_follows_a_sample_major_schedule(pipeline, printer, mlp):
    state = pipeline("interleave", schedule="grad_accumulation")
    assert_expected_inline(printer.tags(state.gm), """prefix.sb0 blk0.sb0 blk1.sb0 suffix.sb0 prefix.sb1 blk0.sb1 blk1.sb1 suffix.sb1 suffix""")
    model, x = mlp
    torch.testing.assert_close(state.gm(*state.example_inputs)[0], model(x))

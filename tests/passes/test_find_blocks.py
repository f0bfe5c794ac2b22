"""find_blocks alone on the Dynamo graph of a two-block MLP."""

import torch
from expecttest import assert_expected_inline


def test_find_blocks_splits_prefix_blocks_suffix(pipeline, printer, mlp):
    state = pipeline("find_blocks")
    blocks = state.blocks
    lines = [f"container {blocks.container}, groups {blocks.groups}"]
    for block in blocks.blocks:
        lines.append(f"{block.path}: nodes {', '.join(block.nodes)}; params {', '.join(map(printer.name, block.params))}")
    lines += [f"{name}: {region}" for name, region in blocks.regions.items()]
    assert_expected_inline("\n".join(lines), """\
container layers, groups ((0, 1),)
layers.0: nodes linear_1, x_1; params layers.0.linear.weight, layers.0.linear.bias
layers.1: nodes linear_2, x_2; params layers.1.linear.weight, layers.1.linear.bias
x: prefix
linear_1: block
x_1: block
linear_2: block
x_2: block
linear_3: suffix
sum_1: suffix""")
    # An analysis: the graph still computes the model.
    model, x = mlp
    torch.testing.assert_close(state.gm(*state.example_inputs)[0], model(x))

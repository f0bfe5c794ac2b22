"""find_blocks alone on the Dynamo graph of a two-block MLP, an encoder-decoder, and
layers made of parts of different classes."""

import pytest
import torch
from expecttest import assert_expected_inline

from slcompile.errors import NoBlocksError


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


class _DecoderBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.cross = torch.nn.Linear(width, width)

    def forward(self, x, memory):
        return torch.relu(self.linear(x) + self.cross(memory))


class _EncoderDecoder(torch.nn.Module):
    """encoder.0-1 -> norm -> decoder.0-1 (each also reads the encoder's output) ->
    heads.0-1 (both read the decoder's output: parallel, no stack) -> sum."""

    def __init__(self, width=8):
        super().__init__()
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.norm = torch.nn.LayerNorm(width)
        self.decoder = torch.nn.ModuleList(_DecoderBlock(width) for _ in range(2))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, 1) for _ in range(2))

    def forward(self, x, y):
        for layer in self.encoder:
            x = torch.relu(layer(x))
        memory = self.norm(x)
        for layer in self.decoder:
            y = layer(y, memory)
        return self.heads[0](y).sum() + self.heads[1](y).sum()


def _pipeline_of(model, *args, stop_after, **options):
    from slcompile.config import SpeedLoaderConfig
    from slcompile.pipeline import run_pipeline
    from slcompile.facts import process_facts

    captured = []
    torch.compile(model, backend=lambda gm, inputs: captured.append((gm, inputs)) or gm.forward, fullgraph=True)(*args)
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "lowering": "aot_eager", **options})
    return run_pipeline(captured[0][0], captured[0][1], config, facts=process_facts(config, captured[0][1]),
                        stop_after=stop_after)


def test_find_blocks_finds_an_encoder_and_a_decoder_stack(printer):
    torch.manual_seed(0)
    model, x, y = _EncoderDecoder(), torch.randn(4, 8), torch.randn(4, 8)
    state = _pipeline_of(model, x, y, stop_after="interleave")
    blocks = state.blocks
    lines = [f"container {blocks.container}, stacks {blocks.stacks}, groups {blocks.groups}"]
    for block in blocks.blocks:
        lines.append(f"{block.index} {block.path}: nodes {', '.join(block.nodes)}; "
                     f"params {', '.join(map(printer.name, block.params))}")
    lines += [f"{name}: {region}" for name, region in blocks.regions.items()]
    lines.append(printer.tags(state.gm))
    assert_expected_inline("\n".join(lines), """\
container decoder, stacks (('encoder', (0, 1)), ('decoder', (2, 3))), groups ((0,), (1,), (2, 3))
0 encoder.0: nodes linear, x; params encoder.0.weight, encoder.0.bias
1 encoder.1: nodes linear_1, x_1, memory; params encoder.1.weight, encoder.1.bias, norm.weight, norm.bias
2 decoder.0: nodes linear_2, linear_3, add, y; params decoder.0.linear.weight, decoder.0.linear.bias, decoder.0.cross.weight, decoder.0.cross.bias
3 decoder.1: nodes linear_4, linear_5, add_1, y_1; params decoder.1.linear.weight, decoder.1.linear.bias, decoder.1.cross.weight, decoder.1.cross.bias
linear: block
x: block
linear_1: block
x_1: block
memory: block
linear_2: block
linear_3: block
add: block
y: block
linear_4: block
linear_5: block
add_1: block
y_1: block
linear_6: suffix
sum_1: suffix
linear_7: suffix
sum_2: suffix
add_2: suffix
prefix.sb0 prefix.sb1 blk0.sb0 blk0.sb1 blk1.sb0 blk1.sb1 blk2.sb0 blk2.sb1 blk3.sb0 blk3.sb1 suffix""")
    torch.testing.assert_close(state.gm(*state.example_inputs)[0], model(x, y))


class _Attention(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.softmax(self.linear(x), -1)


class _FeedForward(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class _Layer(torch.nn.Module):
    """A layer made of parts of different classes, as T5's `T5Block.layer`."""

    def __init__(self, width=8):
        super().__init__()
        self.layer = torch.nn.ModuleList([_Attention(width), _FeedForward(width)])

    def forward(self, x):
        for part in self.layer:
            x = part(x)
        return x


class _TwoLayers(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(width) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_find_blocks_takes_no_parts_of_one_layer_for_blocks():
    with pytest.raises(NoBlocksError, match=r"^no blocks: compiled plainly \(layer\.0 \(_Attention\), "
                       r"layer\.1 \(_FeedForward\) are each of another class: the parts of one module, "
                       r"not repeated blocks \(a graph that holds one layer\)\)$"):
        _pipeline_of(_Layer(), torch.randn(4, 8), stop_after="find_blocks")
    # Layers made of such parts are blocks.
    blocks = _pipeline_of(_TwoLayers(), torch.randn(4, 8), stop_after="find_blocks").blocks
    assert (blocks.container, [b.path for b in blocks.blocks]) == ("layers", ["layers.0", "layers.1"])

"""find_batch_dim alone on the Dynamo graph of a two-block MLP: the user input is
batched along its first dimension, static size 4 over two sub-batches; a batch that
K does not divide is refused."""

import pytest
from expecttest import assert_expected_inline

from slcompile.errors import RefusedError
from slcompile.passes.find_batch_dim import find_batch_dim


def test_find_batch_dim_finds_the_user_inputs_first_dimension(pipeline, printer):
    batch = pipeline("find_batch_dim").batch
    assert_expected_inline(
        f"B={batch.batch_size} dim={batch.batch_dim} dynamic={batch.dynamic} symbols={batch.batch_symbols}\n"
        f"batched: {batch.batched_inputs}\n"
        f"index: {', '.join(f'{printer.name(n)}={i}' for n, i in batch.input_index.items())}", """\
B=4 dim=0 dynamic=False symbols=()
batched: {'l_x_': 0}
index: embed.weight=0, embed.bias=1, l_x_=2, layers.0.linear.weight=3, layers.0.linear.bias=4, layers.1.linear.weight=5, layers.1.linear.bias=6, head.weight=7, head.bias=8""")


def test_find_batch_dim_refuses_a_batch_k_does_not_divide(pipeline):
    state = pipeline("classify_inputs")
    with pytest.raises(RefusedError) as info:
        find_batch_dim(state.gm, list(state.inputs), 0, 3)
    assert_expected_inline(str(info.value), """batch size 4 (dim 0 of input l_x_) is not divisible by num_subbatches=3 [find_batch_dim]""")

"""classify_inputs alone on the Dynamo graph of a two-block MLP: each placeholder's
kind and where Dynamo found it."""

from expecttest import assert_expected_inline


def test_classify_inputs_names_parameters_and_the_user_input(pipeline, printer):
    state = pipeline("classify_inputs")
    assert_expected_inline("\n".join(
        f"{i.index} {printer.name(i.name)}: {i.kind}" + (f" from {i.source}" if i.source else "") for i in state.inputs), """\
0 embed.weight: param
1 embed.bias: param
2 l_x_: user
3 layers.0.linear.weight: param
4 layers.0.linear.bias: param
5 layers.1.linear.weight: param
6 layers.1.linear.bias: param
7 head.weight: param
8 head.bias: param""")
    assert all(value is i.value for value, i in zip(state.example_inputs, state.inputs))
    # An analysis: the graph is Dynamo's.
    assert state.blocks is None and not any(n.meta.get("slc") for n in state.gm.graph.nodes)

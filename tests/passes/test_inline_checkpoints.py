"""inline_checkpoints alone on Dynamo graphs of checkpointed layers: a write in place
whose result nobody reads survives the inlining; a region inside a region (an
autograd.Function's forward and backward, a checkpoint inside a checkpoint) moves into
the graph with its layer, which then runs layer-major like eager."""

import copy

import torch
import torch.utils.checkpoint
from torch import nn

import slcompile
from slcompile.passes.inline_checkpoints import inline_checkpoints, is_checkpoint

OPTIONS = {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise"}
WIDTH, BATCH = 8, 4


class _Tanh(torch.autograd.Function):
    """tanh with its own backward: Dynamo traces it as a region of its own."""

    @staticmethod
    def forward(ctx, x):
        out = torch.tanh(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out * out)


class _Layer(nn.Module):
    """linear -> a doubling and a clamp written in place (their results unread) -> tanh, the tanh an
    autograd.Function with `function=True`, or checkpointed again with `nested=True`."""

    def __init__(self, function=False, nested=False):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.function, self.nested = function, nested

    def forward(self, x):
        hidden = self.linear(x)
        hidden.mul_(2)
        torch.nn.functional.hardtanh(hidden, -0.5, 0.5, True)
        if self.nested:
            return torch.utils.checkpoint.checkpoint(torch.tanh, hidden, use_reentrant=False)
        return _Tanh.apply(hidden) if self.function else torch.tanh(hidden)


class _Checkpointed(nn.Module):
    """Two checkpointed layers; the output also returns labels shifted right whose -100s
    become 0 by a `masked_fill_` whose result nobody reads (T5's `_shift_right`)."""

    def __init__(self, **layer):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(**layer) for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1]
        shifted.masked_fill_(shifted == -100, 0)
        out = self.head(x)
        return out, out.square().mean(), shifted


def _inputs():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (BATCH, 6), generator=generator)
    labels[1, 2:] = -100
    return torch.randn(BATCH, WIDTH, generator=generator), labels


def _dynamo_graph(model, *inputs):
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    return captured[0]


def _methods(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_method" and n.target.endswith("_")]


def test_writes_in_place_whose_result_nobody_reads_survive():
    model, inputs = _Checkpointed(), _inputs()
    gm, inlined = inline_checkpoints(_dynamo_graph(model, *inputs))
    assert inlined == ("layers.0", "layers.1")
    assert _methods(gm) == ["mul_", "mul_", "masked_fill_"]
    assert sum(n.target is torch.nn.functional.hardtanh for n in gm.graph.nodes) == 2
    for got, want in zip(gm(*_params_and(model, gm, inputs)), model(*inputs)):
        torch.testing.assert_close(got, want)


def test_regions_inside_a_checkpoint_are_inlined_with_it():
    for layer in ({"function": True}, {"nested": True}):
        model, inputs = _Checkpointed(**layer), _inputs()
        gm, inlined = inline_checkpoints(_dynamo_graph(model, *inputs))
        assert not any(is_checkpoint(n) for n in gm.graph.nodes), layer
        assert inlined[:2] == ("layers.0", "layers.1"), layer
        for got, want in zip(gm(*_params_and(model, gm, inputs)), model(*inputs)):
            torch.testing.assert_close(got, want)


def test_checkpointed_layers_with_regions_inside_train_layer_major_like_eager():
    for layer in ({"function": True}, {"nested": True}):
        slcompile.clear_compile_reports()
        torch._dynamo.reset()
        model, (x, labels) = _Checkpointed(**layer), _inputs()
        eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
        out_ref, loss_ref, shifted_ref = eager(x, labels)
        loss_ref.backward()
        out, loss, shifted = torch.compile(compiled_model, backend="speedloader", options=OPTIONS)(x, labels)
        loss.backward()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(shifted, shifted_ref)
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        report = slcompile.compile_reports()[-1]
        assert report.fallback_reason is None and len(report.blocks) == 2, layer
        assert "blk1.sb1" in report.schedule


def _params_and(model, gm, inputs):
    """The graph's inputs in placeholder order: parameters by name, then `inputs`."""
    params = dict(model.named_parameters())
    values, rest = [], list(inputs)
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.name.removeprefix("l_self_modules_").rstrip("_")
        name = name.replace("_modules_", ".").replace("_parameters_", ".")
        values.append(params[name] if name in params else rest.pop(0))
    return values

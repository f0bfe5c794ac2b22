"""The slc:: custom ops: opcheck, and small functions using them compiled with
aot_eager and Inductor (before AOTAutograd and inserted into a post-grad graph)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.optests import aot_autograd_check

from slcompile.runtime import Tier, TransferKind, ops, runtime_stats

ACT = TransferKind.ACTIVATION
DEVICE, HOST, NVME = Tier.DEVICE, Tier.HOST, Tier.NVME
CPU = torch.device("cpu")


ISSUE_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def same_transfer(actual, expected, msg=None):
    """Two issue tokens are equivalent when they name the same kind of transfer."""
    got, want = ops.transfer_of(actual), ops.transfer_of(expected)
    assert (got.key, got.direction, got.source, got.destination, got.kind) == (
        want.key, want.direction, want.source, want.destination, want.kind
    ), msg


def test_opcheck_waits_and_free(global_engine):
    x = torch.randn(4, 5)
    token = ops.store(x, "k", "nvme", "activation")
    torch.library.opcheck(ops.WAIT, (token, [x]))
    load_token = ops.load("k", "activation")
    torch.library.opcheck(ops.WAIT_LOAD, (load_token, "k", [4, 5], torch.float32, CPU))
    ops.store(x, "k2", "nvme", "weight")
    torch.library.opcheck(ops.FREE, ("k2",))
    assert "k2" not in global_engine


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_opcheck_issue_ops(global_engine, dynamic):
    x = torch.randn(4, 5)
    ops.wait(ops.store(x, "k", "nvme", "activation"), [x])
    dependency = ops.wait(ops.store(x, "k2", "nvme", "weight"), [x])
    samples = [
        (ops.STORE, (x, "k", "nvme", "activation")),
        (ops.STORE, (x, "k", "host", "gradient", dependency)),
        (ops.LOAD, ("k", "activation")),
        (ops.LOAD, ("k2", "", dependency)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=ISSUE_CHECKS)
        aot_autograd_check(op, args, {}, dynamic, assert_equals_fn=same_transfer,
                           check_gradients="auto")


def test_eager_ops_round_trip_and_forget_their_tokens(global_engine):
    x = torch.randn(300, 7)
    ops.wait(ops.store(x, "a", "nvme", "activation"), [x])
    token = ops.load("a", "")
    loaded = ops.wait_load(token, "a", [300, 7], torch.float32, CPU)
    assert torch.equal(loaded, x)
    assert torch.equal(ops.wait_load(token, "a", [300, 7], torch.float32, CPU), x)  # repeatable
    with pytest.raises(Exception, match="graph expects"):
        ops.wait_load(token, "a", [7, 300], torch.float32, CPU)
    del token
    gc.collect()
    assert ops.pending_tokens() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="zero-copy host tier is CPU-only")
def test_zero_copy_tiers_hand_the_graph_its_own_copy(global_engine):
    x = torch.randn(256)
    ops.store(x, "h", "host", "activation")
    held = global_engine.wait(global_engine.load("h"))
    assert held.data_ptr() != x.data_ptr()  # the op copied the graph's buffer
    loaded = ops.wait_load(ops.load("h", ""), "h", [256], torch.float32, CPU)
    assert loaded.data_ptr() != held.data_ptr() and torch.equal(loaded, x)
    stats = runtime_stats().cumulative
    assert dict(stats.bytes_moved) == {}
    assert stats.local_copy_bytes == 2 * 256 * 4


def offload_roundtrip(x, w):
    """Stores an activation, overlaps it with a matmul, loads it back."""
    a = x * 2
    token = ops.store(a, "act", "nvme", "activation")
    y = (w @ w).relu()  # relu keeps the matmul from fusing with the later add
    done = ops.wait(token, [a])
    loaded = ops.wait_load(ops.load("act", "", done), "act", a.shape, a.dtype, a.device)
    return (y + loaded).sum()


def store_only(x, w):
    """A store whose wait result nobody uses must still happen."""
    a = x + 1
    ops.wait(ops.store(a, "kept", "nvme", "activation"), [a])
    return (w @ w).sum()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_with_autograd(global_engine, backend):
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    expected = ((w @ w).relu() + x * 2).sum()
    (expected_grad,) = torch.autograd.grad(expected, w)
    with inductor_config.patch(reorder_for_peak_memory=False):
        out = torch.compile(offload_roundtrip, backend=backend, fullgraph=True)(x, w)
        out.backward()
        torch.compile(store_only, backend=backend, fullgraph=True)(x, w)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, expected_grad, rtol=1e-4, atol=1e-4)
    kept = global_engine.wait(global_engine.load("kept"))
    assert torch.equal(kept, (x + 1).detach())
    nbytes = 32 * 32 * 4
    assert dict(runtime_stats().bytes_moved) == {
        (ACT, DEVICE, NVME): 2 * nbytes,
        (ACT, NVME, DEVICE): 2 * nbytes,
    }
    gc.collect()
    assert ops.pending_tokens() == 0


@pytest.mark.slow
def test_inductor_keeps_the_schedule_order(global_engine):
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    # Both reorderings move transfers next to their users and lose the overlap.
    with inductor_config.patch(reorder_for_peak_memory=False, reorder_for_locality=False):
        compiled = torch.compile(offload_roundtrip, backend="inductor", fullgraph=True)
        out, (code,) = run_and_get_code(compiled, x, w)
    torch.testing.assert_close(out, ((w @ w).relu() + x * 2).sum(), rtol=1e-4, atol=1e-4)
    positions = [
        code.index(text)
        for text in ("slc.store.default(", "extern_kernels.mm(", "slc.wait.default(",
                     "slc.load.default(", "slc.wait_load.default(")
    ]
    assert positions == sorted(positions)


class InsertOffload(CustomGraphPass):
    """Post-grad pass: offloads the value of the first `sin` to nvme right after it is
    computed and loads it back just before its first use, as a schedule would."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        sin = next(n for n in graph.nodes if n.target is torch.ops.aten.sin.default)
        users = list(sin.users)
        order = {node: index for index, node in enumerate(graph.nodes)}
        first_use = min(users, key=order.__getitem__)
        with graph.inserting_after(sin):
            token = graph.call_function(ops.STORE, (sin, "pg.sin", "nvme", "activation"))
        with graph.inserting_before(first_use):
            done = graph.call_function(ops.WAIT, (token, [sin]))
        with graph.inserting_after(done):
            load_token = graph.call_function(ops.LOAD, ("pg.sin", "", done))
        with graph.inserting_after(load_token):
            val = sin.meta["val"]
            loaded = graph.call_function(
                ops.WAIT_LOAD, (load_token, "pg.sin", list(val.shape), val.dtype, val.device)
            )
        for node in (token, done, load_token):
            node.meta["val"] = ops.fake_token()
        loaded.meta["val"] = val
        for user in users:
            user.replace_input_with(sin, loaded)
        graph.lint()

    def uuid(self) -> str:
        return "slcompile.tests.runtime.InsertOffload.v1"


@pytest.mark.slow
def test_ops_inserted_into_a_post_grad_graph(global_engine):
    def model(x, w):
        s = torch.sin(x)
        return torch.mm(w, w) + s * 3

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    with torch.no_grad(), inductor_config.patch(
        post_grad_custom_post_pass=InsertOffload(), reorder_for_peak_memory=False,
        pattern_matcher=False,
    ):
        out = torch.compile(model, backend="inductor", fullgraph=True)(x, w)
    torch.testing.assert_close(out, model(x, w), rtol=1e-4, atol=1e-4)
    nbytes = 64 * 64 * 4
    assert dict(runtime_stats().bytes_moved) == {
        (ACT, DEVICE, NVME): nbytes,
        (ACT, NVME, DEVICE): nbytes,
    }


def test_symbolic_batch_size_flows_into_wait_load(global_engine):
    compiled = torch.compile(offload_roundtrip_batched, backend="aot_eager", fullgraph=True)
    w = torch.randn(8, 8)
    for batch in (3, 5):
        x = torch.randn(batch, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, w), (x * 2) @ w)
    nbytes = (3 + 5) * 8 * 4
    assert dict(runtime_stats().bytes_moved) == {
        (ACT, DEVICE, NVME): nbytes,
        (ACT, NVME, DEVICE): nbytes,
    }


def offload_roundtrip_batched(x, w):
    """Like ``offload_roundtrip`` with an activation whose batch dim may be symbolic."""
    a = x * 2
    token = ops.store(a, "act.b", "nvme", "activation")
    done = ops.wait(token, [a])
    loaded = ops.wait_load(ops.load("act.b", "", done), "act.b", a.shape, a.dtype, a.device)
    return loaded @ w

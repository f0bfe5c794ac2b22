"""The slc:: ops as the runtime implements them: opcheck, byte counts, and small
functions using them compiled with aot_eager and Inductor (before AOTAutograd and
inserted into a post-grad graph)."""

from __future__ import annotations


import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.optests import aot_autograd_check

from slcompile import vocabulary
from slcompile.runtime import Tier, TransferKind, ops, runtime_stats
from slcompile.runtime.activations import ActivationStash
from slcompile.runtime.weights import WeightStreamer
from slcompile.vocabulary import FETCH_ISSUE, FETCH_WEIGHT, MARK, STASH, UNSTASH, UNSTASH_WAIT, WAIT, WeightKey

ACT, WEIGHT = TransferKind.ACTIVATION, TransferKind.WEIGHT
DEVICE, HOST, NVME = Tier.DEVICE, Tier.HOST, Tier.NVME
CPU = torch.device("cpu")

ISSUE_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.fixture
def nvme_stash(global_engine):
    return ActivationStash(global_engine, "nvme")


def stash(x, key):
    return torch.ops.slc.stash(x, key)


def unstash(token):
    return torch.ops.slc.unstash(token)


def unstash_wait(token, like):
    return torch.ops.slc.unstash_wait(token, like.shape, like.dtype, like.device)


def same_transfer(actual, expected, msg=None):
    """Two issue tokens are equivalent when they name the same kind of transfer."""
    got, want = ops.transfer_of(actual), ops.transfer_of(expected)
    assert (got.key.split("#")[0], got.direction, got.source, got.destination, got.kind) == (
        want.key.split("#")[0], want.direction, want.source, want.destination, want.kind
    ), msg


def test_every_op_is_implemented_and_nothing_else_is_defined():
    defined = {name for name in dir(torch.ops.slc) if not name.startswith("_")}
    names = {op.overloadpacket.__name__ for op in vocabulary.SLC_OPS}
    assert names <= defined
    for op in vocabulary.SLC_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeExplicitAutograd"), op


def test_opcheck_waits(nvme_stash):
    x = torch.randn(4, 5)
    token = stash(x, nvme_stash.graph_key("k"))
    torch.library.opcheck(WAIT, (token, [x]))
    load_token = unstash(token)
    torch.library.opcheck(UNSTASH_WAIT, (load_token, [4, 5], torch.float32, CPU))
    torch.library.opcheck(MARK, ("blk0.sb0 fwd", True))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_opcheck_issue_ops(nvme_stash, dynamic):
    x = torch.randn(4, 5)
    token = stash(x, nvme_stash.graph_key("k"))
    torch.library.opcheck(STASH, (x, nvme_stash.graph_key("k")), test_utils=ISSUE_CHECKS)
    aot_autograd_check(STASH, (x, nvme_stash.graph_key("k")), {}, dynamic, assert_equals_fn=same_transfer,
                       check_gradients="auto")
    for check in ISSUE_CHECKS:  # a stash is loaded once: a stash of its own for each check
        token = stash(x, nvme_stash.graph_key("k"))
        torch.library.opcheck(UNSTASH, (token,), test_utils=(check,))


@pytest.mark.usefixtures("without_collections")
def test_stash_round_trip_counts_bytes_and_forgets_its_tokens(nvme_stash):
    x = torch.randn(300, 7)
    token = stash(x, nvme_stash.graph_key("blk0.sb0.a"))
    torch.ops.slc.wait(token, [x])
    load_token = unstash(token)
    loaded = unstash_wait(load_token, x)
    assert torch.equal(loaded, x)
    assert torch.equal(unstash_wait(load_token, x), x)  # repeatable
    with pytest.raises(Exception, match="graph expects"):
        torch.ops.slc.unstash_wait(load_token, [7, 300], torch.float32, CPU)
    nbytes = 300 * 7 * 4
    assert dict(runtime_stats().cumulative.bytes_moved) == {(ACT, DEVICE, NVME): nbytes, (ACT, NVME, DEVICE): nbytes}
    del token, load_token
    assert ops.pending_tokens() == 0


def test_a_stash_on_nvme_is_freed_by_its_load_while_its_token_lives(nvme_stash):
    """`slc::unstash` is a stash's last use: its slot goes back once the read is done,
    with no collection and whatever still holds the token; a second load is refused."""
    engine = nvme_stash.engine
    before, used, resident = set(engine.keys()), engine.arena.space.used_bytes, runtime_stats().resident_bytes[NVME]
    x = torch.randn(300, 7)
    token = stash(x, nvme_stash.graph_key("blk0.sb0.a"))
    torch.ops.slc.wait(token, [x])
    assert len(set(engine.keys()) - before) == 1
    assert runtime_stats().resident_bytes[NVME] == resident + x.numel() * 4
    loaded = unstash_wait(unstash(token), x)
    assert torch.equal(loaded, x)
    assert set(engine.keys()) == before
    assert (engine.arena.space.used_bytes, runtime_stats().resident_bytes[NVME]) == (used, resident)
    with pytest.raises(Exception, match="loaded already"):
        unstash(token)
    tokens = [stash(x + i, nvme_stash.graph_key(f"blk0.sb0.b{i}")) for i in range(3)]
    torch.ops.slc.wait_many(tokens, [x, x, x])
    loads = torch.ops.slc.unstash_many(tokens)
    assert [torch.equal(unstash_wait(load, x), x + i) for i, load in enumerate(loads)] == [True] * 3
    assert set(engine.keys()) == before and engine.arena.space.used_bytes == used


@pytest.mark.skipif(torch.cuda.is_available(), reason="zero-copy host tier is CPU-only")
def test_zero_copy_tiers_hand_the_graph_its_own_copy(global_engine):
    host = ActivationStash(global_engine, "host")
    x = torch.randn(256)
    token = stash(x, host.graph_key("h"))
    loaded = unstash_wait(unstash(token), x)
    assert loaded.data_ptr() != x.data_ptr() and torch.equal(loaded, x)
    stats = runtime_stats().cumulative
    assert dict(stats.bytes_moved) == {}
    assert stats.local_copy_bytes == 2 * 256 * 4


def _streamed(engine, values, group_issues=False):
    streamer = WeightStreamer(engine, "nvme", live_blocks=2, group_issues=group_issues)
    keys = []
    for name, value in values.items():
        stored = streamer.stored_key_for(name, value)
        streamer.offload(stored, value)
        keys.append(streamer.graph_key(stored))
    return streamer, keys


def test_fetch_is_served_by_its_issued_load_or_loads_once(global_engine):
    a, b = torch.randn(64, 8), torch.randn(32)
    expected = {"a": a.clone(), "b": b.clone()}
    streamer, (key_a, key_b) = _streamed(global_engine, {"a": a, "b": b})
    assert a.untyped_storage().nbytes() == 0  # released
    bwd_a = WeightKey(key_a.streamer, key_a.stored, phase="bwd")
    for key in (key_a, bwd_a, bwd_a):  # issuing a pending key again does nothing
        torch.ops.slc.fetch_issue(key.format())
    assert sorted(streamer.pending) == sorted([key_a.format(), bwd_a.format()])
    torch.testing.assert_close(torch.ops.slc.fetch_weight(a, key_a.format()), expected["a"])
    torch.testing.assert_close(torch.ops.slc.fetch_weight(a, bwd_a.format()), expected["a"])
    torch.testing.assert_close(torch.ops.slc.fetch_weight(b, key_b.format()), expected["b"])  # not issued
    loads = runtime_stats().cumulative.bytes_moved[WEIGHT, NVME, DEVICE]
    assert loads == 2 * a.numel() * 4 + b.numel() * 4
    assert streamer.pending == {}
    torch.ops.slc.fetch_issue(key_b.format())
    streamer.drain()  # what gathered_weights does before the weights change
    assert streamer.pending == {}


def test_grouped_issues_load_together_at_the_next_fetch(global_engine, monkeypatch):
    """A streamer that groups its issues (the graphs put each run of issues just
    before a fetch) holds them until that fetch, then starts their loads in one
    `load_many` call; a drain drops what it still holds."""
    values = {name: torch.randn(16, 4) for name in "abc"}
    expected = {name: value.clone() for name, value in values.items()}
    streamer, keys = _streamed(global_engine, values, group_issues=True)
    together = []
    load_many = global_engine.load_many
    monkeypatch.setattr(global_engine, "load_many", lambda stored, kind: together.append(list(stored)) or
                        load_many(stored, kind))
    for key in keys[1:]:
        torch.ops.slc.fetch_issue(key.format())
    assert streamer.pending == {} and list(streamer.queued) == [k.format() for k in keys[1:]]
    before = runtime_stats().cumulative.bytes_moved.get((WEIGHT, NVME, DEVICE), 0)
    torch.testing.assert_close(torch.ops.slc.fetch_weight(values["a"], keys[0].format()), expected["a"])
    assert together == [[k.stored for k in keys[1:]]] and streamer.queued == {}
    for name, key in zip("bc", keys[1:]):
        torch.testing.assert_close(torch.ops.slc.fetch_weight(values[name], key.format()), expected[name])
    loads = runtime_stats().cumulative.bytes_moved[WEIGHT, NVME, DEVICE] - before
    assert loads == 3 * 16 * 4 * 4  # each weight loaded once
    torch.ops.slc.fetch_issue(keys[0].format())
    streamer.drain()
    assert streamer.queued == {} and streamer.pending == {}


def test_fetch_weight_passes_the_gradient_to_its_parameter(global_engine):
    w = torch.nn.Parameter(torch.randn(4, 4))
    reference = w.detach().clone()
    _, (key,) = _streamed(global_engine, {"w": w})
    x = torch.randn(3, 4)
    (x @ torch.ops.slc.fetch_weight(w, key.format())).sum().backward()
    torch.testing.assert_close(w.grad, (x.T @ torch.ones(3, 4)))
    torch.testing.assert_close(torch.ops.slc.fetch_weight(w, key.format()), reference)


def offload_roundtrip(x, w, key):
    """Stashes an activation, overlaps it with a matmul, loads it back."""
    a = x * 2
    token = torch.ops.slc.stash(a, key)
    y = (w @ w).relu()  # relu keeps the matmul from fusing with the later add
    torch.ops.slc.wait(token, [a])
    loaded = torch.ops.slc.unstash_wait(torch.ops.slc.unstash(token), a.shape, a.dtype, a.device)
    return (y + loaded).sum()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.usefixtures("without_collections")
def test_compiled_with_autograd(nvme_stash, backend):
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    expected = ((w @ w).relu() + x * 2).sum()
    (expected_grad,) = torch.autograd.grad(expected, w)
    key = nvme_stash.graph_key("act")
    with inductor_config.patch(reorder_for_peak_memory=False):
        out = torch.compile(offload_roundtrip, backend=backend, fullgraph=True)(x, w, key)
        out.backward()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, expected_grad, rtol=1e-4, atol=1e-4)
    nbytes = 32 * 32 * 4
    assert dict(runtime_stats().bytes_moved) == {(ACT, DEVICE, NVME): nbytes, (ACT, NVME, DEVICE): nbytes}
    assert ops.pending_tokens() == 0


@pytest.mark.slow
def test_inductor_keeps_the_schedule_order(nvme_stash):
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    # Both reorderings move transfers next to their users and lose the overlap.
    with inductor_config.patch(reorder_for_peak_memory=False, reorder_for_locality=False):
        compiled = torch.compile(offload_roundtrip, backend="inductor", fullgraph=True)
        out, (code,) = run_and_get_code(compiled, x, w, nvme_stash.graph_key("act"))
    torch.testing.assert_close(out, ((w @ w).relu() + x * 2).sum(), rtol=1e-4, atol=1e-4)
    positions = [
        code.index(text)
        for text in ("slc.stash.default(", "extern_kernels.mm(", "slc.wait.default(",
                     "slc.unstash.default(", "slc.unstash_wait.default(")
    ]
    assert positions == sorted(positions)


class InsertPrefetch(CustomGraphPass):
    """Post-grad pass: reads the weight `w` through `slc::fetch_weight`, its load issued
    by `slc::fetch_issue` at the start of the graph, as `place_prefetches` does."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        w = [n for n in graph.nodes if n.op == "placeholder"][1]
        users = list(w.users)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            issue = graph.call_function(FETCH_ISSUE, (self.key,))
            fetch = graph.call_function(FETCH_WEIGHT, (w, self.key))
        issue.meta["val"] = vocabulary.fake_token()
        fetch.meta["val"] = w.meta["val"]
        for user in users:
            user.replace_input_with(w, fetch)
        graph.lint()

    def uuid(self) -> str:
        return f"slcompile.tests.runtime.InsertPrefetch.{self.key}"


@pytest.mark.slow
def test_fetch_ops_inserted_into_a_post_grad_graph(global_engine):
    def model(x, w):
        return torch.mm(x, w).relu() + torch.sin(x)

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    expected = model(x, w)
    _, (key,) = _streamed(global_engine, {"w": w.clone()})
    with torch.no_grad(), inductor_config.patch(
        post_grad_custom_post_pass=InsertPrefetch(key.format()), reorder_for_peak_memory=False,
        pattern_matcher=False,
    ):
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        out, (code,) = run_and_get_code(compiled, x, torch.zeros(64, 64))  # the graph reads w's tier
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert code.index("slc.fetch_issue.default(") < code.index("slc.fetch_weight.default(")
    assert dict(runtime_stats().bytes_moved) == {(WEIGHT, DEVICE, NVME): 64 * 64 * 4, (WEIGHT, NVME, DEVICE): 64 * 64 * 4}


def test_symbolic_batch_size_flows_into_unstash_wait(nvme_stash):
    compiled = torch.compile(offload_roundtrip_batched, backend="aot_eager", fullgraph=True)
    w = torch.randn(8, 8)
    key = nvme_stash.graph_key("act.b")
    for batch in (3, 5):
        x = torch.randn(batch, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, w, key), (x * 2) @ w)
    nbytes = (3 + 5) * 8 * 4
    assert dict(runtime_stats().bytes_moved) == {(ACT, DEVICE, NVME): nbytes, (ACT, NVME, DEVICE): nbytes}


def offload_roundtrip_batched(x, w, key):
    """Like `offload_roundtrip` with an activation whose batch dim may be symbolic."""
    a = x * 2
    token = torch.ops.slc.stash(a, key)
    torch.ops.slc.wait(token, [a])
    loaded = torch.ops.slc.unstash_wait(torch.ops.slc.unstash(token), a.shape, a.dtype, a.device)
    return loaded @ w

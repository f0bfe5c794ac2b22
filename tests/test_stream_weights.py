"""Block weights on the nvme tier: exact numerics, weight traffic independent of K."""

import copy

import pytest
import torch

import slcompile
from conftest import assert_matches_eager, fetched_weights
from models import GPTConfig, TinyGPT, hf_gpt2, make_gpt_batch
from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
from slcompile.meta import SlcMeta, set_slc_meta
from slcompile.passes.stream_weights import place_prefetches
from slcompile.schedules import schedule_of
from slcompile.vocabulary import FETCH_WEIGHT, WeightKey, is_slc_op

CFG = GPTConfig()
NVME = {"lowering": "aot_eager", "weights": "nvme"}
LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)


def _fetched_bytes(graph, model):
    """Bytes and count of the parameters a compiled graph fetches."""
    sizes = fetched_weights(graph)
    return sum(sizes.values()), len(sizes)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_tiny_gpt_weights_on_nvme_match_eager(k):
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**NVME, "num_subbatches": k})
    assert slcompile.compile_reports()[-1].fallback_reason is None


def test_hf_gpt2_weights_on_nvme_match_eager():
    idx, labels = make_gpt_batch(CFG, 8)

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(hf_gpt2(), call, {**NVME, "num_subbatches": 2})


def test_block_weights_leave_memory_embeddings_stay():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    compiled(idx, targets)[1].backward()
    offloaded = dict(slcompile.offloaded_parameters(model))
    block_params = {n for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert set(offloaded) == block_params
    for name, param in model.named_parameters():
        released = param.untyped_storage().nbytes() == 0
        assert released == (name in block_params), name
    assert slcompile.compile_reports()[-1].streamed_bytes == sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n in block_params
    )


def test_weight_bytes_per_training_step_do_not_depend_on_k():
    idx, targets = make_gpt_batch(CFG, 8)
    per_step = {}
    for k in (1, 2, 4, 8):
        torch._dynamo.reset()
        model = TinyGPT(CFG)
        compiled = torch.compile(
            model, backend="speedloader", options={**NVME, "num_subbatches": k, "live_blocks": 1}
        )
        compiled(idx, targets)[1].backward()  # compiles and offloads
        report = slcompile.compile_reports()[-1]
        forward_bytes, forward_count = _fetched_bytes(report.graphs["forward"], model)
        backward_bytes, _ = _fetched_bytes(report.graphs["backward"], model)
        # Every block weight once in the forward; the backward fetches what it reads
        # (not the biases of linear layers: their gradient does not need their value).
        assert forward_bytes == report.streamed_bytes
        assert 0 < backward_bytes < forward_bytes
        assert forward_count == CFG.n_layers * 12
        mark_step()
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            compiled(idx, targets)[1].backward()
            step = mark_step()
            assert step.bytes_moved.get(LOAD, 0) == forward_bytes + backward_bytes
            assert step.bytes_moved.get((TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME), 0) == 0
        per_step[k] = step.bytes_moved[LOAD]
    assert len(set(per_step.values())) == 1, per_step


def test_forward_only_loads_each_weight_once():
    model = TinyGPT(CFG)
    idx, _ = make_gpt_batch(CFG, 8)
    with torch.no_grad():
        expected, _ = copy.deepcopy(model)(idx)
        compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 4, "live_blocks": 1})
        compiled(idx)
        mark_step()
        logits, _ = compiled(idx)
        step = mark_step()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert step.bytes_moved[LOAD] == slcompile.compile_reports()[-1].streamed_bytes


def test_prefetch_serves_every_fetch_with_one_load():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2, "live_blocks": 2})
    compiled(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    cycle = _fetched_bytes(report.graphs["forward"], model)[0] + _fetched_bytes(report.graphs["backward"], model)[0]
    with slcompile.gathered_weights(model):  # drops what the first step prefetched
        pass
    reset_runtime_stats()
    steps = 3
    for _ in range(steps):
        compiled(idx, targets)[1].backward()
    with slcompile.gathered_weights(model):  # waits for (and drops) the last prefetch
        gathered = slcompile.runtime_stats().bytes_moved[LOAD]
    block0 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers.0."))
    # Each fetch was served by exactly one load. Besides: the prefetch of the next
    # step's first block, issued at the end of the last backward (then dropped),
    # and the gather itself, which loads every streamed weight once.
    assert gathered == steps * cycle + block0 + report.streamed_bytes


def test_optimizer_steps_through_gathered_weights_match_eager():
    idx, targets = make_gpt_batch(CFG, 8)
    eager = TinyGPT(CFG)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 4})
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt_eager.zero_grad()
        eager(idx, targets)[1].backward()
        opt_eager.step()
        opt.zero_grad()
        compiled(idx, targets)[1].backward()
        with slcompile.gathered_weights(model):
            opt.step()
    with slcompile.gathered_weights(model):
        for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5, msg=name)
        state = copy.deepcopy(model.state_dict())
    assert all(t.untyped_storage().nbytes() > 0 for t in state.values())


@pytest.mark.slow
def test_weights_on_nvme_inductor_match_eager():
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(
        TinyGPT(CFG), lambda m: m(idx, targets), {"weights": "nvme", "num_subbatches": 2}
    )


def _fetching_graph(blocks):
    """One fetch per block, read by that block's sub-batch 0: the shape `stream_weights`
    leaves in a partitioned graph."""
    graph = torch.fx.Graph()
    outputs = []
    for block in blocks:
        param = graph.placeholder(f"p{block}")
        fetch = graph.call_function(FETCH_WEIGHT, (param, WeightKey("w9", f"w9:p{block}").format()))
        set_slc_meta(fetch, SlcMeta("block", block, None, role="load"))
        relu = graph.call_function(torch.ops.aten.relu.default, (fetch,))
        set_slc_meta(relu, SlcMeta("block", block, 0))
        outputs.append(relu)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule({}, graph)


def _transfers(gm):
    return [f"{n.target.overloadpacket.__name__} {n.args[-1].split(':')[1]}" for n in gm.graph.nodes if is_slc_op(n)]


def test_place_prefetches_issues_each_block_ahead_around_the_step():
    forward, backward = _fetching_graph([0, 1, 2]), _fetching_graph([2, 1, 0])
    placed = place_prefetches(forward, backward, live_blocks=2)
    assert placed.ahead == 1 and placed.issues == {"fwd": 3, "bwd": 3}
    assert _transfers(forward) == [
        "fetch_issue p1@fwd", "fetch_weight p0@fwd",
        "fetch_issue p2@fwd", "fetch_weight p1@fwd",
        "fetch_issue p2@bwd", "fetch_weight p2@fwd",  # the forward's end issues the backward's first
    ]
    assert _transfers(backward) == [
        "fetch_issue p1@bwd", "fetch_weight p2@bwd",
        "fetch_issue p0@bwd", "fetch_weight p1@bwd",
        "fetch_issue p0@fwd", "fetch_weight p0@bwd",  # ... and the backward's the next forward's
    ]
    assert schedule_of(forward, backward).text() == """\
fwd fetch.issue blk1
fwd fetch.wait blk0
fwd blk0.sb0
fwd fetch.issue blk2
fwd fetch.wait blk1
fwd blk1.sb0
fwd fetch.issue blk2@bwd
fwd fetch.wait blk2
fwd blk2.sb0
bwd fetch.issue blk1
bwd fetch.wait blk2
bwd blk2.sb0
bwd fetch.issue blk0
bwd fetch.wait blk1
bwd blk1.sb0
bwd fetch.issue blk0@fwd
bwd fetch.wait blk0
bwd blk0.sb0"""


def test_place_prefetches_with_one_live_block_issues_nothing():
    forward = _fetching_graph([0, 1])
    placed = place_prefetches(forward, None, live_blocks=1)
    assert placed.issues == {"fwd": 0}
    assert _transfers(forward) == ["fetch_weight p0@fwd", "fetch_weight p1@fwd"]


_RELEASED_USES = r"""
import io, sys
import torch
sys.path.insert(0, "tests")
import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch

config = GPTConfig()
model = TinyGPT(config)
idx, targets = make_gpt_batch(config, 4)
compiled = torch.compile(model, backend="speedloader",
                         options={"lowering": "aot_eager", "weights": "nvme", "num_subbatches": 2})
compiled(idx, targets)[1].backward()
weight = dict(model.named_parameters())["layers.1.mlp.fc.weight"]
uses = {
    "adamw": lambda: torch.optim.AdamW(model.parameters()).step(),
    "adamw_foreach": lambda: torch.optim.AdamW(model.parameters(), foreach=True).step(),
    "adamw_fused": lambda: torch.optim.AdamW(model.parameters(), fused=True).step(),
    "eager_forward": lambda: model(idx, targets),
    "data": lambda: weight.data.sum(),
    "clone": lambda: weight.clone(),
    "save_state_dict": lambda: torch.save(model.state_dict(), io.BytesIO()),
}
for use, run in uses.items():
    try:
        run()
        print(use, "ran")
    except slcompile.ReleasedWeightError as error:
        print(use, "raised:", error)
print("repr:", repr(weight).replace("\n", " "))
"""


def test_released_weights_raise_a_named_error_outside_gathered_weights():
    import subprocess
    import sys

    # A subprocess: before the fix each of these uses read freed memory and crashed.
    done = subprocess.run([sys.executable, "-c", _RELEASED_USES], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for use in ("adamw", "adamw_foreach", "adamw_fused", "eager_forward", "data", "clone", "save_state_dict"):
        assert lines[use].startswith("raised: parameter layers."), (use, lines[use])
        assert "rests on the nvme tier" in lines[use] and "slcompile.gathered_weights(model)" in lines[use]
    assert "layers.1.mlp.fc.weight" in lines["clone"] and "layers.1.mlp.fc.weight" in lines["data"]
    assert "layers.1.mlp.fc.weight, on the nvme tier" in lines["repr:"]


def test_state_dict_saved_inside_gathered_weights_round_trips_and_the_model_still_trains():
    import io

    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    compiled(idx, targets)[1].backward()
    model.to("cpu").float().train()  # conversions to what the weights already are read nothing
    with pytest.raises(slcompile.ReleasedWeightError, match=r"parameter layers\.0\..* rests on the nvme tier"):
        model.state_dict()  # outside: refused before anything could be written
    with slcompile.gathered_weights(model):
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(loaded[name], value, msg=name)
    optimizer, reference = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(eager.parameters())
    eager(idx, targets)[1].backward()
    with slcompile.gathered_weights(model):
        optimizer.step()
    reference.step()
    torch.testing.assert_close(compiled(idx, targets)[1], eager(idx, targets)[1])


def test_a_save_of_released_weights_is_refused_before_it_touches_the_checkpoint(tmp_path):
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step():
        optimizer.zero_grad()
        compiled(idx, targets)[1].backward()
        with slcompile.gathered_weights(model):
            optimizer.step()

    train_step()
    checkpoint = tmp_path / "ckpt.pt"
    with slcompile.gathered_weights(model):
        torch.save(model.state_dict(), checkpoint)
        saved = {name: value.clone() for name, value in model.state_dict().items()}
    good = checkpoint.read_bytes()
    train_step()  # new weights, on the nvme tier again
    with pytest.raises(slcompile.ReleasedWeightError) as refused:
        torch.save(model.state_dict(), checkpoint)
    assert checkpoint.read_bytes() == good
    loaded = torch.load(checkpoint)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    assert str(refused.value).startswith(
        "parameter layers.0.ln1.weight rests on the nvme tier and holds no memory (detach, as state_dict() calls "
        "it); read or update it inside slcompile.gathered_weights(model)")


def test_a_plain_optimizer_step_on_released_weights_is_refused_before_it_changes_any_parameter():
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    compiled(idx, targets)[1].backward()
    eager(idx, targets)[1].backward()
    optimizer, reference = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(eager.parameters(), lr=0.5)
    # Unrefused, the for-loop SGD would update the embeddings first and then raise.
    with pytest.raises(slcompile.ReleasedWeightError) as refused:
        optimizer.step()
    with slcompile.gathered_weights(model):
        for name, param in model.named_parameters():
            assert torch.equal(param, initial[name]), name
        optimizer.step()
    assert str(refused.value).startswith("parameter layers.0.ln1.weight rests on the nvme tier and holds no memory "
                                         "(SGD.step)")
    reference.step()
    expected = dict(eager.named_parameters())
    with slcompile.gathered_weights(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_explain_and_tune_of_a_model_whose_weights_rest_on_nvme_equal_those_of_a_fresh_copy():
    model = TinyGPT(CFG)
    fresh = copy.deepcopy(model)
    idx, targets = make_gpt_batch(CFG, 4)
    options = {**NVME, "num_subbatches": 2}
    expected = str(slcompile.explain(fresh, idx, targets, profile=None, **options))
    expected_tune = slcompile.tune(fresh, idx, targets, memory_budget="64MiB", num_subbatches=[2],
                                   live_blocks=(2,), **NVME)
    compiled = torch.compile(model, backend="speedloader", options=options)
    compiled(idx, targets)[1].backward()
    assert slcompile.offloaded_parameters(model)
    assert str(slcompile.explain(model, idx, targets, profile=None, **options)) == expected
    tuned = slcompile.tune(model, idx, targets, memory_budget="64MiB", num_subbatches=[2], live_blocks=(2,), **NVME)
    assert tuned.options == expected_tune.options
    assert tuned.memory.peak_bytes == expected_tune.memory.peak_bytes


def test_a_batch_not_divisible_by_k_after_weights_moved_to_nvme_runs_plainly_with_them_loaded():
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    for batch, seed in ((8, 0), (5, 1)):  # the second compiles plainly: 5 is not divisible by 2
        idx, targets = make_gpt_batch(CFG, batch, seed=seed)
        logits, loss = compiled(idx, targets)
        expected_logits, expected_loss = eager(idx, targets)
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
        loss.backward()
        expected_loss.backward()
    assert "not divisible by num_subbatches=2" in slcompile.compile_reports()[-1].fallback_reason
    assert len(slcompile.offloaded_parameters(model)) > 0
    expected = dict(eager.named_parameters())
    for name, param in model.named_parameters():  # both steps' gradients, summed
        torch.testing.assert_close(param.grad, expected[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_a_dynamic_batch_not_divisible_by_k_at_run_time_runs_plainly_with_the_weights_loaded(caplog):
    model = TinyGPT(CFG)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    idx, targets = make_gpt_batch(CFG, 8)
    torch._dynamo.mark_dynamic(idx, 0)
    torch._dynamo.mark_dynamic(targets, 0)
    with torch.no_grad():  # the backward's fused weight gradients would specialize the batch
        compiled(idx, targets)
        for batch in (5, 7):
            odd_idx, odd_targets = make_gpt_batch(CFG, batch, seed=batch)
            with caplog.at_level("WARNING", logger="slcompile"):
                logits, loss = compiled(odd_idx, odd_targets)
            with slcompile.gathered_weights(model):
                expected_logits, expected_loss = model(odd_idx, odd_targets)
            torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert "batch size 7 is not divisible by num_subbatches=2; running this call with plain" in caplog.text
    assert len(slcompile.compile_reports()) == 1  # no recompile: the guard ran the plain graph


def test_a_whole_model_saved_with_its_weights_offloaded_holds_their_values(tmp_path):
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(idx, targets)[1].backward()
    with slcompile.gathered_weights(model):
        optimizer.step()
    optimizer.zero_grad()
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"an earlier checkpoint")
    # Pickled after torch.save truncated the file: a refusal would have left it empty.
    torch.save(model, checkpoint)
    loaded = torch.load(checkpoint, weights_only=False)
    with slcompile.gathered_weights(model):
        expected = {name: value.clone() for name, value in model.state_dict().items()}
    assert loaded.state_dict().keys() == expected.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert {type(param) for param in loaded.parameters()} == {torch.nn.Parameter}
    torch.save(model.state_dict(keep_vars=True), checkpoint)  # the parameters themselves, pickled
    kept = torch.load(checkpoint, weights_only=False)
    assert kept.keys() == expected.keys()
    for name, param in model.named_parameters():
        assert type(kept[name]) is torch.nn.Parameter and torch.equal(kept[name], expected[name]), name
    torch.testing.assert_close(loaded(idx, targets)[1], compiled(idx, targets)[1])

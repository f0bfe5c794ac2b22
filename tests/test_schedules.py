"""The schedules: same results as eager, each in its own order, with the weight traffic
its order implies (grad_accumulation: K times speedloader's; no_offload: none), and the
schedule read back from the compiled graphs equal to the one the policy wrote."""

import dataclasses

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch
from slcompile.analysis.order import block_order, layer_major_violations, sample_major_violations, step_order
from slcompile.config import SCHEDULES
from slcompile.meta import get_slc_meta
from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
from slcompile.schedules import POLICIES, Policy, ScheduleRequest, schedule_of
from slcompile.schedules.examples.lifetime_aware import lifetime_aware_policy
from slcompile.vocabulary import WeightKey, is_compute, is_fetch

CFG = GPTConfig()
LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)
STORE = (TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME)
WEIGHTS = {"speedloader": "nvme", "grad_accumulation": "nvme", "no_offload": "device", "lifetime_aware": "nvme"}


def _options(schedule, k, **extra):
    return {"lowering": "aot_eager", "schedule": schedule, "weights": WEIGHTS[schedule], "num_subbatches": k, **extra}


def _fetches(gm):
    return [n for n in gm.graph.nodes if is_fetch(n)]


def _fetched_bytes(gm):
    """Bytes of every fetch a compiled graph makes (each fetch counted)."""
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in _fetches(gm))


def _block_bytes(model, position):
    prefix = f"layers.{position}."
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix))


def _train_step(compiled, model, idx, targets):
    for p in model.parameters():
        p.grad = None
    compiled(idx, targets)[1].backward()


def test_every_schedule_option_has_a_policy():
    assert set(POLICIES) == set(SCHEDULES)
    request = ScheduleRequest(blocks=(0, 1), num_subbatches=2, live_blocks=2, weights_streamed=True)
    per_subbatch = [name for name, policy in POLICIES.items() if policy.build(request).fetches_per_subbatch()]
    assert per_subbatch == ["grad_accumulation"]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("schedule", ["speedloader", "grad_accumulation", "no_offload"])  # lifetime_aware: below
def test_tiny_gpt_matches_eager(schedule, k):
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), _options(schedule, k))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.config.schedule == schedule
    assert (report.streamed_bytes > 0) == (WEIGHTS[schedule] == "nvme")


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accumulation_with_resident_weights_matches_eager(k):
    idx, targets = make_gpt_batch(CFG, 8)
    options = {**_options("grad_accumulation", k), "weights": "device"}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accumulation_with_a_dynamic_batch_matches_eager_sample_major(k):
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", k)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options, dynamic_inputs=(idx, targets))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    blocks = sorted(report.block_inputs)
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert sample_major_violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind


def test_grad_accumulation_schedule_text():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    expected = """\
fwd prefix.sb0
fwd blk0.sb0
fwd blk1.sb0
fwd suffix.sb0
fwd prefix.sb1
fwd blk0.sb1
fwd blk1.sb1
fwd suffix.sb1
bwd suffix.sb1
bwd blk1.sb1
bwd blk0.sb1
bwd prefix.sb1
bwd suffix.sb0
bwd blk1.sb0
bwd blk0.sb0
bwd prefix.sb0"""
    explanation = slcompile.explain(TinyGPT(cfg), idx, targets, schedule="grad_accumulation", num_subbatches=2)
    assert explanation.schedule == expected
    model = TinyGPT(cfg)
    options = {**_options("grad_accumulation", 2), "weights": "device"}
    torch.compile(model, backend="speedloader", options=options)(idx, targets)[1].backward()
    assert slcompile.compile_reports()[-1].schedule == expected


def test_speedloader_schedule_text_with_streamed_weights():
    cfg = GPTConfig(n_layers=3)
    idx, targets = make_gpt_batch(cfg, 4)
    model = TinyGPT(cfg)
    torch.compile(model, backend="speedloader", options=_options("speedloader", 2, live_blocks=2))(
        idx, targets
    )[1].backward()
    report = slcompile.compile_reports()[-1]
    # Each block's load is issued one block visit ahead of its fetch, around the
    # cycle: the forward's last block issues the backward's first, the backward's
    # last issues the next forward's first.
    assert report.schedule == """\
fwd prefix.sb0
fwd prefix.sb1
fwd fetch.issue blk1
fwd fetch.wait blk0
fwd blk0.sb0
fwd blk0.sb1
fwd fetch.issue blk2
fwd fetch.wait blk1
fwd blk1.sb0
fwd blk1.sb1
fwd fetch.issue blk2@bwd
fwd fetch.wait blk2
fwd blk2.sb0
fwd blk2.sb1
fwd suffix
bwd suffix
bwd fetch.issue blk1
bwd fetch.wait blk2
bwd blk2.sb1
bwd blk2.sb0
bwd fetch.issue blk0
bwd fetch.wait blk1
bwd blk1.sb1
bwd blk1.sb0
bwd fetch.issue blk0@fwd
bwd fetch.wait blk0
bwd blk0.sb1
bwd blk0.sb0
bwd prefix.sb1
bwd prefix.sb0"""
    assert report.schedule == report.planned_schedule.text()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", ["grad_accumulation", "speedloader", "no_offload"])
def test_compiled_graphs_run_in_the_schedule_order(schedule, k):
    idx, targets = make_gpt_batch(CFG, 8)
    model = TinyGPT(CFG)
    torch.compile(model, backend="speedloader", options=_options(schedule, k))(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    blocks = sorted(report.block_inputs)
    violations = sample_major_violations if schedule == "grad_accumulation" else layer_major_violations
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind
    # Every step, prefix, suffix and weight fetches included, forward and backward:
    # the schedule read from the compiled graphs is the one the policy wrote.
    derived = schedule_of(report.graphs["forward"], report.graphs["backward"])
    assert derived.text() == report.schedule == report.planned_schedule.text()
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        expected = [step.tag for step in derived.phase(phase).compute().steps]
        assert list(step_order(report.graphs[kind])) == expected, kind


def test_grad_accumulation_on_llama_matches_eager_sample_major():
    idx, labels = make_gpt_batch(CFG, 4)

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(hf_llama(), call, _options("grad_accumulation", 2))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        runs = list(step_order(report.graphs[kind]))
        # Sub-batch by sub-batch: the embedding included, not only the blocks.
        assert runs[:6] == (
            ["prefix.sb0", "blk0.sb0", "blk1.sb0", "blk2.sb0", "blk3.sb0", "suffix.sb0"]
            if phase == "fwd"
            else ["suffix.sb1", "blk3.sb1", "blk2.sb1", "blk1.sb1", "blk0.sb1", "prefix.sb1"]
        ), kind


def test_grad_accumulation_fetches_each_block_once_per_subbatch():
    idx, targets = make_gpt_batch(CFG, 8)
    k = 4
    model = TinyGPT(CFG)
    torch.compile(model, backend="speedloader", options=_options("grad_accumulation", k))(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    for kind in ("forward", "backward"):
        seen = {}
        for node in _fetches(report.graphs[kind]):
            meta = get_slc_meta(node)
            seen.setdefault(WeightKey.parse(node.args[1]).stored, []).append(meta.subbatch)
            # Read by its own sub-batch only.
            assert {get_slc_meta(user).subbatch for user in node.users} == {meta.subbatch}
        assert seen and all(sorted(subs) == list(range(k)) for subs in seen.values()), kind
        keys = [node.args[1] for node in _fetches(report.graphs[kind])]
        assert len(set(keys)) == len(keys), "fetches a CSE pass could merge"
        # A sub-batch's fetches open its run of the block, before anything computes.
        started = set()
        for node in report.graphs[kind].graph.nodes:
            meta = get_slc_meta(node) if node.op == "call_function" else None
            if meta is None or meta.region != "block":
                continue
            if is_fetch(node):
                assert (meta.block, meta.subbatch) not in started, (kind, node.name)
            elif is_compute(node):
                started.add((meta.block, meta.subbatch))


def test_grad_accumulation_loads_k_times_the_weight_bytes_of_speedloader():
    idx, targets = make_gpt_batch(CFG, 8)
    per_step = {}
    for k in (1, 2, 4):
        for schedule in ("speedloader", "grad_accumulation"):
            torch._dynamo.reset()
            model = TinyGPT(CFG)
            compiled = torch.compile(
                model, backend="speedloader", options=_options(schedule, k, live_blocks=1)
            )
            _train_step(compiled, model, idx, targets)  # compiles and offloads
            report = slcompile.compile_reports()[-1]
            fetched = _fetched_bytes(report.graphs["forward"]) + _fetched_bytes(report.graphs["backward"])
            mark_step()
            _train_step(compiled, model, idx, targets)
            step = mark_step()
            # Without prefetch, every fetch is one load of its bytes, and nothing is stored.
            assert step.bytes_moved[LOAD] == fetched, (schedule, k)
            assert step.bytes_moved.get(STORE, 0) == 0
            per_step[schedule, k] = step.bytes_moved[LOAD]
    speedloader = per_step["speedloader", 1]
    for k in (1, 2, 4):
        assert per_step["speedloader", k] == speedloader
        assert per_step["grad_accumulation", k] == k * speedloader


@pytest.mark.parametrize("k, live_blocks", [(2, 2), (4, 3)])
def test_grad_accumulation_prefetch_serves_every_fetch_with_one_load(k, live_blocks):
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", k, live_blocks=live_blocks)
    compiled = torch.compile(model, backend="speedloader", options=options)
    _train_step(compiled, model, idx, targets)
    report = slcompile.compile_reports()[-1]
    cycle = _fetched_bytes(report.graphs["forward"]) + _fetched_bytes(report.graphs["backward"])
    with slcompile.gathered_weights(model):  # drops what the first step prefetched
        pass
    reset_runtime_stats()
    steps = 3
    for _ in range(steps):
        _train_step(compiled, model, idx, targets)
    with slcompile.gathered_weights(model):  # waits for (and drops) the last prefetch
        gathered = slcompile.runtime_stats().bytes_moved[LOAD]
    # Each fetch was served by exactly one load. Besides: the next step's first
    # `live_blocks - 1` block visits (sub-batch 0 through blocks 0, 1, ...),
    # prefetched at the end of the last backward and dropped, and the gather itself.
    ahead = sum(_block_bytes(model, position) for position in range(live_blocks - 1))
    assert gathered == steps * cycle + ahead + report.streamed_bytes


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_grad_accumulation_with_activations_on_nvme_matches_eager(recompute):
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", 2, activations="nvme", min_offload_bytes=0, recompute=recompute)
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    offloaded = int(report.offloaded_activations.bytes)
    assert offloaded > 0
    moved = slcompile.runtime_stats().bytes_moved
    stored = moved[TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME]
    loaded = moved[TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE]
    assert stored == loaded == offloaded
    # Stashes and unstashes, forward and backward, where the policy put them.
    assert "bwd unstash.wait blk0.sb0" in report.schedule
    assert report.schedule == report.planned_schedule.text()


def test_the_planner_stashes_what_the_budget_needs_longest_idle_first():
    from expecttest import assert_expected_inline

    from slcompile.schedules.base import SavedActivation
    from slcompile.schedules.planner import describe

    def block(b):
        return ("block", b, 0)

    # Each block saves its own internals (read by its own backward) and its output
    # (read by the next block, forward and backward); a small one must stay.
    saved = tuple(
        SavedActivation(f"x{b}", block(b), 100, block(b), block(b)) for b in range(3)
    ) + tuple(SavedActivation(f"h{b}", block(b), 100, block(b + 1), block(b + 1)) for b in range(2)) + (
        SavedActivation("small", block(2), 8, block(2), block(2), stays="smaller than min_offload_bytes (8 B)"),
    )
    request = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=1, activations_offloaded=True, has_prefix=False,
                              has_suffix=False, saved=saved, offload_at_least=150)
    schedule = POLICIES["speedloader"](request)
    assert_expected_inline("\n".join(describe(schedule)), """\
blk0.sb0: stash (200 B, idle 2 steps)
blk1.sb0: keep (its reload would not hide) (200 B, idle 0 steps)
blk2.sb0: keep (its reload would not hide) (100 B, idle 0 steps)""")
    # Each store waited for after its tensor's last forward use, each load waited for
    # before its first backward use and issued one compute step ahead.
    assert_expected_inline(schedule.text(), """\
fwd blk0.sb0
fwd stash.issue blk0.sb0
fwd stash.wait blk0.sb0
fwd blk1.sb0
fwd stash.wait blk0.sb0
fwd blk2.sb0
bwd unstash.issue blk0.sb0
bwd blk2.sb0
bwd unstash.issue blk0.sb0
bwd unstash.wait blk0.sb0
bwd blk1.sb0
bwd unstash.wait blk0.sb0
bwd blk0.sb0""")
    # Without a budget every activation that may leave does.
    everything = schedule.replan(offload_at_least=None)
    assert everything.stashes() == {block(b) for b in range(3)}


def test_with_a_machine_profile_the_planner_hides_and_places_transfers_by_time():
    from expecttest import assert_expected_inline

    from slcompile.analysis.machine import MachineProfile
    from slcompile.schedules.base import SavedActivation
    from slcompile.schedules.planner import TransferTiming, describe

    def block(b):
        return ("block", b, 0)

    # As above: each block saves 100 B read by its own backward and (blocks 0 and 1)
    # 100 B read by the next block, forward and backward. Each compute step takes 1 s.
    saved = tuple(SavedActivation(f"x{b}", block(b), 100, block(b), block(b)) for b in range(3)) + tuple(
        SavedActivation(f"h{b}", block(b), 100, block(b + 1), block(b + 1)) for b in range(2))
    compute = tuple(((phase, block(b)), 1.0) for phase in ("fwd", "bwd") for b in range(3))

    def planned(write, read, offload_at_least=150, compute=compute):
        disk = MachineProfile("disk", matmul_flops=1e12, memory_bandwidth=1e12, nvme_write=write, nvme_read=read)
        request = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=1, activations_offloaded=True, has_prefix=False,
                                  has_suffix=False, saved=saved, offload_at_least=offload_at_least,
                                  timing=TransferTiming(compute, disk, "nvme"))
        return POLICIES["speedloader"](request)

    # Block 0's 200 B store takes 2 s: the two forward steps after it cover it, so its
    # wait goes to the forward's end; each 100 B load takes 1 s: one step ahead of
    # its tensor's first backward use. Blocks 1 and 2 have too little compute after
    # their stores.
    schedule = planned(write=100, read=100)
    assert_expected_inline("\n".join(describe(schedule)), """\
blk0.sb0: stash (200 B, idle 2 steps, round trip 4000.000 ms)
blk1.sb0: keep (its transfers would not hide) (200 B, idle 0 steps, round trip 4000.000 ms)
blk2.sb0: keep (its transfers would not hide) (100 B, idle 0 steps, round trip 2000.000 ms)""")
    # The loads are where counting steps puts them; the store waits two steps later.
    by_steps = POLICIES["speedloader"](dataclasses.replace(schedule.request, timing=None))
    assert schedule.phase("bwd") == by_steps.phase("bwd")
    assert_expected_inline(schedule.phase("fwd").text(), """\
fwd blk0.sb0
fwd stash.issue blk0.sb0
fwd blk1.sb0
fwd blk2.sb0
fwd stash.wait blk0.sb0""")
    # When block 1's backward takes 0.5 s, block 0's own load (1 s) is issued two
    # steps ahead, at the backward's start, with the other.
    shorter = tuple((step, 0.5 if step == ("bwd", block(1)) else s) for step, s in compute)
    assert planned(write=100, read=100, compute=shorter).phase("bwd").text() == "\n".join([
        "bwd unstash.issue blk0.sb0", "bwd blk2.sb0", "bwd unstash.wait blk0.sb0", "bwd blk1.sb0",
        "bwd unstash.wait blk0.sb0", "bwd blk0.sb0"])
    # A store the forward's remaining compute cannot cover does not hide: kept, where
    # counting steps (idle 2) would stash it.
    slow = planned(write=50, read=100)
    assert slow.stashes() == set()
    assert describe(slow)[0].startswith("blk0.sb0: keep (its transfers would not hide)")
    assert POLICIES["speedloader"](dataclasses.replace(slow.request, timing=None)).stashes() == {block(0)}
    # Without a budget every unit leaves, hidden or not.
    assert slow.replan(offload_at_least=None).stashes() == {block(b) for b in range(3)}


def _transfers_early(request):
    """A policy written in a test: speedloader's, waiting for every stash at the end
    of the forward and issuing every load at the start of the backward."""
    from slcompile.schedules.base import Schedule, Step
    from slcompile.schedules.speedloader import speedloader_schedule

    steps = [s for s in speedloader_schedule(request).steps if s.kind not in ("stash.wait", "unstash.issue")]
    owners = list(dict.fromkeys(s.key for s in steps if s.kind == "stash.issue"))
    last_forward = max(i for i, s in enumerate(steps) if s.phase == "fwd")
    steps[last_forward + 1:last_forward + 1] = [Step("fwd", *owner, "stash.wait") for owner in owners]
    first_backward = min(i for i, s in enumerate(steps) if s.phase == "bwd" and not s.kind.startswith("fetch"))
    steps[first_backward:first_backward] = [Step("bwd", *owner, "unstash.issue") for owner in owners]
    return Schedule(tuple(steps))


def test_stash_and_unstash_run_where_the_schedule_puts_them():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 8)
    peaks = {}
    for schedule in ("speedloader", Policy("transfers_early", _transfers_early)):
        options = {**_options("speedloader", 2, activations="nvme", min_offload_bytes=0), "schedule": schedule}
        reset_runtime_stats()
        assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), options)
        report = slcompile.compile_reports()[-1]
        planned = report.planned_schedule
        derived = schedule_of(report.graphs["forward"], report.graphs["backward"])
        assert derived.text() == report.schedule == planned.text()
        # Each load is issued that many compute steps ahead of its wait (at most).
        bwd = planned.phase("bwd").steps
        compute = [i for i, s in enumerate(bwd) if s.kind == "compute"]
        ahead = []
        for i, step in enumerate(bwd):
            if step.kind == "unstash.wait":
                issue = max(j for j in range(i) if bwd[j].kind == "unstash.issue" and bwd[j].key == step.key)
                ahead.append(sum(issue < c < i for c in compute))
        assert max(ahead) == 1 if schedule == "speedloader" else max(ahead) > 2
        moved = slcompile.runtime_stats().bytes_moved
        stored = moved[TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME]
        loaded = moved[TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE]
        assert stored == loaded == int(report.offloaded_activations.bytes)
        peaks[getattr(schedule, "name", schedule)] = report.memory.peak_bytes["device"]
    # Everything comes back at the backward's start: more of it on the device at once.
    assert peaks["transfers_early"] > peaks["speedloader"]


def test_no_offload_moves_no_bytes():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(model, backend="speedloader", options=_options("no_offload", 4))
    _train_step(compiled, model, idx, targets)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert not _fetches(report.graphs["forward"]) and not _fetches(report.graphs["backward"])
    assert slcompile.offloaded_parameters(model) == []
    blocks = sorted(report.block_inputs)
    assert layer_major_violations(block_order(report.graphs["forward"]), blocks, 4, "fwd") == []
    mark_step()
    _train_step(compiled, model, idx, targets)
    step = mark_step()
    assert sum(step.bytes_moved.values()) == 0


@pytest.mark.parametrize("key", ["weights", "activations"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_no_offload_with_anything_off_the_device_is_refused(key, tier):
    options = {"schedule": "no_offload", key: tier}
    with pytest.raises(ValueError, match=rf"'schedule' and '{key}' conflict.*{key}='device'"):
        slcompile.SpeedLoaderConfig.from_options(options)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options=options)
    with pytest.raises(ValueError, match=rf"^speedloader options 'schedule' and '{key}' conflict"):
        compiled(idx, targets)


@pytest.mark.slow
def test_grad_accumulation_inductor_matches_eager_and_keeps_every_fetch():
    idx, targets = make_gpt_batch(CFG, 8)
    k = 2
    options = {"schedule": "grad_accumulation", "weights": "nvme", "num_subbatches": k}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    # 12 weights per TinyGPT block, each fetched once per sub-batch in the forward.
    assert len(_fetches(report.graphs["forward"])) == k * CFG.n_layers * 12
    blocks = sorted(report.block_inputs)
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert sample_major_violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind


@pytest.mark.parametrize("schedule", ["lifetime_aware", lifetime_aware_policy(min_hidden_steps=4)])
def test_lifetime_aware_keeps_what_cannot_hide_and_matches_eager(schedule):
    idx, targets = make_gpt_batch(CFG, 8)
    options = {**_options("lifetime_aware", 2, activations="nvme", min_offload_bytes=0), "schedule": schedule}
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    planned = report.planned_schedule
    last = CFG.n_layers - 1
    kept = {("block", last, 1)} if isinstance(schedule, str) else {("block", last, 1), ("block", last, 0)}
    stashable = {("prefix", None, s) for s in range(2)} | {("block", b, s) for b in range(CFG.n_layers) for s in range(2)}
    assert planned.stashes() == stashable - kept
    # The compiled graphs store and load exactly what the policy stashes, where it says.
    derived = schedule_of(report.graphs["forward"], report.graphs["backward"])
    assert derived.stashes() == planned.stashes()
    assert derived.text() == report.schedule == planned.text()
    assert any(why == "kept on the device by the schedule" for _, why in report.offloaded_activations.kept)
    moved = slcompile.runtime_stats().bytes_moved
    stored = moved[TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME]
    assert stored == moved[TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE] == int(report.offloaded_activations.bytes)


def _reversed_subbatches(request):
    """A policy written in a test: speedloader's order with each block's sub-batches
    run last to first in the forward (and first to last in the backward)."""
    from slcompile.schedules.base import Schedule, Step, add_fetches

    k = request.num_subbatches
    forward = [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for block in request.blocks:
        forward += [Step("fwd", "block", block, s) for s in reversed(range(k))]
    forward += [Step("fwd", "suffix", subbatch=s) for s in range(k)]
    backward = [Step("bwd", s.region, s.block, s.subbatch) for s in reversed(forward)]
    return Schedule(tuple(add_fetches(forward + backward, request, per_subbatch=False)))


def test_a_policy_passed_as_the_option_orders_the_compiled_graphs():
    idx, targets = make_gpt_batch(CFG, 8)
    options = {**_options("speedloader", 2), "schedule": Policy("reversed_subbatches", _reversed_subbatches)}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert "fwd blk0.sb1\nfwd blk0.sb0\nfwd fetch.issue" in report.schedule
    assert report.schedule == report.planned_schedule.text()

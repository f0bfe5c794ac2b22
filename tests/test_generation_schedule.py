"""Generation's passes as schedules (`slcompile.schedules.generation`), alone: the
steps a pass request asks for, in the order `generate` walks them. The end-to-end
test of the same schedules (walked, measured, equal to eager) is in test_generate.py."""

import itertools

import pytest

from slcompile.schedules import TRANSFER_KINDS
from slcompile.errors import PolicyError
from slcompile.schedules.base import Schedule, Step
from slcompile.schedules.generation import HIDDEN_STORES_IN_FLIGHT, KV_AHEAD, PassRequest, generation_pass
from slcompile.schedules.validate import validate_pass


def _lines(request):
    return generation_pass(request).text().splitlines()


def test_a_decode_pass_with_resident_weights_and_cache_moves_nothing_and_skips_finished_subbatches():
    # Sub-batch 1 has finished: only 0 and 2 run; the cache on the device is still
    # kept (stored) after each step, but nothing is fetched or loaded.
    request = PassRequest("decode", (0, 2), fetched=(False, False), kv_moves=False, stores=True)
    assert _lines(request) == [
        "decode prefix",
        "decode blk0.sb0", "decode store_kv.issue blk0.sb0", "decode blk0.sb2", "decode store_kv.issue blk0.sb2",
        "decode blk1.sb0", "decode store_kv.issue blk1.sb0", "decode blk1.sb2", "decode store_kv.issue blk1.sb2",
        "decode suffix"]
    # The last pass stores nothing.
    last = PassRequest("decode", (0, 2), fetched=(False, False), kv_moves=False, stores=False)
    assert _lines(last) == ["decode prefix", "decode blk0.sb0", "decode blk0.sb2", "decode blk1.sb0",
                            "decode blk1.sb2", "decode suffix"]


def test_a_prefill_of_one_part_stores_every_decode_subbatch_after_it_and_fetches_only_streamed_layers():
    # One prefill part holds both decode sub-batches' rows; layer 1 has no streamed weights.
    request = PassRequest("prefill", (0,), fetched=(True, False, True), kv_moves=True, stores=True, rows=(4, 2))
    assert _lines(request) == [
        "prefill prefix", "prefill fetch.issue blk0", "prefill fetch.wait blk0",
        "prefill blk0.sb0", "prefill store_kv.issue blk0.sb0", "prefill store_kv.issue blk0.sb1",
        "prefill fetch.issue blk2",
        "prefill blk1.sb0", "prefill store_kv.issue blk1.sb0", "prefill store_kv.issue blk1.sb1",
        "prefill fetch.wait blk2",
        "prefill blk2.sb0", "prefill store_kv.issue blk2.sb0", "prefill store_kv.issue blk2.sb1",
        "prefill suffix"]


@pytest.mark.parametrize("phase,layers,parts,kv_moves,spill", [
    (phase, layers, parts, kv_moves, spill)
    for phase, layers, parts, kv_moves, spill in itertools.product(
        ("prefill", "decode"), (1, 2, 5), (1, 2, 4), (False, True), (False, True))
    if not spill or (phase == "prefill" and kv_moves and parts >= 3 and layers >= 2)])
def test_every_pass_computes_each_step_once_with_its_transfers_issued_before_it_is_needed(
        phase, layers, parts, kv_moves, spill):
    subbatches = tuple(range(parts))
    request = PassRequest(phase, subbatches, fetched=(True,) * layers, kv_moves=kv_moves, stores=True,
                          rows=(2, 2), spill_hidden=spill)
    steps = validate_pass(generation_pass(request), request).steps
    assert {step.phase for step in steps} == {phase}
    assert all(step.kind == "compute" or step.kind in TRANSFER_KINDS for step in steps)
    at = {}
    for position, step in enumerate(steps):
        at.setdefault((step.kind, step.region, step.block, step.subbatch), []).append(position)
    computes = [(s.block, s.subbatch) for s in steps if s.kind == "compute" and s.region == "block"]
    # Layer-major: every sub-batch runs layer b before any runs layer b + 1; each once.
    assert computes == [(b, s) for b in range(layers) for s in subbatches]
    for block in range(layers):
        first = at["compute", "block", block, 0][0]
        # One fetch per layer per pass, issued before the previous layer runs.
        assert len(at["fetch.issue", "block", block, None]) == 1
        assert at["fetch.issue", "block", block, None][0] < at["fetch.wait", "block", block, None][0] < first
        if block:
            assert at["fetch.issue", "block", block, None][0] < at["compute", "block", block - 1, 0][0]
        for sb in subbatches:
            compute = at["compute", "block", block, sb][0]
            if phase == "decode" and kv_moves:
                # Each cache loads once, at most KV_AHEAD steps before its own.
                load = at["load_kv.issue", "block", block, sb]
                assert len(load) == 1 and load[0] < compute
                steps_between = sum(1 for s in steps[load[0]:compute] if s.kind == "compute")
                assert steps_between <= KV_AHEAD
            else:
                assert ("load_kv.issue", "block", block, sb) not in at
            if spill and block < layers - 1:
                # Its output leaves after it is made and comes back before the next layer needs it.
                # Its store is waited for once, after it is issued, and its load just
                # before the next layer takes it.
                spill_at, fill_at = at["spill.issue", "block", block, sb][0], at["fill.issue", "block", block, sb][0]
                [spill_wait], [fill_wait] = at["spill.wait", "block", block, sb], at["fill.wait", "block", block, sb]
                assert compute < spill_at < fill_at < fill_wait < at["compute", "block", block + 1, sb][0]
                assert spill_at < spill_wait
                assert steps[fill_wait + 1 + (spill_wait == fill_wait + 1)].key == ("block", block + 1, sb)
            else:
                assert not any(("spill." + half, "block", block, sb) in at for half in ("issue", "wait"))
    # No more than HIDDEN_STORES_IN_FLIGHT spills keep their sources alive past a step.
    storing = 0
    for step in steps:
        storing += {"spill.issue": 1, "spill.wait": -1}.get(step.kind, 0)
        assert 0 <= storing <= HIDDEN_STORES_IN_FLIGHT + (step.kind == "spill.issue")
    assert storing == 0
    stored = [(s.block, s.subbatch) for s in steps if s.kind == "store_kv.issue"]
    assert sorted(stored) == [(b, d) for b in range(layers) for d in subbatches]
    tails = [s for s in steps if s.region == "suffix"]
    assert [s.subbatch for s in tails] == (list(subbatches) if spill else [None])
    assert steps[-1].region == "suffix"


@pytest.mark.parametrize("live_blocks", [1, 2, 3])
def test_while_a_layer_computes_the_weights_of_live_blocks_layers_from_it_are_issued(live_blocks):
    """`live_blocks` is the window: the layer computing and the next `live_blocks - 1`,
    whose loads were issued before its first step, and no layer further ahead."""
    layers = 4
    request = PassRequest("decode", (0, 1), fetched=(True,) * layers, kv_moves=False, stores=False,
                          live_blocks=live_blocks)
    issued: list[int] = []
    for step in validate_pass(generation_pass(request), request).steps:
        if step.kind == "fetch.issue":
            issued.append(step.block)
        elif step.kind == "compute" and step.region == "block":
            window = set(range(step.block, min(step.block + live_blocks, layers)))
            assert {block for block in issued if block >= step.block} == window, (step.text(), issued)
    assert issued == list(range(layers))


def _edited(request, edit):
    steps = list(generation_pass(request).steps)
    edit(steps)
    return Schedule(tuple(steps))


def _at(steps, text):
    return next(i for i, step in enumerate(steps) if step.text() == text)


DECODE = PassRequest("decode", (0, 1), fetched=(True, True), kv_moves=True, stores=True)
PREFILL = PassRequest("prefill", (0, 1, 2), fetched=(True, True), kv_moves=True, stores=True, rows=(2, 3),
                      spill_hidden=True)


@pytest.mark.parametrize("request_,edit,step,problem", [
    (DECODE, lambda steps: steps.remove(steps[_at(steps, "decode blk1.sb1")]),
     "decode store_kv.issue blk1.sb1", "stores the cache of layer 1 before it computed"),
    (DECODE, lambda steps: steps.pop(), "decode suffix", "a step of the pass is missing"),
    (DECODE, lambda steps: steps.append(steps.pop(_at(steps, "decode fetch.wait blk1"))),
     "decode blk1.sb0", "computes before its weights arrive: no `decode fetch.wait blk1`"),
    (DECODE, lambda steps: steps.append(steps.pop(_at(steps, "decode load_kv.issue blk1.sb1"))),
     "decode blk1.sb1", "before its cache's load was issued"),
    (DECODE, lambda steps: steps.insert(0, Step("prefill", "block", 0, 0)),
     "prefill blk0.sb0", "a decode pass has steps of phase 'decode' only"),
    (DECODE, lambda steps: steps.insert(0, Step("decode", "block", 0, 0, "spill.issue")),
     "decode spill.issue blk0.sb0", "this pass keeps them on the device"),
    (PREFILL, lambda steps: steps.remove(steps[_at(steps, "prefill fill.wait blk0.sb2")]),
     "prefill blk1.sb2", "no `fill.wait` of layer 0"),
    (PREFILL, lambda steps: steps.insert(0, steps.pop(_at(steps, "prefill spill.issue blk0.sb1"))),
     "prefill spill.issue blk0.sb1", "spills an output before its layer computed it"),
    (PREFILL, lambda steps: steps.append(Step("prefill", "block", 1, 5, "store_kv.issue")),
     "prefill store_kv.issue blk1.sb5", "decode sub-batch 5, which does not exist"),
])
def test_a_pass_schedule_that_generate_cannot_run_is_refused_naming_its_first_bad_step(request_, edit, step, problem):
    validate_pass(generation_pass(request_), request_)
    with pytest.raises(PolicyError, match=problem) as refused:
        validate_pass(_edited(request_, edit), request_, "edited")
    assert step in str(refused.value) and "edited" in str(refused.value)

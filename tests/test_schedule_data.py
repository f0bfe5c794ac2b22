"""A schedule is data: every built-in policy's schedule, training and generation,
goes through its text and its JSON and comes back equal (with the units it
recomputes, when it chooses them); `replay(schedule)` compiles
a schedule read back that way into the graphs its policy compiled, matching eager,
and refuses a request the schedule was not written for, naming what differs."""

import dataclasses
import json

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.schedules import POLICIES, Schedule, ScheduleRequest, Step, replay
from slcompile.schedules.generation import PassRequest, generation_pass
from slcompile.schedules.policies import BUILTIN_POLICIES

EVERYTHING_MOVES = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=3, live_blocks=2, weights_streamed=True,
                                   activations_offloaded=True, gradients_offloaded=True)
REQUESTS = {
    "streamed": EVERYTHING_MOVES,
    "resident": ScheduleRequest(blocks=(0, 1), num_subbatches=2),
    "forward": dataclasses.replace(EVERYTHING_MOVES, backward=False, gradients_offloaded=False),
}
GENERATION = {
    "prefill": PassRequest("prefill", (0, 1, 2), fetched=(True, False, True), kv_moves=True, stores=True,
                           rows=(2, 3), spill_hidden=True),
    "decode": PassRequest("decode", (0, 2), fetched=(True, True), kv_moves=True, stores=True),
}
CFG = GPTConfig(n_layers=2)
OPTIONS = {"lowering": "aot_eager", "weights": "nvme", "activations": "nvme", "num_subbatches": 2,
           "min_offload_bytes": 0}


def _round_trips(schedule):
    from_text = Schedule.from_text(schedule.text())
    from_json = Schedule.from_json(schedule.to_json())
    assert from_text == schedule and from_text.text() == schedule.text()
    assert from_json == schedule and from_json.text() == schedule.text()
    assert len(from_text) == len(schedule) > 0


@pytest.mark.parametrize("request_name", REQUESTS)
@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_a_built_in_training_schedule_round_trips(policy, request_name):
    request = REQUESTS[request_name]
    schedule = POLICIES[policy](request)
    _round_trips(schedule)
    # The JSON keeps what the schedule was written for; the text keeps the steps alone.
    assert Schedule.from_json(schedule.to_json()).request == request
    assert Schedule.from_text(schedule.text()).request is None
    data = json.loads(schedule.to_json())
    assert data["policy"] == policy and data["format"] == "slcompile.schedule/1"
    assert data["steps"][0] == {"phase": "fwd", "region": "prefix", "block": None, "subbatch": 0,
                                "kind": "compute", "serves": None}


@pytest.mark.parametrize("phase", GENERATION)
def test_a_generation_pass_round_trips(phase):
    schedule = generation_pass(GENERATION[phase])
    assert {s.phase for s in schedule.steps} == {phase}
    _round_trips(schedule)


def test_the_units_a_schedule_recomputes_round_trip():
    request = REQUESTS["streamed"]
    plain = POLICIES["speedloader"](request)
    chosen = dataclasses.replace(plain, recompute=frozenset({(2, 1), (0, 0), (0, 2)}))
    _round_trips(chosen)
    assert chosen != plain and chosen.steps == plain.steps
    assert chosen.text().splitlines()[0] == "recompute blk0.sb0 blk0.sb2 blk2.sb1"
    assert json.loads(chosen.to_json())["recompute"] == [[0, 0], [0, 2], [2, 1]]
    assert Schedule.from_json(chosen.to_json()).request == request
    none = dataclasses.replace(plain, recompute=frozenset())
    _round_trips(none)
    assert none.text().splitlines()[0] == "recompute none" and none != plain
    # A schedule that does not choose writes neither, as before, and reads back None.
    assert "recompute" not in plain.to_json() and "recompute" not in plain.text()
    assert Schedule.from_json(plain.to_json()).recompute is Schedule.from_text(plain.text()).recompute is None
    # A replay recomputes what the replayed schedule does.
    assert replay(Schedule.from_text(chosen.text()))(request).recompute == chosen.recompute
    with pytest.raises(ValueError, match=r"^schedule line 1: `recompute` names \(block, sub-batch\) units "
                                         r"\(`blk1.sb0`\), got 'prefix.sb0'"):
        Schedule.from_text("recompute prefix.sb0\nfwd blk0.sb0")
    with pytest.raises(ValueError, match=r"\"recompute\" must be a list of \[block, sub-batch\] pairs"):
        Schedule.from_json(json.dumps({**json.loads(plain.to_json()), "recompute": [[0]]}))


def test_an_issue_serving_its_own_phase_is_the_step_without_serves():
    assert Step("fwd", "block", 1, kind="fetch.issue", serves="fwd") == Step("fwd", "block", 1, kind="fetch.issue")
    assert Step.from_text("fwd fetch.issue blk0@bwd") == Step("fwd", "block", 0, None, "fetch.issue", serves="bwd")
    assert Step.from_text("prefill prefix") == Step("prefill", "prefix")
    assert Step.from_text("bwd unstash.wait blk2.sb1") == Step("bwd", "block", 2, 1, "unstash.wait")


def test_what_is_not_a_schedule_is_named():
    with pytest.raises(ValueError, match=r"^schedule line 2: not a schedule step: 'fwd fetch.load blk1': kind "
                                         r"'fetch.load' is not one of fetch.issue"):
        Schedule.from_text("fwd blk0.sb0\nfwd fetch.load blk1")
    with pytest.raises(ValueError, match=r"^schedule line 1: not an slc tag: 'block3'"):
        Schedule.from_text("fwd block3\n")
    with pytest.raises(ValueError, match=r"^step 1: \{'phase': 'fwd'\} is not a step"):
        Schedule.from_json(json.dumps({"format": "slcompile.schedule/1", "steps": [
            {"phase": "fwd", "region": "prefix", "subbatch": 0}, {"phase": "fwd"}]}))
    with pytest.raises(ValueError, match="its \"format\" must be 'slcompile.schedule/1'"):
        Schedule.from_json("{}")


def _compile(policy, **options):
    idx, targets = make_gpt_batch(CFG, 4)
    torch._dynamo.reset()
    torch.manual_seed(0)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**OPTIONS, "schedule": policy, **options})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    return report


@pytest.mark.parametrize("policy", ["speedloader", "zigzag_spilling", "grad_accumulation"])
def test_a_replayed_schedule_compiles_as_its_policy(policy):
    written = _compile(policy)
    assert written.schedule == written.planned_schedule.text()
    # What an external solver would hand over: the JSON of a schedule.
    replayed = _compile(replay(Schedule.from_json(written.planned_schedule.to_json()), name="solver"))
    assert replayed.schedule == written.schedule
    assert replayed.planned_schedule == written.planned_schedule
    assert replayed.planned_schedule.policy.name == "solver"


def test_the_schedule_read_back_from_the_graphs_replays():
    written = _compile("zigzag_spilling", live_blocks=2)
    replayed = _compile(replay(Schedule.from_text(written.schedule)), live_blocks=2)
    assert replayed.schedule == written.schedule


def test_a_replay_for_another_request_names_what_differs():
    schedule = POLICIES["speedloader"](EVERYTHING_MOVES)
    other = dataclasses.replace(EVERYTHING_MOVES, num_subbatches=2, live_blocks=1, saved=())
    with pytest.raises(slcompile.PolicyError) as caught:
        replay(Schedule.from_json(schedule.to_json()))(other)
    assert str(caught.value) == ("schedule policy 'replay': replays a schedule written for another request: "
                                 "num_subbatches=3 (the request has 2), live_blocks=2 (the request has 1)")
    # From its text alone, what its steps fix is compared.
    fewer_blocks = dataclasses.replace(EVERYTHING_MOVES, blocks=(0, 1))
    with pytest.raises(slcompile.PolicyError, match=r"^schedule policy 'replay': replays a schedule written for "
                                                    r"another request: blocks=\(0, 1, 2\) \(the request has "
                                                    r"\(0, 1\)\)$"):
        replay(Schedule.from_text(schedule.text()))(fewer_blocks)
    resident = dataclasses.replace(EVERYTHING_MOVES, weights_streamed=False, gradients_offloaded=False)
    with pytest.raises(slcompile.PolicyError, match=r"written for another request: weights_streamed=True \(the "
                                                    r"request has False\), gradients_offloaded=True"):
        replay(Schedule.from_text(schedule.text()))(resident)
    # Learnt on the way, not what the schedule is for: not compared.
    learnt = dataclasses.replace(EVERYTHING_MOVES, saved=(), offload_at_least=0, stash_everything=True)
    assert replay(schedule)(learnt) == schedule


def test_a_replay_compiled_for_another_k_is_a_compile_error():
    written = _compile("speedloader")
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader",
                             options={**OPTIONS, "num_subbatches": 4, "schedule": replay(written.planned_schedule)})
    with pytest.raises(slcompile.CompileError) as caught:
        compiled(idx, targets)
    assert isinstance(caught.value.inner_exception, slcompile.PolicyError)
    assert str(caught.value).startswith("schedule policy 'replay': replays a schedule written for another request: "
                                        "num_subbatches=2 (the request has 4)")

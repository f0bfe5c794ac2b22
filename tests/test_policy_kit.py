"""Writing a policy: what a bad schedule raises (PolicyError naming the step), policies
registered by name (Python, the command line) matching eager, and the documented
example run as it is written (README.md, "Writing a policy", by tests/test_readme.py)."""

import dataclasses
import os
import pathlib
import re

import pytest
import torch

import fresh_process
import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.schedules import (
    POLICIES, Policy, Schedule, ScheduleRequest, Step, add_fetches, layer_major_compute, register_policy,
    speedloader_schedule, validate_schedule,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CFG = GPTConfig(n_layers=2)
STREAMED = ScheduleRequest(blocks=(0, 1), num_subbatches=2, live_blocks=2, weights_streamed=True)
OFFLOADED = ScheduleRequest(blocks=(0, 1), num_subbatches=2, activations_offloaded=True)


@pytest.fixture
def registry():
    """Leaves POLICIES as it found it."""
    before = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(before)


def _edited(edit):
    """A policy writing speedloader's schedule, changed by `edit(steps) -> steps`."""
    return Policy("edited", lambda request: Schedule(tuple(edit(list(speedloader_schedule(request).steps)))))


def _raises(policy, request, step, problem):
    with pytest.raises(slcompile.PolicyError) as caught:
        policy(request)
    assert str(caught.value) == f"schedule policy {policy.name!r} at step `{step}`: {problem}"
    assert caught.value.policy == policy.name and caught.value.step == step


def test_a_missing_suffix_step_names_it():
    policy = _edited(lambda steps: [s for s in steps if s != Step("bwd", "suffix", subbatch=1)])
    _raises(policy, STREAMED, "bwd suffix.sb1",
            "a compute step is missing (each unit runs once per sub-batch in each phase)")


def test_a_streamed_block_without_its_weight_fetch_is_an_error():
    policy = _edited(lambda steps: [s for s in steps if not (s.kind.startswith("fetch") and s.block == 1)])
    _raises(policy, STREAMED, "fwd blk1.sb0",
            "computes before its weights arrive: no `fwd fetch.wait blk1` before it (a streamed block's "
            "compute needs its fetch)")
    # The same schedule is fine when the weights stay on the device, and fetches are not.
    resident = dataclasses.replace(STREAMED, weights_streamed=False)
    assert validate_schedule(Schedule(tuple(layer_major_compute(resident))), resident).text() == \
        speedloader_schedule(resident).text()
    _raises(Policy("fetching", lambda r: speedloader_schedule(STREAMED)), resident, "fwd fetch.issue blk1",
            "fetches weights, but the block weights stay on the device (weights_streamed=False)")


def test_a_stash_of_a_block_that_does_not_exist():
    def stash_blk99(steps):
        return steps[:3] + [Step("fwd", "block", 99, 0, "stash.issue")] + steps[3:]

    _raises(_edited(stash_blk99), OFFLOADED, "fwd stash.issue blk99.sb0", "block 99 does not exist (the blocks are 0, 1)")


def test_a_sub_batch_that_does_not_exist():
    def fetch_sb2(steps):
        return [dataclasses.replace(s, subbatch=2) if s.kind == "fetch.wait" else s for s in steps]

    _raises(_edited(fetch_sb2), STREAMED, "fwd fetch.wait blk0.sb2",
            "sub-batch 2 does not exist (K=2: sub-batches 0..1)")


def test_recomputing_a_unit_that_does_not_exist():
    def recomputing(*units):
        return Policy("recomputing",
                      lambda request: dataclasses.replace(speedloader_schedule(request), recompute=units))

    _raises(recomputing((1, 0), (7, 0)), OFFLOADED, "recompute blk7.sb0",
            "recomputes block 7, which does not exist (the blocks are 0, 1)")
    _raises(recomputing((1, 2)), OFFLOADED, "recompute blk1.sb2",
            "recomputes sub-batch 2, which does not exist (K=2: sub-batches 0..1)")
    with pytest.raises(slcompile.PolicyError, match=r"recomputes \(1,\), which is not a \(block, sub-batch\) pair"):
        recomputing((1,))(OFFLOADED)
    # Any collection of pairs is the set of them.
    assert recomputing([1, 0], (1, 1))(OFFLOADED).recompute == frozenset({(1, 0), (1, 1)})


def test_a_wait_before_its_issue():
    def wait_first(steps):
        stash = next(i for i, s in enumerate(steps) if s.kind == "stash.issue")
        wait = dataclasses.replace(steps[stash], kind="stash.wait")
        return steps[:stash] + [wait] + steps[stash:]

    _raises(_edited(wait_first), OFFLOADED, "fwd stash.wait prefix.sb0",
            "waits for a stash before its `fwd stash.issue prefix.sb0`")


def test_a_step_computed_twice():
    _raises(_edited(lambda steps: steps + [Step("bwd", "block", 0, 0)]), OFFLOADED, "bwd blk0.sb0",
            "computes the same unit twice in one phase")


def test_a_list_instead_of_a_schedule():
    policy = Policy("listed", lambda request: list(speedloader_schedule(request).steps))
    with pytest.raises(slcompile.PolicyError, match=r"^schedule policy 'listed': build returned a list, not a "
                                                    r"slcompile.schedules.Schedule \(wrap the steps"):
        policy(STREAMED)


def test_a_bad_policy_is_a_compile_error_not_a_fallback():
    idx, targets = make_gpt_batch(CFG, 4)
    policy = _edited(lambda steps: [s for s in steps if s != Step("fwd", "suffix", subbatch=0)])
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader",
                             options={"schedule": policy, "lowering": "aot_eager", "weights": "nvme"})
    with pytest.raises(slcompile.CompileError) as caught:
        compiled(idx, targets)
    assert isinstance(caught.value.inner_exception, slcompile.PolicyError)
    assert str(caught.value).startswith("schedule policy 'edited' at step `fwd suffix.sb0`: a compute step is missing")


def test_explain_raises_for_a_bad_policy_what_torch_compile_raises():
    idx, targets = make_gpt_batch(CFG, 4)
    policy = _edited(lambda steps: [s for s in steps if s != Step("fwd", "suffix", subbatch=0)])
    with pytest.raises(slcompile.CompileError) as caught:
        slcompile.explain(TinyGPT(CFG), idx, targets, schedule=policy, lowering="aot_eager", weights="nvme",
                          profile=None)
    assert type(caught.value) is slcompile.errors.OptionCompileError  # as torch.compile's, a ValueError too
    assert isinstance(caught.value.inner_exception, slcompile.PolicyError)
    assert str(caught.value).startswith("schedule policy 'edited' at step `fwd suffix.sb0`: a compute step is missing")


def test_fetches_issued_where_the_graphs_do_not_issue_them_disagree():
    # Valid on its own (a wait may load the weights itself), but the compiled graphs issue
    # each load live_blocks - 1 visits ahead: the schedule read back is another one.
    idx, targets = make_gpt_batch(CFG, 4)
    policy = _edited(lambda steps: [s for s in steps if s.kind != "fetch.issue"])
    assert validate_schedule(policy.build(STREAMED), STREAMED)
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader",
                             options={"schedule": policy, "lowering": "aot_eager", "weights": "nvme"})
    with pytest.raises(slcompile.CompileError, match=re.escape(
            "schedule policy 'edited' at step `fwd fetch.wait blk0`: the compiled graphs make "
            "`fwd fetch.issue blk1` instead (transfer 1 of the fwd phase")):
        compiled(idx, targets)


def _zigzag(request):
    k = request.num_subbatches
    forward = [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for position, block in enumerate(request.blocks):
        forward += [Step("fwd", "block", block, s) for s in (range(k) if position % 2 == 0 else reversed(range(k)))]
    forward += [Step("fwd", "suffix", subbatch=s) for s in range(k)]
    backward = [Step("bwd", s.region, s.block, s.subbatch) for s in reversed(forward)]
    return Schedule(tuple(add_fetches(forward + backward, request, per_subbatch=False)))


def test_a_registered_policy_by_name_matches_eager(registry):
    policy = register_policy(Policy("zigzag", _zigzag))
    assert POLICIES["zigzag"] is policy
    idx, targets = make_gpt_batch(CFG, 4)
    options = {"schedule": "zigzag", "lowering": "aot_eager", "weights": "nvme", "num_subbatches": 2}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert [line for line in report.schedule.splitlines() if line.startswith("fwd blk")] == [
        "fwd blk0.sb0", "fwd blk0.sb1", "fwd blk1.sb1", "fwd blk1.sb0",
    ]


def test_registering_a_name_twice(registry):
    register_policy(Policy("zigzag", _zigzag))
    with pytest.raises(slcompile.PolicyError, match="registered already; pass replace=True"):
        register_policy(Policy("zigzag", speedloader_schedule))
    again = register_policy(Policy("zigzag", speedloader_schedule), replace=True)
    assert POLICIES["zigzag"] is again
    with pytest.raises(slcompile.PolicyError, match="built-in policy's name"):
        register_policy(Policy("speedloader", _zigzag), replace=True)


def test_an_unknown_name_lists_the_registered_ones(registry):
    register_policy(Policy("zigzag", _zigzag))
    with pytest.raises(slcompile.OptionError) as caught:
        slcompile.SpeedLoaderConfig.from_options({"schedule": "zigzga"})
    assert str(caught.value) == (
        "speedloader option 'schedule' must be a registered policy's name, one of 'speedloader', "
        "'grad_accumulation', 'no_offload', 'lifetime_aware', 'spilling', 'zigzag_spilling', 'zigzag', or a slcompile.schedules.Policy object, "
        "got 'zigzga' (slcompile.schedules.register_policy(policy) registers a name)"
    )


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(TESTS))))
    env.pop("SLC_DISABLE", None)
    assert args[0] == "-m"
    return fresh_process.run_module(args[1], list(args[2:]), ROOT, env, timeout=600)


def test_a_registered_policy_by_name_on_the_command_line(tmp_path):
    common = ("--policy-module", "zigzag_policy", "--schedule", "zigzag_test", "--lowering", "aot_eager",
              "--num-subbatches", "2")
    result = _run("-m", "slcompile", "explain", "slcompile.examples:tiny_gpt", *common)
    assert result.returncode == 0, result.stderr[-2000:]
    computed = [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("fwd blk")]
    assert computed == [f"fwd blk{b}.sb{s}" for b in range(4) for s in ((0, 1) if b % 2 == 0 else (1, 0))]
    # demo trains with it and prints each step's loss beside eager's.
    out = tmp_path / "pictures"
    demo = _run("-m", "slcompile", "demo", *common, "--steps", "2", "--layers", "2", "--width", "32",
                "--out", str(out))
    assert demo.returncode == 0, demo.stderr[-2000:]
    losses = [line.split() for line in demo.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(abs(float(f[4]) - float(f[6])) < 1e-4 for f in losses), demo.stdout
    unknown = _run("-m", "slcompile", "explain", "slcompile.examples:tiny_gpt", "--schedule", "zigzag_test")
    assert unknown.returncode == 1
    assert "must be a registered policy's name" in unknown.stderr
    assert "--policy-module MODULE imports a module that registers it" in unknown.stderr

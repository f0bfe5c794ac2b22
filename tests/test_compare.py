"""`slcompile.compare_policies`: two policies compared in one process give the figures
each gives compiled alone in a fresh process; the schedule diff, the DOT pictures and
the timeline show the order and the bytes. (The command line: tests/test_cli.py.)

One comparison (tiny GPT, 2 blocks, K=2, weights and every saved activation on nvme,
aot_eager) of speedloader and zigzag (tests/zigzag_policy.py) serves the module.
"""

import json
import os
import pathlib
import re

import pytest
import torch

import fresh_process
import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime.stats import runtime_stats
from slcompile.schedules import POLICIES, Policy, register_policy
from slcompile.runtime.storage.tiers import Tier
from slcompile.units import format_bytes
from slcompile.viz.roles import format_bytes as label_bytes, transfer_bytes
from slcompile.vocabulary import is_fetch_issue, is_stash, is_stash_wait, is_unstash

ROOT = pathlib.Path(__file__).resolve().parent.parent
CFG = GPTConfig(n_layers=2)
OPTIONS = {"lowering": "aot_eager", "num_subbatches": 2, "weights": "nvme", "activations": "nvme",
           "min_offload_bytes": 0}
COMPARED = ("speedloader", "zigzag_test")

# Run alone in a fresh interpreter: one policy's figures as JSON on the last line.
_ALONE = """
import json, sys, torch
import slcompile, zigzag_policy
from models import GPTConfig, TinyGPT, make_gpt_batch
cfg = GPTConfig(n_layers=2)
idx, targets = make_gpt_batch(cfg, 4)
torch.manual_seed(0)
row = slcompile.compare_policies(TinyGPT(cfg), idx, targets, policies=[sys.argv[1]], **json.loads(sys.argv[2])).rows[0]
print(json.dumps(row.figures()))
"""


@pytest.fixture(scope="module")
def zigzag_registered():
    """"zigzag_test" registered for the module, POLICIES as it was afterwards."""
    before = dict(POLICIES)
    import zigzag_policy  # its import registers the name too

    register_policy(Policy("zigzag_test", zigzag_policy.zigzag, suffix="whole"), replace=True)
    yield
    POLICIES.clear()
    POLICIES.update(before)


@pytest.fixture(scope="module")
def comparison(zigzag_registered):
    idx, targets = make_gpt_batch(CFG, 4)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    # Another model of the process rests on the same tier: not the policies' bytes.
    other = torch.compile(TinyGPT(CFG), backend="speedloader", options=OPTIONS)
    other(idx, targets)[1].backward()
    resident = runtime_stats().resident_bytes.get(Tier.NVME, 0)
    assert resident > 0
    compared = slcompile.compare_policies(model, idx, targets, policies=list(COMPARED), **OPTIONS)
    # Nothing of the copies stays on the tier: a later model's figures do not include them.
    assert runtime_stats().resident_bytes.get(Tier.NVME, 0) == resident
    del other
    return compared


def test_one_process_gives_the_figures_of_one_process_per_policy(comparison):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "tests"))))
    env.pop("SLC_DISABLE", None)
    for row in comparison.rows:
        alone = fresh_process.run_code(_ALONE, os.getcwd(), env, timeout=600, args=[row.policy, json.dumps(OPTIONS)])
        assert alone.returncode == 0, alone.stderr[-3000:]
        assert json.loads(alone.stdout.strip().splitlines()[-1]) == row.figures()
    speedloader, zigzag = comparison.rows
    # The order changes nothing the step moves or holds here (every activation is
    # stashed whatever the order), and the model's numbers are the same.
    assert speedloader.bytes_moved == zigzag.bytes_moved and speedloader.loss == zigzag.loss
    moved = speedloader.bytes_moved
    assert moved[("activation", "device", "nvme")] == moved[("activation", "nvme", "device")] > 0
    assert moved[("weight", "nvme", "device")] > 0 and speedloader.total_transfers == sum(speedloader.transfers.values())
    # The bytes the time model moves are the runtime's counters for the same step: the
    # weights a training step loads (those it loaded again after the previous step's
    # prefetch was dropped excepted), every activation stored and loaded.
    for row in comparison.rows:
        predicted = row.predicted_bytes_moved
        assert row.reloaded_bytes > 0
        assert row.bytes_of("weight") - row.reloaded_bytes == predicted["fetch"], row.policy
        assert row.bytes_moved[("activation", "device", "nvme")] == predicted["stash"]
        assert row.bytes_moved[("activation", "nvme", "device")] == predicted["unstash"]
    # The prediction for the step as measured is the measurement, to a few bytes.
    for row in comparison.rows:
        assert abs(row.predicted_peak_bytes - row.measured_peak_bytes) <= 0.01 * row.measured_peak_bytes, row
        assert row.predicted_tier_peaks["nvme"] == row.measured_tier_peaks["nvme"]
        # The recorded step's allocations (the memory picture's measured device bytes)
        # reach the peak the measured steps reached, at a time inside the step.
        allocations = row.recorded.allocations
        assert abs(row.recorded.allocated_peak_bytes - row.measured_peak_bytes) <= 0.01 * row.measured_peak_bytes
        compute = [event for event in row.recorded.events if event.lane == "compute"]
        peak_time = max(allocations, key=lambda sample: sample[1])[0]
        assert compute[0].start <= peak_time <= compute[-1].end


def test_the_table_has_one_line_per_policy(comparison):
    table = comparison.table().splitlines()
    assert table[0].split()[:3] == ["policy", "peak", "predicted"]
    assert "activation device->nvme" in table[0] and "weight nvme->device" in table[0]
    rows = {line.split()[0]: line for line in table[2:]}
    assert list(rows) == list(COMPARED)
    for row in comparison.rows:
        assert format_bytes(row.predicted_peak_bytes) in rows[row.policy]
        assert f"{format_bytes(row.bytes_of('weight'))} ({row.transfers[('weight', 'nvme', 'device')]})" in rows[row.policy]
    assert str(comparison).startswith(comparison.table())
    assert table[0].split()[-3:] == ["step", "predicted", "bound"]
    for row in comparison.rows:
        # Columns are right-aligned: a longer figure in another row widens the gap.
        assert re.search(rf"{row.predicted_step_seconds * 1e3:.2f} ms +{row.time.bound}", rows[row.policy])


def test_the_predicted_step_time_is_explains(comparison):
    """Each row's step time is the one `explain` predicts for the policy on the same
    machine profile: one time model, read from the same partitioned graphs."""
    idx, targets = make_gpt_batch(CFG, 4)
    torch.manual_seed(0)
    for row in comparison.rows:
        explanation = slcompile.explain(TinyGPT(CFG), idx, targets, schedule=row.policy, **OPTIONS)
        assert row.time.step_seconds == explanation.time.step_seconds > 0
        assert row.time.bound == explanation.time.bound


def test_the_schedule_diff_shows_the_order(comparison):
    diff = comparison.schedule_diff()
    assert diff.startswith("--- speedloader\n+++ zigzag_test\n")
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-" and re.fullmatch(r"[+-](fwd|bwd) blk\d\.sb\d", line)]
    # Block 1 runs sub-batch 1 first under zigzag, in both phases (the backward reversed).
    assert sorted(changed) == sorted(["+fwd blk1.sb1", "-fwd blk1.sb1", "+bwd blk1.sb0", "-bwd blk1.sb0"])
    assert comparison.schedule_diff("speedloader", "speedloader") == ""
    assert diff in str(comparison)


def _clusters(dot: str) -> list[str]:
    return re.findall(r"subgraph \"?cluster_(blk1\.sb\d)", dot)


@pytest.mark.parametrize("detail", ["summary", "ops"])
def test_the_dot_draws_sub_batches_in_schedule_order(comparison, detail):
    from slcompile.viz.dot import graph_to_dot

    orders = {}
    for row in comparison.rows:
        dot = graph_to_dot(row.report.graphs["forward"], row.policy, detail, row.report.blocks)
        orders[row.policy] = (_clusters(dot), re.findall(r'label="(sb\d · runs \d/2)"', dot)[4:6])
    assert orders["speedloader"] == (["blk1.sb0", "blk1.sb1"], ["sb0 · runs 1/2", "sb1 · runs 2/2"])
    assert orders["zigzag_test"] == (["blk1.sb1", "blk1.sb0"], ["sb1 · runs 1/2", "sb0 · runs 2/2"])
    assert comparison.dot("zigzag_test", detail=detail) != comparison.dot("speedloader", detail=detail)


def test_every_transfer_shows_the_bytes_it_moves(comparison):
    row = comparison["zigzag_test"]
    forward, backward = row.report.graphs["forward"], row.report.graphs["backward"]
    stashes = [n for n in forward.graph.nodes if is_stash(n)]
    # The bytes the DOT labels stores with add up to what the runtime stored.
    assert sum(transfer_bytes(n) for n in stashes) == row.bytes_moved[("activation", "device", "nvme")]
    waits = [n for n in forward.graph.nodes if is_stash_wait(n)]
    assert sum(transfer_bytes(n) for n in waits) == row.bytes_moved[("activation", "device", "nvme")]
    loads = [n for n in backward.graph.nodes if is_unstash(n)]
    assert sum(transfer_bytes(n) for n in loads) == row.bytes_moved[("activation", "nvme", "device")]
    issues = [n for n in forward.graph.nodes if is_fetch_issue(n)]
    assert issues and all(transfer_bytes(n) >= 128 for n in issues)
    from slcompile.viz.dot import graph_to_dot

    dot = graph_to_dot(forward, "forward", "ops")
    stash = stashes[0]
    label = re.search(rf'\b{stash.name} \[label="([^"]*)"', dot).group(1)
    assert label.endswith(label_bytes(transfer_bytes(stash))) and transfer_bytes(stash) > 8, label


def test_write_puts_every_picture_in_one_folder(comparison, tmp_path):
    written = comparison.write(tmp_path)
    assert (tmp_path / "table.txt").read_text() == comparison.table() + "\n"
    assert (tmp_path / "schedule.diff").read_text() == comparison.schedule_diff() + "\n"
    for policy in COMPARED:
        # The prefix and each block: runs of K=2 sub-batches (the suffix runs whole).
        assert (tmp_path / policy / "forward.dot").read_text().count("runs 1/2") >= 3
        assert json.loads((tmp_path / policy / "trace.json").read_text())["traceEvents"]
        assert (tmp_path / policy / "schedule.txt").read_text() == comparison[policy].schedule + "\n"
    assert written["timelines"][0].stat().st_size > 0


def test_wrong_arguments_say_what_is_wrong(zigzag_registered):
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(ValueError, match="at least one policy"):
        slcompile.compare_policies(TinyGPT(CFG), idx, targets, policies=[])
    with pytest.raises(ValueError, match="policies=\\[...\\], not the schedule option"):
        slcompile.compare_policies(TinyGPT(CFG), idx, targets, policies=["speedloader"], schedule="speedloader")
    with pytest.raises(ValueError, match="'speedloader' more than once"):
        slcompile.compare_policies(TinyGPT(CFG), idx, targets, policies=["speedloader", "speedloader"])
    with pytest.raises(slcompile.OptionError, match="registered policy's name"):
        slcompile.compare_policies(TinyGPT(CFG), idx, targets, policies=["speedloader", "zigzga"])


def test_a_model_the_backend_refuses_is_an_error_not_a_row(zigzag_registered):
    resident = runtime_stats().resident_bytes.get(Tier.NVME, 0)

    class Flat(torch.nn.Module):  # no repeated blocks: compiled plainly, with the reason logged
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x).sum()

    with pytest.raises(slcompile.RefusedError, match="policy 'speedloader': the graph compiled without sub-batching"):
        slcompile.compare_policies(Flat(), torch.randn(4, 8), policies=["speedloader"], lowering="aot_eager")
    assert runtime_stats().resident_bytes.get(Tier.NVME, 0) == resident


def _missing_suffix(request):
    """Speedloader's schedule without `fwd suffix.sb0`: refused before anything compiles."""
    from slcompile.schedules import Schedule, Step, speedloader_schedule

    return Schedule(tuple(s for s in speedloader_schedule(request).steps if s != Step("fwd", "suffix", subbatch=0)))


REFUSED = "PolicyError: schedule policy 'broken' at step `fwd suffix.sb0`: a compute step is missing"


def test_a_failing_policy_keeps_the_other_rows(tmp_path):
    idx, targets = make_gpt_batch(CFG, 4)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    expected = float(model(idx, targets)[1])
    compared = slcompile.compare_policies(model, idx, targets, policies=["speedloader", Policy("broken", _missing_suffix),
                                                                        "zigzag_spilling"], profile=None, **OPTIONS)
    assert compared.policies == ("speedloader", "broken", "zigzag_spilling")
    broken = compared["broken"]
    # The refusal reaches compare_policies through torch.compile: the row names the PolicyError inside.
    assert broken.error.startswith(REFUSED)
    assert broken.schedule == "" and broken.measured_peak_bytes is None and broken.figures()["error"] == broken.error
    for row in (compared["speedloader"], compared["zigzag_spilling"]):
        assert row.error is None and row.loss == pytest.approx(expected, abs=1e-5)
        assert row.measured_peak_bytes > 0 and row.bytes_of("weight") > 0
        assert row.schedule == row.report.planned_schedule.text()
    lines = {line.split()[0]: line for line in compared.table().splitlines()[2:]}
    assert lines["broken"].endswith(broken.error) and lines["broken"].split()[1] == "-"
    assert compared.table().splitlines()[0].endswith("error")
    # The diff is of the first two policies that compiled.
    assert str(compared).endswith(compared.schedule_diff("speedloader", "zigzag_spilling"))
    written = compared.write(tmp_path)
    assert "broken/forward" not in written and "zigzag_spilling/forward" in written
    assert broken.error in (tmp_path / "table.txt").read_text()


def test_the_command_line_prints_the_error_of_a_failing_policy(tmp_path, capsys, zigzag_registered):
    from slcompile.cli import main

    register_policy(Policy("broken", _missing_suffix))
    code = main(["compare", "cli_targets:tiny", "--policies", "speedloader,broken", "--lowering", "aot_eager",
                 "--num-subbatches", "2", "--weights", "nvme", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    broken = next(line for line in out.splitlines() if line.startswith("broken "))
    assert broken.split()[1] == "-" and broken.split("  ")[-1].startswith(REFUSED)
    assert next(line for line in out.splitlines() if line.startswith("speedloader ")).split()[1] != "-"


H100 = "h100-pcie5-nvme"
PREDICTED = ("speedloader", "grad_accumulation")


def test_without_running_the_rows_are_explain_s_predictions_ranked():
    from slcompile.compare import predicted_bytes_moved

    idx, targets = (t.to("meta") for t in make_gpt_batch(CFG, 4))
    with torch.device("meta"):
        model = TinyGPT(CFG)
    compared = slcompile.compare_policies(model, idx, targets, run=False, profile=H100,
                                          policies=[*PREDICTED, Policy("broken", _missing_suffix)], **OPTIONS)
    assert compared["broken"].error.startswith(REFUSED) and not compared["broken"].ran
    for policy in PREDICTED:
        row = compared[policy]
        explained = slcompile.explain(model, idx, targets, schedule=policy, profile=H100, **OPTIONS)
        assert not row.ran and row.error is None and row.measured_peak_bytes is None
        assert row.schedule == explained.schedule
        assert row.plan_peak_bytes == explained.memory.step_peak_bytes
        assert row.predicted_tier_peaks == explained.predicted_peak_bytes
        assert row.predicted_step_seconds == explained.time.step_seconds
        assert row.predicted_bytes_moved == predicted_bytes_moved(explained.time)
    # grad_accumulation fetches each block's weights once per micro-batch per pass.
    fetched = {policy: compared[policy].predicted_bytes_moved["fetch"] for policy in PREDICTED}
    assert fetched["grad_accumulation"] > fetched["speedloader"] > 0
    ranked = compared.ranked()
    assert ranked[-1].policy == "broken"
    keys = [(r.plan_peak_bytes, sum(r.predicted_bytes_moved.values()), r.predicted_step_seconds) for r in ranked[:-1]]
    assert keys == sorted(keys)
    table = compared.table().splitlines()
    assert [line.split()[0] for line in table[2:]] == [r.policy for r in ranked]
    assert table[0].split()[:3] == ["policy", "peak", "(plan)"] and "fetch moved" in table[0]
    assert table[-1].endswith(compared["broken"].error)


def test_without_running_a_model_with_weights_runs_no_step():
    idx, targets = make_gpt_batch(CFG, 4)
    model = TinyGPT(CFG)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    before, reports = runtime_stats().bytes_moved, len(slcompile.compile_reports())
    row = slcompile.compare_policies(model, idx, targets, run=False, profile=H100, policies=["speedloader"],
                                     **OPTIONS).rows[0]
    # Nothing moved, nothing compiled, the weights untouched and without gradients.
    assert runtime_stats().bytes_moved == before and len(slcompile.compile_reports()) == reports
    for name, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, weights[name])
    explained = slcompile.explain(model, idx, targets, schedule="speedloader", profile=H100, **OPTIONS)
    assert row.plan_peak_bytes == explained.memory.step_peak_bytes > 0

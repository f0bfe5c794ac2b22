"""The suffix (final norm, head, loss) run once on the whole batch (`suffix="whole"`,
the default) or per sub-batch (`suffix="subbatches"`): the same loss and gradients as
eager, the head's weight read once, the schedule's one `suffix` step, and, under a
memory budget that the whole suffix does not meet, the per-sub-batch plan instead."""

from __future__ import annotations

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch
from slcompile.errors import PolicyError
from slcompile.schedules import Policy, Schedule, ScheduleRequest, Step
from slcompile.vocabulary import is_compute

CFG = GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, vocab_size=72)


def _padded_llama_batch(batch: int = 4, seq: int = 12):
    """Input ids, a right-padded attention mask and labels with the padding ignored."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, length in enumerate((seq, seq - 3, seq - 5, 4)[:batch]):
        mask[row, length:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _head_products(graph) -> int:
    """Matrix products in `graph` that make or read a tensor with the vocabulary as a
    dimension: the head's logits, their gradient's products."""
    count = 0
    for node in graph.graph.nodes:
        if is_compute(node) and node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            shapes = [tuple(a.meta["val"].shape) for a in (*node.all_input_nodes, node) if "val" in a.meta]
            count += any(CFG.vocab_size in shape for shape in shapes)
    return count


@pytest.mark.parametrize("suffix", ["auto", "subbatches"])
def test_a_padded_llama_trains_like_eager_with_either_suffix(suffix):
    torch.manual_seed(0)
    model = hf_llama(num_hidden_layers=2)
    ids, mask, labels = _padded_llama_batch()

    def call(m):
        out = m(ids, attention_mask=mask, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(model, call, {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise",
                                       "suffix": suffix})
    report = slcompile.compile_reports()[-1]
    steps = report.schedule.splitlines()
    if suffix == "subbatches":
        assert ["fwd suffix.sb0", "fwd suffix.sb1", "bwd suffix.sb1", "bwd suffix.sb0"] == \
            [s for s in steps if "suffix" in s]
    else:
        assert ["fwd suffix", "bwd suffix"] == [s for s in steps if "suffix" in s]


@pytest.mark.parametrize("k", [2, 4])
def test_the_whole_suffix_reads_the_head_weight_once(k):
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    products = {}
    for suffix in ("whole", "subbatches"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="speedloader",
                                 options={"num_subbatches": k, "lowering": "aot_eager", "suffix": suffix})
        compiled(idx, targets)[1].backward()
        graphs = slcompile.compile_reports()[-1].graphs
        products[suffix] = (_head_products(graphs["forward"]), _head_products(graphs["backward"]))
    # Forward: the logits; backward: the input's gradient and the weight's (per
    # sub-batch, K of the first, and the weight's K shares, or their sum in one
    # product where `fuse_weight_grads` fuses them).
    assert products["whole"] == (1, 2)
    assert products["subbatches"][0] == k and products["subbatches"][1] >= k + 1


def test_grad_accumulation_runs_the_suffix_per_micro_batch_unless_asked():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)

    def call(m):
        return m(idx, targets)

    for suffix, lines in (("auto", ["fwd suffix.sb0", "fwd suffix.sb1", "bwd suffix.sb1", "bwd suffix.sb0"]),
                          ("whole", ["fwd suffix", "bwd suffix"])):
        torch._dynamo.reset()
        assert_matches_eager(model, call, {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise",
                                           "schedule": "grad_accumulation", "suffix": suffix})
        steps = slcompile.compile_reports()[-1].schedule.splitlines()
        assert [s for s in steps if s.split()[-1].startswith("suffix")] == lines
        if suffix == "whole":  # after every micro-batch's blocks, and its backward before theirs
            assert steps.index("fwd suffix") == steps.index("fwd blk1.sb1") + 1
            assert steps.index("bwd suffix") == steps.index("fwd suffix") + 1


def test_under_a_budget_the_whole_suffix_misses_the_suffix_runs_per_subbatch():
    torch.manual_seed(0)
    model = hf_llama(num_hidden_layers=2, vocab_size=2048)
    ids, mask, labels = _padded_llama_batch()
    options = {"num_subbatches": 4, "lowering": "aot_eager", "recompute": "none"}
    peaks = {suffix: slcompile.explain(model, ids, kwargs={"attention_mask": mask, "labels": labels},
                                       profile=None, suffix=suffix, **options).predicted_peak_bytes["device"]
             for suffix in ("whole", "subbatches")}
    assert peaks["whole"] > peaks["subbatches"]
    budget = (peaks["whole"] + peaks["subbatches"]) // 2
    explained = slcompile.explain(model, ids, kwargs={"attention_mask": mask, "labels": labels}, profile=None,
                                  memory_budget=budget, **options)
    assert "fwd suffix.sb3" in explained.schedule
    assert explained.predicted_peak_bytes["device"] == peaks["subbatches"]
    asked_whole = slcompile.explain(model, ids, kwargs={"attention_mask": mask, "labels": labels}, profile=None,
                                    memory_budget=budget, suffix="whole", **options)
    assert asked_whole.graphs[0].budget_error is not None
    fixed = {key: value for key, value in options.items() if key != "num_subbatches"}
    tuned = slcompile.tune(model, ids, kwargs={"attention_mask": mask, "labels": labels}, memory_budget=budget,
                           num_subbatches=[4], **fixed)
    assert tuned.options["suffix"] == "subbatches" and tuned.memory.peak_bytes["device"] == peaks["subbatches"]

    def call(m):
        out = m(ids, attention_mask=mask, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(model, call, {**options, "memory_budget": budget, "on_refusal": "raise"})
    report = slcompile.compile_reports()[-1]
    assert "fwd suffix.sb3" in report.schedule
    assert report.memory.peak_bytes["device"] == peaks["subbatches"] <= budget


def test_a_policy_that_splits_a_whole_suffix_is_told_how_to_write_it():
    request = ScheduleRequest(blocks=(0, 1), num_subbatches=2, whole_suffix=True, backward=False)
    split = [Step("fwd", "prefix", subbatch=s) for s in range(2)]
    split += [Step("fwd", "block", b, s) for b in (0, 1) for s in range(2)]
    split += [Step("fwd", "suffix", subbatch=s) for s in range(2)]
    policy = Policy("splitting", lambda r: Schedule(tuple(split)))
    with pytest.raises(PolicyError, match="runs the suffix once on the whole batch"):
        policy(request)
    whole = Policy("whole", lambda r: Schedule(tuple(split[:-2] + [Step("fwd", "suffix")])))
    assert whole(request).text().splitlines()[-1] == "fwd suffix"
    # The text and JSON forms carry the one step and the request.
    schedule = whole(request)
    assert Schedule.from_text(schedule.text()) == Schedule(schedule.steps)
    assert Schedule.from_json(schedule.to_json()).request.whole_suffix

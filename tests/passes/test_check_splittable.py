"""check_splittable alone: a plan without problems passes unchanged; one with problems
is refused with the ops that mix samples named first, two at most."""

import pytest
import torch
from expecttest import assert_expected_inline

from slcompile.analysis.batch_propagation import BatchPlan
from slcompile.errors import RefusedError
from slcompile.passes.check_splittable import check_splittable


def test_a_plan_without_problems_passes_unchanged(pipeline):
    plan = pipeline("propagate_batch").plan
    assert check_splittable(plan) is plan


def test_problems_are_refused_samples_mixed_first():
    plan = BatchPlan(2, 4, {}, (
        ("add_", "add_ writes in place into the buffer running_mean", "mutation"),
        ("mean", "mean reduces over the batch dimension in block layers.0", "mixes-samples"),
        ("var", "var reduces over the batch dimension in block layers.0", "mixes-samples"),
    ), ())
    with pytest.raises(RefusedError) as info:
        check_splittable(plan)
    assert info.value.pass_name == "check_splittable"
    assert_expected_inline(str(info.value), """cannot split the batch: mean reduces over the batch dimension in block layers.0; var reduces over the batch dimension in block layers.0 (and 1 more) [check_splittable]""")


class _CentredBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        x = self.linear(x)
        return x - x.mean(dim=0)


class _CentredMLP(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CentredBlock(width) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_block_that_mixes_samples_is_refused_by_the_check():
    from slcompile.config import SpeedLoaderConfig
    from slcompile.pipeline import run_pipeline
    from slcompile.facts import process_facts

    captured = []
    x = torch.randn(4, 8)
    torch.compile(_CentredMLP(), backend=lambda gm, inputs: captured.append((gm, inputs)) or gm.forward,
                  fullgraph=True)(x)
    config = SpeedLoaderConfig.from_options({"num_subbatches": 2, "lowering": "aot_eager"})
    with pytest.raises(RefusedError) as info:
        run_pipeline(captured[0][0], captured[0][1], config, facts=process_facts(config, captured[0][1]))
    assert info.value.pass_name == "check_splittable"
    assert_expected_inline(str(info.value), """cannot split the batch: node mean (mean) in model.layers.0 works along the batch dimension (dim=0); node mean_1 (mean) in model.layers.1 works along the batch dimension (dim=0) [check_splittable]""")

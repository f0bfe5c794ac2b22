"""Many configurations in one process: a sweep past Dynamo's recompile limit says which
configurations ran eagerly, the documented sweep compiles every one, `dynamic=True`
keeps no report of a restarted analysis, and what the history of reports and
`explain()` keep stays small."""

import gc
import warnings

import pytest
import torch
from torch import nn

import slcompile
import slcompile.report
from slcompile.runtime import collect_garbage


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        # Its eps is, under dynamic=True, a float input of the graph, which makes
        # AOTAutograd restart Dynamo's analysis with it as a tensor.
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


class Model(nn.Module):
    def __init__(self, width=8, n=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


CONFIGURATIONS = [{"lowering": "aot_eager", "num_subbatches": (1, 2, 4)[i % 3], "min_offload_bytes": i}
                  for i in range(12)]


def _train_step(options, x):
    """One step of a fresh model compiled with `options`; the warnings it raised."""
    model = Model()
    compiled = torch.compile(model, backend="speedloader", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).backward()
    return [w for w in caught if issubclass(w.category, slcompile.RecompileLimitWarning)]


def _own_compiled_report(options):
    report = slcompile.compile_reports()[-1]
    return report.config == slcompile.SpeedLoaderConfig.from_options(options) and report.fallback_reason is None \
        and "backward" in report.graphs  # the backward is compiled at the first backward call


def test_a_sweep_past_the_recompile_limit_says_which_configurations_ran_eagerly():
    x = torch.randn(8, 8)
    eager_from = None
    for i, options in enumerate(CONFIGURATIONS):
        caught = _train_step(options, x)
        if eager_from is None and _own_compiled_report(options):
            assert not caught
            continue
        # Dynamo ran this configuration eagerly: every one past the limit says so
        # loudly, with the fix, and the newest report is this configuration's, saying so.
        eager_from = i if eager_from is None else eager_from
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "recompile_limit" in message and "runs eagerly" in message
        assert "torch._dynamo.reset()" in message and "every later torch.compile of that code" in message
        assert f"'min_offload_bytes': {i}" in message
        report = slcompile.compile_reports()[-1]
        assert report.config == slcompile.SpeedLoaderConfig.from_options(options)
        assert report.fallback_reason == message and not report.compiled
    assert eager_from == torch._dynamo.config.recompile_limit


def test_every_call_past_the_recompile_limit_warns():
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        _calls_past_the_limit()


def _calls_past_the_limit():
    model = Model()
    options = {"lowering": "aot_eager", "num_subbatches": 2}
    compiled = torch.compile(model, backend="speedloader", options=options)
    warned, reports = [], []
    for batch in (8, 12, 16, 12, 8):
        before = len(slcompile.compile_reports())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(torch.randn(batch, 8))
        warned.append(sum(issubclass(w.category, slcompile.RecompileLimitWarning) for w in caught))
        reports.append((len(slcompile.compile_reports()) - before, slcompile.compile_reports()[-1].compiled))
    # The first size compiles; each other size runs eagerly and says so at every
    # call; the size compiled before still runs its compiled graph, silently. One
    # report says the configuration ran eagerly, not one a call.
    assert warned == [0, 1, 1, 1, 0]
    assert reports == [(1, True), (1, False), (0, False), (0, False), (0, False)]
    # Another configuration of the same code, past the limit too: warned at each
    # call, and the newest report is its own.
    other = torch.compile(model, backend="speedloader", options={**options, "num_subbatches": 4})
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other(torch.randn(8, 8))
        assert [str(w.message) for w in caught if issubclass(w.category, slcompile.RecompileLimitWarning)] \
            and "'num_subbatches': 4" in str(caught[-1].message)
        newest = slcompile.compile_reports()[-1]
        assert newest.config.num_subbatches == 4 and not newest.compiled and newest.fallback_reason
    # A reset gives the code back to Dynamo: the next configuration compiles.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(8, 8))
    assert not [w for w in caught if issubclass(w.category, slcompile.RecompileLimitWarning)]
    assert slcompile.compile_reports()[-1].compiled and slcompile.compile_reports()[-1].fallback_reason is None


def test_the_documented_sweep_compiles_every_configuration():
    x = torch.randn(8, 8)
    for options in CONFIGURATIONS:
        torch._dynamo.reset()  # as README.md's "Sweeps in one process" does
        assert not _train_step(options, x)
        assert _own_compiled_report(options)


def test_dynamic_keeps_no_report_of_a_restarted_analysis():
    compiled = torch.compile(Model(), backend="speedloader", dynamic=True,
                             options={"lowering": "aot_eager", "num_subbatches": 2})
    compiled(torch.randn(8, 8)).backward()
    reports = slcompile.compile_reports()
    assert [(r.blocks, r.fallback_reason) for r in reports] == [(("layers.0", "layers.1"), None)]


def _heavy_reachable(root) -> list[str]:
    """Type names of the graphs, tensors and fake-tensor machinery reachable from `root`."""
    heavy = (torch.fx.GraphModule, torch.fx.Graph, torch.Tensor)
    names = ("FakeTensorMode", "ShapeEnv")
    seen, stack, found = {id(root)}, [root], []
    while stack:
        obj = stack.pop()
        if isinstance(obj, heavy) or type(obj).__name__ in names:
            found.append(type(obj).__name__)
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, (type, type(gc), type(_heavy_reachable))):
                seen.add(id(ref))
                stack.append(ref)
    return found


def test_only_the_newest_reports_of_the_history_hold_graphs():
    from slcompile.report import GRAPHS_KEPT

    x = torch.randn(8, 8)
    held = None
    for i, options in enumerate(CONFIGURATIONS[:GRAPHS_KEPT + 2]):
        torch._dynamo.reset()
        _train_step(options, x)
        if i == 0:
            held = slcompile.compile_reports()[-1]
    reports = slcompile.compile_reports()
    assert len(reports) == GRAPHS_KEPT + 2
    for report in reports[:-GRAPHS_KEPT]:
        assert report.graphs_dropped and _heavy_reachable(report) == []
        assert report.blocks == ("layers.0", "layers.1") and report.schedule and report.graph_order["backward"]
        with pytest.raises(ValueError, match="graphs were dropped"):
            report.predicted_peak_bytes()
    for report in reports[-GRAPHS_KEPT:]:
        assert not report.graphs_dropped and "GraphModule" in _heavy_reachable(report)
    # A report held from when it was the newest keeps its graphs.
    assert held is not reports[0] and held.graphs and held.predicted_peak_bytes() > 0


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_explain_calls_leave_no_graphs_behind():
    model, x = Model(), torch.randn(8, 8)
    for _ in range(3):  # caches torch fills once
        slcompile.explain(model, x, num_subbatches=2, lowering="aot_eager", profile=None)
    collect_garbage()
    graphs_before = sum(torch.fx.GraphModule in type(o).__mro__ for o in gc.get_objects())
    managers_before = _guard_managers()
    before = _rss_kib()
    for _ in range(10):
        slcompile.explain(model, x, num_subbatches=2, lowering="aot_eager", profile=None)
    collect_garbage()
    assert sum(torch.fx.GraphModule in type(o).__mro__ for o in gc.get_objects()) <= graphs_before
    # Nor the guards of the captures' cache entries, which Dynamo's finalizers on the
    # model's modules and classes would keep as long as the model lives.
    assert _guard_managers() <= managers_before
    assert _rss_kib() - before < 10 * 1024  # about 0.2 MiB a call is torch's own capture


def _guard_managers() -> int:
    from torch._dynamo.guards import CheckFunctionManager

    return sum(isinstance(o, CheckFunctionManager) for o in gc.get_objects())

"""slcompile: run large models layer-major over sub-batches under `torch.compile`.

`torch.compile(model, backend="speedloader", options={"num_subbatches": 4})` splits
the batch into sub-batches and runs every transformer block for all of them before
the next block, forward and backward, with the results of eager PyTorch.
"""

from slcompile.config import SpeedLoaderConfig
from slcompile.errors import BudgetError, RefusedError
from slcompile.explain import Explanation, GraphExplanation, explain
from slcompile.report import CompileReport, clear_compile_reports, compile_reports
from slcompile.runtime.stats import reset_runtime_stats, runtime_stats
from slcompile.runtime.weights import gathered_weights, offloaded_parameters
from slcompile.tune import TuneResult, tune

__all__ = [
    "SpeedLoaderConfig",
    "RefusedError",
    "BudgetError",
    "explain",
    "Explanation",
    "GraphExplanation",
    "CompileReport",
    "compile_reports",
    "clear_compile_reports",
    "runtime_stats",
    "reset_runtime_stats",
    "gathered_weights",
    "offloaded_parameters",
    "tune",
    "TuneResult",
]

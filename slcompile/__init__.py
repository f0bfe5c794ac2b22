"""slcompile: run large models layer-major over sub-batches under `torch.compile`.

`torch.compile(model, backend="speedloader", options={"num_subbatches": 4})` splits
the batch into sub-batches and runs every transformer block for all of them before
the next block, forward and backward, with the results of eager PyTorch.
"""

from slcompile.config import SpeedLoaderConfig, options
from slcompile.analysis.machine import MachineFacts, MachineProfile
from slcompile.analysis.memory import MemoryPrediction
from slcompile.analysis.time import TimePrediction
from slcompile import defaults
from slcompile.errors import (
    BudgetError, CompileError, OptionError, PolicyError, ProfileError, RecompileLimitWarning, RefusedError,
    ReleasedWeightError,
)
from slcompile.explain import Explanation, GraphExplanation, explain
from slcompile.generate import GenerationExplanation, GenerationOutput, explain_generation, generate, generation
from slcompile.passes.manager import pass_settings
from slcompile.report import CompileReport, clear_compile_reports, compile_reports
from slcompile.runtime.errors import CorruptDataError, DiskFullError, OffloadError
from slcompile.runtime.stats import mark_step, reset_runtime_stats, runtime_stats
from slcompile.runtime.gathering import gathered_weights, offloaded_parameters
from slcompile.optim import OffloadedOptimizer, offload_optimizer
from slcompile.checkpoint import load_sharded, save_sharded
from slcompile.pretrained import save_pretrained
from slcompile.tune import Candidate, GenerationTuneResult, TuneResult, tune, tune_generation
from slcompile.compare import PolicyComparison, PolicyRow, compare_policies
from slcompile.sweep import SweepRow, SweepTable, sweep
from slcompile.schedules.policy import Policy

__all__ = [
    "SpeedLoaderConfig",
    "options",
    "defaults",
    "RefusedError",
    "BudgetError",
    "CompileError",
    "OptionError",
    "ReleasedWeightError",
    "OffloadError",
    "DiskFullError",
    "CorruptDataError",
    "PolicyError",
    "ProfileError",
    "RecompileLimitWarning",
    "explain",
    "Explanation",
    "GraphExplanation",
    "CompileReport",
    "compile_reports",
    "clear_compile_reports",
    "pass_settings",
    "runtime_stats",
    "mark_step",
    "reset_runtime_stats",
    "gathered_weights",
    "offloaded_parameters",
    "offload_optimizer",
    "OffloadedOptimizer",
    "save_sharded",
    "load_sharded",
    "save_pretrained",
    "tune",
    "generate",
    "explain_generation",
    "generation",
    "tune_generation",
    "GenerationTuneResult",
    "GenerationOutput",
    "TuneResult",
    "Candidate",
    "compare_policies",
    "sweep",
    "SweepTable",
    "SweepRow",
    "PolicyComparison",
    "PolicyRow",
    "Policy",
    "MachineProfile",
    "MachineFacts",
    "MemoryPrediction",
    "TimePrediction",
    "GenerationExplanation",
]

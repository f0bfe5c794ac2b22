"""Follow the batch dimension through a Dynamo graph: which values are per-sample.

Run after `find_blocks` and `find_batch_dim`. Never changes the graph.

Every node is run twice on fake tensors with concrete sizes: once at the full batch
and once at one sub-batch (batch / K). Comparing the two outputs tells where the batch
dimension went (`x.transpose(0, 1)` moves it, `x.sum()` removes it). A node is

- *shared*: none of its inputs depends on the batch (weights, masks, positions); it is
  computed once, at full size, and narrowed to a sub-batch where a per-sample value
  consumes it along the batch dimension (`narrow`).
- *batched*: it runs once per sub-batch, with literal batch sizes baked into
  `view`/`reshape`/`expand` arguments rewritten for the sub-batch (`args`).
- *cross-sample*: its result mixes samples (a reduction over the batch, an op along
  the batch dimension, BatchNorm in training). After the last block (the loss) it is
  computed from all sub-batches (`combine`): sums and means of sums decompose exactly,
  anything else runs once on the sub-batches concatenated back. Before or inside a
  block it is a problem that `check_splittable` turns into a refusal.

Inside a block, a mixture of experts flattens batch and sequence into one token
dimension (a row-major merge, so each sub-batch's tokens stay one contiguous chunk),
sorts the tokens by expert, gathers them, multiplies each expert's group and puts the
results back in token order. Those ops work along the batch dimension, yet each
token's result depends on that token alone: run per sub-batch, they route the
sub-batch's own tokens (`routing`). The values in between are *routed*, the
sub-batch's own and not slices of the full batch's; they stay batched nodes, and
the rules say what each one holds (`Route`) so that only ops whose meaning carries
over accept them, and none leaves its block in routed order.

Padding masks gather each sample's own row: Hugging Face builds the 4-D mask with
`mask[batch_arange[:, None, None, None], kv_idx]`, `batch_arange = arange(batch)`.
Such an `arange` over the batch (and its shape-only ops, checked on real values) is a
*sample index*: a shared value like any other, whose uses as a value read slices of
it. A gather that indexes the batch dimension with it keeps each sample's rows its
own; each sub-batch reads its slice of the index less its first sample's index
(`rebase`), so that it indexes its own rows. With a dynamic batch, `arange` of the
batch size symbol and shared masks expanded to it are computed once from the full
batch size; an `arange` of another size that scales with the batch is refused (each
sub-batch would count from 0).

A fresh tensor made at the batch size and written per sample, directly or through
views (`k = kv.new_empty(...)`, `k[..., :d].copy_(k_nope)`), is made per sub-batch.
A fresh tensor made from sizes that one in-place write reads all samples into and
nothing else reads (`torch.zeros(experts).scatter_add_(0, chosen, mask)`, Mixtral's
load-balancing loss counting tokens per expert) is fine after the blocks, where that
write runs once on the sub-batches concatenated back; in a block it mixes samples.

A value is never assumed to be per-sample from its shape alone: every rule below is
checked against the fake outputs, and anything the rules cannot explain is a problem,
not a guess.

The modules, one idea each. The walk holds one `PropagationState`; each family of
rules is a module of functions of that state, which the walk calls (no class takes
its rules from another module's class):

- `plan`: what the propagation decides (`NodeSplit`, `BatchPlan`).
- `state`: what one walk knows (`PropagationState`): each node's values at the full
  batch and at one sub-batch, the splits and problems so far, the families' tables,
  and the helpers they all use (`batched`, `input_bdims`, `execute`).
- `propagate`: the walk over the graph and the order in which every node meets the
  rules (`propagate_batch`).
- `subbatch`: a node run on one sub-batch, and where its batch dimension went.
- `cross_sample`: what mixes samples, and how an op after the blocks is combined
  from the sub-batches.
- `reshape`: literal batch sizes in views rewritten; merges across the batch.
- `writes`: in-place writes, and fresh tensors written per sample.
- `sample_index`: sample indices and the gathers that read them.
- `routing`: tokens routed per sub-batch (mixture of experts).
- `nodes`: what the rules read off an FX node.
- `whole_suffix`: the suffix run once on the whole batch (`run_suffix_whole`).
"""

from slcompile.analysis.batch_propagation.nodes import is_barrier
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, BatchPlan, NodeSplit
from slcompile.analysis.batch_propagation.propagate import PROPAGATE_BATCH_CODE, propagate_batch
from slcompile.analysis.batch_propagation.whole_suffix import run_suffix_whole

__all__ = ["NodeSplit", "BatchPlan", "propagate_batch", "BATCHED_INT", "is_barrier", "PROPAGATE_BATCH_CODE",
           "run_suffix_whole"]

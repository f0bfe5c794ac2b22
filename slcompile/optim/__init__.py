"""An optimizer that steps off the device, block by block, as gradients arrive.

`slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-4, states="host")`
returns an `OffloadedOptimizer`. With the model compiled by the speedloader backend
and its block weights streamed (`weights="nvme"`, or `"host"` on a GPU machine), the
backward stores each block's weight gradients once they are final (summed over the K
sub-batches) to the `gradients` tier and returns no `.grad` for them
(`slcompile.passes.offload_gradients`). As soon as all of a block's gradients have
arrived, a worker thread on the host runs the user's optimizer class, torch's own
implementation, over host copies of that block's parameters (one optimizer instance
per block; fp32 copies for bf16/fp16 parameters), and writes the updated values to
the weights' home tier, where the next forward's fetch reads them. The optimizer
state rests on `states`: host memory, or nvme files loaded before the block's step
and stored after it. `step()` waits for the block steps still running and steps the
parameters that stay on the device (embeddings, head, ...), which keep their
`.grad`, with the same optimizer class; no weight round trip, no
`gathered_weights`.

Needs: one backward per `step()` (gradient accumulation across backward calls is
what `num_subbatches` does inside one step; a second backward before `step()` raises
`OffloadError`); an optimizer whose update of a parameter reads only that
parameter's gradient and state (SGD, Adam, AdamW, Adagrad, RMSprop, ...). LBFGS
(a closure that re-evaluates the loss) and SparseAdam are refused with a
`ValueError`. `step(closure)` runs the closure (the forward and the backward, during
which the blocks step) under `torch.enable_grad()`, does what `step()` does and
returns the closure's loss, as torch's optimizers do: Lightning's automatic
optimization passes one to every step. A closure of Lightning's Trainer that would
clip the gradients (`gradient_clip_val`) is refused with a `ValueError` before it
runs: the clip reads `.grad`, which the streamed weights never get.

`params=` takes parameters or param groups as `optimizer_class` does, and the
optimizer is a `torch.optim.Optimizer` whose `param_groups` every step reads (the
block steps on the worker included): `torch.optim.lr_scheduler` schedulers work
on it, and `add_param_group` adds parameters of the model.

A global gradient-norm clip needs every gradient before any step:
`max_grad_norm=` runs it in two phases. As each block's gradients arrive, the
worker takes them into host memory and computes their norms (the block does not
step yet); `step()` adds the norms of the `.grad` of the other parameters, scales
every gradient by `min(1, max_grad_norm / (total norm + 1e-6))`, as
`torch.nn.utils.clip_grad_norm_` does, and then runs the block steps. The price:
the streamed weights' gradients wait in host memory until `step()` (the size of
the host copies), and the block steps no longer overlap the backward.
(`torch.nn.utils.clip_grad_norm_(model.parameters())` would not see the streamed
weights' gradients, which never become `.grad`.)

A step is all or nothing. When the block steps write bytes (weights on nvme, or
on the host of a GPU machine; states on nvme), each block's updated weights are
written under staging keys and its states under fresh keys, beside the previous
ones, which stay until `step()`: once every block has stepped and written, `step()`
puts them all in place (renames, which need no room) and then steps the resident
parameters. When any write fails (`DiskFullError` for a full disk, or any other
error of a block step, a backward that failed part way included), `step()` drops
what was written and puts every block back as it was before the step: its host
copies (copied back from before the step, or, where the weight's tier holds the
same values, loaded from it), its state in host memory and its previous state
files. The resident parameters are not stepped either: weights, host copies and
states are exactly the previous step's, and running the same batch again once
there is room gives what an uninterrupted run gives. The price: the nvme tier
holds a second copy of the block weights (and of the nvme states) until `step()`,
and the host keeps, until then, a copy of the host states and of the fp32 copies
of bf16/fp16 weights. The next forward's prefetches of the blocks' weights are
issued by `step()` once their new values are in place.

Guarantees: the parameters after each step equal what `optimizer_class` over the
whole model computes (the update is elementwise per parameter, so one instance per
block computes the same numbers); no fetch reads a weight older than its last
update: the next forward's prefetches of a block are issued after that block's
update (the compiled backward hands them over), and any load of it still pending
from before is issued again.

With `shard_weights=True` (`slcompile.runtime.collectives`) each rank receives its
shard of a block's gradients (reduce-scattered, averaged over the ranks), keeps
host copies and state for that shard only, and writes the updated shard back;
`step()` first averages the `.grad` of the replicated parameters over the ranks.
Every rank calls `step()`, `model.state_dict()` (which all-gathers the weights)
and `model.load_state_dict()` together. With `max_grad_norm` the total norm is the
whole model's on every rank: the squared norms of each rank's shards are summed by
one all-reduce of a scalar, and the replicated parameters' are counted once.
`slcompile.save_sharded` / `load_sharded` checkpoint the shards with
`torch.distributed.checkpoint`, no weight gathered (`slcompile.checkpoint`).

On a CPU-only machine the host tier is the device's memory: `gradients="host"` and
`states="host"` move no bytes. When the model was compiled before the optimizer was
created (and with `gradients="auto"`), the streamed weights' gradients come back as
`.grad`; `step()` then steps them the same way from their `.grad` and says so once
in the log. The host copies are the weights' master values: change weights through
`model.load_state_dict` (which updates them), not inside `gathered_weights`.

The modules: `optimizer` holds the public wrapper (`offload_optimizer`,
`OffloadedOptimizer`), which receives the gradients, runs the block steps on its
worker and closes each step; `host_step` holds one block's step over its host
copies, with its state on the host or in nvme files; `checks` what it refuses.
"""

from slcompile.optim.optimizer import OffloadedOptimizer, attached_optimizer_memory, offload_optimizer

__all__ = ["OffloadedOptimizer", "offload_optimizer", "attached_optimizer_memory"]

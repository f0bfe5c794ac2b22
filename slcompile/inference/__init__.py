"""Generation (prefill and decode passes of a Hugging Face decoder), one idea per
module; the entry points are `slcompile.generate` (`generate`, `generation`,
`explain_generation`).

- `options`: the options checked against the model (`generation_plan` -> `_Plan`).
- `capture`: the model seen layer by layer: every layer's arguments captured from
  its own forward, the tail, the compiled layer steps.
- `pass_graph`: one pass's schedule (`slcompile.schedules.generation`) lowered to
  an FX graph of its steps, over the sub-batches and the tiers.
- `executor`: a call of `generate`: the token loop, running each pass's graph.
- `explain`: the same schedules with their bytes, memory and time, predicted.
- `memory`: the device memory of a pass.
- `records`: what a pass did or will do (`GenerationStep`, `GenerationOutput`).
"""

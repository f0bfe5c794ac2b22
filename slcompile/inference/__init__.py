"""Generation (prefill and decode passes of a Hugging Face decoder), one idea per
module; the entry points are `slcompile.generate` (`generate`, `generation`,
`explain_generation`).

- `options`: the options checked against the model (`_plan` -> `_Plan`).
- `capture`: the model seen layer by layer: every layer's arguments captured from
  its own forward, the tail, the compiled layer steps.
- `executor`: a call of `generate`, each pass's schedule
  (`slcompile.schedules.generation`) walked over the sub-batches and the tiers.
- `explain`: the same schedules with their bytes, memory and time, predicted.
- `memory`: the device memory of a pass.
- `records`: what a pass did or will do (`GenerationStep`, `GenerationOutput`).
"""

"""Pictures of what the backend did: graphs (DOT), the timeline (Chrome trace), memory.

- `dot`: the compiled forward and backward graphs as Graphviz DOT, clustered by block
  and sub-batch, inserted nodes highlighted; rendered to SVG/PNG when `dot` exists.
- `trace`: the runtime's timeline as a Chrome trace (Perfetto, chrome://tracing), and
  the time model's predicted timeline in the same format.
- `memory`, `plots`: predicted and measured resident bytes over a step, and a static
  timeline picture (matplotlib).
- `pictures`: record one step and write all of the above into a folder (the CLI).
- `roles`, `summary`: what each node is for; short text for the terminal.
"""

from slcompile.viz.dot import graph_digraph, graph_to_dot, render
from slcompile.viz.pictures import RecordedStep, record_step, write_pictures, write_predicted_timeline
from slcompile.viz.trace import chrome_trace, predicted_chrome_trace, write_chrome_trace

__all__ = [
    "graph_to_dot",
    "graph_digraph",
    "render",
    "chrome_trace",
    "write_chrome_trace",
    "RecordedStep",
    "record_step",
    "write_pictures",
    "predicted_chrome_trace",
    "write_predicted_timeline",
]

"""predict_memory alone on the partitioned graphs of a two-block MLP: the per-node
series by kind, and the peaks they give."""

import torch
from expecttest import assert_expected_inline

from slcompile.analysis.memory import measured_peak_bytes, predict_memory


def test_memory_model_per_node_series_give_the_peaks(partitioned):
    forward, backward, state = partitioned()
    prediction = predict_memory(forward, backward)
    fw, bw = prediction.graphs
    assert (fw.phase, bw.phase) == ("fwd", "bwd")
    assert max(fw.peak, bw.peak) == prediction.step_peak_bytes
    assert prediction.peak_bytes["device"] == prediction.held_bytes + prediction.step_peak_bytes
    kinds = sorted(k for k in fw.live if any(fw.live[k]))
    lines = [" ".join(["node".ljust(12), *kinds])]
    for index, name in enumerate(fw.nodes):
        lines.append(" ".join([name.ljust(12), *(str(fw.live[k][index]).rjust(len(k)) for k in kinds)]))
    assert_expected_inline("\n".join(lines), """\
node         activation saved
primals_1             0     0
primals_2             0     0
primals_3             0     0
primals_4             0     0
primals_5             0     0
primals_6             0     0
primals_7             0     0
primals_8             0     0
primals_9             0     0
slice_1               0     0
t                     0     0
addmm                 0    64
slice_2               0    64
t_1                   0    64
addmm_1               0   128
t_2                   0   128
addmm_2              64   128
relu                 64   192
detach                0   192
t_3                   0   192
addmm_3              64   192
relu_1               64   256
detach_1              0   256
t_4                   0   256
addmm_4              64   256
relu_2               64   320
detach_2              0   320
t_5                   0   320
addmm_5              64   320
relu_3               64   384
detach_3              0   384
t_6                   0   384
addmm_6               8   384
sum_1                12   384
t_7                   4   384
addmm_7              12   384
sum_2                16   384
add                  12   384
output                4   384""")

    # The forward alone, measured by the CPU allocator: its peak is the model's.
    def run_forward():
        outputs = torch.fx.Interpreter(forward).run(*state.example_inputs)
        del outputs

    with torch.no_grad():
        measured = measured_peak_bytes(run_forward)
    assert measured == fw.peak

"""spill_boundaries alone on the partitioned forward of a two-block MLP at K=4: each
boundary output's store, wait, load and loaded copy land where the spilling policy's
steps are, and the schedule read back from the graph has the policy's transfers."""

import dataclasses

from expecttest import assert_expected_inline

from slcompile.passes.spill_boundaries import spill_boundaries
from slcompile.plans import StashPlan
from slcompile.schedules import POLICIES
from slcompile.schedules.derive import schedule_of


def _moves(schedule) -> list[str]:
    return [line for line in schedule.text().splitlines() if line.split()[1].startswith(("spill.", "fill."))]


def test_spill_boundaries_follows_the_spilling_schedule(partitioned, printer):
    forward, _, state = partitioned(num_subbatches=4)
    request = dataclasses.replace(state.schedule.request, activations_offloaded=True)
    schedule = POLICIES["spilling"](request)
    stash = StashPlan("golden", "nvme")
    before = printer.lines(forward)
    spilled = spill_boundaries(forward, schedule, stash.graph_key)
    # Every prefix and block output waits 3 steps (K-1) for its next region: 12 leave.
    assert len(spilled.names) == 12 and int(spilled.bytes) == int(spilled.stored_bytes) == 12 * 8 * 4
    assert _moves(schedule_of(forward)) == _moves(schedule.phase("fwd"))
    diff = printer.diff(before, printer.lines(forward))
    # Prefix sub-batch 0's output (addmm): stored when made, waited for after
    # prefix.sb1, loaded before prefix.sb3 and waited for before blk0.sb0, which reads
    # the loaded copy. Loads are tagged with the step they run in.
    assert_expected_inline("\n".join(diff.splitlines()[:12]), """\
+stash_default = stash.default(addmm, 'golden|prefix.sb0.spill.addmm')  # prefix.sb0
+stash_default_1 = stash.default(addmm_1, 'golden|prefix.sb1.spill.addmm_1')  # prefix.sb1
+wait_default = wait.default(stash_default, [addmm])  # prefix.sb0
+stash_default_2 = stash.default(addmm_2, 'golden|prefix.sb2.spill.addmm_2')  # prefix.sb2
+unstash_default = unstash.default(stash_default)  # prefix.sb3
+wait_default_1 = wait.default(stash_default_1, [addmm_1])  # prefix.sb1
+stash_default_3 = stash.default(addmm_3, 'golden|prefix.sb3.spill.addmm_3')  # prefix.sb3
-addmm_4 = addmm.default(primals_5, addmm, t_4)  # blk0.sb0
+unstash_wait_default = unstash_wait.default(unstash_default, [1, 8], torch.float32, device(type='cpu'))  # blk0.sb0
+unstash_default_1 = unstash.default(stash_default_1)  # blk0.sb0
+wait_default_2 = wait.default(stash_default_2, [addmm_2])  # prefix.sb2
+addmm_4 = addmm.default(primals_5, unstash_wait_default, t_4)  # blk0.sb0\
""")

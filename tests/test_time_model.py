"""The time model's arithmetic on synthetic graphs: exact figures, no timings."""

import dataclasses
import math

import pytest
import torch
import torch.fx

from slcompile.analysis.machine import NAMED_PROFILES, MachineProfile, named_profile
from slcompile.analysis.time import ComputeCost, count_cost, predict_pass_time, predict_time
from slcompile.meta import SlcMeta, set_slc_meta
from slcompile.vocabulary import FETCH_ISSUE, FETCH_WEIGHT, STASH, WAIT, fake_token

# 1 GFLOP/s, memory so fast that bytes never bound compute, 1 MB/s disk and link.
PROFILE = MachineProfile(
    name="synthetic", matmul_flops=1e9, memory_bandwidth=1e30, nvme_read=1e6, nvme_write=1e6,
    link_h2d=2e6, link_d2h=2e6,
)
MM = torch.ops.aten.mm.default


class GraphBuilder:
    """A hand-built partitioned graph: matmuls of a given FLOP count, weight fetches
    and activation stashes, each node tagged with its block."""

    def __init__(self):
        self.graph = torch.fx.Graph()
        self.x = self.graph.placeholder("x")
        self.x.meta["val"] = torch.empty(1000, 1000, device="meta")
        self.param = self.graph.placeholder("w")
        self.param.meta["val"] = torch.empty(500, 1000, device="meta")  # 2 MB of fp32

    def _tag(self, node, block):
        set_slc_meta(node, SlcMeta("block", block, 0))
        return node

    def matmul(self, block, seconds):
        """A 1000 x 1000 x n product taking `seconds` at 1 GFLOP/s (2e9 FLOPs per n=1000)."""
        n = int(seconds * 1000 / 2)
        b = self.graph.placeholder(f"b{len(self.graph.nodes)}")
        b.meta["val"] = torch.empty(1000, n, device="meta")
        node = self.graph.call_function(MM, (self.x, b))
        node.meta["val"] = torch.empty(1000, n, device="meta")
        return self._tag(node, block)

    def fetch_issue(self, block, key):
        node = self.graph.call_function(FETCH_ISSUE, (key,))
        node.meta["val"] = fake_token()
        return self._tag(node, block)

    def fetch(self, block, key):
        node = self.graph.call_function(FETCH_WEIGHT, (self.param, key))
        node.meta["val"] = torch.empty(500, 1000, device="meta")
        return self._tag(node, block)

    def stash(self, block, value, key="a0|x"):
        token = self.graph.call_function(STASH, (value, key))
        token.meta["val"] = fake_token()
        self._tag(token, block)
        return token

    def wait(self, block, token):
        node = self.graph.call_function(WAIT, (token, []))
        node.meta["val"] = fake_token()
        return self._tag(node, block)

    def module(self):
        self.graph.output(None)
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def test_transfer_seconds_are_bytes_over_bandwidth_plus_latency():
    profile = MachineProfile(name="p", matmul_flops=1, memory_bandwidth=1, nvme_read=4e9, nvme_write=2e9,
                             nvme_latency_seconds=1e-4, link_h2d=50e9, link_d2h=25e9)
    assert profile.transfer_seconds("nvme", "read", 8_000_000_000) == ("disk", 1e-4 + 2.0)
    assert profile.transfer_seconds("nvme", "write", 4_000_000_000) == ("disk", 1e-4 + 2.0)
    assert profile.transfer_seconds("host", "read", 100_000_000_000) == ("link.h2d", 2.0)
    assert profile.transfer_seconds("host", "write", 50_000_000_000) == ("link.d2h", 2.0)
    assert profile.transfer_seconds("device", "read", 10**9) == ("compute", 0.0)
    # A CPU machine: the host is the device's memory, nothing is copied.
    cpu = MachineProfile(name="cpu", matmul_flops=1, memory_bandwidth=1, nvme_read=1e9, nvme_write=1e9)
    assert cpu.host_is_device and cpu.transfer_seconds("host", "read", 10**9) == ("link.h2d", 0.0)
    # nvme on a GPU machine crosses the link too: the slower of the two bounds it.
    slow_link = MachineProfile(name="s", matmul_flops=1, memory_bandwidth=1, nvme_read=4e9, nvme_write=4e9,
                               link_h2d=1e9, link_d2h=1e9)
    assert slow_link.transfer_seconds("nvme", "read", 10**9) == ("disk", 1.0)


def test_compute_is_a_roofline_of_torch_flop_counts():
    builder = GraphBuilder()
    node = builder.matmul(0, 1.0)
    cost = count_cost(node)
    assert cost == ComputeCost(flops=2 * 1000 * 1000 * 500, nbytes=4 * (1000 * 1000 + 1000 * 500 + 1000 * 500),
                               large_output_bytes=4 * 1000 * 500)
    profile = MachineProfile(name="p", matmul_flops=1e9, memory_bandwidth=4e6, op_overhead_seconds=0.5)
    assert profile.compute_seconds(cost) == 0.5 + max(1.0, cost.nbytes / 4e6)
    assert profile.compute_seconds(ComputeCost(flops=10**9, nbytes=0)) == 0.5 + 1.0


def test_an_op_moves_its_bytes_at_the_rate_of_its_working_set():
    cache, memory = 100e9, 20e9
    profile = MachineProfile(name="p", matmul_flops=1e9, memory_bandwidth=cache,
                             bandwidth_curve=((1e6, cache), (1e8, memory)))
    assert profile.memory_rate(1e5) == cache and profile.memory_rate(1e9) == memory  # clamped at the ends
    assert profile.memory_rate(1e7) == pytest.approx((cache + memory) / 2)  # halfway in log bytes
    small, large = ComputeCost(flops=0, nbytes=10**5), ComputeCost(flops=0, nbytes=10**9)
    assert profile.compute_seconds(small) == pytest.approx(1e5 / cache)
    assert profile.compute_seconds(large) == pytest.approx(1e9 / memory)
    # Under Inductor an elementwise op costs its output's bytes, at its working set's rate.
    assert profile.compute_seconds(large, "inductor") == pytest.approx(1e9 / 2 / memory)
    # Without a curve, every op at `memory_bandwidth`; a curve never beats it.
    assert dataclasses.replace(profile, bandwidth_curve=()).compute_seconds(large) == pytest.approx(1e9 / cache)
    assert dataclasses.replace(profile, memory_bandwidth=10e9).memory_rate(1e5) == 10e9
    assert MachineProfile.from_json(profile.to_json()) == profile


def test_a_wait_blocks_compute_until_its_transfer_ends():
    builder = GraphBuilder()
    builder.matmul(0, 0.5)
    builder.fetch_issue(1, "w1")  # 2 MB at 1 MB/s: 2 s from t=0.5
    builder.fetch(1, "w1")
    builder.matmul(1, 1.0)
    prediction = predict_time(builder.module(), profile=PROFILE, tiers={"fetch": "nvme"})
    assert prediction.step_seconds == 0.5 + 2.0 + 1.0
    assert prediction.stall_seconds == 2.0
    assert prediction.lane_seconds() == {"compute": 1.5, "disk": 2.0}
    block1 = next(b for b in prediction.blocks if b.region == "blk1")
    assert (block1.compute_seconds, block1.stall_seconds, dict(block1.lane_seconds)) == (1.0, 2.0, {"disk": 2.0})
    assert block1.bound == "disk"


def test_a_transfer_overlaps_the_compute_between_its_issue_and_its_wait():
    builder = GraphBuilder()
    builder.fetch_issue(0, "w1")  # 2 s on the disk, from t=0
    builder.matmul(0, 3.0)        # hides it
    builder.fetch(1, "w1")
    builder.matmul(1, 1.0)
    prediction = predict_time(builder.module(), profile=PROFILE, tiers={"fetch": "nvme"})
    assert prediction.step_seconds == 4.0
    assert prediction.stall_seconds == 0.0
    assert prediction.bound == "compute"


def test_two_lanes_run_side_by_side_and_each_lane_is_serial():
    builder = GraphBuilder()
    first = builder.matmul(0, 1.0)           # t = 0 .. 1
    token = builder.stash(0, first)          # 8 MB out on the link at 2 MB/s: 1 .. 5
    builder.fetch_issue(0, "w1")             # 2 MB in on the disk at 1 MB/s: 1 .. 3
    builder.fetch_issue(0, "w2")             # the disk is busy: 3 .. 5
    builder.fetch(1, "w1")                   # compute waits 1 .. 3
    builder.matmul(1, 1.0)                   # 3 .. 4
    builder.fetch(1, "w2")                   # waits 4 .. 5
    builder.wait(1, token)                   # the stash ended at 5 too
    builder.matmul(1, 0.5)                   # 5 .. 5.5
    prediction = predict_time(builder.module(), profile=PROFILE, tiers={"fetch": "nvme", "stash": "host"})
    assert prediction.step_seconds == 5.5
    assert prediction.lane_seconds() == {"compute": 2.5, "disk": 4.0, "link.d2h": 1.0}
    assert prediction.lane_bytes() == {"disk": 4_000_000, "link.d2h": 2_000_000}
    assert prediction.stall_seconds == 3.0
    disk = sorted((e.start, e.end) for e in prediction.events if e.lane == "disk")
    assert disk == [(1.0, 3.0), (3.0, 5.0)]


def test_a_stash_whose_key_names_its_unit_s_tier_is_timed_on_that_tier():
    """A unit's own stash tier (`Step.tier`, in its key: `a0@nvme|...`) overrides the
    stash's: its bytes go to the disk, not the link."""
    for key, lane in (("a0|blk0.sb0.mm", "link.d2h"), ("a0@nvme|blk0.sb0.mm", "disk")):
        builder = GraphBuilder()
        builder.wait(1, builder.stash(0, builder.matmul(0, 1.0), key))
        prediction = predict_time(builder.module(), profile=PROFILE, tiers={"stash": "host"})
        assert prediction.lane_bytes() == {lane: 2_000_000}, key


def test_a_step_is_bound_by_its_slowest_lane():
    builder = GraphBuilder()
    for block in range(3):  # every block: 1 s of compute, a 2 s fetch issued one block ahead
        builder.fetch_issue(block, f"w{(block + 1) % 3}")  # the last block issues the next step's first
        builder.fetch(block, f"w{block}")
        builder.matmul(block, 1.0)
    prediction = predict_time(builder.module(), profile=PROFILE, tiers={"fetch": "nvme"})
    # Steady state (the w0 fetch comes from the step before): the disk's 3 x 2 s.
    assert prediction.step_seconds == pytest.approx(6.0)
    assert prediction.bound == "disk"
    assert [b.bound for b in prediction.blocks] == ["disk"] * 3
    faster = MachineProfile(**{**PROFILE.__dict__, "nvme_read": 4e6, "link_h2d": 4e6})  # 0.5 s a fetch
    prediction = predict_time(builder.graph.owning_module, profile=faster, tiers={"fetch": "nvme"})
    assert prediction.step_seconds == pytest.approx(3.0)
    assert prediction.bound == "compute"


def test_tokens_per_second_and_mfu():
    builder = GraphBuilder()
    builder.matmul(0, 2.0)
    prediction = predict_time(builder.module(), profile=PROFILE, tokens=1000)
    assert prediction.step_seconds == 2.0
    assert prediction.tokens_per_second == 500.0
    assert prediction.mfu == 1.0
    assert "a prediction, not a measurement" in str(prediction)


def test_named_profiles_and_json_round_trip(tmp_path, monkeypatch):
    from slcompile.profile import machine_profile

    h100 = named_profile("h100-pcie5-nvme")
    assert not h100.host_is_device and h100.link_h2d == 52e9
    assert math.isinf(h100.network) and not math.isinf(NAMED_PROFILES["8xh100-ib"].network)
    with pytest.raises(ValueError, match="h100-pcie5-nvme"):
        named_profile("no-such-machine")
    path = tmp_path / "profile.json"
    path.write_text(h100.to_json())
    assert MachineProfile.from_json(path.read_text()) == h100
    monkeypatch.setenv("SLC_PROFILE", str(path))
    assert machine_profile() == h100
    monkeypatch.setenv("SLC_PROFILE", "8xh100-ib")
    assert machine_profile("current").name == "8xh100-ib"
    assert machine_profile("h100-pcie5-nvme") is h100


def test_a_measured_profile_is_cached_for_the_threads_and_torch_it_ran_with(tmp_path, monkeypatch, caplog):
    """A profile measured with 2 threads is not the one a 1-thread run predicts with:
    the cache is keyed by device, dtype, thread count and torch version."""
    import slcompile.measure as profile_module

    measured = []

    def measure(device=None, *, dtype=None, offload_dir=None, **_):
        measured.append(torch.get_num_threads())
        return dataclasses.replace(PROFILE, name=f"{torch.get_num_threads()} threads",
                                   measured_on=profile_module.profile_key(device, dtype),
                                   bandwidth_curve=((1e6, 1e30),))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SLC_PROFILE", raising=False)
    monkeypatch.setattr(profile_module, "measure_rates", measure)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            assert profile_module.machine_profile().name == f"{count} threads"
        assert measured == [1, 2]
        torch.set_num_threads(1)
        one_thread = profile_module.profile_path()
        assert ("threads", "1") in profile_module.profile_key()
        assert f"torch{torch.__version__}" in one_thread and "-float32-1threads-" in one_thread
        # A cached file whose record names another key (renamed, or an old torch's) is measured anew.
        stale = MachineProfile.from_json(open(one_thread).read())
        key = dict(stale.measured_on, torch="2.0.0")
        open(one_thread, "w").write(dataclasses.replace(stale, measured_on=tuple(key.items())).to_json())
        profile_module.machine_profile()
        assert measured == [1, 2, 1]
        # So is one written by a release that measured no bandwidth curve.
        with open(one_thread) as f:
            fresh = MachineProfile.from_json(f.read())
        with open(one_thread, "w") as f:
            f.write(dataclasses.replace(fresh, bandwidth_curve=()).to_json())
        profile_module.machine_profile()
        assert measured == [1, 2, 1, 1]
        # A profile file measured elsewhere is used, with a warning naming what differs.
        monkeypatch.setenv("SLC_PROFILE", profile_module.profile_path())
        torch.set_num_threads(2)
        with caplog.at_level("WARNING", logger="slcompile.profile"):
            assert profile_module.machine_profile().name == "1 threads"
        assert "threads 1 (now 2)" in caplog.text
    finally:
        torch.set_num_threads(threads)


def test_explain_counts_the_flops_torch_counts_and_times_host_transfers_of_a_named_machine():
    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from torch.utils.flop_counter import FlopCounterMode

    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, n_heads=2)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    same = {  # the CPU's attention kernels compute what the flash ones do
        aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention].__wrapped__,
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            flop_registry[aten._scaled_dot_product_flash_attention_backward].__wrapped__,
    }
    with FlopCounterMode(display=False, custom_mapping=same) as counter:
        model(idx, targets)[1].backward()
    model.zero_grad(set_to_none=True)
    explanation = slcompile.explain(model, idx, targets, num_subbatches=2, weights="host", lowering="aot_eager",
                                    profile="h100-pcie5-nvme")
    predicted = explanation.time
    assert predicted.flops == counter.get_total_flops()
    assert predicted.tokens == 4 * 16
    # Each pass loads the streamed weights it reads (planned as a separate tier: the
    # nvme figure): the forward all of them, the backward those its gradients need.
    streamed = explanation.predicted_peak_bytes["nvme"]
    assert set(predicted.lane_bytes()) == {"link.h2d"}
    assert streamed < predicted.lane_bytes()["link.h2d"] <= 2 * streamed
    assert "predicted time (speedloader, K=2, on h100-pcie5-nvme; a prediction" in str(explanation)


def test_tune_with_a_profile_chooses_the_plan_the_model_predicts_fastest():
    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, n_heads=2)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    result = slcompile.tune(model, idx, targets, memory_budget="1GiB", num_subbatches=[1, 2], live_blocks=(2, 1),
                            profile="h100-pcie5-nvme", weights="nvme", lowering="aot_eager")
    assert len(result.fitting) == 4
    fastest = min(result.fitting, key=lambda c: c.seconds)
    assert result.time.step_seconds == fastest.seconds and result.options == fastest.options
    assert result.options["machine_profile"].name == "h100-pcie5-nvme"
    assert result.why.startswith("predicted fastest on h100-pcie5-nvme of 4 plans that fit")


def test_large_outputs_pay_the_profiles_output_rate_on_top_of_the_roofline():
    profile = MachineProfile(name="p", matmul_flops=1e9, memory_bandwidth=1e30, op_overhead_seconds=0.5,
                             output_seconds_per_byte=1e-6)
    # 1 s of FLOPs, 0.5 s launch, 2 MB of large output at 1 us a byte.
    assert profile.compute_seconds(ComputeCost(flops=10**9, nbytes=0, large_output_bytes=2 * 10**6)) == 3.5


def test_the_compute_scale_multiplies_the_roofline_not_the_launch_or_the_output_bytes():
    profile = MachineProfile(name="p", matmul_flops=1e9, memory_bandwidth=1e30, op_overhead_seconds=0.5,
                             output_seconds_per_byte=1e-6, compute_scale=1.5)
    # 1 s of FLOPs taken 1.5 times, 0.5 s launch, 2 MB of large output at 1 us a byte.
    assert profile.compute_seconds(ComputeCost(flops=10**9, nbytes=0, large_output_bytes=2 * 10**6)) == 4.0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_profile_fits_a_cpu_steps_scale_and_op_cost_and_elsewhere_the_op_and_byte_costs(device):
    """Two steps' (ops, roofline seconds, large output bytes, CPU seconds) made from
    known costs give them back: on a CPU, whose thread computes, a scale of the
    roofline and a cost per op; on a GPU (the host thread's time is not the
    roofline's) a cost per op and per byte of large outputs over the roofline as
    measured."""
    from slcompile.profile import _fit_compute

    steps = [(170, 1.0e-3, 2 * 10**6), (80, 15.0e-3, 20 * 10**6)]
    if device == "cpu":
        rows = [(ops, roof, large, 1.4 * roof + 20e-6 * ops) for ops, roof, large in steps]
        expected = {"op_overhead_seconds": 20e-6, "output_seconds_per_byte": 0.0, "compute_scale": 1.4}
    else:
        rows = [(ops, roof, large, roof + 20e-6 * ops + 3e-10 * large) for ops, roof, large in steps]
        expected = {"op_overhead_seconds": 20e-6, "output_seconds_per_byte": 3e-10, "compute_scale": 1.0}
    fitted = _fit_compute(rows, torch.device(device))
    assert fitted == {name: pytest.approx(value, rel=1e-9, abs=1e-18) for name, value in expected.items()}


def test_a_cpu_fit_that_is_not_positive_keeps_the_measured_roofline():
    from slcompile.profile import _fit_compute

    # The wider step took more over its roofline than a scale of the tiny one's
    # explains (4.7 times it against 4.4): a scale and a cost per op would fit only
    # with a negative cost per op. The rest over the roofline goes to its output bytes.
    rows = [(170, 1.0e-3, 2 * 10**6, 4.4e-3), (80, 15.0e-3, 20 * 10**6, 70.0e-3)]
    fitted = _fit_compute(rows, torch.device("cpu"))
    per_byte = (170 * 55e-3 - 80 * 3.4e-3) / (170 * 20e6 - 80 * 2e6)
    assert fitted == {"op_overhead_seconds": 0.0, "output_seconds_per_byte": pytest.approx(per_byte),
                      "compute_scale": 1.0}


def _pass_graph(request, spills=False):
    """The lowered graph of a generation pass (one row a sub-batch, one streamed
    weight a fetched layer), to be read."""
    from slcompile.inference.pass_graph import PassLayout, lower_pass
    from slcompile.schedules.generation import generation_pass

    parts = tuple((sb, sb, 1) for sb in request.subbatches)
    return lower_pass(generation_pass(request), PassLayout.placeholders(parts, [1] * request.layers, spills))


def test_a_pass_graph_overlaps_the_next_layers_load_and_flushes_its_stores():
    """A decode pass of two layers, read from its lowered graph: layer 0's weights
    (1 MB on nvme, 1 s) load first, layer 1's (1 s) while layer 0 computes (2 s);
    each layer stores 2 MB of cache (2 s) after it computes, on the same disk
    lane, so layer 1's store starts when layer 0's has finished."""
    from slcompile.schedules.generation import PassRequest

    graph = _pass_graph(PassRequest("decode", (0,), fetched=(True, True), kv_moves=True, stores=True))
    stored = {0: (10**6, 10**6), 1: (2 * 10**6,)}

    def moves(direction, what, block, subbatch):
        if what == "w":
            return "nvme", (10**6,)
        return ("nvme", stored[block]) if direction == "store" else ("device", ())

    two_seconds = (ComputeCost(flops=2 * 10**9),)
    timeline = predict_pass_time(graph, moves=moves, costs=[two_seconds] * 2, tail=(), profile=PROFILE,
                                 phase="decode", lowering="aot_eager", tokens=4)
    # Disk: load 0 [0, 1], load 1 [1, 2], store 0 [3, 5], store 1 [5, 7].
    # Compute: stall [0, 1], blk0 [1, 3], blk1 [3, 5]; the pass ends with the last store.
    assert timeline.step_seconds == pytest.approx(7.0)
    assert timeline.compute_seconds == pytest.approx(4.0)
    assert timeline.lane_bytes() == {"disk": 6 * 10**6}
    assert timeline.lane_seconds()["disk"] == pytest.approx(6.0)
    assert [(e.kind, e.region, e.start, e.end) for e in timeline.events if e.lane == "disk"] == [
        ("fetch", "blk0", 0.0, 1.0), ("fetch", "blk1", 1.0, 2.0), ("stash", "blk0", 3.0, 5.0),
        ("stash", "blk1", 5.0, 7.0)]
    assert timeline.bound == "disk"
    assert timeline.tokens_per_second == pytest.approx(4 / 7)
    # A compiled call's fixed cost, and a device-resident tier moving nothing.
    called = MachineProfile(name="c", matmul_flops=1e9, memory_bandwidth=1e30, call_overhead_seconds=0.25)
    timeline = predict_pass_time(graph, moves=lambda *_: ("device", (10**6,)), costs=[two_seconds] * 2, tail=(),
                                 profile=called, phase="decode", lowering="aot_eager")
    assert timeline.step_seconds == pytest.approx(2 * (2.0 + 0.25))
    assert timeline.lane_bytes() == {}


def test_a_pass_that_waits_for_a_spill_stalls_its_compute_until_the_store_is_done():
    """A prefill of three sub-batches that spills its hidden states between two
    layers (1 MB each: stored in 4 s, loaded in 1 s; each layer step 1 s). Disk:
    spill sb0 [1, 5], spill sb1 [5, 9], fill sb0 [9, 10], spill sb2 [10, 14], fill
    sb1 [14, 15], fill sb2 [15, 16]. Layer 0's last step ends at 3, then the graph
    waits for sb0's spill (done at 5) before it fills sb1; layer 1 waits for each
    fill: sb0 from 5 to 10, sb1 from 11 to 15; sb2's is done when it starts (16)."""
    from slcompile.schedules.generation import PassRequest

    request = PassRequest("prefill", (0, 1, 2), fetched=(False, False), kv_moves=True, stores=False,
                          spill_hidden=True)
    graph = _pass_graph(request, spills=True)
    profile = dataclasses.replace(PROFILE, nvme_write=0.25e6)
    one_second = (ComputeCost(flops=10**9),)
    timeline = predict_pass_time(graph, moves=lambda *_: ("nvme", (10**6,)), costs=[one_second] * 2, tail=(),
                                 profile=profile, phase="prefill", lowering="aot_eager")
    assert [(e.kind, e.subbatch, e.start, e.end) for e in timeline.events if e.lane == "disk"] == [
        ("spill", 0, 1.0, 5.0), ("spill", 1, 5.0, 9.0), ("fill", 0, 9.0, 10.0), ("spill", 2, 10.0, 14.0),
        ("fill", 1, 14.0, 15.0), ("fill", 2, 15.0, 16.0)]
    stalls = [(e.region, e.subbatch, e.start, e.end) for e in timeline.events if e.kind == "stall"]
    assert stalls == [("blk0", 0, 3.0, 5.0), ("blk1", 0, 5.0, 10.0), ("blk1", 1, 11.0, 15.0)]
    assert timeline.step_seconds == pytest.approx(17.0)


def test_a_compiled_step_keeps_its_graphs_as_planned_for_the_models(tmp_path):
    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, n_heads=2)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    options = {"num_subbatches": 2, "activations": "nvme", "min_offload_bytes": 0, "recompute": "none",
               "lowering": "aot_eager", "offload_dir": str(tmp_path)}
    explanation = slcompile.explain(model, idx, targets, profile="h100-pcie5-nvme", **options)
    compiled = torch.compile(model, backend="speedloader", options={**options, "on_refusal": "raise"})
    compiled(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    planned, ran = report.partitioned["forward"], report.graphs["forward"]

    def targets_of(gm):
        return [node.target for node in gm.graph.nodes if node.op == "call_function"]

    # The compiled stage marked the regions of the graph it compiled, not of the plan.
    assert torch.ops.slc.mark.default in targets_of(ran)
    assert torch.ops.slc.mark.default not in targets_of(planned)
    assert targets_of(planned).count(STASH) == len(report.offloaded_activations.names) > 0
    tiers = {"fetch": "device", "stash": "nvme", "unstash": "nvme", "store_grad": "device"}
    after = predict_time(planned, report.partitioned["backward"], profile=named_profile("h100-pcie5-nvme"),
                         tiers=tiers)
    assert after.step_seconds == pytest.approx(explanation.time.step_seconds)

"""torch.distributed on neuron (issue 11): collectives as device ops over gloo, DDP.

The multi-process part spawns two ranks once per session (gloo over 127.0.0.1); each rank
runs every scenario in eager and both adaptive strategies, and the tests assert on what the
ranks sent back. The single-process part runs a world of one in this process."""
from __future__ import annotations

import dataclasses
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adaptive_eager as ae
from device import DeviceSpec
from device.interconnect import (BARRIER, P2P, RING_ALL_REDUCE, RING_GATHER, TREE,
                                 collective_plan, collective_us)

from tests.harness import dist_worker as W

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks():
    """Two spawned ranks' results: {rank: {scenario key: data}}."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(W.run, args=(WORLD, _free_port(), results, _free_port()), nprocs=WORLD,
                 join=True)
        out = dict(results)
    for r in range(WORLD):
        assert "error" not in out[r], f"rank {r} failed:\n{out[r]['error']}"
    return out


# -- the default backend -------------------------------------------------------------------
def test_default_backend_is_gloo(ranks):
    for r in range(WORLD):
        assert ranks[r]["backend"] == "ProcessGroupGloo"
        assert ranks[r]["backend_config"] == "neuron:gloo"
        assert "neuron" in ranks[r]["device_types"]


def test_gloo_backend_covers_neuron():
    assert dist.Backend.default_device_backend_map["neuron"] == "gloo"
    assert "neuron" in dist.Backend.backend_capability["gloo"]


def test_no_fallback_warning(ranks):
    for r in range(WORLD):
        assert not [w for w in ranks[r]["warnings"] if "fell back" in w], ranks[r]["warnings"]


# -- collectives: values -------------------------------------------------------------------
@pytest.mark.parametrize("mode", W.MODES)
def test_collective_values(ranks, mode):
    a = torch.arange(4, dtype=torch.float32)
    for r in range(WORLD):
        got = ranks[r][("collectives", mode)]
        torch.testing.assert_close(got["all_reduce"], 2 * a + 10)
        torch.testing.assert_close(got["all_reduce_async_max"], torch.full((4,), 2.0))
        assert [t.tolist() for t in got["all_gather"]] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["all_gather_into_tensor"].tolist() == [0.0, 0.0, 1.0, 1.0]
        # reduce_scatter of arange(4) from both ranks: rank r gets 2 * [2r, 2r + 1]
        assert got["reduce_scatter_tensor"].tolist() == [4.0 * r, 4.0 * r + 2]
        assert got["broadcast"].tolist() == [6.0, 6.0, 6.0]
        assert got["all_to_all_single"].tolist() == [float(r), float(r + 10)]
    assert ranks[1][("collectives", mode)]["send_recv"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("mode", W.MODES)
def test_collectives_counted_not_fallbacks(ranks, mode):
    for r in range(WORLD):
        got = ranks[r][("collectives", mode)]
        assert got["cpu_fallbacks"] == {}
        # 2 all_reduce, all_gather, all_gather_into_tensor, reduce_scatter, broadcast,
        # all_to_all, one of send/recv, barrier
        assert got["collectives"] == 9
        f = 4
        assert got["collective_bytes"] == (4 * f + 4 * f + 2 * WORLD * f + 2 * WORLD * f
                                           + 2 * WORLD * f + 3 * f + WORLD * f + 2 * f + 0)


def test_adaptive_collective_is_a_boundary(ranks):
    for r in range(WORLD):
        got = ranks[r]["boundary"]
        assert got["flushes"].get("collective") == 1
        assert got["reason"] == "collective"
        assert (got["ops"], got["launches"]) == (4, 1)  # fill, mul, add, relu: one fused launch
        assert got["value"].tolist() == [6.0] * 4


# -- DDP -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", W.MODES)
def test_ddp_matches_single_process_cpu(ranks, mode):
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        losses, params = ranks[r][("ddp", mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q)


needs_native = pytest.mark.skipif(not ae.native_hooks(), reason="the native hooks are off")


@needs_native
@pytest.mark.parametrize("option", ["ddp_unused", "ddp_static"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_ddp_options_that_pin_match_single_process_cpu(ranks, option, mode):
    """find_unused_parameters=True and static_graph=True: the reducer pins a host buffer,
    which needs the native hooks' pinned allocator (issue 25; HF Trainer turns
    find_unused_parameters on under torchrun)."""
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        losses, params = ranks[r][(option, mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q)


@needs_native
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_ddp_after_set_device_runs_on_each_ranks_core(ranks, mode):
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        where, losses, params = ranks[r][("ddp_own_core", mode)]
        assert where == f"neuron:{r}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q)


@pytest.mark.parametrize("style", ["fsdp2", "tp"])
@pytest.mark.parametrize("mode", W.MODES)
def test_parallel_style_matches_single_process_cpu(ranks, style, mode):
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        losses, params = ranks[r][(style, mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q)


@pytest.mark.parametrize("mode", W.MODES)
def test_dtensor_on_a_neuron_mesh(ranks, mode):
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    for r in range(WORLD):
        got = ranks[r][("dtensor", mode)]
        torch.testing.assert_close(got["local"], x[2 * r:2 * r + 2])
        torch.testing.assert_close(got["full"], x)
        assert got["sum"] == 2 * x.sum().item()


def test_no_cpu_fallback_in_any_parallel_style(ranks):
    for r in range(WORLD):
        assert ranks[r]["fallbacks"] == {}


# -- the "neuron" backend (accelerate's path), DDP(device_ids=[k]) --------------------------
def test_neuron_backend_is_gloo_under_accelerate(ranks):
    """accelerate asked c10d for a backend named "neuron": "Unknown backend type neuron"."""
    for r in range(WORLD):
        got = ranks[r]["neuron_backend"]
        assert "error" not in got, f"rank {r} failed:\n{got['error']}"
        assert got["backend"] == "neuron" and got["backend_class"] == "ProcessGroupGloo"
        # its device is current_device(), made LOCAL_RANK's core by the group (issue 25)
        assert got["accelerate"] == ("MULTI_NEURON", f"neuron:{r}")
        assert got["object"] == "from 1"
        assert got["cpu_fallbacks"] == {}


@pytest.mark.parametrize("mode", W.MODES)
def test_ddp_device_ids_matches_single_process_cpu(ranks, mode):
    """DDP(device_ids=[k]) with the model on neuron:k, CPU batches (record_stream)."""
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        got = ranks[r]["neuron_backend"]
        assert "error" not in got, f"rank {r} failed:\n{got['error']}"
        losses, params = got[("ddp", mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q)


def test_neuron_backend_registered():
    assert "neuron" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["neuron"] == ["neuron", "cpu"]
    assert dist.Backend.default_device_backend_map["neuron"] == "gloo"  # no backend: gloo


# -- one process, a world of one -----------------------------------------------------------
@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_collective_costs_device_time(world_of_one):
    x = torch.ones(1024, device="neuron")
    ae.synchronize()
    before = ae.metrics()
    dist.all_reduce(x)
    ae.synchronize()
    m = ae.metrics() - before
    assert m.collectives == 1 and m.collective_bytes == 4096 and m.launches == 0
    assert "collectives (bytes)" in ae.metrics_report()
    assert m.device_time_us == pytest.approx(
        collective_us(ae.engine.engine.ENGINE.spec, RING_ALL_REDUCE, 4096, 1))
    assert x.cpu().tolist() == [1.0] * 1024


def test_async_work_handle(world_of_one):
    x = torch.ones(3, device="neuron") * 2
    work = dist.all_reduce(x, async_op=True)
    assert work.wait()
    assert x.cpu().tolist() == [2.0, 2.0, 2.0]


def test_async_work_results_are_the_neuron_tensors(world_of_one, mode):
    """Note [Work results]: `work.result()` and the future's value were gloo's host views (CPU
    tensors over the device buffer): `v + a` raised, and in adaptive mode a write through `v`
    reached an op queued before it (`b = a * 2` gave 60 instead of 6)."""
    import warnings
    a = torch.full((3,), 3.0, device="neuron")
    v = dist.all_reduce(a, async_op=True).get_future().wait()[0]
    b = a * 2
    v.mul_(10)
    assert v.device.type == "neuron" and b.cpu().tolist() == [6.0] * 3
    assert (v + a).cpu().tolist() == [60.0] * 3
    work = dist.all_reduce(a, async_op=True)
    work.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Work.result is deprecated
        assert work.result()[0].device.type == "neuron"


def test_a_collectives_tensors_are_freed_once_dropped(tmp_path, mode):
    """Note [Gloo's thread and the GIL]: the engine held each gloo Work, and through its host
    views (Note [Work results]) the neuron tensors, until the process's second collective
    after it, and the last ones for good after destroy_process_group(): 16384 bytes of a
    dropped all-reduced tensor stayed allocated."""
    import warnings
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        ae.synchronize()
        ae.synchronize()  # two looks: an earlier test's Works are gone
        base = torch.neuron.memory_allocated()
        x = torch.ones(4096, device="neuron")
        dist.all_reduce(x)
        del x
        ae.synchronize()
        assert torch.neuron.memory_allocated() == base
        y = torch.ones(4096, device="neuron")
        work = dist.all_reduce(y, async_op=True)
        work.wait()
        ae.synchronize()  # a Work the user holds keeps its results (Note [Work results])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Work.result is deprecated
            assert work.result()[0].device.type == "neuron"
        del work, y
        torch.neuron.synchronize()
        assert torch.neuron.memory_allocated() == base
        z = torch.ones(4096, device="neuron")
        dist.all_reduce(z)
        del z  # the process's last collective
    finally:
        dist.destroy_process_group()
    assert torch.neuron.memory_allocated() == base


def test_collective_on_poisoned_input_raises_device_error(world_of_one):
    x = torch.ones(4, device="neuron")
    y = x.index_select(0, torch.tensor([7], device="neuron"))  # found only when it runs
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        dist.all_reduce(y)
    ae.synchronize()  # the error was raised once, at the collective
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        dist.all_reduce(y)  # y stays unreadable, as a read of it would say
    z = torch.ones(2, device="neuron")
    dist.all_reduce(z)  # and the device keeps working
    assert z.cpu().tolist() == [1.0, 1.0]


def test_a_collective_over_two_cores_raises_cudas_error(world_of_one):
    """It flushed one core's queue only: gloo sent another core's pending value's never
    written memory, or its value before a queued in-place write (adaptive mode)."""
    with ae.adaptive(strategy="graph"):
        out = torch.zeros(4, device="neuron:0")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            dist.all_gather_into_tensor(out, torch.arange(4.0).to("neuron:1") * 2)
        t = torch.arange(4.0).to("neuron:0") * 2
        dist.all_gather_into_tensor(out, t)  # one core: fine
        assert out.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_collective_trace_row(world_of_one, tmp_path):
    dist.all_reduce(torch.ones(2, device="neuron"))
    ae.save_trace(str(tmp_path / "t.json"))
    import json
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    from device.core import TRACKS
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    assert rows[TRACKS["collective"]] == "collectives"
    assert any(e.get("cat") == "collective" and e["tid"] == TRACKS["collective"] for e in events)


# -- the cost model ------------------------------------------------------------------------
def test_ring_all_reduce_formula():
    spec = DeviceSpec(interconnect_gbps=100.0, interconnect_latency_us=2.0,
                      launch_overhead_us=10.0)
    n, p = 8_000_000, 8
    want = 10.0 + 2 * (p - 1) * (2.0 + n / p / (100.0 * 1e3))
    assert collective_us(spec, RING_ALL_REDUCE, n, p) == pytest.approx(want)
    assert collective_us(spec, RING_GATHER, n, p) == pytest.approx(
        10.0 + (p - 1) * (2.0 + n / p / 1e5))
    assert collective_us(spec, TREE, n, p) == pytest.approx(10.0 + 3 * (2.0 + n / 1e5))
    assert collective_us(spec, P2P, n, 2) == pytest.approx(10.0 + 2.0 + n / 1e5)
    assert collective_us(spec, BARRIER, 0, 5) == pytest.approx(10.0 + math.ceil(math.log2(5)) * 2)
    assert collective_us(spec, RING_ALL_REDUCE, n, 1) == 10.0  # one rank: nothing moves


def test_ring_all_reduce_bandwidth_term_saturates():
    """The ring's bytes per rank approach 2n as p grows: time grows with latency only
    (one level: every rank in one instance)."""
    spec = DeviceSpec(interconnect_latency_us=0.0, launch_overhead_us=0.0,
                      ranks_per_instance=512)
    t = [collective_us(spec, RING_ALL_REDUCE, 2**26, p) for p in (2, 64, 512)]
    assert t[0] < t[1] < t[2] < 2 * t[0]


def test_all_reduce_picks_tree_or_ring_by_size():
    """NCCL's rule: a tree for small messages (log p hops of latency), a ring for large ones."""
    spec = DeviceSpec(interconnect_gbps=100.0, interconnect_latency_us=2.0,
                      launch_overhead_us=0.0)
    assert collective_plan(spec, RING_ALL_REDUCE, 1024, 64) == pytest.approx(
        (2 * 6 * 2.0 + 2 * 1024 / 1e5, "tree"))
    n = 1 << 30
    assert collective_plan(spec, RING_ALL_REDUCE, n, 8) == pytest.approx(
        (2 * 7 * (2.0 + n / 8 / 1e5), "ring"))


def test_two_level_interconnect():
    """Note [Two-level interconnect]: past `ranks_per_instance` ranks, the hops between
    instances are EFA's (the NIC's bandwidth shared by the instance's ranks)."""
    spec = DeviceSpec(interconnect_gbps=320.0, interconnect_latency_us=0.5,
                      inter_instance_gbps=50.0, inter_instance_latency_us=15.0,
                      ranks_per_instance=4, launch_overhead_us=0.0)
    n = 100_000_000
    b1, b2 = 320e3, 50e3 / 4  # bytes per us: a NeuronLink link; a rank's share of the NIC
    # 8 ranks = 2 instances of 4: ring reduce-scatter and all-gather inside, a ring of n/4
    # between the two instances (cheaper than a tree of 2 for this size)
    inside = 3 * (0.5 + n / (4 * b1))
    across = 2 * 1 * (15.0 + (n / 4) / (2 * b2))
    us, algo = collective_plan(spec, RING_ALL_REDUCE, n, 8)
    assert algo == "hierarchical (ring in 4, ring across 2 instances)"
    assert us == pytest.approx(2 * inside + across)
    # the same 8 ranks in one instance: NeuronLink only, faster
    one = dataclasses.replace(spec, ranks_per_instance=8)
    assert collective_us(one, RING_ALL_REDUCE, n, 8) < us
    # all-gather: a ring across instances over each rank's share, then the ring inside
    assert collective_us(spec, RING_GATHER, n, 8) == pytest.approx(
        3 * (0.5 + n / (4 * b1)) + 1 * (15.0 + (n / 4) / (2 * b2)))
    # tree ops and barriers: log2 hops on each level
    assert collective_us(spec, TREE, n, 8) == pytest.approx(
        2 * (0.5 + n / b1) + 1 * (15.0 + n / 50e3))
    assert collective_us(spec, BARRIER, 0, 8) == pytest.approx(2 * 0.5 + 15.0)


def test_projection_grows_past_one_instance():
    """The default figures: an all-reduce over 2 instances costs more than over one."""
    spec = DeviceSpec()
    per = spec.ranks_per_instance
    n = 100 << 20
    assert collective_us(spec, RING_ALL_REDUCE, n, 2 * per) > collective_us(
        spec, RING_ALL_REDUCE, n, per)


def test_pipeline_step_time_adds_the_bubble():
    """Note [Pipeline step time] (benchmarks/pp_llama.py): each rank's clock leaves out the
    wait for its peer; the reconstruction pairs the k-th send with the peer's k-th receive."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import pp_llama
    send, recv = "c10d::send", "c10d::recv_"
    stage0 = [("fwd", "launch", 0.0, 10.0, 0), (send, "collective", 10.0, 2.0, 8),
              (recv, "collective", 12.0, 2.0, 8), ("bwd", "launch", 14.0, 10.0, 0)]
    stage1 = [(recv, "collective", 0.0, 2.0, 8), ("fwd", "launch", 2.0, 10.0, 0),
              (send, "collective", 12.0, 2.0, 8), ("opt", "launch", 14.0, 5.0, 0)]
    delays = pp_llama.pipeline_delays({0: stage0, 1: stage1}, lambda r: 1 - r)
    # stage 1 waits until stage 0's send is done (12 us) instead of its own 2 us: 10 us; its
    # send then starts at 22 and stage 0's receive ends at 24 instead of 14: 10 us
    assert delays[1] == [0.0, 10.0, 10.0, 10.0, 10.0]
    assert delays[0] == [0.0, 0.0, 0.0, 10.0, 10.0]


# -- storage resize (FSDP2 frees and re-allocates unsharded parameters) ----------------------
@pytest.mark.parametrize("mode", W.MODES)
def test_storage_resize_frees_and_reallocates(mode):
    with W._mode(mode):
        x = torch.arange(6, dtype=torch.float32).to("neuron")
        y = x * 2
        torch.neuron.synchronize()
        st = y.untyped_storage()
        used = torch.neuron.memory_allocated()
        st.resize_(0)
        assert st.size() == 0 and torch.neuron.memory_allocated() == used - 24
        with pytest.raises(RuntimeError, match="out of bounds for storage of size 0"):
            y + 1  # CPU would crash here
        st.resize_(24)
        assert st.nbytes() == 24 and torch.neuron.memory_allocated() == used
        y.copy_(torch.ones(6))
        assert (y + 1).cpu().tolist() == [2.0] * 6


@pytest.mark.parametrize("mode", W.MODES)
def test_storage_resize_keeps_the_prefix(mode):
    with W._mode(mode):
        y = torch.arange(6, dtype=torch.float32).to("neuron") * 2  # queued in adaptive mode
        y.untyped_storage().resize_(12)  # runs the queue first
        with pytest.raises(RuntimeError, match="out of bounds for storage of size 12"):
            y[:3]  # y's own extent no longer fits: refused before any view is made
        y.untyped_storage().resize_(24)
        assert y.cpu()[:3].tolist() == [0.0, 2.0, 4.0]


# -- torchrun ------------------------------------------------------------------------------
def test_torchrun_ddp_example(tmp_path):
    """`torchrun --nproc-per-node 2 benchmarks/train_ddp.py`: the losses of one CPU process."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "losses.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(root, "benchmarks", "train_ddp.py"), "--adaptive", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
            root, os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(W.cpu_losses()[0]))
    assert got["world"] == 2 and got["device_count"] == 4  # rank r on neuron:r of the chip
    assert got["devices"] == ["neuron:0"]  # rank 0's (rank 1 checks its own neuron:1)
    assert got["cpu_fallbacks"] == {} and got["collectives"] > 0


# -- overlap (Note [Overlap], Note [Collective stream] in device/core.py) --------------------
def _comm():
    ae.synchronize()
    return ae.metrics()


def test_synchronous_collective_is_all_exposed(world_of_one):
    x = torch.ones(1024, device="neuron")
    before = _comm()
    dist.all_reduce(x)  # issued, then waited for at once by torch.distributed
    m = ae.metrics() - before
    assert m.collective_us > 0 and m.exposed_collective_us == pytest.approx(m.collective_us)
    assert m.hidden_collective_us == pytest.approx(0.0)
    assert "communication exposed / hidden" in ae.metrics_report()


def _compute(n=10):
    a = torch.randn(128, 128, device="neuron")
    for _ in range(n):
        a = (a @ a).tanh()
    return a


def test_async_collective_hides_under_compute_until_wait(world_of_one, mode):
    x = torch.ones(1024, device="neuron")
    before = _comm()
    work = dist.all_reduce(x, async_op=True)  # the compute stream does not wait here...
    _compute()
    work.wait()  # ...but here, by which time the collective is long done
    m = _comm() - before
    assert m.collective_us > 0
    assert m.exposed_collective_us == pytest.approx(0.0)
    assert m.hidden_collective_us == pytest.approx(m.collective_us)
    assert x.cpu().tolist() == [1.0] * 1024


def test_using_an_async_result_before_wait_joins(world_of_one):
    """A launch that reads an async collective's tensor waits for it (its bytes from gloo,
    its end on the timeline), as DDP's reducer, waiting in C++, needs."""
    from adaptive_eager.engine import engine as _engine
    x = torch.full((1024,), 2.0, device="neuron")
    x * 3  # compiled once (a compile's host time would hide the collective)
    before = _comm()
    dist.all_reduce(x, async_op=True)
    y = x * 3  # no wait(): the first use joins
    ae.synchronize()
    m = ae.metrics() - before
    # exposed: all but the host's time to issue `x * 3`, which the collective ran under
    assert m.exposed_collective_us == pytest.approx(
        m.collective_us - _engine.ENGINE.spec.host_op_overhead_us)
    trace = list(_engine.ENGINE.device.trace)
    coll = [e for e in trace if e[1] == "collective"][-1]
    use = [e for e in trace if e[1] == "launch"][-1]
    assert use[2] >= coll[2] + coll[3]  # the launch starts after the collective ends
    assert y.cpu().tolist() == [6.0] * 1024


def test_collectives_queue_on_their_own_stream(world_of_one):
    """Two async collectives run one after the other on the collective stream, and neither
    holds up the compute stream's launches issued meanwhile."""
    from adaptive_eager.engine import engine as _engine
    dev = _engine.ENGINE.device
    x, z = torch.ones(4, device="neuron"), torch.ones(4, device="neuron")
    _compute(2)  # compiled once (a compile's host time would come first)
    ae.synchronize()
    dev.trace.clear()  # (in a long run the timeline is full: its length no longer grows)
    mark = 0
    w1, w2 = dist.all_reduce(x, async_op=True), dist.all_reduce(z, async_op=True)
    _compute(2)
    ae.synchronize()
    w1.wait(), w2.wait()
    events = list(dev.trace)[mark:]
    c1, c2 = [e for e in events if e[1] == "collective"]
    assert c2[2] >= c1[2] + c1[3]
    first = [e for e in events if e[1] == "launch"][0]
    assert first[2] < c2[2] + c2[3]  # compute started before the collectives were done


def _step(opt, work=None):
    """An optimizer step (where explain()'s steps end): `work` waited for first, if given."""
    if work is not None:
        work.wait()
    opt.step()


def test_explain_reports_the_steps_communication(world_of_one, mode):
    """`ae.explain().communication`: the last optimizer step's collectives, exposed and hidden
    (Note [Collective stream]); the figures of the step alone, equal to the metrics' for it."""
    w = torch.nn.Parameter(torch.ones(4, device="neuron"))
    w.grad = torch.zeros(4, device="neuron")
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.ones(1024, device="neuron")
    _compute(2)
    opt.step()  # compiled once; a step before: this test's steps start here
    before = _comm()
    work = dist.all_reduce(x, async_op=True)  # step 1: hidden under compute, then waited
    _compute()
    _step(opt, work)
    m1 = _comm() - before
    c = ae.explain().communication
    assert c["complete"] and c["collectives"] == 1 and c["bytes"] == 4096 and not c["pending"]
    assert c["collective_us"] == pytest.approx(m1.collective_us)
    assert c["exposed_us"] == pytest.approx(0.0) and c["hidden_us"] == pytest.approx(
        m1.collective_us)
    assert "communication, last step: 1 collectives, 4096 B" in str(ae.explain())
    before = _comm()
    dist.all_reduce(x)  # step 2: synchronous, all exposed
    dist.all_reduce(x)
    _step(opt)
    m2 = _comm() - before
    c = ae.explain().communication
    assert c["collectives"] == 2 and c["collective_us"] == pytest.approx(m2.collective_us)
    assert c["exposed_us"] == pytest.approx(m2.exposed_collective_us) == pytest.approx(
        m2.collective_us)
    assert "hidden 0.0 us (0%)" in str(ae.explain())
    assert x.cpu().tolist() == [1.0] * 1024


def test_explain_gives_a_late_join_to_the_step_that_issued_it(world_of_one, mode):
    """A collective waited for after the optimizer step (its first use, in the next step) is
    still its own step's: the wait counts there, not in the step it happened in."""
    w = torch.nn.Parameter(torch.ones(4, device="neuron"))
    opt = torch.optim.SGD([w], lr=0.1)  # no gradient: its steps launch nothing
    x = torch.full((4096,), 2.0, device="neuron")
    x * 3
    opt.step()
    before = _comm()
    dist.all_reduce(x, async_op=True)
    opt.step()  # the step ends with the collective still running
    c = ae.explain().communication
    assert c["collectives"] == 1 and c["pending"] == 1
    y = x * 3  # the join, in the next step
    ae.synchronize()
    m = ae.metrics() - before
    c = ae.explain().communication
    assert c["pending"] == 0 and c["exposed_us"] > 0
    assert c["exposed_us"] == pytest.approx(m.exposed_collective_us)
    assert y.cpu().tolist() == [6.0] * 4096
    opt.step()  # the step that joined it issued no collective: nothing to report
    assert ae.explain().communication["collectives"] == 0
    assert "communication" not in str(ae.explain())


def test_setting_data_across_devices_keeps_the_object():
    """Note [Setting .data across devices]: `p.data = p.to("neuron")` (FSDP2's move of a
    CPU-built module) kept the object on CUDA and raised "incompatible tensor type" here."""
    lin = torch.nn.Linear(3, 2)
    w, want = lin.weight, lin.weight.detach().clone()
    w.data = w.to("neuron")
    assert lin.weight is w and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.device.type == "neuron"
    torch.testing.assert_close(w.cpu(), want)
    v = torch.ones(3, device="neuron")
    buf = torch.zeros(3)
    buf.data = v  # aliases v's buffer, as `.data =` does
    v.add_(1)
    assert buf.cpu().tolist() == [2.0, 2.0, 2.0]
    cpu = torch.zeros(2)
    cpu.data = torch.ones(3)  # PyTorch's own path, unchanged
    assert cpu.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="A neuron tensor cannot take a cpu tensor's data"):
        w.data = torch.zeros(2, 3)  # the other way (FSDP1's CPU offload): named, not done
    assert w.device.type == "neuron"
    torch.testing.assert_close(w.cpu(), want)

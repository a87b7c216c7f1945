"""device/ on its own (device/README.md): a Device's clock, in-flight bound, deferred errors
and blocking mode; the HBM allocator; the cost model's figures; collective formulas. No
engine, no neuron tensor: the objects are made here."""
import math

import pytest
import torch

from device import (COUNTERS, HBM, Device, DeviceError, DeviceSpec, Launch, LaunchError,
                    NeuronOutOfMemoryError)
from device import interconnect

MiB = 1 << 20


# -- the cost model -------------------------------------------------------------------

def test_launch_cost_is_overhead_plus_the_larger_of_memory_and_compute():
    s = DeviceSpec()
    # memory bound: 725 GB/s is 725e3 bytes per us
    assert s.launch_us(725_000, 0) == pytest.approx(s.launch_overhead_us + 1.0)
    # compute bound in FP32 (42 TFLOP/s is 42e6 FLOPs per us), BF16 at its own peak
    assert s.launch_us(0, 42e6) == pytest.approx(s.launch_overhead_us + 1.0)
    assert s.launch_us(0, 167e6, low_precision=True) == pytest.approx(s.launch_overhead_us + 1.0)
    assert s.launch_us(725_000, 84e6) == pytest.approx(s.launch_overhead_us + 2.0)  # max, not sum


def test_dma_and_compile_figures():
    s = DeviceSpec()
    assert s.dma_us(25_000) == pytest.approx(s.dma_overhead_us + 1.0)  # 25 GB/s host link
    assert s.compile_us(1) == s.compile_base_us
    assert s.compile_us(5) == s.compile_base_us + 4 * s.compile_per_op_us


def test_spec_refuses_what_the_model_cannot_use_naming_the_field():
    with pytest.raises(ValueError, match=r"DeviceSpec.hbm_bandwidth_gbps must be a number above 0"):
        DeviceSpec(hbm_bandwidth_gbps=0)
    with pytest.raises(ValueError, match=r"DeviceSpec.max_in_flight"):
        DeviceSpec(max_in_flight=0)
    with pytest.raises(ValueError, match=r"DeviceSpec.launch_overhead_us .* at least 0"):
        DeviceSpec(launch_overhead_us=-1.0)
    assert DeviceSpec(launch_overhead_us=0).launch_overhead_us == 0  # zero overhead is fine


def test_fingerprint_names_every_figure():
    assert DeviceSpec().fingerprint() == DeviceSpec().fingerprint()
    assert DeviceSpec().fingerprint() != DeviceSpec(hbm_bytes=1 << 30).fingerprint()


def test_collective_formulas():
    s = DeviceSpec()
    a, bw, lo = s.interconnect_latency_us, s.interconnect_gbps * 1e3, s.launch_overhead_us
    n, p = 1 << 20, 4
    got = lambda pattern: interconnect.collective_us(s, pattern, n, p) - lo  # noqa: E731
    # inside one instance (Note [Two-level interconnect]): all-reduce is the faster of a ring
    # and a tree for the size
    assert p <= s.ranks_per_instance
    ring, tree = 2 * (p - 1) * (a + n / (p * bw)), 2 * math.ceil(math.log2(p)) * a + 2 * n / bw
    assert got("all_reduce") == pytest.approx(min(ring, tree))
    assert interconnect.collective_plan(s, "all_reduce", n, p)[1] == ("ring" if ring <= tree
                                                                         else "tree")
    assert got("ring") == pytest.approx((p - 1) * (a + n / (p * bw)))
    assert got("tree") == pytest.approx(math.ceil(math.log2(p)) * (a + n / bw))
    assert got("p2p") == pytest.approx(a + n / bw)
    assert got("barrier") == pytest.approx(2 * a)
    assert interconnect.collective_us(s, "all_reduce", n, 1) == lo  # one rank: no wire
    with pytest.raises(AssertionError, match="unknown collective pattern"):
        interconnect.collective_us(s, "mesh", n, p)


# -- the hardware queue and its clock -------------------------------------------------

def _launch(name="k", nbytes=725_000, flops=0.0, run=None):
    return Launch(name, run, nbytes, flops)


def test_launches_run_in_order_on_the_simulated_clock():
    dev = Device()
    cost = dev.spec.launch_us(725_000, 0)
    before = (COUNTERS.launches, COUNTERS.device_time_us)
    first, second = dev.submit(_launch()), dev.submit(_launch())
    assert (first.start_us, first.end_us) == (0.0, pytest.approx(cost))
    assert second.start_us == pytest.approx(first.end_us)  # one queue: the second waits
    assert dev.host_us == 0.0  # asynchronous: the host did not wait
    assert dev.in_flight() == 2
    dev.synchronize()
    assert dev.host_us == pytest.approx(2 * cost) and dev.in_flight() == 0
    assert COUNTERS.launches - before[0] == 2
    assert COUNTERS.device_time_us - before[1] == pytest.approx(2 * cost)
    assert [e[0] for e in dev.trace] == ["k", "k"]


def test_the_host_waits_beyond_max_in_flight():
    dev = Device(DeviceSpec(max_in_flight=2))
    ends = [dev.submit(_launch()).end_us for _ in range(2)]
    assert dev.host_us == 0.0
    dev.submit(_launch())  # a third: the host waits for the oldest
    assert dev.host_us == pytest.approx(ends[0])


def test_the_in_flight_bound_holds_without_pruning_per_launch(monkeypatch):
    """The host waits for the launch `max_in_flight` back, exactly as counting the launches
    not ended by the host's time says (a reference kept here), over launches of varied
    costs and host steps, across a change of the bound (`respec`, both ways); the device
    holds the newest `max_in_flight` end times only, and a launch never prunes them (an
    eager launch pays no prune)."""
    import random
    limit = 3
    dev = Device(DeviceSpec(max_in_flight=limit))
    prunes = []
    in_flight = Device.in_flight
    monkeypatch.setattr(Device, "in_flight", lambda self: prunes.append(1) or in_flight(self))
    rng = random.Random(0)
    host = free = 0.0
    ends = []
    for i in range(300):
        if i in (100, 200):  # the bound changes live
            limit = 5 if i == 100 else 2
            dev.respec(DeviceSpec(max_in_flight=limit))
        nbytes = rng.choice([0, 725_000, 7_250_000])
        cost = dev.spec.launch_us(nbytes, 0.0)
        if sum(e > host for e in ends) >= limit:  # the reference: count the unfinished ones
            host = max(host, sorted(e for e in ends if e > host)[-limit])
        start = max(host, free)
        free = start + cost
        ends.append(free)
        launch = dev.submit(_launch(nbytes=nbytes))
        assert (launch.start_us, launch.end_us) == pytest.approx((start, free))
        assert dev.host_us == pytest.approx(host) and len(dev._ends) <= limit
        step = rng.choice([0.0, 1.0, 20.0])
        dev.advance_host(step)
        host += step
    assert not prunes


def test_blocking_device_waits_for_every_launch():
    dev = Device(blocking=True)
    launch = dev.submit(_launch())
    assert dev.host_us == pytest.approx(launch.end_us)


def test_dma_costs_the_host_link_and_is_counted_apart():
    dev = Device()
    before = (COUNTERS.dmas, COUNTERS.launches)
    d = dev.submit(Launch("h2d", None, 0, 0.0, kind="dma", dma_bytes=25_000))
    assert d.end_us - d.start_us == pytest.approx(dev.spec.dma_us(25_000))
    assert (COUNTERS.dmas - before[0], COUNTERS.launches - before[1]) == (1, 0)


def test_an_error_is_kept_for_the_sync_earliest_first_and_the_device_stays_usable():
    dev = Device()
    ran = []

    def fails(msg):
        def run():
            raise LaunchError(IndexError(msg))
        return run

    dev.submit(_launch("bad1", run=fails("first")))
    dev.submit(_launch("bad2", run=fails("second")))
    dev.submit(_launch("ok", run=lambda: ran.append(1)))  # later work still runs
    assert ran == [1]
    with pytest.raises(DeviceError, match="first") as info:
        dev.synchronize()
    assert info.value.launch.name == "bad1"
    assert isinstance(info.value.launch.error, IndexError)
    dev.synchronize()  # reported once: the next sync is clean
    dev.submit(_launch("after", run=lambda: ran.append(2)))
    dev.synchronize()
    assert ran == [1, 2]


# -- HBM ------------------------------------------------------------------------------

def test_hbm_capacity_oom_message_and_frees():
    dev = Device(DeviceSpec(hbm_bytes=4 * MiB))
    a = dev.alloc(3 * MiB)
    assert (dev.hbm.used, dev.hbm.peak) == (3 * MiB, 3 * MiB)
    with pytest.raises(NeuronOutOfMemoryError) as info:
        dev.alloc(2 * MiB)
    msg = str(info.value)
    assert "out of memory. Tried to allocate 2.00 MiB" in msg and "3.00 MiB in use" in msg
    assert "1.00 MiB free of 4.00 MiB total" in msg and "stays usable" in msg
    assert isinstance(info.value, torch.OutOfMemoryError)  # what users catch
    assert dev.hbm.used == 3 * MiB  # a refused allocation takes nothing
    del a  # the buffer's last reference: its bytes come back
    assert dev.hbm.used == 0
    b = dev.alloc(4 * MiB)  # the whole capacity fits again
    stats = dev.hbm.stats()
    assert stats["allocated_bytes.all.current"] == 4 * MiB
    assert stats["allocated_bytes.all.peak"] == 4 * MiB
    assert (stats["num_ooms"], stats["allocation.all.allocated"],
            stats["allocation.all.freed"]) == (1, 2, 1)
    del b


def test_a_buffer_reserves_its_bytes_when_made(monkeypatch):
    """`Buffer(nbytes, hbm, storage)` (what Device.alloc makes, per eager launch: one frame):
    reserved at once and backed by the storage given (or new host bytes); one HBM refuses is
    not made and releases nothing when collected (no error from its finalizer)."""
    import gc
    import sys
    from device.memory import Buffer
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    hbm = HBM(1024)
    st = torch.UntypedStorage(512)
    a = Buffer(512, hbm, st)
    b = Buffer(256, hbm)
    assert a.storage is st and b.storage.nbytes() == 256 and hbm.used == 768
    with pytest.raises(NeuronOutOfMemoryError):
        Buffer(512, hbm)
    gc.collect()
    assert hbm.used == 768 and hbm.num_ooms == 1 and unraisable == []
    del a, b
    assert hbm.used == 0 and hbm.num_frees == 2


def test_hbm_release_more_than_used_is_an_internal_error():
    hbm = HBM(1024)
    hbm.reserve(512)
    with pytest.raises(AssertionError):
        hbm.release(1024)


def test_a_buffer_is_backed_by_host_bytes_of_its_size():
    dev = Device()
    storage = torch.arange(4, dtype=torch.float32).untyped_storage()
    buf = dev.alloc(16, storage)
    assert buf.storage is storage and dev.hbm.used == 16
    with pytest.raises(AssertionError):  # the storage must hold the whole buffer
        dev.alloc(32, torch.zeros(2).untyped_storage())


def test_the_timeline_keeps_the_newest_launches_sources_within_its_budget():
    """Past SOURCE_BUDGET ops' sources the oldest launches lose theirs, down to half the
    budget, host events between them and launches leaving the full deque included; the
    entries themselves stay, in order."""
    from device import Device, Launch
    from device.core import SOURCE_BUDGET
    n = 3 * SOURCE_BUDGET
    dev = Device(trace_limit=n)
    for i in range(n):
        dev.submit(Launch(f"op{i}", None, 0, 0.0, nodes=((i,), ((0, 0),))))
        if i % 7 == 0:
            dev.mark("sync", "sync", 0.0)
        if i % 101 == 0 or i == n - 1:
            kept = [t[6][0][0] for t in dev.trace if t[6]]
            assert len(kept) <= SOURCE_BUDGET and kept == list(range(i + 1 - len(kept), i + 1))
    assert len(kept) >= SOURCE_BUDGET // 2
    names = [t[0] for t in dev.trace if t[1] == "launch"]
    assert len(dev.trace) == n and names == [f"op{i}" for i in range(n - len(names), n)]


@pytest.mark.parametrize("blocking", [False, True])
def test_submit_plain_is_submit_of_a_plain_launch(blocking):
    """Device.submit_plain (eager launches: no Launch record unless one fails) keeps the
    clock, the in-flight bound, counters, per-core stats, timeline entries and deferred
    errors of `submit`, for launches at both precisions."""
    spec = DeviceSpec(max_in_flight=2)
    figures = []
    for plain in (False, True):
        dev = Device(spec, blocking=blocking)
        before = (COUNTERS.launches, COUNTERS.hbm_bytes, COUNTERS.device_time_us,
                  COUNTERS.kernel_launches)
        ran, errors = [], []
        for i in range(5):
            nbytes, flops, low = 725_000 * (i + 1), 1e6 * i, i % 2 == 1
            run = (lambda i=i: ran.append(i)) if i != 2 else _fails("op 2 failed")
            nodes = (("src%d" % i,), ((flops, nbytes),))
            if plain:
                failed = dev.submit_plain("k%d" % i, run, (), spec.launch_us(nbytes, flops, low),
                                          nbytes, flops, low, nodes, ["ctx"])
            else:
                launch = dev.submit(Launch("k%d" % i, run, nbytes, flops, low, context=["ctx"],
                                           nodes=nodes))
                failed = launch if launch.error is not None else None
            errors.append(failed and (failed.name, failed.start_us, failed.end_us,
                                      str(failed.error), failed.context, failed.nodes,
                                      failed.low_precision))
            dev.advance_host(1.0)
        with pytest.raises(DeviceError, match="op 2 failed") as info:
            dev.synchronize()
        figures.append((ran, errors, list(dev.trace), dev.host_us, dev.free_at_us,
                        dev.submits, dict(dev.stats), info.value.launch.name,
                        COUNTERS.launches - before[0], COUNTERS.hbm_bytes - before[1],
                        COUNTERS.device_time_us - before[2], COUNTERS.kernel_launches - before[3]))
    assert figures[0] == figures[1]
    assert figures[0][1][2] is not None and figures[0][0] == [0, 1, 3, 4]


def _fails(msg):
    def run():
        raise LaunchError(IndexError(msg))
    return run


def test_counters_counted_per_op_store_at_a_dicts_cost():
    """The counters an eager op adds to (a flush's reason and group size, a core's launches
    and device time) are Counters whose stores take no Python slot lookup (Counter's own
    `__delitem__` sent every `c[k] += n` through one: ~0.1 us each, four per eager op)."""
    import collections
    from device import COUNTERS, Device
    for c in (COUNTERS.flushes, COUNTERS.group_sizes, Device().stats):
        assert isinstance(c, collections.Counter) and type(c).__delitem__ is dict.__delitem__
        c["k"] += 2
        assert c["k"] == 2 and c["missing"] == 0 and c.most_common(1) == [("k", 2)]
        del c["k"]
    COUNTERS.reset()
    assert type(COUNTERS.flushes).__delitem__ is dict.__delitem__

"""fusion/ on its own (fusion/README.md): hand-built nodes, no engine and no neuron tensor.
The dependency graph, `partition()` with each strategy (convex groups, the known
non-fusions), a barrier never fused, the ExecutableCache's levels and bounds, and what the
Runner launches and charges."""
import json
import os
import warnings

import networkx as nx
import pytest
import torch

from device import COUNTERS, Device, DeviceSpec
from fusion.cache import ExecutableCache
from fusion.flush import Runner
from fusion.ir import Handle, Node, OpSig
from fusion.ops import BARRIER, CONTRACTION, POINTWISE, REDUCTION, op_class
from fusion.partition import (GraphStrategy, MatmulStrategy, NoneStrategy, dependency_graph,
                              partition)
from fusion.program import BadProgram, Executable, build_program

aten = torch.ops.aten
N = 4  # elements per tensor; float32
NB = 4 * N


def _t(li, n=N):
    return ("T", li, (n,), (1,), 0, "float32")


def binary(func, a, b, out, cls=POINTWISE, n=N, flops=N):
    """`out = func(a, b)`: a, b, out are segment buffer indices."""
    op = OpSig(func, cls, (_t(0, n), _t(1, n)), (), (("N", 2, (n,), (1,), "float32"),), 2,
               [], flops, (4 * n,))
    return Node(op, (a, b, out), [], (4 * n,) * 3, None)


def inplace(func, a, b):
    """`a.func_(b)`: writes buffer a."""
    op = OpSig(func, POINTWISE, (_t(0), _t(1)), (), (), 2, [0], N, ())
    return Node(op, (a, b), [], (NB, NB), None)


def mm(a, b, out, n=2):
    op = OpSig(aten.mm.default, CONTRACTION, (("T", 0, (n, n), (n, 1), 0, "float32"),
                                              ("T", 1, (n, n), (n, 1), 0, "float32")), (),
               (("N", 2, (n, n), (n, 1), "float32"),), 2, [], 2 * n ** 3, (4 * n * n,))
    return Node(op, (a, b, out), [], (4 * n * n,) * 3, None)


def convex(graph, groups):
    """No path leaves a group and comes back into it."""
    for g in groups:
        members = set(g)
        after = set().union(*(nx.descendants(graph, i) for i in g)) - members
        before = set().union(*(nx.ancestors(graph, i) for i in g)) - members
        if after & before:
            return False
    return True


# -- the dependency graph -------------------------------------------------------------

def test_dependency_graph_has_raw_war_and_waw_edges():
    nodes = [binary(aten.add.Tensor, 0, 1, 2),   # 0: c = a + b
             binary(aten.mul.Tensor, 2, 0, 3),   # 1: d = c * a          RAW 0->1
             inplace(aten.add_.Tensor, 0, 1),    # 2: a += b             WAR 0->2, 1->2
             inplace(aten.mul_.Tensor, 2, 1)]    # 3: c *= b             WAW 0->3, WAR 1->3
    g = dependency_graph(nodes)
    kinds = {(u, v): d["kind"] for u, v, d in g.edges(data=True)}
    assert kinds[(0, 1)] == "RAW"
    assert kinds[(0, 2)] == "WAR" and kinds[(1, 2)] == "WAR"
    assert kinds[(1, 3)] == "WAR" and (0, 3) in kinds  # WAW (or RAW) on c
    assert nx.is_directed_acyclic_graph(g)


# -- partition ------------------------------------------------------------------------

def _chain(k):
    """k pointwise ops, each reading the previous result: buffers 0, 1 in; 2.. made."""
    nodes, prev = [], 0
    for i in range(k):
        nodes.append(binary(aten.add.Tensor, prev, 1, 2 + i))
        prev = 2 + i
    return nodes


def test_a_pointwise_chain_is_one_group():
    nodes = _chain(5)
    groups, reasons = partition(nodes, dependency_graph(nodes), GraphStrategy())
    assert groups == [[0, 1, 2, 3, 4]] and reasons == []


def test_groups_are_convex_contiguous_runs_with_every_strategy():
    nodes = _chain(3) + [mm(4, 4, 10), binary(aten.add.Tensor, 10, 10, 11),
                         mm(11, 4, 12), inplace(aten.add_.Tensor, 0, 1)]
    graph = dependency_graph(nodes)
    for strategy in (GraphStrategy(max_group_ops=2), MatmulStrategy(), NoneStrategy()):
        groups, reasons = partition(nodes, graph, strategy)
        assert [i for g in groups for i in g] == list(range(len(nodes)))  # in queue order
        assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)
        assert convex(graph, groups), (strategy.name, groups)
        assert len(reasons) == len(groups) - 1 and all(reasons)  # every cut has a reason


def test_known_non_fusions_of_the_graph_strategy():
    # size limit
    nodes = _chain(5)
    groups, reasons = partition(nodes, dependency_graph(nodes), GraphStrategy(max_group_ops=2))
    assert [len(g) for g in groups] == [2, 2, 1]
    assert reasons == ["size limit (2 ops)"] * 2
    # contraction limit: five chained matmuls, at most four per group
    mms = [mm(0, 1, 2)] + [mm(1 + i, 1, 2 + i) for i in range(1, 5)]
    groups, reasons = partition(mms, dependency_graph(mms), GraphStrategy())
    assert [len(g) for g in groups] == [4, 1] and reasons == ["contraction limit (4)"]
    # the working set must fit in SBUF: two ops each making half of it plus one byte, the
    # second a reduction (Note [Elementwise groups stream]: pointwise ops only would stream)
    half = DeviceSpec().sbuf_bytes // 8 + 1  # float32 elements: 4 bytes each, twice
    big = [binary(aten.add.Tensor, 0, 1, 2, n=half),
           binary(aten.add.Tensor, 2, 1, 3, n=half, cls=REDUCTION)]
    groups, reasons = partition(big, dependency_graph(big), GraphStrategy())
    assert reasons == ["SBUF capacity"]


def test_a_group_of_pointwise_ops_only_is_not_bounded_by_sbuf():
    """Note [Elementwise groups stream]: pointwise ops far beyond SBUF stay one group, until
    an op of another class joins it (then the whole working set counts)."""
    half = DeviceSpec().sbuf_bytes // 8 + 1
    chain = [binary(aten.add.Tensor, i, 1, i + 2, n=half) for i in (0, 2, 3, 4)]
    chain[1:] = [binary(aten.mul.Tensor, i + 1, 1, i + 2, n=half) for i in range(1, 4)]
    groups, reasons = partition(chain, dependency_graph(chain), GraphStrategy())
    assert [len(g) for g in groups] == [4] and reasons == []
    ended = chain + [binary(aten.add.Tensor, 5, 1, 6, n=half, cls=REDUCTION)]
    groups, reasons = partition(ended, dependency_graph(ended), GraphStrategy())
    assert [len(g) for g in groups] == [4, 1] and reasons == ["SBUF capacity"]
    # a contraction first: the bound holds from the start
    small_mm = [mm(7, 8, 0)] + chain[:2]
    groups, reasons = partition(small_mm, dependency_graph(small_mm),
                                GraphStrategy(DeviceSpec(sbuf_bytes=4 * half + 64)))
    assert reasons == ["SBUF capacity"]


def test_the_matmul_strategy_cuts_after_a_matmul_and_around_in_place_ops():
    nodes = [binary(aten.add.Tensor, 0, 1, 2), mm(2, 2, 3), binary(aten.add.Tensor, 3, 1, 4),
             inplace(aten.add_.Tensor, 4, 1), binary(aten.mul.Tensor, 4, 1, 5)]
    groups, reasons = partition(nodes, dependency_graph(nodes), MatmulStrategy())
    assert groups == [[0, 1], [2], [3], [4]]
    assert reasons == ["after matmul", "in-place op", "in-place op"]


def test_the_none_strategy_launches_every_op():
    nodes = _chain(3)
    groups, reasons = partition(nodes, dependency_graph(nodes), NoneStrategy())
    assert groups == [[0], [1], [2]] and reasons == ["strategy none"] * 2


def test_a_barrier_is_never_fused():
    """Data-dependent ops are barriers: the engine runs each alone, at its call, and no
    Program may hold one, fused or not (a barrier reaching fusion is refused, never run)."""
    assert op_class(aten.nonzero.default) == BARRIER
    nz = OpSig(aten.nonzero.default, BARRIER, (_t(0),), (), (("N", 1, (N, 1), (1, 1), "int64"),),
               1, [], N, (8 * N,))
    barrier = Node(nz, (2, 3), [], (NB, 8 * N), None)
    for nodes in ([binary(aten.add.Tensor, 0, 1, 2), barrier], [barrier]):
        program, _ = build_program(nodes, keep={3})
        with pytest.raises(BadProgram, match="aten::nonzero is not implemented by the device"):
            Executable(program)


# -- the executable cache -------------------------------------------------------------

def _program(n=N):
    program, _ = build_program([binary(aten.add.Tensor, 0, 1, 2, n=n)], keep={2})
    return program


def test_memory_level_is_an_lru_that_evicts_to_80_percent():
    cache = ExecutableCache(None, max_entries=5)
    programs = [_program(n) for n in range(1, 7)]
    before = COUNTERS.cache_evictions
    levels = [cache.get(p, Executable)[1] for p in programs]
    assert levels == ["compile"] * 6
    assert len(cache) == 4 and COUNTERS.cache_evictions - before == 2  # 6 > 5: down to 4
    assert cache.get(programs[-1], Executable)[1] == "memory"  # the newest stayed
    assert cache.get(programs[0], Executable)[1] == "compile"  # the oldest went
    # a size bound (each entry counts its JSON payload)
    size = len(json.dumps(programs[0].to_json()).encode())
    small = ExecutableCache(None, max_mb=3.5 * size / 2**20)
    for p in programs[:4]:
        small.get(p, Executable)
    assert len(small) <= 2


def test_disk_round_trip_in_a_new_cache(tmp_path):
    program = _program()
    first = ExecutableCache(str(tmp_path), salt="v1")
    exe, level = first.get(program, Executable)
    assert level == "compile" and os.path.exists(first.path(program))
    compiled = []
    second = ExecutableCache(str(tmp_path), salt="v1")  # as a new process would
    exe2, level = second.get(program, lambda p: compiled.append(p) or Executable(p))
    assert level == "disk" and compiled == []
    assert exe2.program.key == program.key
    a, b = torch.arange(4.0), torch.full((4,), 10.0)
    st = [a.untyped_storage(), b.untyped_storage(), None]
    exe2.run(st, [[]], None, set())
    assert torch.equal(torch.empty(0).set_(st[2], 0, (4,), (1,)), a + b)  # the same op
    # another salt (package, torch, executor or device version) is another file
    assert ExecutableCache(str(tmp_path), salt="v2").path(program) != first.path(program)


@pytest.mark.parametrize("damage", ["garbage", "checksum", "foreign"])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning_and_recompiled(tmp_path, damage):
    program = _program()
    cache = ExecutableCache(str(tmp_path))
    cache.get(program, Executable)
    path = cache.path(program)
    data = open(path, "rb").read()
    if damage == "garbage":
        data = b"not a cache file"
    elif damage == "checksum":
        assert b'"float32"' in data
        data = data.replace(b'"float32"', b'"float64"', 1)  # payload changed, header not
    else:  # a valid file of another program under this one's name
        other = ExecutableCache(str(tmp_path / "other"))
        other.get(_program(8), Executable)
        data = open(other.path(_program(8)), "rb").read()
    open(path, "wb").write(data)
    before = COUNTERS.cache_disk_errors
    with pytest.warns(UserWarning, match="Ignoring executable cache file"):
        _, level = ExecutableCache(str(tmp_path)).get(program, Executable)
    assert level == "compile" and COUNTERS.cache_disk_errors - before == 1
    with warnings.catch_warnings():  # recompiled over: the next reader loads it quietly
        warnings.simplefilter("error")
        assert ExecutableCache(str(tmp_path)).get(program, Executable)[1] == "disk"


# -- the runner -----------------------------------------------------------------------

_NODES = [binary(aten.add.Tensor, 0, 1, 2), binary(aten.mul.Tensor, 2, 0, 3)]


def _segment(dev):
    """d = (a + b) * a, with c = a + b freed before the flush (not written back). The same
    Node objects each time: the engine shares one OpSig per signature (the plan's key)."""
    a, b = torch.arange(4.0), torch.full((4,), 10.0)
    ha = Handle(NB, buffer=dev.alloc(NB, a.clone().untyped_storage()))
    hb = Handle(NB, buffer=dev.alloc(NB, b.clone().untyped_storage()))
    hd = Handle(NB, pending=True)
    return _NODES, [ha, hb, None, hd], hd, (a + b) * a


def _delta(before):
    return {k: getattr(COUNTERS, k) - v for k, v in before.items()}


def test_runner_fuses_charges_the_cost_model_and_reuses_its_plan():
    dev = Device()
    runner = Runner(dev, ExecutableCache(None))
    keys = ("launches", "compiles", "compile_time_us", "device_time_us", "bytes_saved",
            "plan_hits", "plan_misses")
    nodes, refs, hd, want = _segment(dev)
    before = {k: getattr(COUNTERS, k) for k in keys}
    report = runner.run(nodes, refs, "test", GraphStrategy())
    got = _delta(before)
    # one launch: reads a and b from outside (32 B), writes d back (16 B); c stays inside
    assert report.launches == 1 and report.groups[0]["name"] == "add.Tensor|mul.Tensor"
    assert got["launches"] == 1 and got["compiles"] == 1
    assert got["compile_time_us"] == pytest.approx(dev.spec.compile_us(2))
    assert got["device_time_us"] == pytest.approx(dev.spec.launch_us(3 * NB, 2 * N))
    assert got["bytes_saved"] == NB and got["plan_misses"] == 1
    dev.synchronize()
    assert not hd.pending
    assert torch.equal(torch.empty(0).set_(hd.buffer.storage, 0, (4,), (1,)), want)
    nodes, refs, hd, want = _segment(dev)  # the same segment again: its plan is reused
    before = {k: getattr(COUNTERS, k) for k in keys}
    assert runner.run(nodes, refs, "test", GraphStrategy()).plan_hit
    got = _delta(before)
    assert (got["plan_hits"], got["compiles"], got["launches"]) == (1, 0, 1)


def test_runner_with_strategy_none_launches_and_charges_each_op():
    dev = Device()
    runner = Runner(dev, ExecutableCache(None))
    nodes, refs, hd, want = _segment(dev)
    before = {k: getattr(COUNTERS, k) for k in ("launches", "device_time_us", "bytes_saved")}
    runner.run(nodes, refs, "test", NoneStrategy())
    got = _delta(before)
    # c now leaves the first launch (the second reads it): 3 x 16 B each
    assert got["launches"] == 2 and got["bytes_saved"] == 0
    assert got["device_time_us"] == pytest.approx(2 * dev.spec.launch_us(3 * NB, N))
    dev.synchronize()
    assert torch.equal(torch.empty(0).set_(hd.buffer.storage, 0, (4,), (1,)), want)

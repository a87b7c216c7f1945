"""The differential fuzzer (tests/fuzzer.py): its CI pass and tests of its own parts.

The long run is `python tests/fuzzer.py --minutes 30 --mode all --policy both` (tests/README.md,
"Fuzzing"); here a short fixed-seed pass over every mode and both policies, leaving out the
families and patterns of known, not yet fixed bugs (fuzzer.CI_EXCLUDED_*, each with its repro).
"""
import math

import pytest
import torch

from tests import fuzzer

CI_SEEDS = range(0, 120)


def test_ci_pass():
    fams = [f for f in fuzzer.FAMILIES if f not in fuzzer.CI_EXCLUDED_FAMILIES]
    lines = []
    n, fails = fuzzer.fuzz(CI_SEEDS, fuzzer.MODES, fuzzer.POLICIES, fams,
                           exclude=list(fuzzer.CI_EXCLUDED_PATTERNS), log=lines.append)
    assert n == len(CI_SEEDS)
    assert not fails, "\n".join(lines)


def test_ci_pass_beside_another_thread():
    """Policy "threads": the same programs while three other threads record, sync and check
    their own ops on the device (fuzzer._Noise)."""
    fams = [f for f in fuzzer.FAMILIES if f not in fuzzer.CI_EXCLUDED_FAMILIES]
    lines = []
    n, fails = fuzzer.fuzz(CI_SEEDS[:40], ["eager", "graph"], [fuzzer.THREADS], fams,
                           exclude=list(fuzzer.CI_EXCLUDED_PATTERNS), log=lines.append)
    assert n == 40
    assert not fails, "\n".join(lines)


def test_ci_pass_repeated():
    """Policy "repeat": each program three times in one adaptive scope, replay checked
    against the slow path (Note [Replay]); the last run compared with CPU."""
    fams = [f for f in fuzzer.FAMILIES if f not in fuzzer.CI_EXCLUDED_FAMILIES]
    lines = []
    n, fails = fuzzer.fuzz(CI_SEEDS[:40], ["eager", "graph"], [fuzzer.REPEAT], fams,
                           exclude=list(fuzzer.CI_EXCLUDED_PATTERNS), log=lines.append)
    assert n == 40
    assert not fails, "\n".join(lines)


def test_ci_pass_compiled():
    """Policy compile: each program as one function under torch.compile(backend="neuron")
    against the same under "aot_eager" on CPU (a few seeds: each compiles twice)."""
    fams = [f for f in fuzzer.FAMILIES if f not in fuzzer.CI_EXCLUDED_FAMILIES]
    lines = []
    n, fails = fuzzer.fuzz(range(1, 9), ["eager", "graph"], [fuzzer.COMPILE], fams,
                           exclude=list(fuzzer.CI_EXCLUDED_PATTERNS), log=lines.append)
    assert n == 8
    assert not fails, "\n".join(lines)


def test_a_worker_a_failed_compile_broke_is_replaced():
    """Note [A compile failure can break the process]: after AOTAutograd failed inside an
    inference_mode block, the worker could compile nothing more, and every later program of
    the compile policy was skipped (a run checked ~100 programs a second). The worker asks to
    be replaced, so the next program runs in a new one."""
    broken = ["torch.manual_seed(469)", "v1 = torch.randn((1, 5), device=dev).double()",
              "v2 = v1.std(-2)", "v3 = v1.median()",
              "with torch.inference_mode(): v2.narrow(0, 0, 1).mul_(2)",
              "torch.neuron.synchronize()"]
    pool = fuzzer.Pool()
    try:
        assert pool.check(broken, [("graph", "compile")]) == []
        assert pool.proc is None  # replaced: the next check starts a fresh worker
    finally:
        pool.close()


def test_ci_pass_inductor_executor():
    """Policy inductor: adaptive with the Inductor executor against neuron eager, within
    float tolerance (it found the aliased foreach writes of fusion/executors/fx.py)."""
    fams = [f for f in fuzzer.FAMILIES if f not in fuzzer.CI_EXCLUDED_FAMILIES]
    lines = []
    n, fails = fuzzer.fuzz(range(1, 25), ["graph"], [fuzzer.INDUCTOR], fams,
                           exclude=list(fuzzer.CI_EXCLUDED_PATTERNS), log=lines.append)
    assert n == 24
    assert not fails, "\n".join(lines)


def test_the_inductor_comparison_finds_a_wrong_value_and_an_error():
    prog = ["v0 = torch.arange(6.0, device=dev)", "v1 = (v0 * 2).reshape(2, 3)",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    eager = fuzzer.run_program(prog, "neuron")
    run = fuzzer.run_program(prog, "neuron", "graph", fuzzer.INDUCTOR)
    assert fuzzer.compare_close(prog, eager, run, ref[2]) == []
    run[1]["v1"]["value"] = run[1]["v1"]["value"] * (1 + 1e-6)  # float tolerance
    assert fuzzer.compare_close(prog, eager, run, ref[2]) == []
    run[1]["v1"]["value"] = run[1]["v1"]["value"] + 0.01
    assert [k for k, _ in fuzzer.compare_close(prog, eager, run, ref[2])] == ["inductor-value"]
    run[1]["v1"]["stride"] = [1, 2]
    assert "inductor-stride" in [k for k, _ in fuzzer.compare_close(prog, eager, run, ref[2])]
    bad = ({"at": 1, "type": "RuntimeError"}, run[1])
    assert [k for k, _ in fuzzer.compare_close(prog, eager, bad, ref[2])] == ["inductor-raised"]
    assert ("eager", fuzzer.INDUCTOR) not in fuzzer.configs(["eager", "graph"], [fuzzer.INDUCTOR])


def test_the_compiled_comparison_finds_a_wrong_value_and_an_error():
    prog = ["v0 = torch.arange(6.0, device=dev)", "v1 = (v0 * 2).reshape(2, 3)",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    cpu = fuzzer.run_compiled(prog, "cpu")
    run = fuzzer.run_compiled(prog, "neuron", "graph")
    assert cpu[0] is None and set(cpu[1]) == {"v0", "v1"}
    assert fuzzer.compare_compiled(ref, cpu, run) == []
    run[1]["v1"]["value"] = run[1]["v1"]["value"] + 1
    assert [k for k, _ in fuzzer.compare_compiled(ref, cpu, run)] == ["value"]
    cpu[1]["v1"]["value"] = cpu[1]["v1"]["value"] * 0  # CPU's compile differs from eager,
    run[1]["v1"]["value"] = ref[1]["v1"]["value"]  # the device equals eager: accepted
    assert fuzzer.compare_compiled(ref, cpu, run) == []
    err = ({"at": 0, "type": "RuntimeError", "msg": "boom", "deferred": False}, {})
    assert [k for k, _ in fuzzer.compare_compiled(ref, cpu, err)] == ["raised"]
    snip = fuzzer.snippet(prog, "graph-compile")
    assert "return {'v0': v0, 'v1': v1}" in snip and "backend='neuron'" in snip
    # `del` is left out: AOTAutograd would drop a dead random op and move later draws
    src = fuzzer._program_source(["v0 = torch.randn((), device=dev)", "del v0"])
    assert "    pass\n" in src and "del" not in src and "return {'v0': v0}" in src
    # such a variable is returned to keep its draw alive, not compared (it has no taints
    # left in the reference: this float64 draw differs by policy; fuzzer seed 14500050)
    gone = ["v0 = torch.randn((5, 1, 4), dtype=torch.float64, device=dev)", "del v0",
            "torch.neuron.synchronize()"]
    assert fuzzer.check(gone, [("eager", fuzzer.COMPILE)]) == []


def test_what_the_other_thread_finds_is_a_failure(monkeypatch):
    prog = ["v0 = torch.ones(3, device=dev)", "v1 = v0 + 1", "torch.neuron.synchronize()"]
    assert fuzzer.check(prog, [("graph", fuzzer.THREADS)]) == []
    monkeypatch.setattr(fuzzer, "_bits_equal", lambda a, b: False)  # a wrong value over there
    fails = fuzzer.check(prog, [("graph", fuzzer.THREADS)])
    thread = [f for f in fails if f["kind"] == "thread"]  # (and the program's vs eager)
    assert [f["config"] for f in thread] == ["graph-threads"]
    assert "its value at step" in thread[0]["detail"]
    monkeypatch.undo()
    monkeypatch.setattr(torch.neuron, "synchronize", lambda: 1 / 0)  # an error over there
    fails = fuzzer.check(prog[:2], [("eager", fuzzer.THREADS)])
    assert [f["kind"] for f in fails] == ["thread"]
    assert "ZeroDivisionError" in fails[0]["detail"]
    snip = fuzzer.snippet(prog, "graph-threads")
    assert "_Noise(problems := [])" in snip and "ae.adaptive(strategy='graph')" in snip


def test_generator_is_deterministic_and_honours_exclusions():
    assert fuzzer.generate(5) == fuzzer.generate(5)
    assert fuzzer.generate(5) != fuzzer.generate(6)
    for seed in range(20):
        prog = fuzzer.generate(seed, exclude=[r"\+", r"sum"])
        assert not any("+" in s or "sum" in s for s in prog)
        assert prog[-1] == "torch.neuron.synchronize()"


def test_stmt_info_reads_defs_and_mutations():
    i = fuzzer.stmt_info("v3 = v1[v2 > 0] + v1")
    assert (i["defs"], i["reads"], i["muts"]) == ("v3", {"v1", "v2"}, set())
    assert fuzzer.stmt_info("v1[0] = v4")["muts"] == {"v1"}
    assert fuzzer.stmt_info("v2.mT.mul_(2)")["muts"] == {"v2"}
    assert fuzzer.stmt_info("torch.add(v0, 1, out=v5)")["muts"] == {"v5"}
    assert fuzzer.stmt_info("v6 = v0.detach().float().requires_grad_()")["muts"] == set()
    assert fuzzer.stmt_info("_ = v0.cpu()")["sync"]
    assert fuzzer.stmt_info("fz.addto_(v1[1:], v2)")["muts"] == {"v1"}  # a custom op's write
    assert fuzzer.stmt_info("v3.data = v4.mT")["muts"] == {"v3"}


def test_the_generator_never_divides_an_int_min():
    """Note [Edge values]: INT_MIN // -1 (and % -1) is SIGFPE in CPU's process, the
    generator's own and the reference's: an integer division reading an int32/int64 tensor
    holding its minimum is never made (overflow makes one: `2**31 - 1 + 1`)."""
    g = fuzzer.Gen(0)
    g.step("v0 = torch.tensor([2**31 - 1, 3], dtype=torch.int32, device=dev) + 1", 0)
    g.step("v1 = torch.tensor([-2**63 + 1], device=dev) - 1", 0)
    for code in ("v2 = v0 // -1", "v2 = v0 % -1", "v2 = torch.remainder(v1, -1)",
                 "v2 = torch.div(v0, -1, rounding_mode='floor')"):
        assert not g.step(code, 0) and code not in g.stmts
    assert g.step("v2 = v0 * -1", 0)  # (not a division)
    assert g.step("v3 = torch.tensor([5, -9], device=dev)", 0) and g.step("v4 = v3 // -1", 0)


def test_an_out_view_never_shares_its_inputs_storage():
    """`f_outview` (as `f_out`): an out= view that its resize makes overlap the input is
    undefined, CPU computes through it (seed 22011389: `torch.add(v1, 1, out=v0.select(1, 1))`
    with v1 = v0.reshape(-1)), so the generator never writes a view into its input's storage."""
    g = fuzzer.Gen(0)
    g.step("v0 = torch.randn((2, 2), device=dev)", 0)
    g.step("v1 = v0.reshape(-1)", 0)
    g.step("v2 = torch.randn(3, device=dev)", 0)
    made = [g.f_outview() for _ in range(400)]
    inputs = [c for c in made if "out=v" in c and ("(v1" in c or "[v1" in c)]
    assert inputs and all("out=v0" not in c for c in inputs)
    assert any("out=v0" in c for c in made) and any("out=v2" in c for c in made)


def test_fz_threads_runs_its_callables_at_once_and_raises_in_their_order():
    """Note [Threads in a program]: the first callable waits for the second (run one after
    the other, it would time out), the first's value is the statement's, and of two
    exceptions the first callable's is raised, whichever thread raised first."""
    import threading
    fz = fuzzer._fz()
    seen = threading.Event()
    assert fz.threads(lambda: seen.wait(30), lambda: seen.set()) is True

    def late():
        seen.wait(30)
        raise KeyError("first")
    seen.clear()
    with pytest.raises(KeyError, match="first"):
        fz.threads(late, lambda: seen.set() or 1 / 0)


def test_thread_statements_keep_their_storages_apart():
    """Note [Threads in a program]: neither thread writes a storage the other reads, and at
    most one draws random numbers, so any interleaving gives CPU's values."""
    g = fuzzer.Gen(3, families=["threads", "inplace", "out", "pointwise", "random", "view"])
    for code in ("v0 = torch.randn((2, 3), device=dev)", "v1 = v0[0]", "v2 = v0.t()",
                 "v3 = torch.randn(3, device=dev)", "v4 = torch.ones(3, device=dev)"):
        assert g.step(code, 0)
    made = [c for c in (g.f_threads() for _ in range(300)) if c]
    assert len(made) > 100
    storage = lambda v: g.ns[v].untyped_storage()._cdata  # noqa: E731
    writes_between = 0
    for code in made:
        a, b = code.split("fz.threads(lambda: ", 1)[1][:-1].split(", lambda: ")
        ia, ib = (fuzzer.stmt_info("v99999 = " + x) for x in (a, b))  # (keyword args as such)
        assert not (ia["random"] and ib["random"]), code
        for w, other in ((ia["muts"], ib["reads"]), (ib["muts"], ia["reads"])):
            assert not {storage(v) for v in w} & {storage(v) for v in other}, code
            writes_between += bool(w and other)
    assert writes_between  # (writes happen beside reads of other storages)


def test_a_threads_statements_own_deferred_error_may_pass_its_sync():
    """Note [Threads in a program] (seed 23010134): the thread that syncs may do so before the
    other queues an op whose error is deferred; that error is then raised at the next sync,
    in one run and not in another, and both are accepted, as far as that sync only."""
    prog = ["v0 = torch.arange(3, device=dev)",
            "v1 = fz.threads(lambda: v0.index_select(0, torch.tensor([7], device=dev)), "
            "lambda: v0.tolist())",
            "v2 = v0 * 2",
            "torch.neuron.synchronize()",
            "v3 = v0 + 1",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert (ref[0]["at"], ref[0]["type"]) == (1, "IndexError")
    reads = fuzzer.run_program(prog[:3], "neuron")[1]
    late = ({"at": 3, "type": "NeuronRuntimeError", "msg": "", "deferred": True}, reads)
    assert fuzzer.compare(prog, ref, late) == []
    too_late = (dict(late[0], at=5), late[1])
    assert fuzzer.compare(prog, ref, too_late)[0][0] == "raised"
    at_it = (dict(late[0], at=1), late[1])
    assert fuzzer.compare_to_eager(late, at_it, ref[2], prog) == []
    assert fuzzer.compare_to_eager(too_late, at_it, ref[2], prog)[0][0] == "vs-eager-raised"
    hidden = [s.replace("v0.tolist()", "fz.twice(v0)") for s in prog]  # (a fallback: a sync
    assert fuzzer.compare_to_eager(late, at_it, ref[2], hidden) == []  # no text shows)
    plain = [s.replace("fz.threads(lambda: ", "(lambda: ") if "fz." in s else s for s in prog]
    assert fuzzer.compare_to_eager(late, at_it, ref[2], plain)[0][0] == "vs-eager-raised"


def test_a_threads_statement_may_raise_its_second_threads_error_first():
    """Note [Threads in a program] (seed 23101036): both threads raise on CPU, the statement
    the first's error; the device defers the first's (a bool matmul: LIMITS, the probe is
    skipped for same-dtype contractions), so the second's is raised at the call: accepted,
    as a type CPU's other thread raised; any other type is not."""
    prog = ["v0 = torch.tensor([1, -2], device=dev)",
            "v1 = torch.ones((1, 1), device=dev) > 0",
            "v2 = torch.ones((1, 1), device=dev)",
            "v3 = fz.threads(lambda: v1 @ v1.mT, lambda: v2.scatter(0, torch.zeros((1, 1), "
            "dtype=torch.int64, device=dev), v0.view(2, 1)))",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert (ref[0]["at"], ref[0]["type"], ref[0]["others"]) == (3, "NotImplementedError",
                                                                ["RuntimeError"])
    run = fuzzer.run_program(prog, "neuron")
    assert (run[0]["at"], run[0]["type"]) == (3, "RuntimeError")
    assert fuzzer.compare(prog, ref, run) == []
    other = (dict(run[0], type="ValueError"), run[1])
    assert fuzzer.compare(prog, ref, other)[0][0] == "raised"
    # seed 23203372: the first's error at the call on both, the second's deferred on the
    # device: a later read may raise it, as after any deferred error
    prog = ["v0 = torch.ones(1, device=dev) > 0", "v1 = torch.ones(1, device=dev)",
            "v2 = fz.threads(lambda: F.relu6(v0), lambda: v1.scatter(0, torch.tensor([-3], "
            "device=dev), -1.5))", "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert ref[0]["at"] == 2 and ref[0]["others"] == ["RuntimeError"]
    run = fuzzer.run_program(prog, "neuron")
    assert (run[0]["at"], run[0]["type"]) == (2, ref[0]["type"])
    assert run[1]["v0"]["read_error"] == "NeuronRuntimeError"
    assert fuzzer.compare(prog, ref, run) == []


def test_the_other_cores_are_the_cpu_in_the_reference():
    """The cores family's `dev1`..`dev3`: neuron:1-3 on the device, "cpu" in the reference;
    variables there are read by that family only (an op mixing cores raises)."""
    assert fuzzer._namespace("cpu")["dev2"] == "cpu"
    assert fuzzer._namespace("neuron")["dev2"] == "neuron:2"
    made = set()
    for seed in range(30):
        g = fuzzer.Gen(seed, ["cores", "pointwise", "inplace"])
        g.build()
        remote = {k for k in g.core if k in g.ns}
        made |= remote
        assert not set(g.vars()) & remote  # what every other family picks from
        assert all(g.ns[k].device.type == "cpu" for k in remote)
    assert made


def _reading(value, stride=None):
    return {"dtype": str(value.dtype), "shape": list(value.shape),
            "stride": list(stride or value.stride()), "offset": 0, "requires_grad": False,
            "value": value}


def test_comparator_values_nan_and_strides():
    a = torch.tensor([[1.0, math.nan], [3.0, 4.0]])
    assert fuzzer.compare_reading("v0", _reading(a), _reading(a.clone()), []) == []
    b = a.clone()
    b[1, 1] = 4.5
    assert [k for k, _ in fuzzer.compare_reading("v0", _reading(b), _reading(a), [])] == ["value"]
    kinds = [k for k, _ in fuzzer.compare_reading("v0", _reading(a, (1, 2)), _reading(a), [])]
    assert kinds == ["stride"]
    # a size-1 dimension's stride is not significant
    c = torch.ones(1, 3)
    assert fuzzer.compare_reading("v0", _reading(c, (7, 1)), _reading(c), []) == []
    i = torch.tensor([1, 2])
    assert fuzzer.compare_reading("v0", _reading(i + 1), _reading(i), [])[0][0] == "value"
    assert fuzzer.compare_reading("v0", _reading(i.float()), _reading(i), [])[0][0] == "dtype"


def test_comparator_float64_policy():
    x = torch.tensor([1.0, 2.0, 1e30], dtype=torch.float64)
    near = x * (1 + 1e-6)        # float32 precision: within the policy's tolerance
    far = x * (1 + 1e-2)
    assert fuzzer.compare_reading("v0", _reading(near), _reading(x), ["f64"]) == []
    assert fuzzer.compare_reading("v0", _reading(near), _reading(x), [])[0][0] == "value"
    assert fuzzer.compare_reading("v0", _reading(far), _reading(x), ["f64"])[0][0] == "value"
    # float32 saturation: CPU's float64 1e39 is inf once cast to float32, as on the device
    big = torch.tensor([1e39], dtype=torch.float64)
    assert fuzzer.compare_reading("v0", _reading(torch.tensor([math.inf], dtype=torch.float64)),
                                  _reading(big), ["f64"]) == []
    # ... and NaN where that is infinite (bar run seed 5126846: gelu(inf) is NaN in float32),
    # but not where it is finite
    nan = torch.tensor([math.nan], dtype=torch.float64)
    assert fuzzer.compare_reading("v0", _reading(nan), _reading(big), ["f64"]) == []
    assert fuzzer.compare_reading("v0", _reading(nan), _reading(big / 1e25), ["f64"]) != []
    # float32 saturating inside an op (bar run seed 5148887: CPU's float32 mean of four 8.5e37s
    # is inf, its float64 one is 8.5e37)
    huge = torch.tensor([8.5e37], dtype=torch.float64)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    assert fuzzer.compare_reading("v0", _reading(inf), _reading(huge), ["f64"]) == []
    assert fuzzer.compare_reading("v0", _reading(inf), _reading(huge), []) != []
    # final bar, seed 10160672: a norm of values near 1e20 squares them past float32's max
    norm = torch.tensor([8.6e20], dtype=torch.float64)
    assert fuzzer.compare_reading("v0", _reading(inf), _reading(norm), ["f64"]) == []
    # float64 random draws come from the float32 stream: metadata only
    assert fuzzer.compare_reading("v0", _reading(far), _reading(x), ["f64", "rng64"]) == []
    # ints computed from float64 (comparisons, casts): metadata only
    i = torch.tensor([1, 2])
    assert fuzzer.compare_reading("v0", _reading(i + 1), _reading(i), ["f64"]) == []


def test_bit_equality_is_bitwise_with_nan_equal():
    a = torch.tensor([0.0, math.nan, 1.0])
    assert fuzzer._bits_equal(a, a.clone())
    assert not fuzzer._bits_equal(a, torch.tensor([-0.0, math.nan, 1.0]))
    assert not fuzzer._bits_equal(a, torch.tensor([0.0, math.nan, 1.0000001]))


def test_compare_finds_a_wrong_value_on_the_device():
    """A neuron run that computed something else is caught (a planted 'bug')."""
    prog = ["v0 = torch.ones(3, device=dev)", "v1 = v0 * 2", "torch.neuron.synchronize()"]
    wrong = ["v0 = torch.ones(3, device=dev)", "v1 = v0 * 2.5", "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert fuzzer.compare(prog, ref, fuzzer.run_program(prog, "neuron")) == []
    fails = fuzzer.compare(prog, ref, fuzzer.run_program(wrong, "neuron"))
    assert [k for k, _ in fails] == ["value"] and "v1" in fails[0][1]


def test_error_rules_immediate_deferred_and_taint():
    # CPU raises IndexError at statement 1; neuron defers it to the sync (NeuronRuntimeError)
    prog = ["v0 = torch.arange(5., device=dev)",
            "v1 = v0.index_select(0, torch.tensor([7], device=dev))",
            "v2 = v1 + 1",                       # depends on the failed statement: tainted
            "v3 = v0 * 2",                       # independent: must be right or unreadable
            "torch.neuron.synchronize()"]
    err, reads, taint = ref = fuzzer.run_reference(prog)
    assert (err["at"], err["type"]) == (1, "IndexError")
    assert "err" in taint["v2"] and "err" not in taint.get("v3", [])
    assert "v3" in reads and "v2" not in reads
    run = fuzzer.run_program(prog, "neuron")
    assert run[0]["type"] == "NeuronRuntimeError" and 1 <= run[0]["at"] <= 4
    assert fuzzer.compare(prog, ref, run) == []
    # a deferred error may not surface after a later explicit sync point
    late = (dict(run[0], at=4), run[1])
    assert fuzzer.compare(prog[:3] + ["_ = v0.cpu()"] + prog[3:], ref, late)[0][0] == "raised"
    # neuron raising where CPU does not, or another type at the same statement
    ok = ["v0 = torch.ones(2, device=dev)", "torch.neuron.synchronize()"]
    bad = ({"at": 0, "type": "ValueError", "msg": "x", "deferred": False}, {})
    assert fuzzer.compare(ok, fuzzer.run_reference(ok), bad)[0][0] == "raised"


def test_shrinker_keeps_the_failure_and_drops_dependents():
    prog = ["v0 = torch.randn((4, 5), device=dev)", "v1 = v0 + 1", "v2 = v1.exp()",
            "v3 = torch.zeros((3, 3), device=dev)", "v4 = v3 @ v3",
            "torch.neuron.synchronize()"]
    small = fuzzer.shrink(prog, lambda c: any("@" in s for s in c))
    assert small == ["v3 = torch.zeros((1, 1), device=dev)", "v4 = v3 @ v3",
                     "torch.neuron.synchronize()"]
    assert fuzzer._without(prog, {0}) == prog[3:]


def test_abort_in_a_worker_is_caught_and_shrunk():
    prog = ["v0 = torch.ones(2, device=dev)", "v1 = v0 + 1",
            "__import__('os').abort()", "torch.neuron.synchronize()"]
    pool = fuzzer.Pool()
    try:
        fails = pool.check(prog, [("eager", "default")])
        assert [f["kind"] for f in fails] == ["crash"] and "exit -6" in fails[0]["detail"]
        small = fuzzer.shrink(prog, lambda c: any(
            f["kind"] == "crash" for f in pool.check(c, [("eager", "default")])))
        assert small == ["__import__('os').abort()", "torch.neuron.synchronize()"]
        # the pool starts a fresh worker after the crash
        assert pool.check(prog[:2] + prog[3:], [("eager", "default")]) == []
    finally:
        pool.close()


def test_driver_reports_and_shrinks_a_crash():
    prog = ["v0 = torch.ones(2, device=dev)", "v1 = v0 * 3",
            "_ = v1.sum().item() == 6.0 and __import__('os').abort()",
            "torch.neuron.synchronize()"]
    make = lambda seed, fams, excl: prog if seed == 1 else prog[:2] + prog[3:]
    n, fails = fuzzer.fuzz(range(3), ["eager"], ["default"], make=make, log=lambda s: None)
    assert n == 3
    assert [(f["kind"], f["seed"], f["count"]) for f in fails] == [("crash", 1, 1)]
    assert "exit -6" in fails[0]["detail"] and "not reproduced" not in fails[0]["detail"]
    assert fails[0]["snippet"].endswith("\n".join(prog))


def test_a_later_cpu_error_inside_the_deferred_window_is_accepted():
    prog = ["v0 = torch.randn((1, 1), device=dev)",
            "v1 = v0 & 1",                        # CPU raises; neuron may defer it
            "v2 = torch.arange(3, device=dev)",
            "v3 = v2.mT",                         # raises on CPU too (1-D), at once on neuron
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert ref[0]["all"] == {1: "NotImplementedError", 3: "RuntimeError"}
    later = ({"at": 3, "type": "RuntimeError", "msg": "", "deferred": False},
             fuzzer.run_program(prog[:3], "neuron")[1])
    assert fuzzer.compare(prog, ref, later) == []
    other = (dict(later[0], type="ValueError"), later[1])
    assert fuzzer.compare(prog, ref, other)[0][0] == "raised"


def test_a_check_above_the_device_refusing_first_may_leave_the_ops_error_pending():
    """Seed 96836: autograd refused a complex scatter_reduce after the op was queued, where
    CPU's kernel refused its index first; the op's own error surfaces at the next read (as
    CUDA's asynchronous errors do). Accepted as unreadable, never as a wrong value, and only
    when the two refused in other words."""
    prog = ["v0 = torch.randn((2, 3), device=dev)",
            "v1 = torch.complex(v0, v0).requires_grad_()",
            "v2 = v1.scatter_reduce(0, torch.tensor([[-4, 0, 0]], device=dev), v1[:1], 'prod')",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert (ref[0]["at"], ref[0]["type"]) == (2, "RuntimeError")
    run = fuzzer.run_program(prog, "neuron")
    assert (run[0]["at"], run[0]["type"]) == (2, "RuntimeError")
    assert run[0]["msg"] != ref[0]["msg"]
    assert run[1]["v0"].get("read_error") == "NeuronRuntimeError"  # the op's error, pending
    assert fuzzer.compare(prog, ref, run) == []
    same_words = (dict(run[0], msg=ref[0]["msg"]), run[1])
    assert fuzzer.compare(prog, ref, same_words)[0][0] == "read"
    wrong = (run[0], {**run[1], "v0": {**ref[1]["v0"], "value": ref[1]["v0"]["value"] + 1}})
    assert fuzzer.compare(prog, ref, wrong)[0][0] == "value"


def test_an_error_at_a_shape_the_float64_policy_leaves_free_is_accepted():
    # fuzzer seed 5108656: how many float64 draws `where` keeps is free (the device draws
    # them from the float32 stream), so is whether indexing the result raises
    def prog(dtype):
        return ["torch.manual_seed(2)",
                f"v0 = torch.rand((5,), device=dev, dtype={dtype})",
                "v1 = torch.where(torch.bernoulli(v0) > 0)[0]",
                "v2 = torch.arange(3., device=dev) * 2",  # compared as any value
                "v3 = v1.select(0, -9)",
                "torch.neuron.synchronize()"]
    raised = {"at": 4, "type": "IndexError", "msg": "", "deferred": False}
    for dtype in ("torch.float64", "torch.float32"):
        p = prog(dtype)
        ref = fuzzer.run_reference(p)
        assert ref[0]["at"] == 4  # CPU raises too: no draw keeps 9 of 5
        quiet = (None, fuzzer.run_program(p[:4] + p[5:], "neuron")[1])
        fails = fuzzer.compare(p, ref, quiet)
        # float64: CPU's error is policy-free, values before it are compared and match;
        # float32: the same stream as CPU, so neuron must raise too
        assert (fails == []) == (dtype == "torch.float64"), fails
        assert fuzzer.compare(p, ref, (raised, quiet[1])) == []
    # values before the parting statement are still compared
    p = prog("torch.float64")
    ref, reads = fuzzer.run_reference(p), fuzzer.run_program(p[:4] + p[5:], "neuron")[1]
    assert fuzzer.compare(p, ref, (raised, reads)) == []
    wrong = dict(reads, v2=dict(reads["v2"], value=reads["v2"]["value"] + 1))
    assert [k for k, _ in fuzzer.compare(p, ref, (raised, wrong))] == ["value"]


def test_an_infinite_gradient_through_min_is_nan_beside_it_as_on_cuda():
    # fuzzer seed 5124568: PyTorch's min() backward for devices and subclasses multiplies by
    # the mask (0 * -inf = NaN); CPU's fills it. Accepted for such reductions only.
    prog = ["v3 = torch.tensor([3., 7., 0.], device=dev).requires_grad_()",
            "v6 = v3.min()", "v6.reciprocal().backward()", "torch.neuron.synchronize()"]
    ref, run = fuzzer.run_reference(prog), fuzzer.run_program(prog, "neuron")
    assert run[1]["v3"]["grad"][:2].isnan().all() and (ref[1]["v3"]["grad"][:2] == 0).all()
    assert fuzzer.compare(prog, ref, run) == []
    assert [k for k, _ in fuzzer.compare_reading(
        "v3", run[1]["v3"], ref[1]["v3"], [])] == ["grad"]  # without the rule


def test_an_empty_contraction_of_two_dtypes_may_raise_cpus_own_error():
    # bar run seed 5204411: PyTorch's matmul under Python dispatch reaches mm, which checks
    # dtypes before seeing the batch is empty; plain CPU's reaches bmm, which does not
    prog = ["v0 = torch.randn((1, 1, 4), device=dev)",
            "v3 = torch.rand((2, 0, 4), device=dev) > 0.5",
            "v5 = torch.matmul(v3, v0.mT)", "v6 = v0 * 2", "torch.neuron.synchronize()"]
    run = fuzzer.run_program(prog, "neuron")
    assert run[0]["at"] == 2 and "same dtype" in run[0]["msg"]
    assert fuzzer.compare(prog, fuzzer.run_reference(prog), run) == []
    same = [s.replace(" > 0.5", "") for s in prog]  # one dtype: CPU is fine, a failure
    assert fuzzer.compare(same, fuzzer.run_reference(same), run)
    # not empty: plain CPU's bmm refuses Bool (NotImplementedError), mm refuses the mix
    # first under Python dispatch (seed 714619): both refuse at that statement, accepted
    full = [s.replace("(2, 0, 4)", "(2, 1, 4)") for s in prog]
    ref, run_full = fuzzer.run_reference(full), fuzzer.run_program(full, "neuron")
    assert (ref[0]["at"], ref[0]["type"]) == (2, "NotImplementedError")
    assert (run_full[0]["at"], run_full[0]["type"]) == (2, "RuntimeError")
    assert fuzzer.compare(full, ref, run_full) == []
    earlier = ({**run_full[0], "at": 1}, run_full[1])  # refused elsewhere: a failure
    assert fuzzer.compare(full, ref, earlier)[0][0] == "raised"


def test_what_is_computed_from_a_float64_comparison_is_checked_by_metadata():
    # bar run seed 6155176: `v1 == gelu(v1)` in float64 may flip in float32, and so does the
    # erf of it: both are compared by dtype/shape/strides only
    prog = ["v1 = torch.randn((3,), device=dev).double()", "v8 = F.gelu(v1)",
            "v10 = v1 == v8", "v11 = v10.erf()", "v12 = v1.float() * 2",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert "f64disc" in ref[2]["v10"] and "f64disc" in ref[2]["v11"]
    assert "f64disc" not in ref[2]["v12"]  # a float from float64: compared with tolerance
    run = fuzzer.run_program(prog, "neuron")
    flipped = dict(run[1], v11=dict(run[1]["v11"], value=1 - run[1]["v11"]["value"]))
    assert fuzzer.compare(prog, ref, (None, flipped)) == []
    wrong = dict(run[1], v12=dict(run[1]["v12"], value=run[1]["v12"]["value"] + 1))
    assert [k for k, _ in fuzzer.compare(prog, ref, (None, wrong))] == ["value"]


def test_a_one_argument_where_of_a_float64_comparison_is_free_in_shape():
    # fuzzer seed 31003668: float64 sigmoid(-100) is 3.7e-44 > 0, computed as float32 it is 0:
    # what `torch.where(mask)` (nonzero) selects may differ, as for nonzero itself
    prog = ["torch.manual_seed(0)", "v1 = torch.randn((1, 1, 1), device=dev).double()",
            "v2 = v1 - 100.0", "v3 = v2.sigmoid()", "v8 = torch.where(v3 > 0)[0]",
            "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert "f64cut" in ref[2]["v8"]
    assert fuzzer.compare(prog, ref, fuzzer.run_program(prog, "neuron")) == []


def test_the_reference_reads_a_value_as_a_device_copy_does():
    # fuzzer seed 8101303: `.cpu()` of a CPU tensor is itself; of a device tensor a copy made
    # through autograd, which refuses a multi-output view whose base changed in place
    prog = ["v2 = torch.ones(2, device=dev).requires_grad_()", "v7 = v2 * 1",
            "v9 = v7.split(1)[-1]", "v7.mul_(2)", "_ = v9.cpu()", "torch.neuron.synchronize()"]
    ref = fuzzer.run_reference(prog)
    assert (ref[0]["at"], ref[0]["type"]) == (4, "RuntimeError")
    assert fuzzer.compare(prog, ref, fuzzer.run_program(prog, "neuron")) == []


def test_device_only_pytorch_behaviours_are_accepted_narrowly():
    # final bar, seed 9151314: a 0-d source over the target's memory is copy_ on a device
    prog = ["v4 = torch.tensor([3, 4], device=dev)", "v5 = v4.unbind(0)[0]", "v4[::2] = v5",
            "torch.neuron.synchronize()"]
    run = fuzzer.run_program(prog, "neuron")
    assert "single memory location" in run[0]["msg"]
    assert fuzzer.compare(prog, fuzzer.run_reference(prog), run) == []
    other = ["v4 = torch.tensor([3, 4], device=dev)", "v5 = v4[:1]", "v4[::2] = v5",
             "torch.neuron.synchronize()"]  # not 0-d: not excused
    assert not fuzzer._aliased_0d_setitem(other, run[0], fuzzer.run_reference(other))
    # PyTorch's view replay for subclasses, after an in-place view op on the base
    prog = ["v0 = torch.ones((2, 3), device=dev).requires_grad_()", "v1 = v0 * 1",
            "v2 = v1.permute(1, 0)", "v1.unsqueeze_(0)", "v3 = v2 + 1",
            "torch.neuron.synchronize()"]
    run = fuzzer.run_program(prog, "neuron")
    assert run[0]["at"] == 4 and fuzzer.compare(prog, fuzzer.run_reference(prog), run) == []
    unrelated = prog[:4] + ["v3 = v0 + 1", "torch.neuron.synchronize()"]
    assert fuzzer.compare(unrelated, fuzzer.run_reference(unrelated), run)[0][0] == "raised"
    # final bar, seed 9613922: an out= resize changes its tensor in place as well, and the
    # replay refuses first where CPU raises another error at the same statement
    prog = ["v3 = torch.full((1, 1, 1), 1.0, device=dev)", "v5 = v3.mT",
            "torch.exp(torch.tensor(1.0, device=dev), out=v3)",
            "v3.add_(torch.tensor(1.0, device=dev).requires_grad_())",
            "v6 = v5.scatter_reduce(0, torch.zeros((1, 1, 1), dtype=torch.long, device=dev), "
            "torch.tensor(True, device=dev), 'amax')", "torch.neuron.synchronize()"]
    run = fuzzer.run_program(prog, "neuron")
    ref = fuzzer.run_reference(prog)
    assert run[0]["at"] == ref[0]["at"] == 4 and run[0]["type"] != ref[0]["type"]
    assert fuzzer.compare(prog, ref, run) == []
    # final bar, seed 9102543: an adaptive optimizer's step on float64 near a zero gradient
    step = "torch.optim.AdamW([v3], lr=0.01).step()"
    assert fuzzer._F64_CUT.search(step) and not fuzzer._F64_CUT.search(
        "torch.optim.SGD([v3], lr=0.1).step()")


def test_a_hang_is_reported_with_the_workers_stacks_and_stderr_never_blocks():
    pool = fuzzer.Pool(timeout=20)
    try:
        # 1 MB of stderr (C++ warnings do this) must not block the worker on a full pipe
        noisy = ["_ = __import__('sys').__stderr__.write('w' * 1_000_000)",
                 "torch.neuron.synchronize()"]
        assert pool.check(noisy, [("eager", "default")]) == []
        pool.timeout = 2
        fails = pool.check(["__import__('time').sleep(60)"], [("eager", "default")])
        assert [f["kind"] for f in fails] == ["hang"]
        assert "most recent call first" in fails[0]["stderr"]  # faulthandler's stack dump
    finally:
        pool.close()

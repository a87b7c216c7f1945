"""Issue 28: compile causes (Note [Compile causes] in fusion/causes.py), launches' source
lines, the per-line report."""
import torch

import adaptive_eager as ae


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to("neuron")


def run(fn, adaptive=True, **settings):
    """fn() under a fresh memory cache and no disk cache, lazily; the metrics of the run."""
    with ae.override(disable_disk_cache=True, queue_low_threshold=0, **settings), \
            ae.adaptive(adaptive):
        ae.reset_metrics()
        fn()
        torch.neuron.synchronize()
        return ae.metrics()


def test_new_shapes_are_counted_with_the_dim_that_varied():
    def loop():
        for T in (5, 9, 13, 17, 21):  # 5 sequence lengths: 1 new sequence, 4 new shapes
            x = rand(4, T)
            ((x * 2 + 1).asinh() * 0.5).sum().item()
    m = run(loop)
    assert m.compiles == 5
    assert m.compile_causes == {"new op sequence": 1, "new shape": 4}
    assert m.compile_dims == {"dim 1 of input 0 of mul.Tensor": 4}
    assert "new shape=4" in ae.metrics_report()
    assert "dim 1 of input 0 of mul.Tensor=4" in ae.metrics_report()


def test_new_shapes_in_eager_mode_too():
    from fusion.causes import HISTORY
    HISTORY.clear()  # the keys earlier tests compiled would be the nearest (another dim)

    def loop():
        for n in (3, 7, 11):
            (rand(37, n).acosh() * 3).sum()  # 37 rows: shapes no other test compiles
    m = run(loop, adaptive=False)
    # acosh and mul of each new width: new shapes of dim 1 (sum too); the first of each op
    # may have been compiled by an earlier test, so only the later ones are pinned
    assert m.compile_causes.get("new shape", 0) >= 4
    assert m.compile_dims.get("dim 1 of input 0 of acosh", 0) >= 2


def test_new_scalar_type_and_dtype():
    x = rand(6, 5)
    m = run(lambda: [(x.expm1() * 2).sum().item(), (x.expm1() * 2.5).sum().item()])
    assert m.compile_causes.get("new scalar type") == 1
    xh = rand(6, 5, dtype=torch.bfloat16)
    m = run(lambda: [(x.log1p() * 2.5).sum().item(), (xh.log1p() * 2.5).sum().item()])
    assert m.compile_causes.get("new dtype") == 1


def test_same_key_again_after_a_cache_setting_change():
    from fusion.causes import HISTORY
    HISTORY.clear()  # only this test's compiles are remembered
    x = rand(3, 4)

    def f():
        (x.sinh() - 0.25).abs().sum().item()
    run(f)
    # each settings change (in and out of the override) makes another cache, whose memory
    # level starts empty: the same key compiles again, for that cause
    m = run(f, cache_max_entries=500)
    assert m.compile_causes == {"cache setting": 1}
    # Again and again: each new cache may sit where a freed one was (an id() names another
    # cache then: that compile was taken for an eviction, a flaky CI failure)
    for i in range(20):
        m = run(f, cache_max_entries=501 + i % 2)
        assert m.compile_causes == {"cache setting": 1}, i


def _line_of(text):
    """"this file:N" of the first line of this file containing `text`."""
    with open(__file__) as f:
        n = next(i for i, s in enumerate(f, 1) if text in s and "_line_of" not in s)
    return f"{__file__}:{n}"


def test_explain_and_trace_name_each_launchs_lines(tmp_path):
    import json
    x = rand(4, 8)
    with ae.override(queue_low_threshold=0), ae.adaptive(True):
        y = x * 2  # line A
        z = (y + 1).relu()  # line B
        z.sum().item()  # line C
    a, b, c = _line_of("# line A"), _line_of("# line B"), _line_of("# line C")
    g = ae.explain().groups
    assert len(g) == 1 and g[0]["lines"] == {a: 1, b: 2, c: 1}
    assert "test_lines.py:%s x2" % b.rsplit(":", 1)[1] in str(ae.explain())
    ae.save_trace(str(tmp_path / "t.json"))
    ev = json.load(open(tmp_path / "t.json"))["traceEvents"]
    # (core 0's: the trace lists each core's launches in turn, and core 1 may have run some)
    launch = [e for e in ev if e.get("cat") == "launch" and e.get("pid") == 0][-1]
    assert launch["args"]["lines"] == {a: 1, b: 2, c: 1}
    # eager: one launch per op, each with its one line
    ae.reset_metrics()
    (x * 3).neg().sum().item()  # line D
    ae.save_trace(str(tmp_path / "e.json"))
    ev = json.load(open(tmp_path / "e.json"))["traceEvents"]
    last = [e["args"].get("lines") for e in ev
            if e.get("cat") == "launch" and e.get("pid") == 0][-3:]
    assert last == [{_line_of("# line D"): 1}] * 3


def test_profiler_events_carry_lines(tmp_path):
    import json
    x = rand(4, 8)
    with torch.profiler.profile() as prof, ae.adaptive(True):
        (x * 2 + 1).sum().item()  # line E
    prof.export_chrome_trace(str(tmp_path / "p.json"))
    ev = json.load(open(tmp_path / "p.json"))["traceEvents"]
    ours = [e for e in ev if e.get("cat") == "neuron_launch"]
    assert ours and ours[-1]["args"]["lines"] == {_line_of("# line E"): 3}


def test_line_report_splits_device_time_by_line_and_counts_compiles():
    w = rand(64, 64)

    def loop():
        for T in (6, 10, 14):
            x = rand(T, 64)
            h = x @ w  # line MM
            (h.cos() * 0.3 + 1).sum().item()  # line PW
    m = run(loop)
    rep = ae.line_report()
    by = {r["line"]: r for r in rep.rows}
    mm, pw = by[_line_of("# line MM")], by[_line_of("# line PW")]
    assert (mm["ops"], pw["ops"]) == (3, 12)  # mm; cos, mul, add, sum
    assert mm["launches"] == pw["launches"] == 3  # fused together, once per length
    # every launch's time is split among its ops' lines: the lines add up to the device's
    trace = list(ae.engine.engine.ENGINE.device.trace)
    launches = [e for e in trace if e[1] == "launch"][-3:]  # the three fused launches
    assert [len(e[6][0]) for e in launches] == [5, 5, 5]
    launched = sum(e[3] for e in launches)
    assert abs(sum(r["device_us"] for r in rep.rows) - launched) < 1e-9 * launched
    assert launched < m.device_time_us  # (the copies to the device are DMAs: no line)
    assert mm["device_us"] > pw["device_us"] / 5 > 0  # mm's FLOPs weigh more per op
    assert mm["split"] == "cost"
    assert mm["compiles"] == pw["compiles"] == 3
    assert mm["new_shapes"] == 2  # the varied input (x, dim 0) is read by mm
    assert pw["syncs"] == 3
    text = str(rep)
    assert "test_lines.py:" in text and "split" in text


def test_line_report_window_starts_at_reset_metrics():
    x = rand(8)
    (x * 2).sum().item()  # line OLD
    ae.reset_metrics()
    (x + 2).sum().item()  # line NEW
    lines = {r["line"] for r in ae.line_report().rows}
    assert _line_of("# line NEW") in lines and _line_of("# line OLD") not in lines


def test_shape_churn_sentence_and_bucketing_what_if_match_a_padded_run():
    """Note [Shape churn]: the new shapes are traced to the line where the varied tensor
    entered the device (through a view: the group reads B*T rows), and the what-if's
    compiles are a padded run's (padded by ae.pad_to_bucket)."""
    from fusion.causes import HISTORY
    HISTORY.clear()
    w = rand(32, 32)
    lengths = [8, 13, 21, 30, 37, 45, 50, 64, 70, 8, 13]

    def loop(**bucket):
        for T in lengths:
            x = torch.randn(2, T, 32)
            if bucket:
                x = ae.pad_to_bucket(x, 1, **bucket)
            x = x.to("neuron")  # line ENTERS
            h = x.view(-1, 32) @ w  # 2*T rows
            (h.erf() * 2).sum().item()
    m = run(loop)
    from adaptive_eager.tools.lines import churn
    c = churn()
    assert (c["dim"], c["line"]) == (1, _line_of("# line ENTERS"))
    assert c["sizes"] == sorted(set(lengths)) and c["new_shapes"] == m.compiles - 1 == 8
    n = c["line"].rsplit(":", 1)[1]
    assert "89% of compiles (8 of 9) are new shapes of dim 1 of the tensor from " \
           f"test_lines.py:{n} (9 distinct sizes, 8..70)" in ae.metrics_report()
    for name, bucket in (("multiple of 32", {"multiple": 32}),
                         ("power of two", {"buckets": "power of two"})):
        padded = run(lambda: loop(**bucket))  # the prediction, against a real padded run
        assert padded.compiles == c["whatif"][name], name
    assert c["whatif"]["multiple of 32"] == 3  # 32, 64, 96


def test_shape_churn_without_an_entry_names_the_group_input():
    """Tensors made on the device (no host copy): the group input dim, as before."""
    from fusion.causes import HISTORY
    HISTORY.clear()

    def loop():
        for T in (9, 17, 25):
            torch.ones(T, 6, device="neuron").cosh().sum().item()  # line MADE
    run(loop)
    from adaptive_eager.tools.lines import churn
    c = churn()
    assert not c["entered"] and (c["dim"], c["input"]) == (0, 0)
    assert c["new_shapes"] >= 2 and c["line"] == _line_of("# line MADE")


def test_backward_ops_name_the_forward_lines_they_differentiate(tmp_path):
    """Note [Backward lines]: in a training step, each backward op names the forward line of
    the op it differentiates ("file:line (backward)"), in line_report, explain, save_trace."""
    import json
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to("neuron")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = rand(5, 8)
    fwd = {}
    for adaptive in (False, True):
        with ae.override(queue_low_threshold=0), ae.adaptive(adaptive):
            ae.reset_metrics()
            h = lin(x)  # line LIN
            loss = (h.tanh() * 3).sum()  # line ACT
            loss.backward()  # line BWD
            opt.step()
            opt.zero_grad()
            loss.item()
        lin_b = _line_of("# line LIN") + " (backward)"
        act_b = _line_of("# line ACT") + " (backward)"
        rows = {r["line"]: r for r in ae.line_report().rows}
        # addmm's backward: mm (grad of the weight) and sum (grad of the bias; the input
        # needs none); tanh's backward (tanh_backward) and mul's (mul by 3)
        assert rows[lin_b]["ops"] == 2, rows
        assert rows[act_b]["ops"] == 2, rows
        assert rows[lin_b]["device_us"] > 0
        fwd[adaptive] = rows
        ae.save_trace(str(tmp_path / "t.json"))
        ev = json.load(open(tmp_path / "t.json"))["traceEvents"]
        named = set().union(*(e["args"].get("lines", {}) for e in ev if e.get("cat") == "launch"))
        assert {lin_b, act_b} <= named
    # adaptive: the step's last flush; explain names the backward lines of its groups
    text = str(ae.explain())
    assert "test_lines.py:%s (backward) x2" % act_b.split(":")[-1].split(" ")[0] in text
    groups = ae.explain().groups
    assert any(lin_b in g["lines"] for g in groups)
    # the forward lines keep their own rows (forward ops only)
    assert fwd[True][_line_of("# line LIN")]["ops"] == 1  # addmm


def test_backward_error_names_the_forward_line():
    from adaptive_eager.engine.source import BACKWARD
    src = ("t.py", 7, None)
    assert ae.engine.source.where((BACKWARD, src)) == "t.py:7 (backward)"
    e = ae.NeuronRuntimeError("mm", "boom", (BACKWARD, src))
    assert 'File "t.py", line 7 (the forward op this backward op differentiates)' in str(e)
    assert e.source == src

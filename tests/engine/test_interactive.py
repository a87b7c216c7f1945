"""print, pdb, the interactive interpreter and Python control flow in adaptive mode."""
import io
import os
import subprocess
import sys
import textwrap
import tracemalloc
from contextlib import redirect_stdout

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.engine import engine as _engine

ENV = dict(os.environ, TORCH_NEURONX_ENABLE_CONCATENATION="1", PYTHONBREAKPOINT="pdb.set_trace")

PDB_SCRIPT = textwrap.dedent("""
    import torch, adaptive_eager as ae

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(12.0).view(4, 3) / 10)

        def forward(self, x):
            h = torch.relu(x @ self.w - 0.5)
            breakpoint()
            return (h * 2).sum()

    assert ae.is_adaptive()
    x = torch.arange(8.0).view(2, 4).to("neuron")
    out = Net().to("neuron")(x)
    print("result", round(out.item(), 4))
""")


def _expected_h():
    x = torch.arange(8.0).view(2, 4)
    return torch.relu(x @ (torch.arange(12.0).view(4, 3) / 10) - 0.5)


def test_pdb_prints_values_mid_forward(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PDB_SCRIPT)
    cmds = "p h\np h.sum().item()\np ae.is_adaptive()\nc\n"
    out = subprocess.run([sys.executable, str(script)], input=cmds, capture_output=True,
                         text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    h = _expected_h()
    shown = torch._tensor_str._tensor_str(h.detach(), len("tensor("))
    flat = " ".join(out.stdout.split())
    assert " ".join(f"tensor({shown}, device='neuron:0', grad_fn=<ReluBackward0>)".split()) in flat
    assert f"{h.sum().item()}" in out.stdout
    assert "True" in out.stdout
    assert f"result {round((h * 2).sum().item(), 4)}" in out.stdout


def test_python_dash_i_shows_values():
    lines = textwrap.dedent("""
        x = torch.arange(4.0, device="neuron") * 2 + 1
        x
        y = x.exp().sum()
        if (x > 6).any(): print("big", x.max().item())

        print(round(y.item(), 3))
    """)
    out = subprocess.run([sys.executable, "-i", "-c", "import torch, adaptive_eager as ae"],
                         input=lines, capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensor([1., 3., 5., 7.], device='neuron:0')" in out.stdout
    assert "big 7.0" in out.stdout
    assert str(round(torch.tensor([1.0, 3, 5, 7]).exp().sum().item(), 3)) in out.stdout


def test_prints_inside_training_loop_match_eager():
    def run():
        buf = io.StringIO()
        with redirect_stdout(buf):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 1)).to("neuron")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(16, 8).to("neuron")
            for step in range(4):
                loss = model(x).pow(2).mean()
                print(step, loss)
                print(f"{loss:.6f}", model[0].weight[0, :3])
                loss.backward()
                opt.step()
                opt.zero_grad()
        return buf.getvalue()

    eager = run()
    with ae.adaptive():
        lazy = run()
    assert lazy == eager
    assert "device='neuron:0'" in lazy


def test_control_flow_on_values(mode):
    x = torch.tensor([3.0, -1.0, 2.0], device="neuron")
    steps = 0
    while (x > 0).any() and steps < 10:
        x = x - 1
        steps += 1
    assert steps == 3 and x.tolist() == [0.0, -4.0, -1.0]


def test_flop_counter_mode_composes_with_adaptive():
    from torch.utils.flop_counter import FlopCounterMode
    a, b = torch.randn(8, 16, device="neuron"), torch.randn(16, 4, device="neuron")
    with FlopCounterMode(display=False) as fc, ae.adaptive():
        c = (a @ b).relu()
        assert ae.is_adaptive()
    assert fc.get_total_flops() == 2 * 8 * 16 * 4
    assert not ae.is_adaptive()
    torch.testing.assert_close(c.cpu(), (a.cpu() @ b.cpu()).relu())


def test_the_scope_runs_its_ops_with_dynamo_off(monkeypatch):
    """Note [The scope's dispatch]: the scope turns Dynamo's frame callback off around its
    dispatch itself (torch._disable_dynamo's work, which TorchDispatchMode no longer wraps
    around it), and restores it after: a compiled function's callback never sees the
    engine's frames."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame
    from adaptive_eager.engine.engine import Engine
    seen = []
    real = Engine.dispatch

    def spy(self, func, args, kwargs):
        seen.append(get_eval_frame_callback())
        return real(self, func, args, kwargs)

    monkeypatch.setattr(Engine, "dispatch", spy)
    x = torch.ones(3, device="neuron")
    with ae.adaptive():
        prior = set_eval_frame(False)  # Dynamo's run-only callback: compiles nothing
        try:
            y = x * 2
            assert get_eval_frame_callback() is False
        finally:
            set_eval_frame(prior)
    assert seen and all(cb is None for cb in seen), seen
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_a_scoped_op_runs_no_more_python_than_a_process_wide_one():
    """Note [The scope's dispatch]: in the steady state a neuron op under `ae.adaptive()`
    runs the same Python functions as under `set_adaptive(True)`, the mode's dispatch in
    place of the tensor's (no HigherOrderOperator __instancecheck__, no mode-stack list:
    three frames per op, ~10% of the scope's cost); other modes still see the op."""
    import sys
    from torch.utils.flop_counter import FlopCounterMode
    x, a = torch.randn(16, device="neuron"), torch.randn(16, device="neuron")

    def step():
        y = x
        for _ in range(6):
            y = y * a
        return y

    def python_calls():
        for _ in range(3):
            step()
            torch.neuron.synchronize()
        calls = []
        y = x * a

        def profile(frame, event, arg):
            if event == "call":
                calls.append(frame.f_code.co_name)
        sys.setprofile(profile)
        try:
            y = y * a  # the second op of a steady step: replayed
        finally:
            sys.setprofile(None)
        torch.neuron.synchronize()
        return calls

    ae.set_adaptive(True)
    try:
        wide = python_calls()
    finally:
        ae.set_adaptive(False)
    with ae.adaptive():
        scoped = python_calls()
    assert "__torch_dispatch__" in scoped and sorted(scoped) == sorted(wide), (scoped, wide)
    with FlopCounterMode(display=False) as fc, ae.adaptive():
        out = x.view(4, 4) @ a.view(4, 4)
    assert fc.get_total_flops() == 2 * 4 * 4 * 4
    torch.testing.assert_close(out.cpu(), x.cpu().view(4, 4) @ a.cpu().view(4, 4))


def test_cpu_foreach_writes_inside_an_adaptive_scope_are_seen_by_autograd():
    """Under any dispatch mode CPU's in-place foreach kernels bump no version: a CPU tensor
    saved for backward and overwritten in an `ae.adaptive()` block gave a silently wrong
    gradient. The scope bumps them, so backward raises CPU's error, as outside it."""
    w = [torch.ones(3, requires_grad=True) * 1]
    y = w[0] * w[0]  # saves w[0]
    with ae.adaptive():
        torch._foreach_add_(w, [torch.arange(3.0)])
    assert w[0]._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_nested_adaptive_scopes_restore_mode():
    assert not ae.is_adaptive()
    with ae.adaptive():
        assert ae.is_adaptive()
        with ae.adaptive(False):
            assert not ae.is_adaptive()
            with ae.adaptive(strategy="matmul"):
                assert ae.is_adaptive() and ae.strategy() == "matmul"
            assert ae.strategy() == "graph"
        assert ae.is_adaptive()
    assert not ae.is_adaptive()


def test_deterministic_algorithms_disable_adaptive():
    with ae.adaptive():
        torch.use_deterministic_algorithms(True)
        try:
            assert not ae.is_adaptive()
            x = torch.ones(3, device="neuron") * 2
            assert ae.metrics().flushes.get("eager", 0) >= 1
        finally:
            torch.use_deterministic_algorithms(False)
        assert ae.is_adaptive()
        del x


def test_mode_switch_flushes():
    ae.set_adaptive(True)
    x = torch.ones(3, device="neuron") * 2
    assert _engine.ENGINE.seg.nodes
    ae.set_adaptive(False)
    assert not _engine.ENGINE.seg.nodes and ae.metrics().flushes["mode switch"] == 1
    assert x.tolist() == [2.0, 2.0, 2.0]


def test_exit_flushes_queued_work(tmp_path):
    code = ("import torch, adaptive_eager as ae\n"
            "x = torch.ones(3, device='neuron')\n"
            "y = x.index_select(0, torch.tensor([5], device='neuron'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=ENV, timeout=120)
    assert out.returncode == 0  # exit never crashes, but the queued error is reported
    assert "index_select" in out.stderr


def _loop(n, limit):
    x = torch.zeros(16, device="neuron")
    w = torch.full((16,), 0.5, device="neuron")
    worst = 0
    tracemalloc.start()
    for i in range(n):
        x = x * w + 1
        worst = max(worst, len(_engine.ENGINE.seg.nodes))
        if i == n // 5:
            early = tracemalloc.get_traced_memory()[0]
    late = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert worst <= limit
    return x, late - early


def test_ten_thousand_iterations_without_sync_stay_bounded():
    with ae.adaptive():
        x, growth = _loop(10_000, 1024)
    assert growth < 1_000_000, growth  # flat host memory
    assert abs(x[0].item() - 2.0) < 1e-6
    with ae.override(queue_low_threshold=0, buffer_size_limit=256), ae.adaptive():
        ae.reset_metrics()
        x, growth = _loop(10_000, 256)
        assert ae.metrics().flushes["buffer full"] >= 10_000 * 2 // 256 - 1
    assert growth < 1_000_000, growth

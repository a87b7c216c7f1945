"""torch.optim's fused steps (`fused=True`, Trainer's default `adamw_torch_fused`) are device
ops (issue 24): CPU's values bit for bit, 0 CPU fallbacks, fused with the step's other ops in
adaptive mode."""
import contextlib

import pytest
import torch

import adaptive_eager as ae

CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), amsgrad=True)),  # the tensor_lr overload
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
]
IDS = ["adamw", "adamw-tensor-lr-amsgrad", "adam-maximize", "sgd-nesterov", "sgd", "adagrad"]


def _train(device, cls, kw, steps=3):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    m.to(device)
    opt = cls(m.parameters(), fused=True, **kw)  # (Adagrad makes its state at once)
    x = torch.randn(5, 4).to(device)
    losses = []
    for _ in range(steps):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses, [p.detach().cpu() for p in m.parameters()] + [v.cpu() for v in state]


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_fused_step_matches_cpu_bit_for_bit(cls, kw, mode):
    cpu_losses, cpu = _train("cpu", cls, kw)
    ae.reset_metrics()
    losses, neuron = _train("neuron", cls, kw)
    assert ae.metrics().cpu_fallbacks == {}
    assert losses == cpu_losses and cpu_losses[0] != cpu_losses[-1]
    assert len(neuron) == len(cpu)
    for a, b in zip(neuron, cpu):
        assert torch.equal(a, b)


def test_fused_step_fuses_with_the_backward_in_adaptive_mode():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).to("neuron")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    x = torch.randn(5, 4).to("neuron")
    with ae.adaptive():
        m(x).square().mean().backward()
        opt.step()
        ae.synchronize()
        groups = ae.explain().groups
    assert any("_fused_adamw_" in g["name"] and g["ops"] > 1 for g in groups), groups


def test_fused_step_with_grad_scale_and_found_inf_matches_cpu():
    """GradScaler's path: the kernel unscales the gradients and skips the step on inf."""
    def step(device, inf):
        torch.manual_seed(0)
        ps = [torch.randn(3, 2), torch.randn(4)]
        gs = [torch.randn(3, 2) * 8, torch.randn(4) * 8]
        if inf:
            gs[1][0] = float("inf")
        avg, sq = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        steps = [torch.tensor(1.0) for _ in ps]
        lists = [[t.to(device) for t in ts] for ts in (ps, gs, avg, sq, steps)]
        scale = torch.tensor(8.0).to(device)
        found = torch.tensor(float(inf)).to(device)
        torch._fused_adamw_(lists[0], lists[1], lists[2], lists[3], [], lists[4], lr=0.1,
                            beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=scale, found_inf=found)
        return [t.cpu() for ts in lists for t in ts]
    for inf in (False, True):
        ae.reset_metrics()
        for a, b in zip(step("neuron", inf), step("cpu", inf)):
            assert torch.equal(a, b)
        assert ae.metrics().cpu_fallbacks == {}


def test_fused_step_bumps_versions_so_a_stale_graph_raises():
    """A backward through a graph that saved a parameter before the step raises, as with
    the foreach step (CPU's fused kernel bumps no version: a silently wrong gradient)."""
    w = torch.nn.Parameter(torch.ones(3).to("neuron"))
    opt = torch.optim.SGD([w], lr=0.1, fused=True)
    w.grad = torch.ones(3).to("neuron")
    loss = (w * w).sum()  # saves w
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_fused_step_runs_interpreted_under_the_inductor_executor():
    """torch 2.13's functionalization of `_fused_adamw_` fails an internal assert: a group
    holding the step is not handed to Inductor (no compile, no warning), and keeps CPU's
    values."""
    def run(device):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        x = torch.randn(5, 4).to(device)
        for _ in range(2):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in m.parameters()]
    cpu = run("cpu")
    with ae.override(executor="inductor"), ae.adaptive():
        ae.reset_metrics()
        neuron = run("neuron")
    m = ae.metrics()
    assert all(torch.equal(a, b) for a, b in zip(neuron, cpu))
    assert m.cpu_fallbacks == {} and m.compiled_groups == 0
    assert any("fused optimizer step" in r for r in m.compile_failures), m.compile_failures


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_a_steady_fused_step_is_replayed_through_its_version_bumping_handler(adaptive):
    """Note [Handled replay]: a steady fused step is replayed (its `_foreach_add_` of the
    steps and `_fused_adamw_`), CPU's values bit for bit, and still bumps versions: a graph
    that saved the parameters before the step raises in backward."""
    def run(device):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        m.to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        x = torch.randn(5, 8).to(device)
        ctx = ae.adaptive() if adaptive and device == "neuron" else contextlib.nullcontext()
        with ctx:
            for i in range(4):
                opt.zero_grad()
                m(x).square().sum().backward()
                stale = m(x).sum() if i == 3 else None  # saves the parameters
                ae.synchronize()
                ae.reset_metrics()
                opt.step()
                ae.synchronize()
            counts = (ae.metrics().ops, ae.metrics().replayed_ops)
            if device == "neuron":  # (CPU's fused kernels bump no version: no error there)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    stale.backward()
        return [p.detach().cpu() for p in m.parameters()], counts

    cpu, _ = run("cpu")
    neuron, counts = run("neuron")
    assert all(torch.equal(a, b) for a, b in zip(neuron, cpu))
    assert counts == (2, 2), counts  # (main: (2, 0))

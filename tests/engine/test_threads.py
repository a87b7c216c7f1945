"""Note [Threads] in adaptive_eager/engine/engine.py: several Python threads issue ops at once; each
thread's results are CPU's, bit for bit, in eager and adaptive mode, also while one thread
syncs and another records."""
import threading

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae


def _chain(x: torch.Tensor, steps: int) -> torch.Tensor:
    for i in range(steps):
        x = (x * 1.5 + i).sin() / 2
        if i % 7 == 0:
            x = x @ x.T[:, :x.shape[1]] if x.shape[0] == x.shape[1] else x.relu()
    return x


def _run_threads(target, n):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    ts = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_threads_running_their_own_chains_match_cpu(mode):
    inputs = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [_chain(x, 40) for x in inputs]
    got = [None] * 4

    def work(i):
        got[i] = _chain(inputs[i].to("neuron"), 40).cpu()

    _run_threads(work, 4)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_one_thread_syncs_while_others_record(mode):
    x = torch.randn(16, 16)
    expected = _chain(x, 30)
    stop = threading.Event()
    results = []

    def reader(_):
        y = torch.ones(4, device="neuron")
        while not stop.is_set():
            y = y + 1
            results.append(y.sum().item())  # a sync point, over and over

    def writer(i):
        results_w = _chain(x.to("neuron"), 30).cpu()
        assert torch.equal(results_w, expected)

    t = threading.Thread(target=reader, args=(0,))
    t.start()
    try:
        _run_threads(writer, 3)
    finally:
        stop.set()
        t.join()
    assert results == [4.0 * (k + 2) for k in range(len(results))]


def test_threads_with_backward(mode):
    torch.manual_seed(0)
    ws = [torch.randn(6, 6) for _ in range(3)]
    expected = []
    for w in ws:
        p = w.clone().requires_grad_()
        (p.tanh() @ p).sum().backward()
        expected.append(p.grad)
    got = [None] * 3

    def work(i):
        p = ws[i].to("neuron").requires_grad_()
        (p.tanh() @ p).sum().backward()
        got[i] = p.grad.cpu()

    _run_threads(work, 3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_compiled_graphs_in_threads_leave_the_mode_and_settings_alone(mode):
    """A compiled graph runs as one engine segment, which switches the engine to lazy
    recording with its own settings for the graph (compile.one_segment) and back. Threads
    running graphs at once once saved each other's switched state as their own: an eager
    process was left adaptive and purely lazy for good."""
    import sys

    from adaptive_eager.engine import engine as _engine
    from adaptive_eager.config import config

    @torch.compile(backend="neuron")
    def f(x):
        return (x * 2 + 1).relu().sum(0)

    x = torch.randn(8, 4)
    xn = x.to("neuron")
    f(xn)  # compiled once, before the threads
    state = (_engine.ENGINE.adaptive, config.queue_low_threshold, config.buffer_size_limit)
    got = [[] for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads inside the segment's set-up and restore
    try:
        _run_threads(lambda i: got[i].extend(f(xn).cpu() for _ in range(100)), 3)
    finally:
        sys.setswitchinterval(interval)
    assert (_engine.ENGINE.adaptive, config.queue_low_threshold,
            config.buffer_size_limit) == state
    want = (x * 2 + 1).relu().sum(0)
    assert all(torch.equal(g, want) for r in got for g in r)


def _busy_child(code: str) -> "subprocess.CompletedProcess":
    """`code` in a fresh interpreter, beside a daemon thread busy on neuron (`_BUSY`)."""
    import subprocess
    import sys
    import textwrap
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_BUSY) + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=240)


_BUSY = """
    import os, threading, time, torch, adaptive_eager as ae
    warm = threading.Event()
    def busy():  # a daemon thread issuing neuron ops (and holding the engine lock) non-stop
        a = torch.ones(64, device="neuron")
        while True:
            a = (a * 1.0001).tanh()
            a.sum().item()
            warm.set()
    threading.Thread(target=busy, daemon=True).start()
    # Past its first ops, whose lazy imports (torch._dynamo imports numpy.random) held a module
    # lock: a fork then left the child's `import numpy.random` (DataLoader workers seed numpy)
    # waiting on it forever, a hazard of forking during any import, not of the engine.
    warm.wait(120)
    time.sleep(0.3)
"""


def test_a_forked_child_has_its_own_locks_and_counters():
    """os.fork (DataLoader workers) while another thread holds the engine lock: the child
    inherited it held and hung (in torch.manual_seed); its metrics repeated the parent's."""
    r = _busy_child("""
    from torch.utils.data import DataLoader, TensorDataset
    dl = DataLoader(TensorDataset(torch.arange(64.)), batch_size=16, num_workers=2, timeout=60)
    print(sum(b[0].to("neuron").sum().item() for b in dl))
    pid = os.fork()
    if pid == 0:
        ops = ae.metrics().ops
        x = (torch.arange(4., device="neuron") * 2).sum().item()
        os._exit(0 if ops == 0 and x == 12.0 else 3)
    print(os.waitpid(pid, 0)[1])
    """)
    assert r.returncode == 0 and r.stdout.split() == ["2016.0", "0"], r.stderr[-2000:]


class _DeviceDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((2,), float(i), device="neuron")


def test_a_dataloader_worker_making_device_tensors_says_what_to_do():
    """The worker's collate asked for a TypedStorage and said only that a neuron tensor has
    none; CUDA's users get told to keep device work in the main process."""
    dl = torch.utils.data.DataLoader(_DeviceDataset(), batch_size=2, num_workers=1,
                                     timeout=120)
    with pytest.raises(RuntimeError, match=r"Return CPU tensors from the Dataset"):
        next(iter(dl))
    assert (torch.ones(2, device="neuron") * 2).tolist() == [2.0, 2.0]


def test_exit_with_a_daemon_thread_running_neuron_ops():
    """The interpreter's shutdown stopped such a thread inside PyTorch's C++ dispatcher frames:
    "terminate called without an active exception" (plain CPU PyTorch aborts so every time).
    The engine lock is held at exit and the thread let on to it (`park_daemon_threads`):
    without that wait, 2 of 30 runs aborted; failed in 2 of 5 CI runs with a fixed 0 s/50 ms."""
    r = _busy_child("print('bye')\n")
    assert r.returncode == 0 and r.stdout.strip() == "bye", r.stderr[-2000:]


def test_a_cpu_thread_drawing_random_numbers_changes_no_device_draw_and_the_reverse(mode):
    """The device's random ops ran with its state swapped into the CPU's default generator:
    another thread's CPU draws (data augmentation) ran inside the swap, taking the device's
    numbers (different dropout masks) and losing their own. The first-call probe of a random
    op restored the CPU generator afterwards, undoing the other thread's draws too."""
    import threading

    def device_draws():
        torch.neuron.manual_seed(1)
        x = torch.ones(256, device="neuron")
        out = [F.dropout(x, 0.5) for _ in range(40)]
        out += [torch.rand(256, device="neuron") for _ in range(20)]
        out += [torch.randperm(256 + i % 3, device="neuron")[:256].float() for i in range(20)]
        return torch.stack(out).cpu()
    alone = device_draws()
    stop, start, rows = threading.Event(), [], []

    def augment():
        start.append(torch.get_rng_state())
        while not stop.is_set():
            rows.append(torch.randn(512))
    t = threading.Thread(target=augment)
    t.start()
    try:
        together = device_draws()
    finally:
        stop.set()
        t.join()
    assert torch.equal(together, alone)
    torch.set_rng_state(start[0])
    assert all(torch.equal(r, torch.randn(512)) for r in rows)


@pytest.mark.parametrize("scope, read, inner, base", [
    (lambda: ae.adaptive(), ae.is_adaptive, True, False),
    (lambda v=[3, 5]: ae.override(buffer_size_limit=v.pop(0)),
     lambda: ae.config.buffer_size_limit, 5, None)])
def test_scopes_left_out_of_order_across_threads(scope, read, inner, base):
    """Thread A enters a scope, B enters one, A leaves, B leaves: B's scope lost its value
    when A left (A's entry value came back), and A's entry value stayed for good after B."""
    base = read() if base is None else base
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with scope():
            a_in.set()
            b_in.wait(60)
        a_out.set()

    def b():
        a_in.wait(60)
        with scope():
            b_in.set()
            a_out.wait(60)
            seen.append(read())
    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == [inner] and read() == base


def test_an_override_restores_only_what_it_set():
    """Leaving `override(max_group_ops=...)` also put back the mode from its entry, undoing
    an `ae.set_adaptive(True)` made inside it."""
    with ae.override(max_group_ops=4):
        ae.set_adaptive(True)
    try:
        assert ae.is_adaptive()
    finally:
        ae.set_adaptive(False)


def test_threads_asking_for_storage_addresses_get_distinct_ones():
    """Note [Device addresses]: `data_ptr()` holds no engine lock; two threads giving two
    live buffers their first address at once both read the one bump pointer, and two
    storages shared an address (fuzzer seed 856: `a.untyped_storage().data_ptr() ==
    b.untyped_storage().data_ptr()` was True for two tensors)."""
    import sys
    tensors = [[torch.empty(4, device="neuron") for _ in range(5000)] for _ in range(3)]
    ptrs = [None] * 3

    def work(i):
        ptrs[i] = [t.untyped_storage().data_ptr() for t in tensors[i]]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads switch inside the bump
    try:
        _run_threads(work, 3)
    finally:
        sys.setswitchinterval(interval)
    flat = [p for ps in ptrs for p in ps]
    assert len(set(flat)) == len(flat)


def _engine_entries():
    """What users do that reaches the engine, each way PyTorch reaches it: through
    `__torch_dispatch__`, and through the kernels we register below the Python key
    (`_copy_from`, factories, `empty`), the generator and storage APIs."""
    import copy
    import io
    x = torch.arange(6.0).reshape(2, 3).to("neuron")
    yield torch.tensor(2.5, device="neuron")  # a 0-d host value copied in (`_copy_from`)
    yield torch.tensor([1.0, 2.0], device="neuron")
    yield torch.full((3,), 3.0, device="neuron") * x[0]
    yield torch.arange(4, device="neuron") + 1
    yield torch.randperm(5, device="neuron")
    yield torch.rand(3, device="neuron")
    yield x.new_zeros(3).copy_(torch.ones(3))
    yield torch.empty(2, device="neuron").fill_(1.0)
    yield torch.empty_strided((2, 2), (1, 2), device="neuron").fill_(2.0)
    yield torch.ops.aten._efficientzerotensor([3], device="neuron")
    torch.manual_seed(3)
    torch.neuron.manual_seed(4)
    torch.neuron.set_rng_state(torch.neuron.get_rng_state())
    yield x.to(torch.float16)
    yield (x * 2).cpu()
    yield (x + 1).sum().item()
    yield str(x * 3)
    y = x * 4
    y.untyped_storage().resize_(y.untyped_storage().nbytes())
    yield y
    buf = io.BytesIO()
    torch.save(x * 5, buf)
    buf.seek(0)
    yield torch.load(buf)
    yield copy.deepcopy(x * 6)
    yield x[x > 2]  # a shape only the data tells (run now)
    yield (x * 7).tolist()
    z = torch.zeros(2, 3, device="neuron")
    z[torch.tensor([1])] = torch.tensor(9.0)  # host index and value
    yield z
    z.data = x * 8
    yield z
    m = torch.nn.Linear(3, 2).to("neuron")
    m(x).sum().backward()
    yield m.weight.grad
    yield torch.ones(4).pin_memory().to("neuron", non_blocking=True)
    yield torch.neuron.memory_allocated()
    torch.neuron.synchronize()


def test_every_engine_entry_holds_the_engine_lock(monkeypatch, mode):
    """Note [Threads]: every way into the engine holds its lock, so ops of other threads
    never interleave inside it. `torch.tensor(v, device="neuron")` reaches our `_copy_from`
    below the Python key; it queued its copy with no lock, and with other threads running
    ops that numbered nodes for another segment and left a live value unwritten (a wrong
    value in another thread, or an AttributeError in a flush). Checked where the engine
    changes its queue, runs a flush and allocates, on the calling thread."""
    from adaptive_eager.engine import engine as engine_mod
    from adaptive_eager.engine.queue import Segment
    from device import Device
    from fusion.flush import Runner
    unlocked = []

    def checked(cls, name):
        f = getattr(cls, name)

        def method(*args, **kwargs):
            if not engine_mod._LOCK._is_owned():
                import traceback
                unlocked.append(f"{cls.__name__}.{name}\n" + "".join(traceback.format_stack(limit=8)))
            return f(*args, **kwargs)
        monkeypatch.setattr(cls, name, method)

    for cls, name in [(Segment, "enqueue"), (Segment, "take"), (Runner, "run_sig"),
                      (Device, "alloc"), (Device, "submit"), (Device, "submit_plain")]:
        checked(cls, name)
    for out in _engine_entries():
        if isinstance(out, torch.Tensor):
            out.cpu()
    assert not unlocked, unlocked[0]

"""Lightning on neuron (issue 24): `Trainer(accelerator="neuron")` trains with CPU's losses, one
device and DDP, fp32 and bf16-mixed; Lightning is imported only by the user (Note [Lightning])."""
import json
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae

L = pytest.importorskip("lightning.pytorch")
from tests.harness.lightning_module import data, module_class  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)


def _fit(lightning, accelerator, precision="32-true", steps=5):
    module = module_class(lightning)()
    trainer = lightning.Trainer(accelerator=accelerator, devices=1, max_steps=steps,
                                precision=precision, **QUIET)
    trainer.fit(module, data())
    return module, trainer


_CPU = {}


def _cpu_losses(precision):
    if precision not in _CPU:
        with ae.adaptive(False):
            _CPU[precision] = _fit(L, "cpu", precision)[0].losses
    return _CPU[precision]


def test_lightning_is_imported_only_by_the_user():
    """One process, both orders: a Lightning imported before adaptive_eager (lightning_fabric,
    autoload off) is registered with at once; one imported after, when the user imports it;
    adaptive_eager itself imports none."""
    code = ("import sys\n"
            "import lightning_fabric as F\n"
            "assert 'neuron' not in F.accelerators.ACCELERATOR_REGISTRY\n"
            "def lightnings():\n"
            "    return {m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric')}\n"
            "before = lightnings()\n"
            "import adaptive_eager\n"
            "assert lightnings() == before, lightnings() - before\n"
            "assert 'neuron' in F.accelerators.ACCELERATOR_REGISTRY\n"
            "import lightning.pytorch as L\n"
            "assert 'neuron' in L.accelerators.AcceleratorRegistry\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT,
                                            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_trainer_on_neuron_has_cpus_losses(mode, precision):
    """Lightning built SingleDeviceStrategy(device="cpu") for an accelerator it does not know
    (the model trained on the CPU), and CUDA's autocast for bf16-mixed (fp32 on neuron)."""
    module, trainer = _fit(L, "neuron", precision)
    assert trainer.strategy.root_device == torch.device("neuron:0")
    assert module.devices == {"neuron:0"}
    want_dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    assert module.dtypes == {want_dtype}  # autocast engaged, on neuron
    assert ae.metrics().cpu_fallbacks == {}
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(_cpu_losses(precision)),
                               rtol=0, atol=0)


def test_16_mixed_is_cpus_float16_autocast_and_gradscaler(mode):
    """`precision="16-mixed"` on neuron: float16 autocast on the device and
    `torch.amp.GradScaler("neuron")` (Lightning's own plugin would build CUDA's, and on the CPU
    turns 16-mixed into bf16-mixed, so the reference is the same steps by hand on the CPU):
    losses and parameters bit for bit."""
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float64 is not supported")  # GradScaler's unscale_
        module, trainer = _fit(L, "neuron", "16-mixed")
    assert trainer.precision_plugin.scaler._device == "neuron"
    assert module.dtypes == {torch.float16} and module.devices == {"neuron:0"}
    assert ae.metrics().cpu_fallbacks == {}
    with ae.adaptive(False):
        net = module_class(L)().net
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler, losses = torch.amp.GradScaler("cpu"), []
        for _, (x, y) in zip(range(5), data()):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert module.losses == losses
    assert all(torch.equal(p.cpu(), q) for p, q in zip(module.net.parameters(), net.parameters()))


def test_pytorch_lightning_package_too():
    pl = pytest.importorskip("pytorch_lightning")
    module, trainer = _fit(pl, "neuron")
    assert trainer.strategy.root_device == torch.device("neuron:0")
    assert module.losses == _cpu_losses("32-true")


def test_devices_are_checked():
    with pytest.raises(Exception, match="requested 5 neuron devices but only 4"):
        L.Trainer(accelerator="neuron", devices=5, **QUIET)
    with pytest.raises(Exception, match="Invalid neuron devices"):
        L.Trainer(accelerator="neuron", devices=[0, 7], **QUIET)
    trainer = L.Trainer(accelerator="neuron", devices=[2], **QUIET)
    assert trainer.strategy.root_device == torch.device("neuron:2")


def test_auto_picks_neuron_where_lightning_would_pick_the_cpu():
    """`accelerator="auto"` (Trainer's and Fabric's default) trained a script written for any
    device on the CPU; now neuron, with Lightning's GPU rule for `devices="auto"` (every core,
    DDP), and the CPU still by name."""
    module = module_class(L)()
    trainer = L.Trainer(devices=1, max_steps=2, **QUIET)
    assert trainer.accelerator.name() == "neuron"
    trainer.fit(module, data())
    assert module.devices == {"neuron:0"}
    assert ae.metrics().cpu_fallbacks == {}
    every = L.Trainer(**QUIET)
    assert every.num_devices == torch.neuron.device_count() > 1
    assert type(every.strategy).__name__ == "DDPStrategy"
    assert every.strategy.parallel_devices[1] == torch.device("neuron:1")
    assert L.Trainer(accelerator="cpu", **QUIET).strategy.root_device.type == "cpu"
    from lightning.fabric import Fabric
    assert Fabric(devices=1).device == torch.device("neuron:0")


def test_ddp_two_devices_matches_one_cpu_process(tmp_path):
    """`Trainer(accelerator="neuron", devices=2, strategy="ddp")` (adaptive): Lightning built the
    DDP wrapper under torch.cuda.stream(torch.cuda.Stream()). Rank r trains on neuron:r; the
    ranks' mean loss is one CPU process's loss on both ranks' batches."""
    out = tmp_path / "rank"
    script = os.path.join(ROOT, "tests", "harness", "lightning_ddp.py")
    proc = subprocess.run([sys.executable, script, "neuron", "adaptive", str(out)],
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank.{r}.json").read_text()) for r in range(2)]
    # the reference: one CPU process on both ranks' batches of each step
    module = module_class(L)()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_losses = []
    for b0, b1 in zip(ranks[0]["batches"], ranks[1]["batches"]):
        x, y = (torch.cat([torch.tensor(b0[i]), torch.tensor(b1[i])]) for i in range(2))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module.net(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert len(ref_losses) == 3
    for r, got in enumerate(ranks):
        assert got["root_device"] == f"neuron:{r}" and got["devices"] == [f"neuron:{r}"]
        assert got["cpu_fallbacks"] == {}
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses))
        for p, q in zip(got["params"], module.parameters()):
            torch.testing.assert_close(torch.tensor(p), q.detach())


def _fabric_losses(accelerator, precision):
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator=accelerator, devices=1, precision=precision)
    model = module_class(L)().net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    assert next(model.parameters()).device == fabric.device
    losses = []
    for x, y in data():
        x, y = fabric.to_device((x, y))
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, fabric.device


def test_fabric_on_neuron_has_cpus_losses(mode):
    """Fabric's connector has Trainer's three gaps (Note [Lightning]): bf16-mixed is neuron's
    autocast (its losses are CPU's bf16-mixed ones, not fp32's), on neuron:0."""
    with ae.adaptive(False):
        cpu, _ = _fabric_losses("cpu", "bf16-mixed")
        fp32, _ = _fabric_losses("cpu", "32-true")
    losses, device = _fabric_losses("neuron", "bf16-mixed")
    assert device == torch.device("neuron:0") and losses == cpu and losses != fp32
    assert ae.metrics().cpu_fallbacks == {}


def test_a_lightning_this_cannot_change_only_warns(monkeypatch):
    """A Lightning without the connector methods changed here: a warning naming it, nothing
    changed (the accelerator is registered last), `import lightning` itself unharmed."""
    import types
    from adaptive_eager.integration import lightning as glue
    fake = types.ModuleType("fake_lightning.connector")
    fake.Connector = type("Connector", (), {})  # no _choose_strategy
    flavour = glue._Flavour("lightning.pytorch", "Connector", "AcceleratorRegistry",
                            "_precision_plugin_flag", "_setup_model", "determine_ddp_device_ids")
    monkeypatch.setitem(glue._CONNECTORS, fake.__name__, flavour)
    ddp = L.strategies.DDPStrategy._setup_model
    with pytest.warns(UserWarning, match="could not register the 'neuron' accelerator with "
                                         "lightning.pytorch .AttributeError"):
        glue._register(fake)
    assert L.strategies.DDPStrategy._setup_model is ddp
    glue._registered.discard(fake.__name__)


def test_checkpoint_and_resume_match_cpu(mode, tmp_path):
    """`ModelCheckpoint` mid-run, then `fit(ckpt_path=...)` in a new Trainer: the run and the
    resumed run (momentum state read back onto the device) have CPU's losses bit for bit."""
    base = module_class(L)

    class Momentum(base):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def run(accelerator, ckpt=None):
        module, where = Momentum(), tmp_path / accelerator / ("resumed" if ckpt else "full")
        save = L.callbacks.ModelCheckpoint(dirpath=where, every_n_train_steps=3, save_top_k=-1)
        trainer = L.Trainer(accelerator=accelerator, devices=1, max_steps=6,
                            callbacks=[save], **dict(QUIET, enable_checkpointing=True))
        trainer.fit(module, data(), ckpt_path=ckpt)
        return module, where / "epoch=0-step=3.ckpt"

    with ae.adaptive(False):
        cpu, cpu_ckpt = run("cpu")
        cpu_resumed, _ = run("cpu", cpu_ckpt)
    dev, dev_ckpt = run("neuron")
    dev_resumed, _ = run("neuron", dev_ckpt)
    assert dev.losses == cpu.losses and dev_resumed.losses == cpu_resumed.losses
    assert len(dev_resumed.losses) == 3 and dev_resumed.devices == {"neuron:0"}
    assert ae.metrics().cpu_fallbacks == {}


def test_an_error_in_a_step_is_the_error_raised(mode):
    """Note [Lightning's teardown]: an exception in `training_step` (after the forward) reached
    the user as "_apply(): Couldn't swap ...": Trainer's teardown moved the module to the CPU
    while the exception's traceback still held the step's graph. Now the user's error is
    raised, with a warning, and the module stays whole on neuron; a later fit trains on."""
    base = module_class(L)

    class Failing(base):
        def training_step(self, batch, i):
            loss = super().training_step(batch, i)
            if i == 1:
                raise ValueError("a user's error")
            return loss

    module = Failing()
    trainer = L.Trainer(accelerator="neuron", devices=1, max_steps=3, **QUIET)
    with pytest.warns(UserWarning, match="could not move the model to the CPU"), \
            pytest.raises(ValueError, match="a user's error"):
        trainer.fit(module, data())
    assert {p.device.type for p in module.parameters()} == {"neuron"}
    module.training_step = super(Failing, module).training_step
    L.Trainer(accelerator="neuron", devices=1, max_steps=2, **QUIET).fit(module, data())
    assert {p.device.type for p in module.parameters()} == {"cpu"}  # Lightning's teardown


def test_batch_size_finder_shrinks_on_a_neuron_oom():
    """Note [Lightning's OOM test]: `BatchSizeFinder` doubles the batch until an error its
    `is_oom_error` recognizes (CUDA's, the CPU allocator's); a neuron OOM ended the search (and
    the fit). On a device with 2 MiB free, the search stops below the largest batch, and the
    run after it has CPU's losses at the batch found."""
    import gc
    base = module_class(L)

    class Wide(base):
        def __init__(self, batch_size=2):
            super().__init__()
            torch.manual_seed(0)
            self.batch_size = batch_size
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 2048), torch.nn.ReLU(),
                                           torch.nn.Linear(2048, 4))

        def train_dataloader(self):
            return data(self.batch_size, n=256)

    def fit(accelerator, batch_size, finder=()):
        module = Wide(batch_size)
        L.Trainer(accelerator=accelerator, devices=1, max_steps=2, callbacks=list(finder),
                  **QUIET).fit(module)
        return module
    gc.collect()
    ae.set_device_spec(ae.DeviceSpec(hbm_bytes=torch.neuron.memory_allocated() + (2 << 20)))
    try:
        found = fit("neuron", 2, [L.callbacks.BatchSizeFinder(init_val=2, steps_per_trial=1)])
    finally:
        ae.set_device_spec(ae.DeviceSpec())
    assert 2 < found.batch_size < 256, found.batch_size
    with ae.adaptive(False):
        cpu = fit("cpu", found.batch_size)
    assert found.losses[-2:] == cpu.losses and found.devices == {"neuron:0"}

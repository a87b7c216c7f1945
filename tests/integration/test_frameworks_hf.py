"""Hugging Face Trainer, accelerate, PEFT and TRL treat `neuron` as a normal device (issue 24):
stock arguments, no env var, no neuron-specific line. Each test trains a tiny GPT-2 (random
weights, synthetic data, no network) for a few steps on the CPU (`use_cpu=True` /
`Accelerator(cpu=True)`), on neuron in eager mode and on neuron in adaptive mode, and compares
the losses: bit for bit where the run is the same program (dropout off: CPU and neuron draw
different masks), within bfloat16's tolerance under autocast (neuron's is CUDA's policy)."""
import contextlib
import os
import subprocess
import sys
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import adaptive_eager as ae  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from tests.harness.trainer_torchrun import VOCAB, Data, Losses  # noqa: E402  (shared with torchrun)

MODES = ["cpu", "eager", "adaptive"]


def _model(dropout=0.0, positions=16, **config):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=positions, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **config))


def _args(mode, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / mode), max_steps=5, logging_steps=1, report_to=[],
                per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True, seed=0)
    base.update(kw)
    if mode == "cpu":
        base["use_cpu"] = True
    cls = kw.pop("_cls", transformers.TrainingArguments)
    base.pop("_cls", None)
    return cls(**base)


def _scope(mode):
    return ae.adaptive() if mode == "adaptive" else contextlib.nullcontext()


def _train(mode, tmp_path, model=None, trainer_cls=None, resume=None, train_dataset=None,
           extra_callbacks=(), **kw):
    """Losses of a Trainer run; on neuron also checks the device and 0 CPU fallbacks."""
    rec = Losses()
    with _scope(mode):
        args = _args(mode, tmp_path, **kw)
        trainer = (trainer_cls or transformers.Trainer)(
            model=model if model is not None else _model(), args=args,
            train_dataset=train_dataset or Data(), callbacks=[rec, *extra_callbacks])
        ae.reset_metrics()
        trainer.train(resume_from_checkpoint=resume)
        fallbacks = ae.metrics().cpu_fallbacks
    if mode != "cpu":
        assert args.device.type == "neuron"
        assert next(trainer.model.parameters()).device.type == "neuron"
        assert fallbacks == {}, fallbacks
    else:
        assert args.device.type == "cpu"
    assert len(rec.losses) == args.max_steps - (resume is not None and 3 or 0)
    return rec.losses


def _same_everywhere(run):
    cpu, eager, lazy = (run(mode) for mode in MODES)
    assert eager == cpu and lazy == cpu, (cpu, eager, lazy)
    assert cpu[0] != cpu[-1]
    return cpu


def _close_everywhere(run):
    """Under bfloat16 autocast: neuron's policy is CUDA's (CPU's differs: `pow` runs in
    float32 on CUDA, in bfloat16 on CPU), so the losses agree within bfloat16's rounding;
    eager and adaptive bit for bit."""
    cpu, eager, lazy = (run(mode) for mode in MODES)
    assert eager == lazy
    torch.testing.assert_close(eager, cpu, rtol=2e-3, atol=0)
    return cpu


# -- detection --------------------------------------------------------------------------
def test_frameworks_pick_neuron_with_stock_arguments(tmp_path):
    import importlib.util
    assert importlib.util.find_spec("torch_neuronx").origin == "adaptive-eager"
    assert transformers.TrainingArguments(output_dir=str(tmp_path)).device == \
        torch.device("neuron:0")
    assert transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True).device == \
        torch.device("cpu")


def _python(code, env=None, path=()):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([*path, os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


_DETECT = ("import importlib.util, torch, transformers, accelerate; "
           "s = importlib.util.find_spec('torch_neuronx'); "
           "print(s and s.origin, transformers.TrainingArguments('o').device, "
           "accelerate.Accelerator().device)")


def test_off_switch_leaves_frameworks_on_the_cpu():
    """ADAPTIVE_EAGER_FRAMEWORKS=0: the import name is not answered, frameworks pick the CPU
    (the device itself still works)."""
    assert _python(_DETECT, {"ADAPTIVE_EAGER_FRAMEWORKS": "0"}) == ["None", "cpu", "cpu"]


def test_a_real_torch_neuronx_is_found_first(tmp_path):
    """The finder answers only when no real package is found: one on the path wins."""
    pkg = tmp_path / "torch_neuronx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    code = "import torch, torch_neuronx; print(getattr(torch_neuronx, 'REAL', False))"
    assert _python(code, path=[str(tmp_path)]) == ["True"]
    import torch_neuronx  # here, none on the path: ours
    assert torch_neuronx.SIMULATED and torch_neuronx.Stream is torch.neuron.Stream


# -- Trainer ----------------------------------------------------------------------------
def test_trainer_with_stock_arguments_matches_cpu(tmp_path):
    """Default arguments: Trainer's default optimizer is `adamw_torch_fused` (a device op,
    no CPU fallback)."""
    assert _args("eager", tmp_path).optim == "adamw_torch_fused"
    _same_everywhere(lambda mode: _train(mode, tmp_path))


def test_trainer_bf16_engages_autocast(tmp_path):
    """`bf16=True` raised "Your setup doesn't support bf16/gpu" (no
    torch.neuron.is_bf16_supported)."""
    dtypes = []

    def model():
        m = _model()
        m.lm_head.register_forward_hook(lambda mod, i, out: dtypes.append(out.dtype))
        return m
    _close_everywhere(lambda mode: _train(mode, tmp_path, model=model(), bf16=True))
    assert set(dtypes) == {torch.bfloat16}  # autocast engaged, on CPU and on neuron


@pytest.mark.timeout(300)
def test_gradient_accumulation_and_checkpointing_match_cpu(tmp_path):
    _same_everywhere(lambda mode: _train(mode, tmp_path, gradient_accumulation_steps=2,
                                         gradient_checkpointing=True))


def _resume(mode, tmp_path, trainer_cls=None, dropout=0.0):
    """5 steps straight (a checkpoint at step 3), then a new Trainer resumed from it."""
    kw = dict(save_strategy="steps", save_steps=3)
    full = _train(mode, tmp_path, model=_model(dropout), trainer_cls=trainer_cls, **kw)
    ckpt = str(tmp_path / mode / "checkpoint-3")
    rest = _train(mode, tmp_path, model=_model(dropout), trainer_cls=trainer_cls,
                  resume=ckpt, **kw)
    return full, full[:3] + rest


@pytest.mark.timeout(300)
def test_checkpoint_and_resume_match_cpu(tmp_path):
    def run(mode):
        full, resumed = _resume(mode, tmp_path / mode)
        assert resumed == full
        return full
    _same_everywhere(run)


@pytest.mark.timeout(300)
def test_resume_with_dropout_is_the_uninterrupted_run(tmp_path):
    """Note [Trainer's RNG state]: with dropout, a stock Trainer resumed from a checkpoint
    draws the masks the uninterrupted run drew (Trainer saves CPU's generator and, through our
    wrapper, the device's: without it the resumed losses differ), in both modes."""
    for mode in ("eager", "adaptive"):
        full, resumed = _resume(mode, tmp_path / mode, dropout=0.1)
        assert resumed == full, mode
        assert os.path.isfile(tmp_path / mode / mode / "checkpoint-3" / "neuron_rng_state.pth")


@pytest.mark.timeout(300)
def test_auto_find_batch_size_shrinks_the_batch_on_a_neuron_oom(tmp_path):
    """Note [Out-of-memory wording]: `Trainer(auto_find_batch_size=True)` retries with a smaller
    batch when accelerate's `should_reduce_batch_size` recognizes the error by its message
    (" out of memory."). Neuron's read "out of memory: tried to", so the first OOM ended the
    run. On a device with 1 MiB free (a batch of 64 needs 1.3 MB), the batch shrinks until it
    fits, and the run then has the losses of a CPU run at that batch size, in eager and
    adaptive mode."""
    import gc
    from accelerate.utils.memory import should_reduce_batch_size

    class Sizes(transformers.TrainerCallback):
        def __init__(self):
            self.sizes = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.sizes.append(state.train_batch_size)
    got = {}
    for mode in ("eager", "adaptive"):
        gc.collect()
        ae.set_device_spec(ae.DeviceSpec(hbm_bytes=torch.neuron.memory_allocated() + (1 << 20)))
        sizes = Sizes()
        try:
            with pytest.raises(torch.OutOfMemoryError) as oom:
                torch.empty(1 << 20, device="neuron")
            assert should_reduce_batch_size(oom.value)
            del oom
            got[mode] = _train(mode, tmp_path, model=_model(positions=8), max_steps=2,
                               per_device_train_batch_size=64, auto_find_batch_size=True,
                               train_dataset=Data(n=64), extra_callbacks=[sizes])
        finally:
            ae.set_device_spec(ae.DeviceSpec())
        assert sizes.sizes[0] == 64 and sizes.sizes[-1] < 64, sizes.sizes  # retried, smaller
        got[mode] = got[mode], sizes.sizes[-1]
    assert got["eager"] == got["adaptive"]
    losses, size = got["eager"]
    assert losses == _train("cpu", tmp_path, model=_model(positions=8), max_steps=2,
                            per_device_train_batch_size=size, train_dataset=Data(n=64))


def test_model_moved_by_hand_then_trained_by_a_default_trainer(tmp_path):
    """The issue's case: a tied GPT-2 moved to neuron by hand and given to a stock Trainer.
    Trainer used to move it back with .to("cpu"), which untied lm_head from wte."""
    def run(mode):
        m = _model()
        if mode != "cpu":
            m.to("neuron")
        losses = _train(mode, tmp_path, model=m)
        assert m.lm_head.weight is m.transformer.wte.weight
        return losses
    _same_everywhere(run)


# -- fp16 -----------------------------------------------------------------------------------
class _Fp16Run:
    """What a run did at each step: the model's inputs, the logits' dtype and device (F.linear
    under autocast), the scale after the step; the backward of step `INF_AT` makes every
    gradient before the MLP's infinite. Module hooks: they stay with the module on its way to
    the device."""
    STEPS, LR, INF_AT = 5, 1e-2, 2

    def __init__(self):
        self.inputs, self.logits, self.scales, self.backwards = [], [], [], 0
        # `gelu`: GPT-2's default `gelu_new` calls `pow`, which CUDA's autocast (so neuron's)
        # runs in float32 and CPU's in float16; with `gelu` every op of the step takes the same
        # dtype under both (checked op by op), so the two runs can be equal bit for bit.
        self.model = _model(activation_function="gelu")
        self.model.register_forward_pre_hook(self._input, with_kwargs=True)
        self.model.lm_head.register_forward_hook(
            lambda mod, args, out: self.logits.append((out.dtype, out.device.type)))
        self.model.transformer.h[0].mlp.register_full_backward_pre_hook(self._poison)

    def _input(self, module, args, kwargs):
        self.inputs.append({k: v.cpu() for k, v in kwargs.items()})

    def _poison(self, module, grad_output):
        self.backwards += 1
        if self.backwards == self.INF_AT + 1:
            return tuple(g * float("inf") for g in grad_output)

    def by_hand_on_cpu(self, inputs):
        """Trainer's steps written out, on the CPU: its default optimizer (fused AdamW, no
        weight decay), linear schedule, max_grad_norm=1, accelerate's float16 autocast around
        the forward and a GradScaler. The schedule advances at the skipped step too, on a GPU
        as well: accelerate counts a step skipped only when GradScaler does not call
        `optimizer.step`, and a fused optimizer's is called with `found_inf` (it skips)."""
        model, n = self.model, self.STEPS
        opt = torch.optim.AdamW(model.parameters(), lr=self.LR, weight_decay=0.0, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (n - s) / n))
        scaler = torch.amp.GradScaler("cpu")
        losses = []
        for kwargs in inputs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**kwargs).loss
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            model.zero_grad()
            losses.append(loss.item())
            self.scales.append(scaler.get_scale())
        return losses


def _accelerate_with_fp16():
    accelerate = pytest.importorskip("accelerate")
    from packaging.version import Version
    if Version(accelerate.__version__) < Version("1.16"):
        pytest.skip("accelerate < 1.16 refuses fp16 on devices outside its own list "
                    "(adaptive_eager/LIMITS.md)")
    return accelerate


@pytest.mark.timeout(300)
def test_trainer_fp16_trains_as_on_a_gpu_with_cpus_values(tmp_path):
    """`Trainer(fp16=True)` raised accelerate's "fp16 mixed precision requires a device in
    (...)" (accelerate 1.15 listed devices by name). accelerate 1.16 asks torch instead
    (`torch.amp.is_autocast_available`, `torch.neuron.get_amp_supported_dtype()`), takes the
    accelerator's `torch.amp.GradScaler("neuron")` and autocasts the forward on neuron in
    float16. Five steps, one with infinite gradients (skipped, the scale halved), equal the
    same steps by hand on the CPU (CPU's float16 autocast and GradScaler) bit for bit: losses,
    scales and parameters, in eager and adaptive mode."""
    _accelerate_with_fp16()
    runs = {}
    for mode in ("eager", "adaptive"):
        run, rec = _Fp16Run(), Losses()

        class Scales(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                run.scales.append(trainer.accelerator.scaler.get_scale())
        with _scope(mode), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "float64 is not supported")  # GradScaler's unscale_
            args = _args(mode, tmp_path, fp16=True, learning_rate=run.LR, max_steps=run.STEPS)
            trainer = transformers.Trainer(model=run.model, args=args, train_dataset=Data(),
                                           callbacks=[rec, Scales()])
            assert args.device.type == "neuron"
            assert trainer.accelerator.scaler._device == "neuron"
            ae.reset_metrics()
            trainer.train()
            assert ae.metrics().cpu_fallbacks == {}
        assert set(run.logits) == {(torch.float16, "neuron")}  # autocast engaged, on neuron
        runs[mode] = run, rec.losses
    run, losses = runs["eager"]
    hand = _Fp16Run()
    with ae.adaptive(False):
        hand_losses = hand.by_hand_on_cpu(run.inputs)
    assert set(hand.logits) == {(torch.float16, "cpu")}
    assert run.scales == hand.scales == [2.0 ** 16] * 2 + [2.0 ** 15] * 3
    assert losses == hand_losses and losses[0] != losses[-1]
    for p, q in zip(run.model.parameters(), hand.model.parameters()):
        assert torch.equal(p.cpu(), q), (p, q)
    lazy, lazy_losses = runs["adaptive"]
    assert lazy_losses == losses and lazy.scales == run.scales
    assert all(torch.equal(p.cpu(), q) for p, q in zip(lazy.model.parameters(),
                                                       hand.model.parameters()))


# -- Trainer under torchrun (issue 25) --------------------------------------------------------
@pytest.mark.skipif(not ae.native_hooks(), reason="the native hooks are off: DDP's "
                    "find_unused_parameters (Trainer's default) needs their pinned allocator")
def test_trainer_under_torchrun_matches_one_cpu_process(tmp_path):
    """A stock Trainer under `torchrun --nproc-per-node 2` (tests/harness/trainer_torchrun.py):
    each rank on neuron:LOCAL_RANK, DDP with Trainer's find_unused_parameters=True; losses and
    parameters equal one CPU process on the global batch, in eager and adaptive mode. Rank 1
    put its model on neuron:0 and DDP its batches on neuron:1 ("Expected all tensors to be on
    the same device") until the neuron process group made core LOCAL_RANK current (Note [The
    neuron backend] in integration/distributed.py)."""
    import json
    from tests.harness import trainer_torchrun as T
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(root, "tests", "harness", "trainer_torchrun.py"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, "\n".join(
        line for line in proc.stderr.splitlines() if "Error" in line)[-3000:]
    ref = T.train("cpu", str(tmp_path / "cpu"), 2 * T.PER_RANK, use_cpu=True)
    assert len(ref["losses"]) == T.STEPS and ref["losses"][0] != ref["losses"][-1]
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}.json").read_text())
        for mode in ("eager", "adaptive"):
            run = got[mode]
            assert run["args_device"] == f"neuron:{rank}" and run["current_device"] == rank
            assert run["param_devices"] == [f"neuron:{rank}"]
            assert run["wrapper"] == "DistributedDataParallel" and run["find_unused_parameters"]
            assert run["cpu_fallbacks"] == {}
            torch.testing.assert_close(run["losses"], ref["losses"])
            for p, q in zip(run["params"], ref["params"]):
                torch.testing.assert_close(torch.tensor(p), torch.tensor(q))


# -- .cpu() of a tied model -------------------------------------------------------------
def test_tied_gpt2_round_trip_keeps_the_tie_and_the_optimizer():
    """neuron -> cpu -> neuron: lm_head stays wte (one Parameter object), the optimizer built
    before the first move keeps training it, losses equal CPU's."""
    batch = Data()[0]
    batch = {k: v[None] for k, v in batch.items()}

    def run(device, mode):
        m = _model()
        params = list(m.parameters())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        with _scope(mode):
            for step in range(5):
                m.to(device if step != 2 else "cpu")  # step 2 runs on the CPU
                where = next(m.parameters()).device
                loss = m(**{k: v.to(where) for k, v in batch.items()}).loss
                loss.backward()
                if step != 2:  # the state lives where it was made: step on the device
                    opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        assert m.lm_head.weight is m.transformer.wte.weight
        assert list(m.parameters()) == params
        return losses
    cpu = run("cpu", "eager")
    assert run("neuron", "eager") == cpu
    assert run("neuron", "adaptive") == cpu


# -- accelerate -------------------------------------------------------------------------
def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_accelerator_prepare_trains_on_neuron_as_on_cpu():
    accelerate = pytest.importorskip("accelerate")

    def run(mode):
        _reset_accelerate()
        with _scope(mode):
            acc = accelerate.Accelerator(cpu=mode == "cpu")
            assert acc.device.type == ("cpu" if mode == "cpu" else "neuron")
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loader = torch.utils.data.DataLoader(Data(), batch_size=2)
            model, opt, loader = acc.prepare(model, opt, loader)
            ae.reset_metrics()
            losses = []
            for step, batch in zip(range(5), loader):
                loss = model(**batch).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            assert ae.metrics().cpu_fallbacks == {}
        _reset_accelerate()
        return losses
    _same_everywhere(run)


def test_accelerator_fp16_autocasts_and_scales_on_neuron():
    """`Accelerator(mixed_precision="fp16")` by itself: the device, the scaler and the
    autocast are neuron's (the Trainer test above compares the values with the CPU's)."""
    accelerate = _accelerate_with_fp16()
    _reset_accelerate()
    try:
        acc = accelerate.Accelerator(mixed_precision="fp16")
        assert acc.device.type == "neuron" and acc.native_amp
        assert isinstance(acc.scaler, torch.amp.GradScaler) and acc.scaler._device == "neuron"
        model = acc.prepare(torch.nn.Linear(4, 4))
        out = model(torch.ones(2, 4, device="neuron"))  # prepare wrapped forward in autocast
        assert out.dtype == torch.float32  # and its outputs in convert_outputs_to_fp32
        with acc.autocast():
            assert (torch.ones(2, 4, device="neuron") @ torch.ones(4, 4, device="neuron")).dtype \
                == torch.float16
    finally:
        _reset_accelerate()


# -- PEFT -------------------------------------------------------------------------------
def test_peft_lora_through_trainer_matches_cpu(tmp_path):
    peft = pytest.importorskip("peft")

    def run(mode):
        torch.manual_seed(0)
        m = peft.get_peft_model(_model(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
            task_type="CAUSAL_LM"))
        return _train(mode, tmp_path, model=m, learning_rate=1e-2)
    _same_everywhere(run)


# -- TRL --------------------------------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>", unk_token="<unk>")


@pytest.mark.timeout(300)
def test_trl_sft_trainer_matches_cpu(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(2)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (7,), generator=g))
             for _ in range(12)]
    data = datasets.Dataset.from_dict({"text": texts})

    def run(mode):
        rec = Losses()
        with _scope(mode):
            # TRL's default on neuron (`pad_to_multiple_of="auto"`) pads batches to 128 tokens
            # (one compile per shape): the CPU run is given the same padding
            args = _args(mode, tmp_path, _cls=trl.SFTConfig, max_length=16,
                         gradient_checkpointing=False,
                         **({"pad_to_multiple_of": 128} if mode == "cpu" else {}))
            assert args.pad_to_multiple_of == 128
            trainer = trl.SFTTrainer(model=_model(positions=128), args=args, train_dataset=data,
                                     processing_class=_tokenizer(), callbacks=[rec])
            ae.reset_metrics()
            trainer.train()
            fallbacks = ae.metrics().cpu_fallbacks
        assert args.device.type == ("cpu" if mode == "cpu" else "neuron")
        assert args.bf16  # TRL's default: bfloat16 autocast (it raised on neuron before)
        assert mode == "cpu" or fallbacks == {}, fallbacks
        return rec.losses
    _close_everywhere(run)


def test_accelerator_save_and_load_state_keep_the_device_rng(tmp_path):
    """accelerate's own checkpoints (`save_state` / `load_state`) carry neuron's RNG state
    (it asks `torch.accelerator`): the draws after a load are those after the save."""
    from accelerate import Accelerator
    acc = Accelerator()
    assert acc.device.type == "neuron"
    torch.neuron.manual_seed(3)
    acc.save_state(str(tmp_path / "state"))
    after_save = torch.rand(4, device=acc.device).cpu()
    acc.load_state(str(tmp_path / "state"))
    assert torch.equal(torch.rand(4, device=acc.device).cpu(), after_save)

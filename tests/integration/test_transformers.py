"""Hugging Face Transformers models port with `.to("neuron")` alone: tiny configs, random
init, no network. Training matches CPU's bit for bit in eager and adaptive modes, greedy
generation gives CPU's tokens, and save_pretrained / from_pretrained round trips."""
import contextlib

import pytest
import torch

import adaptive_eager as ae

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 64


def _model(kind):
    """Two layers, hidden size 32, dropout off (CPU and neuron draw different masks)."""
    torch.manual_seed(0)
    t = transformers
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32))
    if kind == "bert":
        return t.BertForMaskedLM(t.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    if kind == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(
            d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=VOCAB,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    raise AssertionError(kind)


def _batch(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 8), generator=g)
    labels = torch.randint(1, VOCAB, (2, 5), generator=g) if kind == "t5" else ids.clone()
    return {"input_ids": ids, "labels": labels}


def _train(kind, device, steps=3):
    model = _model(kind)
    n = len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before .to, as users do
    model.to(device)
    assert len(list(model.parameters())) == n  # ties survive .to
    batch = {k: v.to(device) for k, v in _batch(kind).items()}
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


KINDS = ["gpt2", "llama", "bert", "t5"]


@pytest.mark.parametrize("kind", KINDS)
def test_training_matches_cpu(kind):
    # Bit for bit since attention takes CPU's kernel (attention.py): before, every one of
    # these models ended its third step a few ulps off CPU's weights.
    cpu, m_cpu = _train(kind, "cpu")
    eager, m_eager = _train(kind, "neuron")
    assert eager == cpu
    for (name, p), q in zip(m_cpu.named_parameters(), m_eager.parameters()):
        assert torch.equal(p, q.cpu()), name
    assert cpu[0] != cpu[2]  # AdamW did move the weights
    for strategy in ("graph", "matmul"):
        with ae.adaptive(strategy=strategy):
            lazy, m_lazy = _train(kind, "neuron")
        assert lazy == eager, f"adaptive {strategy} differs from eager"  # bit for bit
        for (name, p), q in zip(m_eager.named_parameters(), m_lazy.parameters()):
            assert torch.equal(p.cpu(), q.cpu()), name


def _moe_train(device):
    """A tiny Mixtral, 2 AdamW steps: Transformers runs its experts through `_grouped_mm`."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        experts_implementation="grouped_mm")).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v.to(device) for k, v in _batch("llama").items()}
    losses = []
    for _ in range(2):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_moe_experts_train_on_the_device_as_cpu():
    """Mixtral, Qwen-MoE and the other MoE models of Transformers 5 run their experts through
    `torch._grouped_mm`, which fell back to the CPU at every expert layer (4 calls forward
    and backward each). Now CPU's kernel on the device: losses (with the router's aux loss)
    and weights bit for bit, no fallback, in eager and adaptive mode."""
    cpu = _moe_train("cpu")
    for ctx in (contextlib.nullcontext(), ae.adaptive()):
        ae.reset_metrics()
        with ctx:
            got = _moe_train("neuron")
        assert ae.metrics().cpu_fallbacks == {}
        assert got[0] == cpu[0] and cpu[0][0] != cpu[0][1]
        assert all(torch.equal(p, q) for p, q in zip(got[1], cpu[1]))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["eager", "graph", "matmul"])
def test_greedy_generate_gives_cpu_tokens(kind, mode):
    model = _model(kind).eval()
    prompt = torch.tensor([[5, 17, 3, 42]])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cpu = model.generate(prompt, **kw)
    model.to("neuron")
    ctx = contextlib.nullcontext() if mode == "eager" else ae.adaptive(strategy=mode)
    with ctx:
        out = model.generate(prompt.to("neuron"), **kw)
    assert out.device.type == "neuron"
    assert out.cpu().tolist() == cpu.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_from_pretrained_round_trip(kind, tmp_path):
    _, model = _train(kind, "neuron", steps=1)
    model.save_pretrained(tmp_path)  # safetensors, tied weights stored once
    loaded = type(model).from_pretrained(tmp_path)
    assert len(list(loaded.parameters())) == len(list(model.parameters()))
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, expected[k]), k
    loaded.to("neuron")
    batch = {k: v.to("neuron") for k, v in _batch(kind).items()}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).loss.cpu(), model(**batch).loss.cpu(),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("device_map", ["neuron", {"": "neuron:0"}, "auto"])
def test_from_pretrained_with_device_map_loads_onto_neuron(device_map, tmp_path):
    """`from_pretrained(path, device_map=...)` (accelerate's loading, straight onto the
    device): every weight on neuron with the saved values, ties kept, CPU's loss and
    tokens. "auto" (accelerate >= 1.16 asks `torch.accelerator`) spreads the layers over
    the cores, as over GPUs, and its hooks move the activations between them."""
    model = _model("gpt2").eval()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, device_map=device_map)
    cores = {p.device for p in loaded.parameters()}
    assert {d.type for d in cores} == {"neuron"} and (len(cores) > 1) == (device_map == "auto")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for k, v in loaded.state_dict().items():
        assert torch.equal(v.cpu(), model.state_dict()[k]), k
    batch = _batch("gpt2")
    with torch.no_grad():
        want = model(**batch).loss
        got = loaded(**{k: v.to("neuron") for k, v in batch.items()}).loss
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    prompt = batch["input_ids"][:1]
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert loaded.generate(prompt.to("neuron"), **kw).cpu().tolist() == \
        model.generate(prompt, **kw).tolist()


@pytest.mark.parametrize("how", ["device_map", "cpu_offload", "disk_offload"])
def test_weights_offloaded_to_the_cpu_run_on_neuron(how, tmp_path):
    """accelerate's offloading (a `device_map` naming "cpu" beside the device, `cpu_offload`,
    `disk_offload`): each offloaded layer's weights come onto neuron for its forward and go
    back to meta after, through `type(p)(data, requires_grad=...)`, which raised a TypeError
    (a neuron Parameter's type is NeuronTensor: Note [type(p) of a neuron Parameter]); so did
    `init_empty_weights()` under `torch.device("neuron")`. Logits and greedy tokens are
    CPU's."""
    accelerate = pytest.importorskip("accelerate")
    model = _model("llama").eval()
    batch = _batch("llama")["input_ids"]
    with torch.no_grad():
        want = model(batch).logits
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want_tokens = model.generate(batch[:, :4], **kw)
    if how == "device_map":
        model.save_pretrained(tmp_path)
        model = type(model).from_pretrained(tmp_path, device_map={
            "model.embed_tokens": "neuron:0", "model.layers.0": "cpu", "model.layers.1": "cpu",
            "model.norm": "neuron:0", "model.rotary_emb": "neuron:0", "lm_head": "neuron:0"})
    else:
        offload = getattr(accelerate, how)
        offload(model, *([tmp_path] if how == "disk_offload" else []), execution_device="neuron:0")
    ae.reset_metrics()
    x = batch.to("neuron")
    with torch.no_grad():
        got = model(x).logits
    assert got.device.type == "neuron" and torch.equal(got.cpu(), want)
    assert model.generate(x[:, :4], **kw).cpu().tolist() == want_tokens.tolist()
    assert ae.metrics().cpu_fallbacks == {}
    w = model.lm_head.weight if how == "device_map" else torch.ones(2, device="neuron")
    p = type(w)(w.detach() * 2, requires_grad=False)  # the call form, as nn.Parameter's
    assert isinstance(p, torch.nn.Parameter) and not p.requires_grad and p.device == w.device
    assert type(w)(torch.ones(2, device="meta")).requires_grad  # Parameter's default
    with torch.device("neuron"), accelerate.init_empty_weights():  # the old __dict__ passed
        assert torch.nn.Linear(2, 2).weight.device.type == "meta"  # as keywords too


def test_sharded_save_and_hub_shared_tensor_check_see_neuron_storages(tmp_path):
    """huggingface_hub identifies storages through the traceable-subclass protocol, where a
    neuron tensor has no inner tensors: every neuron tensor looked like one empty storage, so
    `max_shard_size` wrote one file and `save_torch_model` refused a tied model."""
    from huggingface_hub import save_torch_model
    files = {}
    for dev in ("cpu", "neuron"):
        model = _model("gpt2").to(dev)
        model.save_pretrained(tmp_path / dev, max_shard_size="20KB")
        files[dev] = sorted(p.name for p in (tmp_path / dev).iterdir())
        (tmp_path / f"hub-{dev}").mkdir()
        save_torch_model(model, tmp_path / f"hub-{dev}")  # tied wte / lm_head stored once
    assert files["neuron"] == files["cpu"] and len(files["cpu"]) > 3


def test_gradient_checkpointing_with_dropout_gives_cpus_gradients():
    """model.gradient_checkpointing_enable(), dropout on: the recomputed forward draws the
    forward's masks again (the device RNG state is saved), so the gradients equal CPU's for
    the same checkpointed step, bit for bit. (CPU's own gradients with and without
    checkpointing differ by an ulp in transformers 5.24, so each is compared with CPU's.)"""
    t = transformers
    grads = {}
    for dev in ("cpu", "neuron"):
        for ckpt in (False, True):
            torch.manual_seed(0)
            model = t.GPT2LMHeadModel(t.GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)).to(dev)
            model.train()
            if ckpt:
                model.gradient_checkpointing_enable()
            batch = {k: v.to(dev) for k, v in _batch("gpt2").items()}
            torch.manual_seed(1)
            model(**batch).loss.backward()
            grads[dev, ckpt] = [p.grad.cpu() for p in model.parameters()]
    for ckpt in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(grads["cpu", ckpt], grads["neuron", ckpt]))

"""A stock Hugging Face Trainer under `torchrun --nproc-per-node 2` on neuron (issue 25).
tests/integration/test_frameworks_hf.py runs it with the repository on PYTHONPATH and compares
it with one CPU process on the global batch (`train(..., use_cpu=True)` from this module).
Each rank trains a tiny GPT-2 (random weights, no network) in eager mode, then in adaptive
mode, and writes `<prefix>.<rank>.json`. argv: the output file prefix."""
import contextlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import adaptive_eager as ae  # noqa: E402

VOCAB = 32
STEPS = 3
PER_RANK = 2  # the batch of each rank; one CPU process takes 2 * PER_RANK


def model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class Data(torch.utils.data.Dataset):
    def __init__(self, n=12, length=8):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])  # Trainer's mean over the ranks


def train(mode, out_dir, batch, use_cpu=False):
    """One stock Trainer run: its logged losses, final parameters and where it ran."""
    rec = Losses()
    with ae.adaptive() if mode == "adaptive" else contextlib.nullcontext():
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out_dir, mode), max_steps=STEPS, logging_steps=1,
            report_to=[], per_device_train_batch_size=batch, save_strategy="no",
            disable_tqdm=True, seed=0, use_cpu=use_cpu)
        trainer = transformers.Trainer(model=model(), args=args, train_dataset=Data(),
                                       callbacks=[rec])
        before = ae.metrics()
        trainer.train()
        fallbacks = (ae.metrics() - before).cpu_fallbacks
    wrapped = trainer.model_wrapped
    return {"losses": rec.losses,
            "params": [p.detach().cpu().tolist() for p in trainer.model.parameters()],
            "args_device": str(args.device),
            "param_devices": sorted({str(p.device) for p in trainer.model.parameters()}),
            "wrapper": type(wrapped).__name__,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
            "current_device": torch.neuron.current_device(),
            "cpu_fallbacks": fallbacks}


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    prefix = sys.argv[1]
    got = {mode: train(mode, os.path.dirname(prefix), PER_RANK) for mode in ("eager", "adaptive")}
    with open(f"{prefix}.{os.environ['RANK']}.json", "w") as f:
        json.dump(got, f)

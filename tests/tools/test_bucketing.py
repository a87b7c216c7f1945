"""Issue 28: the padding helpers (adaptive_eager/tools/bucketing.py) and the time to steady
state (Note [Time to steady state] in adaptive_eager/tools/steps.py)."""
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.tools import bucketing, steps


def test_pad_to_bucket_pads_the_end_of_one_dim():
    x = torch.arange(6.).view(2, 3)
    y = ae.pad_to_bucket(x, 1, multiple=4, value=-1)
    assert y.shape == (2, 4) and torch.equal(y[:, :3], x) and (y[:, 3] == -1).all()
    assert ae.pad_to_bucket(x, 0, buckets=[1, 4, 8]).shape == (4, 3)
    assert ae.pad_to_bucket(x, -1, buckets="power of two").shape == (2, 4)
    assert ae.pad_to_bucket(x, 1, multiple=3) is x  # already a bucket's size
    xn = x.to("neuron")  # on the device too, same values
    assert torch.equal(ae.pad_to_bucket(xn, 1, multiple=8, value=2.5).cpu(),
                       ae.pad_to_bucket(x, 1, multiple=8, value=2.5))
    with pytest.raises(ValueError, match="larger than every bucket"):
        ae.pad_to_bucket(x, 1, buckets=[2])
    with pytest.raises(ValueError, match="one of multiple= or buckets="):
        ae.pad_to_bucket(x, 1)
    assert [bucketing.bucket_size(n, buckets="power of two") for n in (1, 5, 8, 9)] == \
        [1, 8, 8, 16]


def test_bucketing_collate_pads_every_tensor_of_a_batch():
    def collate(seqs):  # pads to the longest, as DataCollatorWithPadding
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        return {"input_ids": ids, "labels": ids.clone(), "n": torch.tensor([len(seqs)])}
    c = ae.bucketing_collate(collate, dim=1, multiple=16, values={"labels": -100})
    seqs = [torch.arange(1, 6), torch.arange(1, 20)]
    b = c(seqs)
    assert b["input_ids"].shape == b["labels"].shape == (2, 32)
    assert (b["labels"][:, 19:] == -100).all() and (b["input_ids"][:, 19:] == 0).all()
    assert torch.equal(b["input_ids"][:, :19], collate(seqs)["input_ids"])
    assert b["n"].shape == (1,)  # no dim 1: left alone
    # a DataLoader with torch's default collate; tuples stay tuples
    data = [(torch.ones(3, 5), torch.tensor(1))] * 4
    loader = torch.utils.data.DataLoader(data, batch_size=2,
                                         collate_fn=ae.bucketing_collate(dim=2, multiple=8))
    x, y = next(iter(loader))
    assert x.shape == (2, 3, 8) and y.shape == (2,)
    with pytest.raises(ValueError):  # checked when wrapped, not at the first batch
        ae.bucketing_collate(collate, multiple=0)


def test_steady_state_summary():
    # (clock us, compiles, compile us) at the start and after each of 5 steps: steps 1 and
    # 3 compiled, then none
    start = (0.0, 0, 0.0)
    pts = [(1000.0, 4, 900.0), (1100.0, 4, 900.0), (2000.0, 6, 1700.0), (2100.0, 6, 1700.0),
           (2200.0, 6, 1700.0)]
    s = steps.summary(pts, start)
    assert s["steady_from"] == 4 and s["warm_ms"] == 2.0 and s["warm_compile_ms"] == 1.7
    assert s["warm_compiles"] == 6 and s["steady_step_ms"] == pytest.approx(0.1)
    assert "steady state from step 4 of 5: the first 3 steps took 2.0 ms modeled (1.7 ms " \
           "of it compiling, 6 compiles)" in steps.sentence(s)
    s = steps.summary(pts[:3], start)  # the last step compiled
    assert s["steady_from"] is None
    assert steps.sentence(s).startswith("compiles did not stop: step 3 of 3 still compiled")


@pytest.mark.parametrize("adaptive", [False, True])
def test_steady_state_of_a_training_loop_on_the_device(adaptive):
    """Lengths 8, 16, 8, 16, 8 on a fresh op sequence: steps 1 and 2 compile, then none
    (adaptive: each step's work compiles at the sync after its optimizer step)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).to("neuron")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with ae.override(disable_disk_cache=True), ae.adaptive(adaptive):
        steps.install()
        try:
            for n in (8, 16, 8, 16, 8):
                x = torch.randn(n, 4).to("neuron")
                lin(x).sinh().mean().backward()
                opt.step()
                opt.zero_grad()
                torch.neuron.synchronize()
            s = steps.summary()
        finally:
            steps.uninstall()
    assert s["steps"] == 5 and s["steady_from"] == 3, s
    assert s["warm_compiles"] > 0 and s["warm_ms"] > s["steady_step_ms"] > 0
    assert s["warm_compile_ms"] <= s["warm_ms"]

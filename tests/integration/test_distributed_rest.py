"""torch.distributed on neuron, the rest of the reference's list (issue 30): pipeline() stages,
fully_shard of a CPU-built module, async checkpoints of sharded state, SyncBatchNorm, FSDP1. Two
spawned ranks (gloo) run every scenario in eager and adaptive mode; each is compared with
one CPU process on the global batch."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.harness import dist_worker as W

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(tmp_path_factory.mktemp("dcp"))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(W.run_rest, args=(WORLD, port, path, results), nprocs=WORLD, join=True)
        out = dict(results)
    for r in range(WORLD):
        assert "error" not in out[r], f"rank {r} failed:\n{out[r]['error']}"
    return out


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("mode", W.REST_MODES)
def test_fully_shard_of_a_cpu_built_module(ranks, mode):
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        losses, params, devices = ranks[r][("fully_shard_cpu", mode)]
        assert devices == ["neuron"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        _close(params, ref_params)


@pytest.mark.parametrize("mode", W.REST_MODES)
def test_pipeline_build_stage(ranks, mode):
    """pipeline() + build_stage: stage 0 (Linear, ReLU) on rank 0, stage 1 on rank 1."""
    ref_losses, ref_params = W.cpu_losses()
    losses0, params0, devices0 = ranks[0][("pipeline", mode)]
    losses1, params1, devices1 = ranks[1][("pipeline", mode)]
    assert devices0 == devices1 == ["neuron"]
    torch.testing.assert_close(torch.tensor(losses1), torch.tensor(ref_losses))
    _close(params0 + params1, ref_params)


@pytest.mark.parametrize("mode", W.REST_MODES)
def test_async_save_and_load_of_sharded_state(ranks, mode):
    ref_params = [p.detach() for p in W.make_model().parameters()]  # what was saved
    for r in range(WORLD):
        _close(ranks[r][("async_checkpoint", mode)], ref_params)


@pytest.mark.parametrize("mode", W.REST_MODES)
def test_sync_batch_norm_matches_one_cpu_process(ranks, mode):
    ref_losses, ref_state = W.cpu_bn_losses()
    for r in range(WORLD):
        losses, state = ranks[r][("sync_batch_norm", mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        _close(state, ref_state)  # parameters, running mean and variance, batches seen


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("mode", W.REST_MODES)
def test_fsdp1_matches_one_cpu_process(ranks, mode, use_orig_params):
    """FullyShardedDataParallel, a unit per Linear, rank r on neuron:r (built on the CPU and
    moved by FSDP1 when use_orig_params=False): its post-backward hook frees the unsharded
    flat parameter after `record_stream` under no_dispatch (which had no neuron kernel)."""
    ref_losses, ref_params = W.cpu_losses()
    for r in range(WORLD):
        losses, params, freed = ranks[r][("fsdp1", use_orig_params, mode)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        _close(params, ref_params)
        assert freed  # the unsharded parameters were resharded (storage resized to 0)


@pytest.mark.parametrize("style", ["ddp_overlap", "fsdp2_overlap"])
@pytest.mark.parametrize("mode", W.REST_MODES)
def test_communication_hides_under_compute(ranks, style, mode):
    """Note [Overlap]: DDP's bucket all-reduces run while backward computes; FSDP2's
    prefetched all-gathers and its reduce-scatters too. With a host that costs nothing per
    op, only compute can hide them: the timeline shows it (a collective's span crosses a
    launch's or a copy's) and the metrics split the collectives' time into exposed and hidden;
    `ae.explain()` gives the step's own figures."""
    for r in range(WORLD):
        got = ranks[r][(style, mode)]
        assert got["collectives"] >= 4, got
        assert got["crossing"] > 0, got
        assert got["hidden_us"] > 0.3 * got["collective_us"], got
        assert got["exposed_us"] >= 0
        assert got["hidden_us"] + got["exposed_us"] == pytest.approx(got["collective_us"])
        step = got["explain"]  # ae.explain(): the same step's figures
        assert step["complete"] and step["collectives"] == got["collectives"], step
        assert step["collective_us"] == pytest.approx(got["collective_us"])
        assert step["exposed_us"] == pytest.approx(got["exposed_us"])


def test_no_cpu_fallback(ranks):
    for r in range(WORLD):
        assert ranks[r]["fallbacks"] == {}

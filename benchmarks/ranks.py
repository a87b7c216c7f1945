"""Running a multi-rank benchmark (dp_step.py, fsdp_tp_llama.py, pp_llama.py): the ranks as
spawned processes on one machine, rendezvous on a free local port, results gathered."""
from __future__ import annotations

import socket

import torch.multiprocessing as mp


def spawn(rank_fn, world: int, *args) -> dict:
    """Run `rank_fn(rank, world, port, *args, results)` in `world` processes and return what
    they put in `results` (a shared dict) as a plain dict."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_fn, args=(world, port, *args, results), nprocs=world, join=True)
        return dict(results)

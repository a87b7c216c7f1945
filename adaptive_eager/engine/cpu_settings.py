"""Note [CPU settings]: a queued op computes at its flush, with the host CPU's kernels, and
those read process settings at that moment: the float32 matmul precision (and the newer
`fp32_precision` API), oneDNN on or off and its deterministic / TF32 flags, deterministic
algorithms, the default dtype (an integer true division or `sqrt` of an integer tensor
computes in it), the intra-op thread count (how a reduction is split) and, per thread,
whether denormals flush to zero. On CPU and in eager mode an op computes under the settings of its
call, so the queue must too:
- a call that changes a process-wide setting first flushes every core's queue, under the old
  value; a call that changes nothing flushes nothing (Dynamo restores them after each trace);
- flush-to-zero is a flag of each thread's CPU (MXCSR's FTZ and DAZ bits) with no getter in
  torch: it is read by its effect (`thread_ftz`: half the least normal double comes out 0),
  and a queue holds the ops of one setting only (`Segment.ftz`): an op recorded under another
  flushes the queue first, and a flush runs under its queue's setting, whichever thread
  flushes. Read, not tracked from torch's setter: a new thread starts with its creator's flag
  (the OS copies it), so a thread that never set it may flush to zero (fuzzer seed 326: the
  noise thread, started while the main thread had it on, flushed the main thread's queued
  denormals under its inherited flag).
- the intra-op thread count is per thread too: a thread takes the process's count when it
  first runs a parallel op and keeps it, so after `torch.set_num_threads(n)` in one thread
  another may still split reductions its own way. Once any thread set it (`THREADS_SET`), a
  queue holds the ops of one count only (`Segment.threads`), as for flush-to-zero, and a
  flush runs under its queue's count (fuzzer seed 51653: `batch_norm`'s statistics, queued
  by the main thread and flushed by a noise thread, came out ulps off). Switching a thread's
  count sets the process's too (PyTorch has one setter): a thread started after such a
  flush takes the flushing thread's count, not the one last set.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch

from .. import patches

FTZ_USED = [False]  # whether any thread ever turned it on: until then ops skip the check
THREADS_SET = [False]  # whether any thread ever set the thread count: until then all agree
thread_count = torch._C.get_num_threads  # this thread's
_set_num_threads = torch._C.set_num_threads  # the unwrapped setter
_set_flush_denormal = torch._C.set_flush_denormal  # the unwrapped setter
_LEAST = sys.float_info.min  # the least normal double: half of it is subnormal


def thread_ftz() -> bool:
    """Whether this thread's CPU flushes denormals to zero now (its own setting, or the one
    it inherited from the thread that started it): a subnormal result comes out 0."""
    return _LEAST * 0.5 == 0.0


_SAME = contextlib.nullcontext()


def ftz(on: bool):
    """A context running its block with flush-to-zero `on` in this thread, then restoring
    the thread's own (per flush: nothing to make when they agree, the common case)."""
    return _SAME if not FTZ_USED[0] or on == thread_ftz() else \
        _Switched(thread_ftz, _set_flush_denormal, on)


def threads(n: int):
    """A context running its block with intra-op thread count `n` in this thread (0: its
    own), then restoring the thread's own (nothing to make when they agree)."""
    return _SAME if not THREADS_SET[0] or not n or n == thread_count() else \
        _Switched(thread_count, _set_num_threads, n)


class _Switched:
    """A thread's setting (`get`, `set`) switched to `value` inside the block."""

    def __init__(self, get, set, value):
        self.get, self.set, self.value = get, set, value

    def __enter__(self):
        self.before = self.get()
        self.set(self.value)

    def __exit__(self, *exc):
        self.set(self.before)


def _marking(flag: list, setter):
    """`setter`, raising `flag` first (before a flush it makes: that flush must see it)."""
    @functools.wraps(setter)
    def call(*args, **kwargs):
        flag[0] = True
        return setter(*args, **kwargs)
    return call


def install(flush_all) -> None:
    """Wrap the setters so that a change first runs `flush_all()` (idempotent)."""
    if patches.is_patched(torch._C, "_set_mkldnn_enabled"):
        return

    def flushing(getter, setter, key=lambda *a, **k: a[-1]):
        """`setter`, flushing first when the value it sets is not `getter`'s now."""
        @functools.wraps(setter)
        def call(*args, **kwargs):
            try:
                same = getter(*args[:-1]) == key(*args, **kwargs)
            except Exception:  # a getter that refuses (mixed precision APIs): assume a change
                same = False
            if not same:
                flush_all()
            return setter(*args, **kwargs)
        return call

    C = torch._C
    wrapped = {
        "_set_float32_matmul_precision": flushing(C._get_float32_matmul_precision,
                                                  C._set_float32_matmul_precision),
        "_set_fp32_precision_setter": flushing(C._get_fp32_precision_getter,
                                               C._set_fp32_precision_setter),
        "_set_mkldnn_enabled": flushing(C._get_mkldnn_enabled, C._set_mkldnn_enabled),
        "_set_mkldnn_deterministic": flushing(C._get_mkldnn_deterministic,
                                              C._set_mkldnn_deterministic),
        "_set_onednn_allow_tf32": flushing(C._get_onednn_allow_tf32, C._set_onednn_allow_tf32),
        "_set_deterministic_algorithms": flushing(
            lambda: (C._get_deterministic_algorithms(),
                     C._get_deterministic_algorithms_warn_only()),
            C._set_deterministic_algorithms,
            key=lambda mode, warn_only=False: (bool(mode), bool(warn_only))),
        "set_num_threads": _marking(THREADS_SET, flushing(C.get_num_threads,
                                                          C.set_num_threads)),
        "_set_default_dtype": flushing(C.get_default_dtype, C._set_default_dtype),
        "_set_default_tensor_type": flushing(C.get_default_dtype, C._set_default_tensor_type,
                                             key=lambda t: t.dtype),
    }
    for name, fn in wrapped.items():  # Note [CPU settings]: a change flushes first
        patches.patch(C, name, fn, rests_on=f"torch's Python setters calling torch._C.{name}")
    patches.patch(torch, "set_num_threads", wrapped["set_num_threads"],
                  rests_on="torch.set_num_threads is torch._C's")
    # the torch.backends properties (`torch.backends.mkldnn.enabled = False`) hold the setters
    # they were made with
    from torch.backends import ContextProp
    for cls in (type(torch.backends), type(torch.backends.mkldnn)):
        for name, prop in list(vars(cls).items()):
            if isinstance(prop, ContextProp):
                patches.patch(cls, name, ContextProp(prop.getter, flushing(
                    lambda *_, g=prop.getter: g(), prop.setter)),
                    rests_on="torch.backends.ContextProp (private) holding the setter it "
                             "was made with")

    def set_flush_denormal(mode: bool) -> bool:
        if mode:  # before the flag: a flush in between (a finalizer) must not skip the check
            FTZ_USED[0] = True
        return _set_flush_denormal(mode)
    set_flush_denormal.__doc__ = _set_flush_denormal.__doc__
    for owner in (C, torch):
        patches.patch(owner, "set_flush_denormal", set_flush_denormal,
                      rests_on="torch.set_flush_denormal re-exporting torch._C's: the "
                               "thread's flush-to-zero mode is read per segment")

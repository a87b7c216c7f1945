"""The pass rate of an OpInfo run, forward (tests/conformance/test_opinfo.py) or backward
(test_opinfo_grad.py): the summary line, and the issue's bar (99.5% of the ops tested, in
each mode, once at least 100 ops ran)."""
from __future__ import annotations

import time
from pathlib import Path

MODES = ("eager", "adaptive", "matmul")  # adaptive: graph strategy; matmul: the reference's
BAR = 0.995
BAR_MIN_OPS = 100  # a `-k` run of a few ops only prints


def summary(results: dict, title: str = "OpInfo") -> str:
    tested = [r for r in results.values() if r.skipped is None]
    n = len(tested)
    p = sum(r.passed("eager") for r in tested)
    q = sum(r.passed("adaptive") for r in tested)
    mm = sum(r.passed("matmul") for r in tested)
    pct = lambda k: (100.0 * k / n) if n else 0.0  # noqa: E731
    return (f"{title}: {n} ops tested, {p} pass in eager ({pct(p):.1f}%), "
            f"{q} pass in adaptive graph ({pct(q):.1f}%), {mm} in adaptive matmul "
            f"({pct(mm):.1f}%)")


def hold_bar(results: dict) -> None:
    """The issue's bar on a whole-file run (at least 100 ops tested): 99.5% in each mode."""
    tested = [r for r in results.values() if r.skipped is None]
    if len(tested) >= BAR_MIN_OPS:
        for mode in MODES:
            rate = sum(r.passed(mode) for r in tested) / len(tested)
            assert rate >= BAR, f"{mode}: {rate:.1%} of {len(tested)} ops pass (bar: 99.5%)"


def report(request, results: dict, title: str, t0: float) -> None:
    """The pass counts over what a module ran, printed (a module fixture's teardown)."""
    skipped = sum(r.skipped is not None for r in results.values())
    samples = sum(r.samples for r in results.values())
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n{summary(results, title)}; {skipped} skipped; {samples} "
                            f"samples; {time.perf_counter() - t0:.0f}s since import")


def report_and_hold(request, results: dict, title: str, t0: float) -> None:
    """A module fixture's teardown (after the module's last test, whatever order the tests
    ran in; a bar held by a test named to come last held only in file order): the summary
    printed, then the bar held (a miss is an error at that teardown)."""
    if not results:
        return
    report(request, results, title, t0)
    hold_bar(results)


def load_xfail(path: Path, modes=MODES) -> dict:
    """An expected-failure file (opinfo_xfail.txt and its kin): {(mode, id): reason}, from
    lines `mode:id  # reason` or `id  # reason` (every mode in `modes`)."""
    out = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        body, _, reason = line.partition("#")
        body = body.strip()
        if not body:
            continue
        mode, sep, name = body.partition(":")
        if sep and mode not in modes:
            raise ValueError(f"{path}:{n}: unknown mode {mode!r}")
        for m in ((mode,) if sep else modes):
            out[(m, (name if sep else body).strip())] = reason.strip()
    return out

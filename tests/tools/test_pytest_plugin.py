"""The pytest plugin (adaptive_eager/tools/pytest_entry.py, Note [Benchmark plugin]): a user's test file
using `neuron_benchmark`, run by pytest in a fresh folder with the plugin found through the
pytest11 entry point that pyproject.toml declares; `report` on its JSON; a pytest run not
using it imports no torch; and the per-round figures whatever rounds pytest-benchmark runs."""
import json
import os
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae

ROOT = Path(__file__).resolve().parents[2]

USER_TEST = '''
import torch


def train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_train_step(neuron_benchmark):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128)).to(neuron_benchmark.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 128, device=neuron_benchmark.device)
    neuron_benchmark(train_step, model, opt, x)
'''


def _user_folder(tmp_path: Path, test: str) -> dict:
    """A folder with only `test` in it, and the environment of a pytest run there in which
    the plugin comes through pyproject.toml's pytest11 entry point (as a pip install makes
    it: a distribution's entry_points.txt on the path), the package from this checkout."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    dist = tmp_path / "site" / "ae_plugin_probe-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ae-plugin-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in eps["pytest11"].items()))
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "test_user.py").write_text(test)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path / "site")]),
               TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"))
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "TORCH_NEURONX_ENABLE_CONCATENATION"):
        env.pop(var, None)
    return env


def _run(args, env, cwd, timeout=300):
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_a_users_test_records_launches_and_device_time_per_mode_and_report_compares(tmp_path):
    env = _user_folder(tmp_path, USER_TEST)
    user = tmp_path / "user"
    r = _run(["-m", "pytest", "--benchmark-json", "out.json", "--neuron-modes", "eager,graph"],
             env, user)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_train_step[eager]" in r.stdout and "test_train_step[graph]" in r.stdout
    bench = json.loads((user / "out.json").read_text())["benchmarks"]
    info = {b["extra_info"]["mode"]: b["extra_info"] for b in bench}
    assert sorted(info) == ["eager", "graph"]
    assert {b["group"] for b in bench} == {"test_train_step"}  # one table for both modes
    eager, graph = info["eager"], info["graph"]
    assert eager["device"] == graph["device"] == "neuron"
    assert eager["ops_per_step"] == graph["ops_per_step"] > 0
    assert 0 < graph["launches_per_step"] < eager["launches_per_step"]
    assert 0 < graph["device_us_per_step"] < eager["device_us_per_step"]
    assert eager["flushes_per_step"] == {"eager": eager["launches_per_step"]}
    for e in (eager, graph):
        assert e["warmup_compiles"] > 0 and e["compiles_per_step"] == 0
        assert e["cpu_fallbacks_per_step"] == {} and e["host_us_per_op"] > 0
        assert e["rounds"] >= 5  # pytest-benchmark's min_rounds, and its calibration's

    r = _run(["-m", "adaptive_eager", "report", "out.json", "--png", "out.png"], env, user)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split(" | ")[1]: line for line in r.stdout.splitlines()
            if line.startswith("| test_train_step |")}
    assert sorted(rows) == ["eager", "graph"]
    assert "| vs eager |" in r.stdout  # ratios to the run's first mode
    ratio = graph["launches_per_step"] / eager["launches_per_step"]
    assert f"| {graph['launches_per_step']:.1f} | {ratio:.2f}x |" in rows["graph"]
    assert f"| {eager['launches_per_step']:.1f} | 1.00x |" in rows["eager"]
    assert (user / "out.png").stat().st_size > 0


def test_a_pytest_run_not_using_the_fixture_imports_no_torch(tmp_path):
    env = _user_folder(tmp_path, '''
import os
import sys


def test_plain():
    assert "adaptive_eager.tools.pytest_entry" in sys.modules  # the plugin is loaded
    assert "torch" not in sys.modules and "adaptive_eager.api" not in sys.modules
    import torch  # a test importing torch: the API loads through torch's autoload only
    assert ("adaptive_eager.api" in sys.modules) == (os.environ.get(
        "TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1")
''')
    for autoload in ("1", "0"):  # with autoload off, torch's import leaves the device alone
        r = _run(["-m", "pytest", "-q"], dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload),
                 tmp_path / "user", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "1 passed" in r.stdout
    # a wrong mode is a usage error before collection, in PyTorch-free pytest words
    r = _run(["-m", "pytest", "-q", "--neuron-modes", "eager,gpu"], env, tmp_path / "user",
             timeout=120)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "--neuron-modes 'eager,gpu': unknown mode(s) gpu; choose from eager, graph" in r.stderr


def _fixture(disabled: bool):
    """pytest-benchmark's own fixture object, as its plugin makes it (tiny time budget)."""
    from pytest_benchmark.fixture import BenchmarkFixture
    log = types.SimpleNamespace(debug=lambda *a, **k: None, info=lambda *a, **k: None,
                                warning=lambda *a, **k: None)
    stats = []
    node = types.SimpleNamespace(name="t", _nodeid="t.py::t")
    return BenchmarkFixture(
        node, disable_gc=False, timer=types.SimpleNamespace(target=time.perf_counter),
        min_rounds=3, min_time=5e-6, max_time=0.05, warmup=False, warmup_iterations=0,
        calibration_precision=10, add_stats=stats.append, logger=log, warner=lambda *a: None,
        disabled=disabled, cprofile=False, cprofile_loops=None, cprofile_dump=None)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_figures_are_per_round_whatever_rounds_pytest_benchmark_runs(mode):
    """Benchmarks disabled (our pyproject's addopts: the function runs once), calibrated
    rounds, pedantic rounds and figures() without pytest-benchmark record the same
    deterministic figures per round: the rounds are counted where they run."""
    from adaptive_eager.tools.pytest_plugin import NeuronBenchmark, figures, mode_scope

    def make():
        torch.manual_seed(0)
        w = torch.randn(32, 32).to("neuron")
        return lambda x: torch.relu(x @ w + 1.0).sum(0) * 2.0

    x = torch.randn(16, 32).to("neuron")
    got = {}
    for how in ("disabled", "calibrated", "pedantic"):
        nb = NeuronBenchmark(_fixture(disabled=how == "disabled"), mode, group="g")
        with nb.scope():
            step = make()
            if how == "pedantic":
                nb.pedantic(step, args=(x,), rounds=4)
            else:
                out = nb(step, x)
                assert out.device.type == "neuron" and out.shape == (32,)
        got[how] = nb.extra_info
        assert nb.benchmark.group == "g" and nb.extra_info["mode"] == mode
    with mode_scope(mode) as device:
        got["figures"] = figures(make(), device, rounds=3, args=(x,))
    assert got["disabled"]["rounds"] == 1 and got["pedantic"]["rounds"] == 4
    assert got["calibrated"]["rounds"] >= 4  # calibration + 3 rounds + the result's call
    keys = ("ops_per_step", "launches_per_step", "flushes_per_step", "hbm_bytes_per_step",
            "compiles_per_step")
    for how in ("calibrated", "pedantic", "figures"):
        assert {k: got[how][k] for k in keys} == {k: got["disabled"][k] for k in keys}, how
        assert got[how]["device_us_per_step"] == pytest.approx(  # (a sum over rounds / n)
            got["disabled"]["device_us_per_step"], rel=1e-12), how
    assert got["disabled"]["launches_per_step"] == (1 if mode == "graph" else 5)
    assert not ae.is_adaptive()  # each scope restores the mode before it


def test_compile_mode_compiles_the_function_unless_the_test_compiled_its_model():
    from adaptive_eager.tools.pytest_plugin import NeuronBenchmark
    x = torch.randn(8, 16).to("neuron")
    nb = NeuronBenchmark(_fixture(disabled=True), "compile")
    with nb.scope():
        assert ae.is_adaptive() and nb.device == "neuron"
        nb(lambda t: (t * 2).sin() + 1, x)
        assert nb.extra_info["launches_per_step"] == 1
    lin = torch.nn.Linear(16, 16).to("neuron")
    nb = NeuronBenchmark(_fixture(disabled=True), "compile")
    with nb.scope():
        model = nb.compile(lin)
        assert model is not lin
        step = lambda t: model(t).sum()  # noqa: E731
        nb(step, x)
        assert nb._fn(step) is step  # not compiled a second time
    nb = NeuronBenchmark(_fixture(disabled=True), "graph")
    assert nb.compile(lin) is lin
    with pytest.raises(ValueError, match="unknown mode 'gpu'"):
        NeuronBenchmark(_fixture(disabled=True), "gpu")


def test_cpu_mode_counts_ops_and_times_them():
    from adaptive_eager.tools.pytest_plugin import NeuronBenchmark
    nb = NeuronBenchmark(_fixture(disabled=True), "cpu")
    with nb.scope():
        x = torch.randn(4, 4, device=nb.device)
        nb(lambda t: (t + 1) * 2, x)
    assert nb.extra_info["ops_per_step"] == 2 and nb.extra_info["host_us_per_op"] > 0
    assert "launches_per_step" not in nb.extra_info


def test_report_ratios_are_to_the_first_mode_with_the_figure(tmp_path, capsys):
    from adaptive_eager.tools import report

    def bench(mode, launches, device_us, wall_s):
        e = {"mode": mode, "host_us_per_op": 1.0, "ops_per_step": 10}
        if mode != "cpu":
            e.update(launches_per_step=launches, device_us_per_step=device_us,
                     warmup_compiles=3, warmup_compile_ms_modeled=60.0, compiles_per_step=0)
        return {"group": "test_x", "name": f"test_x[{mode}]", "extra_info": e,
                "stats": {"min": wall_s, "median": wall_s, "mean": wall_s}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"benchmarks": [bench("cpu", 0, 0, 0.001),
                                               bench("eager", 8, 160.0, 0.004),
                                               bench("graph", 2, 40.0, 0.002)]}))
    assert report.main([str(path), "--md", str(tmp_path / "r.md")]) == 0
    out = capsys.readouterr().out
    assert "| launches/step | vs eager |" in out and "| vs cpu |" in out
    graph = next(line for line in out.splitlines() if line.startswith("| test_x | graph |"))
    assert graph.startswith("| test_x | graph | 2.0 | 0.25x |  | 40.0 | 0.25x | 3 (60) / 0 |")
    assert "| 2000 | 2.00x |" in graph  # wall time against the first mode, cpu
    assert (tmp_path / "r.md").read_text().startswith("| test | mode |")
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(SystemExit):
        report.main([str(empty)])
    assert "were benchmarks disabled?" in capsys.readouterr().err


def test_the_plugin_and_its_implementation_know_the_same_modes():
    from adaptive_eager.tools import pytest_entry
    from adaptive_eager.tools.pytest_plugin import MODES
    assert set(pytest_entry.MODES) == set(MODES)


def test_the_scope_sets_realtime_and_a_metrics_window_and_restores_both():
    from adaptive_eager.tools.pytest_plugin import NeuronBenchmark
    x = torch.randn(4).to("neuron")
    (x + 1).cpu()  # launches before the scope are not the test's
    nb = NeuronBenchmark(_fixture(disabled=True), "graph", realtime=True)
    with nb.scope():
        assert ae.config.realtime and ae.is_adaptive()
        (x * 2 + 1).cpu()
        assert nb.metrics().launches == 1 and nb.metrics().flushes == {"cpu": 1}
    assert not ae.config.realtime and not ae.is_adaptive()
    with pytest.raises(RuntimeError, match="inside the test"):
        nb.metrics()
    nb = NeuronBenchmark(_fixture(disabled=True), "cpu", realtime=True)
    assert not nb.realtime  # the CPU has no launches to wait for


def test_the_lazy_package_knows_the_api_names():
    """Note [Lazy package]: the package lists the API's names before the API loads (its
    `__getattr__` loads the API for those): the two lists agree, and the names are api's."""
    from adaptive_eager import api
    assert sorted(ae.__all__) == sorted(api.__all__)
    assert all(getattr(ae, name) is getattr(api, name) for name in api.__all__)

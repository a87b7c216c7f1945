"""The command line: --help, `run` on a small script, metrics files (each in a subprocess)."""
import json
import os
import subprocess
import sys

import pytest

from adaptive_eager.__main__ import COMMANDS

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
TRAIN = '''\
import sys
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                            torch.nn.Linear(32, 4)).to("neuron")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")
for step in range(int(sys.argv[1])):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")  # line 14: a sync every step
'''


def cli(*args, cwd=None, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "adaptive_eager", *args], capture_output=True,
                          text=True, cwd=cwd, env=env or ENV, timeout=timeout)


# The commands users are told about (README, adaptive_eager/README.md "tools/"), written out:
# a command dropped from, or added to, the table must change this line too.
EXPECTED = ("demo", "run", "report", "config")


def test_the_command_table_is_the_documented_one():
    assert tuple(COMMANDS) == EXPECTED


def test_help_lists_every_command():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.split("commands:")[1].splitlines()
              if line.startswith("  ") and line.strip()]
    assert tuple(listed) == EXPECTED, r.stdout
    bad = cli("no-such-command")
    assert bad.returncode == 2 and "unknown command 'no-such-command'" in bad.stderr


def _help(cmd, capsys) -> str:
    """`python -m adaptive_eager CMD --help`, in this process (argparse exits 0)."""
    from adaptive_eager.__main__ import main
    try:
        code = main([cmd, "--help"])
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("cmd", EXPECTED)
def test_each_command_has_help(cmd, capsys):
    assert "usage: python -m adaptive_eager " + cmd in _help(cmd, capsys)


def test_run_help_documents_its_options(capsys):
    out = " ".join(_help("run", capsys).split())
    for opt in ("--modes", "--json OUT", "--trace DIR", "script", "non-zero"):
        assert opt in out, opt


def test_metrics_file_written_at_exit(tmp_path):
    env = dict(ENV, TORCH_NEURONX_METRICS_ENABLED="1", TORCH_NEURONX_METRICS_DIR=str(tmp_path),
               RANK="3")
    code = "import torch\nx = torch.ones(4).to('neuron')\nprint(int(os.getpid()))\n"
    r = subprocess.run([sys.executable, "-c", "import os\n" + code], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout)
    path = tmp_path / f"neuron_metrics_rank3_pid{pid}.json"
    data = json.loads(path.read_text())
    assert data["pid"] == pid and data["rank"] == 3
    assert data["metrics"]["h2d_bytes"] == 16
    env.pop("TORCH_NEURONX_METRICS_ENABLED")  # off by default: no file
    subprocess.run([sys.executable, "-c", "import torch"], env=env, timeout=300, check=True)
    assert len(list(tmp_path.iterdir())) == 1


def test_run_compares_modes_on_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out_json, trace = tmp_path / "out.json", tmp_path / "traces"
    r = cli("run", "--modes", "eager,graph,compile", "--json", str(out_json), "--trace",
            str(trace), str(script), "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("step 2 loss") == 3  # the script's own output, once per mode
    data = json.loads(out_json.read_text())
    by = {m["mode"]: m for m in data["modes"]}
    assert set(by) == {"eager", "graph", "compile"}
    assert by["graph"]["launches"] < by["eager"]["launches"]
    assert by["compile"]["launches"] <= by["graph"]["launches"]
    assert by["compile"]["dynamo_graphs"] >= 2  # forward and backward captured
    assert by["graph"]["flushes"]["item"] == 3
    assert any("`item` at train.py:14 (3 times)" in a for a in data["advice"]), data["advice"]
    for line in ("mode", "eager", "graph", "compile", "train.py:14"):
        assert line in r.stdout
    assert sorted(os.listdir(trace)) == ["trace_compile.json", "trace_eager.json",
                                        "trace_graph.json"]


def test_run_exit_code_when_the_script_fails(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import torch\nx = torch.ones(2).to('neuron')\nraise SystemExit(3)\n")
    r = cli("run", "--modes", "eager", str(script), cwd=tmp_path)
    assert r.returncode == 1
    assert "failed in: eager" in r.stdout


def test_run_gives_the_script_what_python_gives_it(tmp_path):
    """As `python script.py`: `__file__` absolute, sys.argv[0] as typed, the script's classes
    picklable (`__main__` is the script), __name__ == "__main__"."""
    (tmp_path / "s.py").write_text(
        "import os, pickle, sys\n"
        "class Box:\n    pass\n"
        "assert pickle.loads(pickle.dumps(Box())).__class__ is Box\n"
        "print('FILE', __file__ == os.path.join(os.getcwd(), 's.py'), os.path.isabs(__file__))\n"
        "print('ARGV', sys.argv, __name__)\n")
    r = cli("run", "--modes", "eager", "s.py", "a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FILE True True" in r.stdout and "ARGV ['s.py', 'a'] __main__" in r.stdout


def test_a_log_file_that_cannot_be_opened_names_its_variable(tmp_path):
    env = dict(ENV, TORCH_NEURONX_LOG_FILE=str(tmp_path / "missing" / "log"))
    r = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode != 0 and "TORCH_NEURONX_LOG_FILE=" in r.stderr, r.stderr[-2000:]


def _result(mode, **kw):
    base = {"mode": mode, "returncode": 0, "ops": 100, "launches": 100, "flushes": {},
            "cpu_fallbacks": {}, "sync_sites": {}, "device_time_us": 2000.0,
            "dynamo_graphs": 0, "wall_s": 1.0}
    return {**base, **kw}


def test_advice_is_drawn_from_the_numbers():
    from adaptive_eager.tools.run import advice, table
    results = [
        _result("eager", cpu_fallbacks={"aten::foo": 300}),
        _result("graph", launches=10, device_time_us=200.0, cpu_fallbacks={"aten::foo": 300},
                flushes={"item": 42, "device idle": 58},
                sync_sites={"item@/x/train.py:31": 42, "repr@/x/train.py:40": 1}),
        _result("compile", returncode=1),
    ]
    tips = advice(results)
    assert any("compile" in t and "failed" in t for t in tips)
    assert any("42% of flushes in graph mode are `item` at train.py:31 (42 times)" in t
               and "up to 42" in t for t in tips)
    assert sum("aten::foo fell back to CPU 300 times" in t for t in tips) == 1
    assert any("graph launches 10 executables against eager's 100 (10%)" in t for t in tips)
    assert "item=42" in table(results)


def test_report_tables_the_tiny_chain_against_cpu_and_the_floor(tmp_path):
    """`report` on a run with benchmarks/test_host_overhead.py: a host-time table."""
    import json
    from adaptive_eager.tools import report

    def bench(group, info, median):
        return {"group": group, "extra_info": info, "stats": {"median": median, "mean": median}}
    data = {"benchmarks": [bench("tiny_chain", {"mode": m, "ops_per_step": 800}, t)
                           for m, t in (("cpu", 0.002), ("entry", 0.0025), ("floor", 0.01),
                                        ("ltc", 0.004),
                                        ("graph", 0.025), ("scoped", 0.03), ("eager", 0.05))]
                 + [bench("slow_path:setitem", {"mode": m, "ops_per_step": 100,
                                                "program": "setitem", "us_per_op": 1}, t)
                    for m, t in (("cpu", 0.0002), ("graph", 0.01))]}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    table = report.host_table(str(path))
    assert "| graph | 25.00 | 31.25 | 12.5x | 2.5x |" in table
    assert "| ltc | 4.00 | 5.00 | 2.0x | 0.4x |" in table
    assert "| entry | 2.50 | 3.12 | 1.2x | 0.2x |" in table  # (the slow paths have no entry column)
    assert "| scoped | 30.00 | 37.50 | 15.0x | 3.0x |" in table
    # setitem: 100 us/op in graph mode, 50x CPU's 2 us, 3.2x the chain's 31.25
    assert "| setitem | 2.0 (1x, 0.8x) |  |  | 100.0 (50x, 3.2x) |  |  |" in table
    assert report.load(str(path)) == {}  # the chain is no workload of the main table


def test_report_on_another_json_says_what_it_needs(tmp_path, capsys):
    """`report` on `run --json`'s output (or any other JSON) was a bare KeyError traceback."""
    from adaptive_eager.tools import report
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"modes": {}}))
    with pytest.raises(SystemExit) as e:
        report.main([str(path), "--md", str(tmp_path / "r.md"), "--png", str(tmp_path / "r.png")])
    assert e.value.code == 2
    assert "is not pytest-benchmark's JSON" in capsys.readouterr().err


def test_run_lines_prints_the_top_lines_per_mode(tmp_path):
    (tmp_path / "s.py").write_text(
        "import torch\n"
        "w = torch.randn(32, 32).to('neuron')\n"
        "for T in (4, 8, 12):\n"
        "    h = torch.randn(T, 32).to('neuron') @ w\n"  # line 4
        "    (h.tanh() * 2).sum().item()\n")  # line 5
    out_json = tmp_path / "o.json"
    r = cli("run", "--modes", "eager,graph", "--lines", "3", "--json", str(out_json), "s.py",
            cwd=tmp_path, env=dict(ENV, TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "c")))
    assert r.returncode == 0, r.stderr[-3000:]
    for mode in ("eager", "graph"):
        assert f"--- {mode}: top 3 lines by device time ---" in r.stdout
    by = {m["mode"]: m for m in json.loads(out_json.read_text())["modes"]}
    lines = {x["line"].rsplit(":", 1)[1]: x for x in by["graph"]["lines"]}
    assert lines["4"]["launches"] == lines["5"]["launches"] == 3
    assert lines["5"]["ops"] == 9 and lines["5"]["syncs"] == 3
    assert by["eager"]["compile_causes"].get("new shape", 0) >= 4  # tanh, mul, sum, mm: 4+
    assert by["graph"]["compile_causes"] == {"new op sequence": 1, "new shape": 2}
    advice = json.loads(out_json.read_text())["advice"]
    assert any(a.startswith("graph: 67% of compiles (2 of 3) are new shapes of dim 0 of "
                            "the tensor from s.py:4 (3 distinct sizes, 4..12)")
               for a in advice), advice
    # time to steady state: no optimizer, no steps
    assert not any("steady state" in a or "did not stop" in a for a in advice)


def test_run_names_the_varying_input_of_the_variable_length_gpt(tmp_path):
    """Issue 28's script (tests/harness/varlen_gpt.py, 6 steps): `run` names the line where
    the batch enters the device and its dim 1, and the bucketing what-if's compiles are
    within 10% of a real run padded by ae.bucketing_collate; the time to steady state."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "harness", "varlen_gpt.py")
    with open(script) as f:
        n = next(i for i, s in enumerate(f, 1) if "# the batch enters the device" in s)
    env = dict(ENV, TORCH_NEURONX_NEFF_DISABLE_CACHE="1")
    runs = {}
    for bucket in ("0", "32"):
        out_json = tmp_path / f"o{bucket}.json"
        r = cli("run", "--modes", "graph", "--json", str(out_json), script, "--steps", "6",
                "--bucket", bucket, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[bucket] = json.loads(out_json.read_text())
    graph = runs["0"]["modes"][0]
    advice = runs["0"]["advice"]
    assert any(a.startswith("graph: ") and f"new shapes of dim 1 of the tensor from "
               f"varlen_gpt.py:{n} (6 distinct sizes, 15..60)" in a for a in advice), advice
    predicted = graph["churns"][0]["whatif"]["multiple of 32"]
    real = runs["32"]["modes"][0]["compiles"]
    assert graph["compiles"] > real  # padding saved compiles...
    assert abs(predicted - real) <= 0.1 * real, (predicted, real)  # ...as predicted
    assert graph["steps"][0]["steps"] == 6  # six optimizer steps, each a new length
    assert any(a.startswith("graph: ") and ("steady state from step" in a or
                                             "compiles did not stop" in a) for a in advice)

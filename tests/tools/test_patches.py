"""Note [Patches]: every monkeypatch of torch or a library is made through
`adaptive_eager.patches`, listed with the private API it rests on, in place, and made once."""
import importlib
import importlib.machinery
import sys
import types

import pytest
import torch

import adaptive_eager  # noqa: F401  (registers the device, which makes the patches)
from adaptive_eager import patches

# What `import adaptive_eager` patches, and what it patches once torch._dynamo, pipelining and
# asynchronous checkpoints are imported. A patch dropped (or a torch upgrade that moves the
# API under it) fails here.
AT_IMPORT = {
    "torch.utils.swap_tensors", "torch.__future__.get_swap_module_params_on_conversion",
    "torch.to_dlpack", "torch.utils.dlpack.to_dlpack", "torch.clear_autocast_cache",
    "torch.autograd.graph._engine_run_backward", "torch.autograd._engine_run_backward",
    "torch.nn.modules.module.BackwardHook",
    "torch.nn.modules.module.Module._get_backward_hooks",
    "torch._C._autograd._push_saved_tensors_default_hooks",
    "torch.accelerator.synchronize", "torch.accelerator.memory.memory_stats",
    "torch.accelerator.set_device_index", "torch.accelerator.current_stream",
    "torch.accelerator.set_stream", "torch.storage.UntypedStorage.__new__", "torch.Tensor.data",
    "torch._C._set_float32_matmul_precision", "torch._C._set_mkldnn_enabled",
    "torch._C._set_deterministic_algorithms", "torch._C.set_num_threads", "torch.set_num_threads",
    "torch.backends.mkldnn.MkldnnModule.enabled", "torch._C.set_flush_denormal",
    "torch.set_flush_denormal", "torch.serialization._legacy_load",
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v3", "torch.storage._to",
    "torch.jit.load", "torch.autograd.profiler.profile._start_trace",
    "torch.autograd.profiler.profile.export_chrome_trace",
    "torch.fx.experimental.proxy_tensor.HANDLED_TYPES",
    "torch.distributed.destroy_process_group",
    "torch.distributed.distributed_c10d.destroy_process_group",
}
AFTER_IMPORTS = {
    "torch._TorchCompileInductorWrapper.__call__",
    "torch._dynamo.variables.builder.infer_subclass_type",
    "torch.distributed.pipelining.stage._PipelineStage._move_submod_to_device",
    "torch.distributed.checkpoint._state_dict_stager.StateDictStager._offload_tensor",
}


def _import_the_lazy_ones():
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint._state_dict_stager  # noqa: F401
    import torch.distributed.pipelining.stage  # noqa: F401


def test_every_patch_is_listed_and_in_place():
    _import_the_lazy_ones()
    where = [p.where for p in patches.applied()]
    assert AT_IMPORT | AFTER_IMPORTS <= set(where), sorted((AT_IMPORT | AFTER_IMPORTS) - set(where))
    assert len(where) == len(set(where)), "one entry per patched attribute"
    for p in patches.applied():
        assert p.in_place(), f"{p.where} is no longer ours (it rests on: {p.rests_on})"
        assert p.rests_on and p.original is not p.new


def test_installing_again_changes_nothing():
    """Every install function runs again without patching twice (wrapping a wrapper)."""
    _import_the_lazy_ones()
    from adaptive_eager.engine import cpu_settings, hooks, serialization, storage, tensor
    from adaptive_eager.integration import compile, distributed, lightning, registration
    before = [(p.where, p.new) for p in patches.applied()]
    for _ in range(2):
        cpu_settings.install(lambda: None)
        hooks.install()
        serialization.register()
        storage.refuse_device_storages()
        tensor.install_set_data()
        registration._wrap_backward()
        registration._route_accelerator_api()
        compile.install()
        compile.register()
        distributed._route_work_results()
        distributed._release_works_at_destroy()
        distributed._patch_pipeline_stage(sys.modules["torch.distributed.pipelining.stage"])
        distributed._patch_stager(
            sys.modules["torch.distributed.checkpoint._state_dict_stager"])
        lightning.install()
    after = [(p.where, p.new) for p in patches.applied()]
    assert after == before


@pytest.fixture
def fresh(monkeypatch):
    """A PATCHES list of the test's own (the process's stays as it was)."""
    monkeypatch.setattr(patches, "PATCHES", [])


def test_patch_applies_once_and_again_after_a_restore(fresh):
    owner = types.SimpleNamespace(f=lambda: "theirs")
    original = owner.f
    wrapped = patches.patch(owner, "f", wrap=lambda g: lambda: "ours+" + g(), rests_on="f")
    assert owner.f is wrapped and owner.f() == "ours+theirs"
    assert patches.patch(owner, "f", wrap=lambda g: lambda: "again+" + g(),
                         rests_on="f") is wrapped  # in place: nothing done
    assert owner.f() == "ours+theirs" and len(patches.PATCHES) == 1
    assert patches.is_patched(owner, "f")
    owner.f = original  # a test's monkeypatch undone, say: patched again, still one entry
    assert not patches.is_patched(owner, "f")
    patches.patch(owner, "f", wrap=lambda g: lambda: "ours+" + g(), rests_on="f")
    assert owner.f() == "ours+theirs" and len(patches.PATCHES) == 1


def test_patch_asks_for_what_it_rests_on(fresh):
    owner = types.SimpleNamespace(f=None)
    with pytest.raises(TypeError, match="rests on"):
        patches.patch(owner, "f", 1, rests_on="")
    with pytest.raises(TypeError, match="either"):
        patches.patch(owner, "f", 1, wrap=lambda g: 2, rests_on="x")
    assert owner.f is None and patches.PATCHES == []


def _write_module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_after_import_runs_after_the_module_ran(tmp_path, monkeypatch):
    name = "ae_after_import_probe"
    _write_module(tmp_path, monkeypatch, name)
    seen = []
    hooks_before = list(sys.meta_path)
    patches.after_import(name, lambda m: seen.append(m.VALUE))
    assert seen == [] and name not in sys.modules  # nothing imported by us
    try:
        module = importlib.import_module(name)
        assert seen == [41]
        assert sys.meta_path == hooks_before  # the hook is gone
        assert "exec_module" not in vars(module.__spec__.loader)  # the loader's own again
        patches.after_import(name, lambda m: seen.append(m.VALUE + 1))  # imported: at once
        assert seen == [41, 42]
    finally:
        sys.modules.pop(name, None)
        sys.meta_path[:] = hooks_before


@pytest.mark.parametrize("fails", [False, True], ids=["made", "failed"])
def test_after_import_of_a_module_under_way_runs_once_it_ran(tmp_path, monkeypatch, fails):
    """Asked while the module's import is under way (torch's autoload, inside a module of
    ours that imported torch: Note [Lazy package]), after its code ran; not if it failed."""
    name = f"ae_after_import_under_way_{fails}"
    (tmp_path / f"{name}.py").write_text(
        "import sys\nfrom adaptive_eager import patches\n"
        "patches.after_import(__name__, lambda m: sys.ae_seen.append(m.VALUE))\n"
        f"sys.ae_seen.append(0)\nVALUE = 41\n{'1 / 0' if fails else ''}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(sys, "ae_seen", [], raising=False)
    try:
        if fails:
            with pytest.raises(ZeroDivisionError):
                importlib.import_module(name)
            assert sys.ae_seen == [0]
        else:
            module = importlib.import_module(name)
            assert sys.ae_seen == [0, 41]
            assert type(module.__spec__) is importlib.machinery.ModuleSpec  # its own again
            assert not module.__spec__._initializing
    finally:
        sys.modules.pop(name, None)


def test_after_import_of_a_module_that_does_not_exist_does_nothing(monkeypatch):
    hooks_before = list(sys.meta_path)
    seen = []
    patches.after_import("ae_no_such_module_probe", seen.append)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("ae_no_such_module_probe")
        assert seen == []
    finally:
        sys.meta_path[:] = hooks_before


def test_no_module_patches_torch_outside_the_registry():
    """No module of ours assigns an attribute of torch (or a library) directly: the
    assignments to a name imported from torch, or to a class or module got from it, go
    through `patches.patch` (a textual check of `torch.x = ...` / `setattr(torch...`)."""
    import ast
    from pathlib import Path
    root = Path(adaptive_eager.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(tt, ast.Attribute) and ast.unparse(tt).startswith("torch."):
                        bad.append(f"{path.name}:{node.lineno}: {ast.unparse(tt)}")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                    and ast.unparse(node.args[0]).startswith("torch")):
                bad.append(f"{path.name}:{node.lineno}: setattr({ast.unparse(node.args[0])})")
    assert not bad, bad
    assert torch.utils.swap_tensors.__module__ == "adaptive_eager.engine.tensor"

"""Every CPU patch names the megatron-core code it works around; these fail if that code changes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import megatron.core
import pytest

from elastic_pretrain.parallel import cpu_compat

EXPECTED = [
    "rng_tracker",
    "cuda_device_noops",
    "moe_te_general_gemm",
    "cuda_streams",
    "moe_alltoall_splits",
    "sp_torch_norm",
    "cuda_device_shim",
    "tensor_type_string",
    "checkpoint_rng",
    "sharded_tensor_init_data",
    "eager_jit_fuser",
]


def test_megatron_version_is_the_one_patched():
    assert megatron.core.__version__ == cpu_compat.MEGATRON_CORE_VERSION


def test_the_patches_are_named_and_justified():
    assert [p.name for p in cpu_compat.PATCHES] == EXPECTED
    assert all(p.why and p.probes for p in cpu_compat.PATCHES)


@pytest.mark.parametrize("patch", cpu_compat.PATCHES, ids=lambda p: p.name)
def test_patched_megatron_code_is_unchanged(patch):
    for probe in patch.probes:
        assert probe.holds(), f"{patch.name}: megatron-core no longer has {probe} — revisit the patch"


def test_shimmed_modules_still_hardcode_cuda():
    import importlib
    import inspect

    for name in cpu_compat.SHIMMED_MODULES:
        src = inspect.getsource(importlib.import_module(name))
        assert "cuda" in src, f"{name} no longer mentions cuda: drop it from SHIMMED_MODULES"


_UNPATCHED = {
    "rng_tracker": """
        from megatron.core.tensor_parallel import random as R
        R.CudaRNGStatesTracker().add("x", 1)
    """,
    "moe_te_general_gemm": """
        from megatron.core.transformer.moe import moe_utils
        assert not hasattr(moe_utils, "te_general_gemm"), "TE gemm defined without TE"
        raise RuntimeError("missing")
    """,
    "cuda_streams": """
        import torch
        torch.cuda.Stream()
    """,
    "cuda_device_shim": """
        from megatron.core.transformer.utils import get_default_causal_mask
        get_default_causal_mask(4)
    """,
}


def test_without_the_patches_megatron_fails_on_cpu():
    """The failure each patch exists for is real (checked in one fresh, unpatched interpreter)."""
    lines = ["import warnings, json; warnings.simplefilter('ignore'); failed = {}"]
    for name, snippet in _UNPATCHED.items():
        body = textwrap.indent(textwrap.dedent(snippet).strip(), "    ")
        lines += [f"try:\n{body}\n    failed[{name!r}] = False", f"except Exception:\n    failed[{name!r}] = True"]
    lines.append("print(json.dumps(failed))")
    proc = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120)
    import json

    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failed == {name: True for name in _UNPATCHED}, f"works without the patch (remove it?): {failed}"


_IMPORT_REPORT = """
import inspect, json, sys
{first}
import megatron.core
from megatron.core import jit
from megatron.core.transformer import utils
from elastic_pretrain.parallel import cpu_compat
print(json.dumps([{{m: m in sys.modules for m in ("torch._dynamo", "torch._inductor")}},
                  jit.jit_fuser is jit.noop_decorator, not hasattr(utils.gelu_impl, "__wrapped__"),
                  cpu_compat.AT_IMPORT, "jit_fuser = torch.compile" in inspect.getsource(jit)]))
"""


def _import_report(first: str) -> list[object]:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _IMPORT_REPORT.format(first=first)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_eager_jit_fuser_keeps_torch_compile_out_of_megatrons_import():
    """Every entry point imports the package before megatron-core: its import hook makes megatron's jit_fuser
    the no-op decorator as megatron.core.jit is imported, so the fused functions stay plain functions and
    neither torch._dynamo nor torch._inductor is imported. Control: megatron-core imported first (no hook
    yet) imports both and wraps the functions; the hook leaves the module's source readable (the probes)."""
    unloaded = {"torch._dynamo": False, "torch._inductor": False}
    assert _import_report("import elastic_pretrain") == [unloaded, True, True, ["eager_jit_fuser"], True]
    loaded = {"torch._dynamo": True, "torch._inductor": True}
    assert _import_report("import megatron.core") == [loaded, False, False, [], True]


def test_the_import_hook_leaves_megatron_alone_with_cuda(monkeypatch):
    import torch

    calls = []
    module = type("Jit", (), {"disable_jit_fuser": staticmethod(lambda: calls.append(1))})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "AT_IMPORT", [])
    cpu_compat.after_megatron_jit(module)
    assert calls == [] and cpu_compat.AT_IMPORT == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_compat.after_megatron_jit(module)
    assert calls == [1] and cpu_compat.AT_IMPORT == ["eager_jit_fuser"]


def test_patches_apply_only_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.needs_cpu_patches() is False


def test_rng_tracker_forks_are_reproducible(mesh1):
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    state = tracker.get_states()
    with tracker.fork():
        a = torch.rand(3)
    tracker.set_states(state)
    with tracker.fork():
        b = torch.rand(3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)

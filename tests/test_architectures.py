"""Each architecture the project serves loads in vLLM as installed (`cluster.cli.architectures`, which `make setup`
runs), Qwen3.5 included: its model code imports torchvision, whose C++ operators do not load beside the CPU torch;
scripts/torchvision_cpu.py (installed into the virtual environment, loaded at interpreter start) is what makes that
import succeed - without it, it fails as it did before."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.cli.architectures import ARCHITECTURES, check


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cpu_torch() -> None:
    """The hook matters beside a CPU torch only (a CUDA torch loads torchvision's operators: the hook does nothing)."""
    if _run("import torch; print(torch.version.cuda)").stdout.strip() != "None":
        pytest.skip("a CUDA build of torch: torchvision's operators load, nothing for the hook to do")


def test_torchvision_imports_beside_the_cpu_torch_through_the_hook(cpu_torch):
    r = _run("import sys, torch, torchvision.extension as e, torchvision.transforms.v2.functional\n"
             "import _hpd_torchvision_cpu as h\n"
             "print(torch.version.cuda, e._has_ops(), h._library is not None)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["None", "False", "True"]  # CPU torch, its operators absent, the schemas defined


def test_without_the_hook_torchvision_fails_as_before(cpu_torch):
    r = _run("import sys, _hpd_torchvision_cpu as h\n"
             "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, h._BeforeMetaRegistrations)]\n"
             "import torchvision")
    assert r.returncode != 0
    assert "torchvision::nms does not exist" in r.stderr


def test_without_the_hook_the_check_names_qwen35(cpu_torch):
    """`make setup`'s check fails, naming each architecture and the error, when torchvision cannot import (with it
    installed, transformers imports it under vLLM: nothing of vLLM loads)."""
    r = _run("import sys, _hpd_torchvision_cpu as h\n"
             "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, h._BeforeMetaRegistrations)]\n"
             "from cluster.cli.architectures import check\n"
             "print(check(['Qwen3.5', 'Qwen3-Next']))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Qwen3.5: Qwen3_5ForCausalLM: vLLM did not import: RuntimeError" in r.stdout  # transformers imports
    assert "torchvision::nms does not exist" in r.stdout  # torchvision once it is installed, and vLLM transformers


def test_an_operator_torchvision_could_not_load_still_says_so(cpu_torch):
    """The hook defines schemas only: torchvision's C++ operators stay unavailable, with torch's own error."""
    r = _run("import torch, torchvision\n"
             "torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)")
    assert r.returncode != 0
    assert "torchvision::nms" in r.stderr and "NotImplementedError" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_vllm_loads_each_architecture_as_a_hybrid(name):
    assert check([name]) == []


def test_an_architecture_vllm_does_not_know_is_named():
    from cluster.cli.architectures import ArchitectureError, inspect

    with pytest.raises(ArchitectureError, match="Qwen9ForCausalLM: not an architecture vLLM"):
        inspect("Qwen9ForCausalLM")

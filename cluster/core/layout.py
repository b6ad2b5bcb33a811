"""Engine layouts: what one prefill or decode engine keeps per request, per TP rank, in bytes.

A hybrid model has two kinds of per-layer cache:
  * attention layers keep paged K and V, one page per kernel block of tokens;
  * GDN / Mamba layers keep one fixed-size state per request: a conv state and a recurrent ("ssm") state.

Everything TP-dependent is derived from a TP-independent `ModelShape` by `shard()`: every shardable axis is a
sequence of *units* (heads, groups or channels); a rank holds a contiguous run of units, or - where a projection
has fewer units than ranks and may be replicated (Mamba2 B/C groups, attention KV heads) - the one unit its heads
belong to. The transfer planner works purely on units, so any pair of TP sizes maps the same way.

This module imports neither Ray, vLLM nor NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from cluster.core.errors import FieldError

CONV_LAYOUTS = ("DS", "SD")  # vLLM's VLLM_SSM_CONV_STATE_LAYOUT values: (channels, rows) or (rows, channels)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise LayoutError("dtype", f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


class LayoutError(FieldError):
    """A model shape or TP size that cannot be laid out; `field` names the offending setting."""


@dataclass(frozen=True)
class Proj:
    """One shardable axis of a state: `units` units of `unit_elems` elements each.

    For a conv sub-projection a unit is a head or group of `unit_elems` conv channels (in the DS conv layout one
    channel is `conv_rows` contiguous elements; in SD one element of each of the `conv_rows` rows: see
    `EngineLayout.conv_ranges`). For the recurrent state a unit is one head
    (or one channel for Mamba1) of `unit_elems` contiguous elements. For attention a unit is one KV head.
    """

    name: str
    units: int
    unit_elems: int
    replicable: bool = False  # may be replicated when units < tp (Mamba2 B/C groups, attention KV heads)

    def held_units(self, tp: int, rank: int) -> tuple[int, ...]:
        """Global unit ids that `rank` of `tp` holds, in its memory order."""
        if self.units % tp == 0:
            per = self.units // tp
            return tuple(range(rank * per, (rank + 1) * per))
        if self.replicable and tp % self.units == 0:
            # each rank holds the single unit its share of heads belongs to
            return (rank * self.units // tp,)
        why = "replicated only when TP is a multiple of it" if self.replicable else "not replicable"
        raise LayoutError(
            f"{self.name}.units",
            f"{self.units} {self.name} units cannot be split over TP {tp} (must be divisible; {why})",
        )

    def local_units(self, tp: int) -> int:
        return len(self.held_units(tp, 0))


@dataclass(frozen=True)
class StateShape:
    """The unsharded GDN / Mamba state of one layer (all such layers of a model share it)."""

    kind: Literal["gdn", "mamba2", "mamba1"]
    conv_kernel: int
    conv_projs: tuple[Proj, ...]  # in channel order: GDN [Q, K, V], Mamba2 [x, B, C], Mamba1 [x]
    ssm: Proj

    @property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1


@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    head_dim: int

    @property
    def heads(self) -> Proj:
        return Proj("kv_heads", self.num_kv_heads, self.head_dim, replicable=True)


@dataclass(frozen=True)
class ModelShape:
    """What a model keeps per request, independent of TP. Two engines can pair only if these are equal."""

    architecture: str
    num_layers: int
    state_layers: tuple[int, ...]  # indices of GDN / Mamba layers
    attention_layers: tuple[int, ...]
    state: StateShape | None
    attention: AttentionShape | None

    def fields(self) -> dict[str, object]:
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "state_layers": self.state_layers,
            "attention_layers": self.attention_layers,
            "state.kind": self.state.kind if self.state else None,
            "state.conv_kernel": self.state.conv_kernel if self.state else None,
            "state.conv_projs": self.state.conv_projs if self.state else None,
            "state.ssm": self.state.ssm if self.state else None,
            "attention.num_kv_heads": self.attention.num_kv_heads if self.attention else None,
            "attention.head_dim": self.attention.head_dim if self.attention else None,
        }


# --------------------------------------------------------------------------------------------------------------
# Per-engine layout (one TP size, dtypes, block sizes, cache groups)


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group of the hybrid allocator: layers of one kind that share block ids. Layer i of every group
    lives in memory region i (the allocator makes one layer of each group alias one buffer), so a region's page for
    block b belongs to whichever group allocated b."""

    kind: Literal["state", "attention"]
    layers: tuple[int, ...]


def default_groups(model: ModelShape) -> tuple[CacheGroup, ...]:
    """The hybrid allocator's grouping (vLLM 0.32): each kind's layers (kinds in order of their first layer) split
    into groups of `group_size` layers - the smaller kind's layer count, or the larger's when it is under 1.5x the
    smaller - with group i of a kind taking layers[i::num_groups]."""
    kinds = sorted((layers[0], kind, layers) for kind, layers in (("state", model.state_layers), ("attention", model.attention_layers)) if layers)
    if not kinds:
        return ()
    counts = [len(layers) for *_, layers in kinds]
    lo, hi = min(counts), max(counts)
    size = hi if hi < 1.5 * lo else lo
    groups = []
    for _, kind, layers in kinds:
        n = -(-len(layers) // size)
        groups += [CacheGroup(kind, tuple(layers[i::n])) for i in range(n)]  # type: ignore[arg-type]
    return tuple(groups)


@dataclass(frozen=True)
class EngineLayout:
    """One engine's run-time cache layout, per TP rank. Built offline (`offline_layout`) or from what a running engine
    reports (`layout_from_report`); both give this type.

    Memory model (vLLM 0.32 hybrid allocator, LBHNC): each rank has `num_regions` regions; a region is an array of
    logical pages of `page_bytes`, and kernel block k of a region starts at k * kernel_page_bytes
    (kernel_page_bytes = page_bytes / physical_blocks_per_logical).
      * a state page (GDN/Mamba) holds [conv state | recurrent state | padding]; the conv state is either DS
        (channels, conv_rows): the sub-projections back to back, each one contiguous - or SD (conv_rows, channels),
        vLLM's default and its faster CPU kernel: each row holds every channel of this rank, so a sub-projection is
        `conv_rows` strided runs (`conv_layout`, from VLLM_SSM_CONV_STATE_LAYOUT);
      * an attention kernel page holds, per local KV head, its K rows then its V rows: (heads, 2, kernel_block_size,
        head_dim) - heads outermost, so a head slice is one contiguous range (HND). vLLM's CPU attention (CPU_TILED)
        keeps the heads outermost but not the tokens inside a kernel block: K sits in 32-token tiles and V is stored
        transposed, so a token's bytes depend on the kernel block size (measured: tests/test_planner_validation.py).
    `block_size` is the logical block size in tokens; attention kernels see `kernel_block_size`-token blocks.
    """

    model: ModelShape
    tp: int
    dtype: str  # attention KV and conv state
    ssm_dtype: str  # recurrent state
    block_size: int
    kernel_block_size: int
    page_bytes: int  # one logical page of one region on one rank, padding included
    groups: tuple[CacheGroup, ...]
    conv_layout: str = "DS"
    kv_layout: str = "HND"

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise LayoutError("tp", f"TP size must be an integer >= 1, got {self.tp!r}")
        dtype_bytes(self.dtype)
        dtype_bytes(self.ssm_dtype)
        if self.conv_layout not in CONV_LAYOUTS:
            raise LayoutError("conv_layout", f"unknown conv-state layout {self.conv_layout!r}; expected one of {CONV_LAYOUTS}")
        if self.block_size < 1:
            raise LayoutError("block_size", f"must be >= 1, got {self.block_size}")
        if self.kernel_block_size < 1 or self.block_size % self.kernel_block_size:
            raise LayoutError(
                "kernel_block_size",
                f"logical block size {self.block_size} is not a multiple of kernel block size {self.kernel_block_size}",
            )
        for proj in self.projections():  # every projection must shard at this TP
            proj.held_units(self.tp, 0)
        if self.page_bytes % self.physical_blocks_per_logical:
            raise LayoutError("page_bytes", f"{self.page_bytes} does not split into {self.physical_blocks_per_logical} kernel pages")
        if self.model.state and self.page_bytes < self.min_state_page_bytes:
            raise LayoutError("page_bytes", f"{self.page_bytes} cannot hold the state ({self.min_state_page_bytes} bytes)")
        if self.model.attention and self.kernel_page_bytes < self.kv_kernel_block_bytes:
            raise LayoutError(
                "page_bytes", f"kernel page {self.kernel_page_bytes} cannot hold {self.kv_kernel_block_bytes} bytes of K and V"
            )

    def projections(self) -> tuple[Proj, ...]:
        out: list[Proj] = []
        if self.model.state:
            out += [*self.model.state.conv_projs, self.model.state.ssm]
        if self.model.attention:
            out.append(self.model.attention.heads)
        return tuple(out)

    # ---- derived sizes (per rank) ----
    @cached_property
    def physical_blocks_per_logical(self) -> int:
        return self.block_size // self.kernel_block_size

    @cached_property
    def kernel_page_bytes(self) -> int:
        return self.page_bytes // self.physical_blocks_per_logical

    @cached_property
    def num_regions(self) -> int:
        return max((len(g.layers) for g in self.groups), default=0)

    @cached_property
    def elem_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @cached_property
    def ssm_elem_bytes(self) -> int:
        return dtype_bytes(self.ssm_dtype)

    @cached_property
    def conv_rows(self) -> int:
        return self.model.state.conv_rows if self.model.state else 0

    @cached_property
    def conv_proj_dims(self) -> tuple[int, ...]:
        """Per-rank channel counts of the conv sub-projections, in order."""
        if not self.model.state:
            return ()
        return tuple(p.local_units(self.tp) * p.unit_elems for p in self.model.state.conv_projs)

    def conv_proj_offsets(self) -> tuple[int, ...]:
        """Byte offset of each conv sub-projection inside this rank's conv state in the DS layout (where each is one
        contiguous range; `conv_ranges` gives the ranges in either layout)."""
        offs, at = [], 0
        for dim in self.conv_proj_dims:
            offs.append(at)
            at += dim * self.conv_rows * self.elem_bytes
        return tuple(offs)

    def conv_ranges(self, proj: int, slot: int, count: int) -> list[tuple[int, int]]:
        """(byte offset, size) ranges inside this rank's conv state that hold units [slot, slot + count) of conv
        sub-projection `proj` (unit slots as `Proj.held_units` numbers them on this rank), in element order: one
        range in the DS layout, one per conv row in SD. Two layouts of one model give ranges of equal sizes."""
        ue = self.model.state.conv_projs[proj].unit_elems
        if self.conv_layout == "DS":
            unit = ue * self.conv_rows * self.elem_bytes
            return [(self.conv_proj_offsets()[proj] + slot * unit, count * unit)]
        channels = sum(self.conv_proj_dims)
        first = sum(self.conv_proj_dims[:proj]) + slot * ue
        return [((row * channels + first) * self.elem_bytes, count * ue * self.elem_bytes) for row in range(self.conv_rows)]

    def conv_row_ranges(self, row: int) -> list[tuple[int, int]]:
        """(byte offset, size) ranges of conv row `row` (the state of one past token, every channel of this rank):
        one element per channel in the DS layout, one range in SD."""
        channels, eb = sum(self.conv_proj_dims), self.elem_bytes
        if self.conv_layout == "SD":
            return [(row * channels * eb, channels * eb)]
        return [((c * self.conv_rows + row) * eb, eb) for c in range(channels)]

    @cached_property
    def conv_state_bytes(self) -> int:
        return sum(self.conv_proj_dims) * self.conv_rows * self.elem_bytes

    @cached_property
    def ssm_state_bytes(self) -> int:
        if not self.model.state:
            return 0
        ssm = self.model.state.ssm
        return ssm.local_units(self.tp) * ssm.unit_elems * self.ssm_elem_bytes

    @cached_property
    def ssm_offset(self) -> int:
        """Byte offset of the recurrent state inside a state page (right after the conv state)."""
        return self.conv_state_bytes

    @cached_property
    def min_state_page_bytes(self) -> int:
        return self.conv_state_bytes + self.ssm_state_bytes

    @cached_property
    def kv_heads_local(self) -> int:
        return self.model.attention.heads.local_units(self.tp) if self.model.attention else 0

    @cached_property
    def kv_head_bytes(self) -> int:
        """One KV head's K and V rows in one kernel block."""
        if not self.model.attention:
            return 0
        return 2 * self.kernel_block_size * self.model.attention.head_dim * self.elem_bytes

    @cached_property
    def kv_kernel_block_bytes(self) -> int:
        return self.kv_heads_local * self.kv_head_bytes

    SUMMARY = ("tp", "dtype", "ssm_dtype", "block_size", "kernel_block_size", "physical_blocks_per_logical",
               "page_bytes", "num_regions", "conv_layout", "kv_layout", "conv_rows", "conv_proj_dims", "conv_state_bytes",
               "ssm_state_bytes", "kv_heads_local", "kv_kernel_block_bytes")

    def summary(self) -> dict[str, object]:
        """The layout's fields and derived sizes that `python -m cluster plan` prints."""
        out = {name: getattr(self, name) for name in self.SUMMARY}
        out["conv_proj_dims"] = list(self.conv_proj_dims)
        return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def offline_layout(
    model: ModelShape,
    tp: int,
    dtype: str = "bfloat16",
    ssm_dtype: str | None = None,
    block_size: int | None = None,
    kernel_block_size: int | None = None,
    min_kernel_block: int = 32,
    kv_layout: str = "HND",
    conv_layout: str = "DS",
) -> EngineLayout:
    """The layout an engine of this model would get at this TP, computed as vLLM 0.32's hybrid allocator does:
    the attention block size is raised (in multiples of the kernel block base) until an attention page holds a state
    page, and the state page is padded to the attention page. On CPU the kernel block equals the logical block
    (any multiple of 32 tokens); pass `kernel_block_size` for GPU backends with fixed kernel sizes. `conv_layout`:
    DS is vLLM's stock NIXL layout (and CUDA engines'); the CPU engines here run SD
    (actors.engine.settings.launch_env)."""
    ssm_dtype = ssm_dtype or dtype
    probe = EngineLayout(model, tp, dtype, ssm_dtype, 1, 1, 1 << 62, default_groups(model))  # sizes only
    per_token = probe.kv_heads_local * 2 * model.attention.head_dim * probe.elem_bytes if model.attention else 0
    state_page = probe.min_state_page_bytes
    requested = block_size or (128 if model.attention else 1)
    if model.attention and model.state:
        base = max(min_kernel_block, requested)
        needed = base * _ceil_div(state_page, base * per_token)
        size = max(requested, needed)
        if kernel_block_size is not None:
            size = kernel_block_size * _ceil_div(size, kernel_block_size)
        page = size * per_token
    elif model.attention:
        size, page = requested, requested * per_token
    else:
        size, page = requested, state_page
    kernel = kernel_block_size or size
    return EngineLayout(model, tp, dtype, ssm_dtype, size, kernel, page, default_groups(model), conv_layout=conv_layout,
                        kv_layout=kv_layout)


def fields_differ(a: ModelShape, b: ModelShape) -> list[tuple[str, object, object]]:
    fa, fb = a.fields(), b.fields()
    return [(k, fa[k], fb[k]) for k in fa if fa[k] != fb[k]]




# --------------------------------------------------------------------------------------------------------------
# The run-time source: what a running engine reports


# vLLM's names -> head-major, token-major, or head-major with tiled kernel blocks (vLLM's CPU attention)
KV_LAYOUTS = {"HND": "HND", "LBHNC": "HND", "NHD": "NHD", "CPU_TILED": "CPU_TILED"}
HEAD_MAJOR = ("HND", "CPU_TILED")  # a head's slice of a kernel page is one contiguous range


def layout_from_report(report: dict, model: ModelShape) -> EngineLayout:
    """The layout a running engine reports (see actors/engine/report.py for how it is read out of vLLM), checked
    against the model's shape: the sizes the engine really allocated must be the sizes the planner derives."""
    try:
        groups = tuple(CacheGroup(g["kind"], tuple(g["layers"])) for g in report["groups"])
        layout = EngineLayout(
            model=model,
            tp=report["tp"],
            dtype=report["dtype"],
            ssm_dtype=report.get("ssm_dtype") or report["dtype"],
            block_size=report["block_size"],
            kernel_block_size=report["kernel_block_size"],
            page_bytes=report["page_bytes"],
            groups=groups,
            conv_layout=report.get("conv_layout", "DS"),
            kv_layout=KV_LAYOUTS.get(report.get("kv_layout", "HND"), report.get("kv_layout", "HND")),
        )
    except KeyError as e:
        raise LayoutError(f"report.{e.args[0]}", "missing from the engine's report") from None
    for name in ("conv_state_bytes", "ssm_state_bytes", "kv_heads_local"):
        if name in report and report[name] != getattr(layout, name):
            raise LayoutError(
                f"report.{name}",
                f"the engine reports {report[name]}, the model's shape at TP {layout.tp} gives {getattr(layout, name)}",
            )
    for i, g in enumerate(groups):
        layers = model.state_layers if g.kind == "state" else model.attention_layers
        if not set(g.layers) <= set(layers):
            raise LayoutError(f"report.groups[{i}]", f"{g.kind} group lists layers {g.layers} that are not {g.kind} layers")
    return layout


__all__ = [
    "AttentionShape",
    "CacheGroup",
    "default_groups",
    "offline_layout",
    "EngineLayout",
    "LayoutError",
    "ModelShape",
    "Proj",
    "StateShape",
    "dtype_bytes",
    "fields_differ",
    "layout_from_report",
]

"""A byte-exact model of the engines' cache memory, for executing plans with plain memory copies.

`FullState` holds one request's unsharded state (every unit of every projection as raw bytes); `shard_into` writes it
into one rank's regions exactly where the layout says a TP rank keeps it. Executing a plan copies bytes between the
prefill ranks' memory and the decode ranks' memory; the result must equal sharding the full state for decode directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.core.layout import EngineLayout, Proj
from cluster.core.planner import RequestPlan


@dataclass
class FullState:
    conv: dict[int, list[np.ndarray]]  # layer -> per conv proj: (units, unit_bytes)
    ssm: dict[int, np.ndarray]  # layer -> (units, unit_bytes)
    kv: dict[int, np.ndarray]  # layer -> (kv_heads, 2, tokens, head_bytes_per_token)


def make_full_state(layout: EngineLayout, num_tokens: int, rng: np.random.Generator) -> FullState:
    model, st = layout.model, layout.model.state
    conv, ssm, kv = {}, {}, {}
    for layer in model.state_layers:
        conv[layer] = [rng.integers(0, 256, (p.units, p.unit_elems * st.conv_rows * layout.elem_bytes), dtype=np.uint8) for p in st.conv_projs]
        ssm[layer] = rng.integers(0, 256, (st.ssm.units, st.ssm.unit_elems * layout.ssm_elem_bytes), dtype=np.uint8)
    for layer in model.attention_layers:
        a = model.attention
        kv[layer] = rng.integers(0, 256, (a.num_kv_heads, 2, num_tokens, a.head_dim * layout.elem_bytes), dtype=np.uint8)
    return FullState(conv, ssm, kv)


def _gather(proj: Proj, tp: int, rank: int, full: np.ndarray) -> bytes:
    return full[list(proj.held_units(tp, rank))].tobytes()


def _conv_bytes(layout: EngineLayout, rank: int, full_conv: list[np.ndarray]) -> bytes:
    """One rank's conv state as it lies in memory: its channels of every sub-projection in order, as (channels,
    conv_rows) in the DS layout or transposed to (conv_rows, channels) in SD."""
    st, eb = layout.model.state, layout.elem_bytes
    parts = [full[list(p.held_units(layout.tp, rank))].reshape(-1, st.conv_rows, eb) for p, full in zip(st.conv_projs, full_conv)]
    ds = np.concatenate(parts)  # (channels, rows, element bytes)
    return (ds if layout.conv_layout == "DS" else ds.transpose(1, 0, 2)).tobytes()


class RankMemory:
    """One rank's regions: `num_regions` arrays of `num_pages` logical pages, filled with noise."""

    def __init__(self, layout: EngineLayout, rank: int, num_pages: int, rng: np.random.Generator):
        self.layout, self.rank = layout, rank
        self.regions = [rng.integers(0, 256, num_pages * layout.page_bytes, dtype=np.uint8) for _ in range(layout.num_regions)]

    def kv_token_range(self, block_ids, tokens: range):
        """(region-relative byte offset, size) of every (local head, K|V, token) row for tokens in `tokens`."""
        L = self.layout
        tok = L.model.attention.head_dim * L.elem_bytes
        for t in tokens:
            logical = block_ids[t // L.block_size]
            kernel = logical * L.physical_blocks_per_logical + (t % L.block_size) // L.kernel_block_size
            row = t % L.kernel_block_size
            for slot in range(L.kv_heads_local):
                for k in (0, 1):
                    yield t, slot, k, kernel * L.kernel_page_bytes + slot * L.kv_head_bytes + (k * L.kernel_block_size + row) * tok, tok

    def write_state(self, full: FullState, group_blocks: list[list[int]]) -> None:
        """Write each state layer's shard into its region, on the page of its group's running-state block."""
        L = self.layout
        st = L.model.state
        for gi, group in enumerate(L.groups):
            if group.kind != "state":
                continue
            page = group_blocks[gi][-1] * L.page_bytes
            for region, layer in enumerate(group.layers):
                conv = _conv_bytes(L, self.rank, full.conv[layer])
                ssm = _gather(st.ssm, L.tp, self.rank, full.ssm[layer])
                mem = self.regions[region]
                mem[page : page + len(conv)] = np.frombuffer(conv, np.uint8)
                mem[page + L.ssm_offset : page + L.ssm_offset + len(ssm)] = np.frombuffer(ssm, np.uint8)

    def write_kv(self, full: FullState, group_blocks: list[list[int]], tokens: range) -> None:
        L = self.layout
        heads = L.model.attention.heads
        held = heads.held_units(L.tp, self.rank)
        for gi, group in enumerate(L.groups):
            if group.kind != "attention":
                continue
            for region, layer in enumerate(group.layers):
                mem = self.regions[region]
                for t, slot, k, off, size in self.kv_token_range(group_blocks[gi], tokens):
                    mem[off : off + size] = full.kv[layer][held[slot], k, t]


def execute(plan: RequestPlan, prefill_mem: list[RankMemory], decode_mem: list[RankMemory]) -> int:
    """Run every read of the plan as a memory copy; returns the number of copies (descriptors)."""
    copies = 0
    for rank, reads in enumerate(plan.reads):
        dst = decode_mem[rank]
        for rr in reads:
            for region in rr.regions:
                for remote_rank, ro, lo, size in rr.rows.tolist():
                    src = prefill_mem[remote_rank].regions[region]
                    assert ro >= 0 and ro + size <= len(src), "read outside the prefill region"
                    assert lo >= 0 and lo + size <= len(dst.regions[region]), "write outside the decode region"
                    dst.regions[region][lo : lo + size] = src[ro : ro + size]
                    copies += 1
    return copies

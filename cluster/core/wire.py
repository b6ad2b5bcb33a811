"""Plain-dict (JSON-able) forms of layouts and pair plans, for the trip from the coordinator to the decode workers."""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.core.layout import AttentionShape, CacheGroup, EngineLayout, ModelShape, Proj, StateShape
from cluster.core.planner import UnitRun, PairPlan, Read

# a prefill request's transfer-parameter flag (engine actor -> connector scheduler): prefill the whole prompt and
# sample the first output token, instead of vLLM's hybrid default of stopping one prompt token short
FIRST_TOKEN = "pd_first_token"


def layout_to_dict(layout: EngineLayout) -> dict[str, Any]:
    return dataclasses.asdict(layout)


def model_from_dict(d: dict[str, Any]) -> ModelShape:
    state = d["state"]
    attn = d["attention"]
    return ModelShape(
        architecture=d["architecture"],
        num_layers=d["num_layers"],
        state_layers=tuple(d["state_layers"]),
        attention_layers=tuple(d["attention_layers"]),
        state=StateShape(state["kind"], state["conv_kernel"], tuple(Proj(**p) for p in state["conv_projs"]), Proj(**state["ssm"]))
        if state
        else None,
        attention=AttentionShape(**attn) if attn else None,
    )


def layout_from_dict(d: dict[str, Any]) -> EngineLayout:
    fields = dict(d)
    fields["model"] = model_from_dict(d["model"])
    fields["groups"] = tuple(CacheGroup(g["kind"], tuple(g["layers"])) for g in d["groups"])
    return EngineLayout(**fields)


def pair_to_dict(pair: PairPlan) -> dict[str, Any]:
    return {
        "prefill": layout_to_dict(pair.prefill),
        "decode": layout_to_dict(pair.decode),
        "tp_ratio": pair.tp_ratio,
        "state_reads": [[dataclasses.asdict(r) for r in reads] for reads in pair.state_reads],
        "kv_head_runs": [[dataclasses.asdict(h) for h in runs] for runs in pair.kv_head_runs],
    }


def pair_from_dict(d: dict[str, Any]) -> PairPlan:
    """The plan exactly as negotiated: nothing is re-derived here, so the data path uses what the coordinator sent."""
    return PairPlan(
        prefill=layout_from_dict(d["prefill"]),
        decode=layout_from_dict(d["decode"]),
        tp_ratio=d["tp_ratio"],
        state_reads=tuple(tuple(Read(**r) for r in reads) for reads in d["state_reads"]),
        kv_head_runs=tuple(tuple(UnitRun(**h) for h in runs) for runs in d["kv_head_runs"]),
    )

"""`python -m cluster plan` on every shipped model config and every TP pair, and its `--json` output against the schema
documented in docs/design.md (no engines: the planner alone)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.main import main

CONFIGS = sorted(Path("configs/models").glob("*.json"))
TP = (1, 2, 4, 8)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_plan_json_for_every_tp_pair(config, capsys):
    for p in TP:
        for d in TP:
            assert main(["plan", "--model", str(config), "--prefill-tp", str(p), "--decode-tp", str(d), "--json"]) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["tp_ratio"] == (d // p if d >= p else -(p // d))
            for side, tp in (("prefill", p), ("decode", d)):
                assert out[side]["tp"] == tp
                assert out[side]["conv_rows"] == 3 and len(out[side]["conv_proj_dims"]) == 3
                assert out[side]["conv_state_bytes"] == sum(out[side]["conv_proj_dims"]) * 3 * 2
            assert len(out["reads"]) == d
            for reads in out["reads"]:
                pieces = {r["piece"] for r in reads}
                assert pieces == {"conv0", "conv1", "conv2", "ssm"}
                # every decode rank reads exactly its conv and recurrent state, no more
                assert sum(r["size"] for r in reads if r["piece"] != "ssm") == out["decode"]["conv_state_bytes"]
                assert sum(r["size"] for r in reads if r["piece"] == "ssm") == out["decode"]["ssm_state_bytes"]
                for r in reads:
                    limit = out["prefill"]["ssm_state_bytes" if r["piece"] == "ssm" else "conv_state_bytes"]
                    assert 0 <= r["remote_offset"] and r["remote_offset"] + r["size"] <= limit and 0 <= r["remote_rank"] < p


def test_human_readable_and_errors(tmp_path):
    cmd = [sys.executable, "-m", "cluster", "plan", "--model", "configs/models/qwen3.5-0.8b.json", "--prefill-tp", "2", "--decode-tp", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "tp_ratio 2" in out and "decode rank 3 reads from prefill ranks [1]" in out and "conv_proj_dims" in out
    bad = subprocess.run([*cmd[:-4], "--prefill-tp", "3", "--decode-tp", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "error: q.units: 16 q units cannot be split over TP 3" in bad.stderr
    cfg = json.loads(Path("configs/models/qwen3.5-0.8b.json").read_text())
    del cfg["text_config"]["head_dim"]
    cfg["text_config"]["num_attention_heads"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ok = subprocess.run([*cmd[:5], str(tmp_path), "--prefill-tp", "1", "--decode-tp", "1", "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["prefill"]["kv_heads_local"] == 2


# ---------------------------------------------------------------------------------------------------------------
# `plan --json` against the schema documented in docs/design.md: the doc's table is parsed here and the real command's
# output held to it, so that neither can change without the other.

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
SCHEMA_MARK = "<!-- plan-json-schema"
SIDES = ("prefill", "decode")


def documented_schema() -> dict[str, str]:
    """{key path: type} from the table under the schema marker in docs/design.md. Paths as the doc writes them, with
    `<side>` expanded to prefill and decode and list indices ([d], [i]) written as []."""
    lines = DESIGN.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SCHEMA_MARK))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows[0][:2] == ["key", "type"] and set(rows[1][0]) <= {"-", ":"}, "the schema table's header changed"
    schema: dict[str, str] = {}
    for key, typ, *_ in rows[2:]:
        key = re.sub(r"\[[a-z]\]", "[]", key.strip("`"))
        for k in ([key.replace("<side>", s) for s in SIDES] if "<side>" in key else [key]):
            assert k not in schema, f"{k} documented twice"
            schema[k] = typ
    return schema


def key_paths(value, path: str = "") -> list[tuple[str, object]]:
    """Every (key path, value) of a dict's keys, at any depth; items of a list share the path `<list path>[]`."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            p = f"{path}.{k}" if path else k
            out.append((p, v))
            out += key_paths(v, p)
    elif isinstance(value, list):
        for item in value:
            out += key_paths(item, path + "[]")
    return out


def matches(typ: str, value) -> bool:
    """Whether `value` is of the documented type: int, float, str, bool, object, enum(a, b, ...), list[T]."""
    if typ.startswith("list[") and typ.endswith("]"):
        return isinstance(value, list) and all(matches(typ[5:-1], v) for v in value)
    if typ.startswith("enum(") and typ.endswith(")"):
        return isinstance(value, str) and value in [v.strip() for v in typ[5:-1].split(",")]
    kinds = {"int": int, "float": float, "str": str, "bool": bool, "object": dict}
    assert typ in kinds, f"docs/design.md: unknown type {typ!r} in the plan --json schema"
    return isinstance(value, kinds[typ]) and (typ == "bool" or not isinstance(value, bool))


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory):
    """config.json of each builtin tiny model (`cluster.cli.tiny_circuit.model_config`), one directory per kind."""
    from cluster.cli.tiny_circuit import KINDS, model_config

    root = tmp_path_factory.mktemp("tiny-configs")
    for kind in KINDS:
        (root / kind).mkdir()
        model_config(kind).to_json_file(root / kind / "config.json")
    return root


def plan_json(model_dir: Path, p: int, d: int, layout: str) -> dict:
    cmd = [sys.executable, "-m", "cluster", "plan", "--model", str(model_dir), "--prefill-tp", str(p),
           "--decode-tp", str(d), "--conv-layout", layout, "--tokens", "700", "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


# (kind, prefill TP, decode TP): GDN and Mamba2 both ways and at equal TP, KV heads replicated (gdn-asym at TP 4),
# an attention-only model (no state reads)
PLAN_CASES = [("gdn", 1, 2), ("gdn", 2, 1), ("gdn", 2, 2), ("gdn-asym", 1, 4), ("mamba2", 2, 1), ("mamba2", 1, 2),
              ("attn", 2, 1)]


def test_plan_json_matches_the_documented_schema(tiny_configs):
    schema = documented_schema()
    seen: set[str] = set()
    for kind, p, d in PLAN_CASES:
        for layout in ("SD", "DS"):
            out = plan_json(tiny_configs / kind, p, d, layout)
            for path, value in key_paths(out):
                assert path in schema, f"`plan --json` prints {path!r}, which docs/design.md does not document"
                assert matches(schema[path], value), (
                    f"{kind} P TP {p} -> D TP {d} {layout}: {path} = {value!r} is not the documented {schema[path]}")
                seen.add(path)
            assert out["prefill"]["conv_layout"] == out["decode"]["conv_layout"] == layout
            assert len(out["reads"]) == len(out["kv_head_runs"]) == len(out["remote_ranks"]) == d
            for key in ("state_descriptors_per_layer", "descriptors", "descriptors_uncoalesced", "bytes"):
                assert len(out["request"].get(key, out.get(key))) == d
    missing = sorted(set(schema) - seen)
    assert not missing, f"docs/design.md documents keys that `plan --json` never prints: {missing}"


@pytest.mark.parametrize("kind,p,d", [c for c in PLAN_CASES if c[0] != "attn"], ids=lambda c: str(c))
def test_conv_state_is_read_per_row_in_sd_and_per_run_in_ds(tiny_configs, kind, p, d):
    """The documented `piece` semantics: in the SD layout every conv read of the DS layout becomes `conv_rows` reads,
    one per conv row, each a row stride further on both sides; the recurrent state reads are the same in both."""
    sd, ds = plan_json(tiny_configs / kind, p, d, "SD"), plan_json(tiny_configs / kind, p, d, "DS")
    rows = sd["decode"]["conv_rows"]
    stride = {side: sd[side]["conv_state_bytes"] // rows for side in SIDES}  # one row: every channel of the rank
    for rank in range(d):
        for piece in {r["piece"] for r in ds["reads"][rank]}:
            sd_reads = [r for r in sd["reads"][rank] if r["piece"] == piece]
            ds_reads = [r for r in ds["reads"][rank] if r["piece"] == piece]
            if piece == "ssm":
                assert sd_reads == ds_reads
                continue
            assert len(sd_reads) == rows * len(ds_reads)
            assert sum(r["size"] for r in sd_reads) == sum(r["size"] for r in ds_reads)
            for run in range(len(ds_reads)):  # SD reads of one run: its rows, in order
                per_row = sd_reads[run * rows:(run + 1) * rows]
                assert len({(r["remote_rank"], r["size"]) for r in per_row}) == 1
                for a, b in zip(per_row, per_row[1:]):
                    assert b["remote_offset"] - a["remote_offset"] == stride["prefill"]
                    assert b["local_offset"] - a["local_offset"] == stride["decode"]

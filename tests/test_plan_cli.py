"""`python -m cluster plan` on every shipped model config and every TP pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.__main__ import main

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

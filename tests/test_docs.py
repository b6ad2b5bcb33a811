"""The README and docs/ against the repository (no engines): the README stays a guide (its first lines the two make
commands, at most 300 lines), links and anchors resolve, the files the docs name exist, the `python -m cluster`
commands they show take the options they are shown with, and the deploy.yaml fields they name are fields."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text(path: Path) -> str:
    return path.read_text()


def test_readme_is_a_short_guide_that_starts_with_the_two_commands():
    lines = text(ROOT / "README.md").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert lines.index("```bash") <= 2 and [line.split()[:2] for line in block] == [["make", "run"], ["make", "test"]]
    makefile = text(ROOT / "Makefile")
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", text(path), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", body, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_anchors_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", text(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        assert dest.exists(), f"{doc.name}: link to {target} - no such file"
        if anchor:
            assert anchor in anchors(dest), f"{doc.name}: link to {target} - no such heading in {dest.name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_exist(doc):
    for path in set(re.findall(r"`((?:cluster|actors|tests|configs|scripts|docs)/[\w./*<>-]+)`", text(doc))):
        if "<" in path:
            continue
        assert list(ROOT.glob(path)), f"{doc.name} names {path}, which is not in the repository"


HELP = {  # where each `python -m cluster` command's own options are parsed
    "bench": "from cluster.cli.bench import main; main({args})",
    # a tiny model (--kind) or a real architecture (--config): two parsers, both listed
    "build-model": "from cluster.cli import tiny_model, real_model\nfor m in (tiny_model, real_model):\n"
                   "    try:\n        m.main({args})\n    except SystemExit:\n        pass",
}


def help_text(*words: str) -> str:
    """`-h` of `python -m cluster <words>`, from the parser that owns the command's options."""
    if words[0] in HELP:
        argv = [sys.executable, "-c", HELP[words[0]].format(args=[*words[1:], "-h"])]
    else:
        argv = [sys.executable, "-m", "cluster", *words, "-h"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cluster_commands_take_the_options_they_are_shown_with():
    bench_help = help_text("bench")
    shown: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        for cmd in re.findall(r"python -m cluster ((?:bench )?[a-z0-9-]+)([^`\n|#]*)", text(doc)):
            words = tuple(cmd[0].split())
            shown.setdefault(words, set()).update(re.findall(r"(--[a-z][a-z-]*)", cmd[1]))
    assert ("bench", "goodput") in shown and ("plan",) in shown
    for words, options in shown.items():
        if words[0] == "bench":
            assert re.search(rf"\b{words[1]}\b", bench_help), f"docs show `bench {words[1]}`, not a benchmark"
        usage = help_text(*words)
        for option in options:
            assert option in usage, f"docs show `python -m cluster {' '.join(words)} {option}`, which it does not take"


def config_fields() -> set[str]:
    from pydantic import BaseModel

    from cluster.core import config

    names: set[str] = set()
    for obj in vars(config).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel):
            names |= set(obj.model_fields)
    return names


def test_deploy_fields_in_the_docs_are_fields():
    fields = config_fields()
    tables = [text(ROOT / "README.md").split("### deploy.yaml")[1].split("###")[0],
              text(ROOT / "docs" / "operations.md").split("## Configuration reference")[1].split("\n## ")[0]]
    named = 0
    for table in tables:
        for line in table.splitlines():
            if not line.startswith("| `"):
                continue
            for token in re.findall(r"`([*a-z_.]+)`", line.split("|")[1]):
                parts = [p for p in token.split(".") if p and p != "*"]
                unknown = [p for p in parts if p not in fields and p not in ("prefill", "decode")]
                assert not unknown, f"deploy.yaml has no field {token!r} (named in the docs)"
                named += 1
    assert named > 30

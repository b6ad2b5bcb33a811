"""The code's layers and the one direction its imports run, read from the source (every import statement, the ones
inside functions included):

    cluster/*.py     entry points: the launcher, `python -m cluster` (plan, bench), the benchmark clients
      -> actors/     the Ray runtime: engine, coordinator, pool and front-end actors, the router, the connector
        -> cluster/core/   the pure core: shapes, layouts, planner, registry, deploy config, wire format

A module imports from its own layer or the ones below it, never above; the core imports neither Ray nor vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "actors": 1, "entry": 2}


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return "core" if rel[:2] == ("cluster", "core") else "actors" if rel[0] == "actors" else "entry"


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "actors":
        return "actors"
    if parts[0] == "cluster":
        return "core" if parts[1:2] == ["core"] else "entry" if len(parts) > 1 else None
    return None


def imports(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text())


def imports_in(source: str) -> list[tuple[int, str]]:
    """(line, module or module.name) of every absolute import in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from cluster import bench` names modules, `from cluster.core.x import y` names objects
            out += [(node.lineno, f"{node.module}.{a.name}" if node.module in ("cluster", "cluster.core", "actors") else node.module)
                    for a in node.names]
    return out


SOURCES = sorted([*ROOT.glob("cluster/**/*.py"), *ROOT.glob("actors/*.py")])


def test_every_source_is_in_a_layer():
    assert {layer_of_file(p) for p in SOURCES} == set(LAYERS)
    assert any(layer_of_file(p) == "core" for p in SOURCES) and len(SOURCES) > 20


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    mine = layer_of_file(path)
    upward = [(line, name) for line, name in imports(path)
              if (target := layer_of_module(name)) is not None and LAYERS[target] > LAYERS[mine]]
    assert not upward, f"{path.relative_to(ROOT)} ({mine}) imports from a layer above it: {upward}"
    if mine == "core":
        runtime = [(line, name) for line, name in imports(path) if name.split(".")[0] in ("ray", "vllm")]
        assert not runtime, f"{path.relative_to(ROOT)} is in the pure core but imports {runtime}"


def test_the_check_sees_an_upward_import():
    """The oracle can fail: what a core module importing the router, Ray and a sibling would be judged."""
    names = [n for _, n in imports_in("from actors.router import Router\nimport ray\nfrom cluster import launch\n"
                                      "def f():\n    from cluster.core.planner import plan_pair\n")]
    assert names == ["actors.router", "ray", "cluster.launch", "cluster.core.planner"]
    assert [layer_of_module(n) for n in names] == ["actors", None, "entry", "core"]

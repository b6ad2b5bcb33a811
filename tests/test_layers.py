"""The code's layers and the one direction its imports run, read from the source (every import statement, the ones
inside functions included):

    cluster/cli/ (and cluster/__main__.py)   entry points: the command line, the launcher, the benchmarks, tiny models
      -> actors/         the Ray runtime, one subpackage per part, each importing only from those before it:
                           host -> clients -> engine -> control -> frontend (`ACTOR_PARTS` below; actors/__init__.py
                           says what each part is)
        -> cluster/core/     the pure core: shapes, layouts, planner, registry, deploy config, wire format

Each directory holds one layer. `python tests/test_layers.py` draws the directories and the imports between them.

A module imports from its own layer or the ones below it, never above; the core imports neither Ray, vLLM, NIXL nor
the model stack (torch, transformers). And no
module but `actors/clients/engine_client.py` calls an engine actor's methods, and none but
`actors/clients/coordinator_client.py` the coordinator's: everything else talks to them through `EngineClient` and
`CoordinatorClient`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "actors": 1, "entry": 2}
# the core stays light: no runtime and no model stack (the tiny-model builder, torch and transformers, is an entry
# point)
CORE_NEVER_IMPORTS = ("ray", "vllm", "torch", "transformers", "tokenizers", "safetensors", "nixl")


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return "core" if rel[:2] == ("cluster", "core") else "actors" if rel[0] == "actors" else "entry"


def directory_of(name: str) -> str | None:
    """The source directory of module `name` (`cluster.core.planner` -> cluster/core); None outside the project."""
    parts = name.split(".")
    if parts[0] not in ("cluster", "actors"):
        return None
    for cut in range(len(parts), 0, -1):
        if (ROOT.joinpath(*parts[:cut])).is_dir():
            return "/".join(parts[:cut])
    return None


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "actors":
        return "actors"
    if parts[0] == "cluster":
        return "core" if parts[1:2] == ["core"] else "entry" if parts[1:2] in (["cli"], ["__main__"]) else None
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
            # `from cluster.cli import bench` names modules, `from cluster.core.x import y` names objects
            out += [(node.lineno, f"{node.module}.{a.name}" if node.module in ("cluster", "cluster.core", "cluster.cli", "actors") else node.module)
                    for a in node.names]
    return out


SOURCES = sorted([*ROOT.glob("cluster/**/*.py"), *ROOT.glob("actors/**/*.py")])
TESTS = sorted(ROOT.glob("tests/**/*.py"))
# the parts of actors/, in the order their imports may run (a part imports from itself and the parts before it)
ACTOR_PARTS = {"host": 0, "clients": 1, "engine": 2, "control": 3, "frontend": 4}


def test_every_source_is_in_a_layer():
    assert {layer_of_file(p) for p in SOURCES} == set(LAYERS)
    assert any(layer_of_file(p) == "core" for p in SOURCES) and len(SOURCES) > 20


def test_each_directory_is_one_layer():
    """A directory's modules are all of one layer (cluster/ itself holds only `python -m cluster`'s two lines)."""
    by_dir: dict[str, set[str]] = {}
    for path in SOURCES:
        by_dir.setdefault(str(path.parent.relative_to(ROOT)), set()).add(layer_of_file(path))
    mixed = {d: layers for d, layers in by_dir.items() if len(layers) > 1}
    assert not mixed, f"directories holding more than one layer: {mixed}"
    assert sorted(p.name for p in (ROOT / "cluster").glob("*.py")) == ["__init__.py", "__main__.py"]


def picture() -> dict[str, dict[str, int]]:
    """{directory: {directory it imports: how many import statements}} over the project's sources."""
    edges: dict[str, dict[str, int]] = {}
    for path in SOURCES:
        mine = str(path.parent.relative_to(ROOT))
        for _, name in imports(path):
            target = directory_of(name)
            if target is not None and target != mine:
                edges.setdefault(mine, {}).setdefault(target, 0)
                edges[mine][target] += 1
    return edges


def test_the_picture_has_no_arrow_up():
    edges = picture()
    rank = {d: LAYERS[layer_of_file(ROOT / d / "x.py")] for d in edges}
    up = [(a, b) for a, targets in edges.items() for b in targets
          if LAYERS[layer_of_file(ROOT / b / "x.py")] > rank[a]]
    assert not up and "cluster/core" in edges["cluster/cli"], (up, edges)
    assert any(d.startswith("actors/") for d in edges["cluster/cli"]), edges


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    mine = layer_of_file(path)
    upward = [(line, name) for line, name in imports(path)
              if (target := layer_of_module(name)) is not None and LAYERS[target] > LAYERS[mine]]
    assert not upward, f"{path.relative_to(ROOT)} ({mine}) imports from a layer above it: {upward}"
    if mine == "core":
        runtime = [(line, name) for line, name in imports(path) if name.split(".")[0] in CORE_NEVER_IMPORTS]
        assert not runtime, f"{path.relative_to(ROOT)} is in the pure core but imports {runtime}"


def part_of(name: str) -> str | None:
    """The part of actors/ module `name` is in (`actors.engine.actor` -> engine); None outside actors/."""
    parts = name.split(".")
    return parts[1] if parts[0] == "actors" and len(parts) > 1 and parts[1] in ACTOR_PARTS else None


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_are_absolute(path):
    """The checks here read absolute imports: a relative one (`from .x import y`) would pass them unseen."""
    relative = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, f"{path.relative_to(ROOT)} has relative imports at lines {relative}"


def test_every_actors_module_is_in_a_part():
    """actors/ holds its parts' folders and nothing else (its __init__ says what each is)."""
    actors = [p.relative_to(ROOT / "actors") for p in SOURCES if p.parts[len(ROOT.parts)] == "actors"]
    loose = [str(p) for p in actors if len(p.parts) == 1 and p.name != "__init__.py"]
    assert not loose, f"modules of actors/ outside its parts: {loose}"
    assert {p.parts[0] for p in actors if len(p.parts) > 1} == set(ACTOR_PARTS)
    assert all((ROOT / "actors" / part / "__init__.py").read_text().startswith('"""') for part in ACTOR_PARTS)


ACTOR_SOURCES = [p for p in SOURCES if p.parts[len(ROOT.parts)] == "actors" and p.parent.name in ACTOR_PARTS]


@pytest.mark.parametrize("path", ACTOR_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_actors_parts_import_in_order(path):
    mine = ACTOR_PARTS[path.parent.name]
    later = [(line, name) for line, name in imports(path)
             if (part := part_of(name)) is not None and ACTOR_PARTS[part] > mine]
    assert not later, f"{path.relative_to(ROOT)} ({path.parent.name}) imports from a part after it: {later}"


def test_the_part_check_sees_a_later_part():
    names = [n for _, n in imports_in("from actors.frontend.router import Router\nfrom actors.host.cores import x\n")]
    assert [part_of(n) for n in names] == ["frontend", "host"] and part_of("cluster.core.planner") is None


def test_the_check_sees_an_upward_import():
    """The oracle can fail: what a core module importing the router, Ray and a sibling would be judged."""
    names = [n for _, n in imports_in("from actors.frontend.router import Router\nimport ray\n"
                                      "from cluster.cli import launch\n"
                                      "def f():\n    from cluster.core.planner import plan_pair\n")]
    assert names == ["actors.frontend.router", "ray", "cluster.cli.launch", "cluster.core.planner"]
    assert [layer_of_module(n) for n in names] == ["actors", None, "entry", "core"]


# ---- engines are reached only through actors/clients/engine_client.py ------------------------------------------
CLIENT = ROOT / "actors" / "clients" / "engine_client.py"


def remote_methods(classes: set[str] | None = None, exclude: set[str] = frozenset()) -> set[str]:
    """Public method names of the classes named `classes` (None: every class) in actors/ and cluster/."""
    names: set[str] = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (classes is None or node.name in classes) and node.name not in exclude:
                names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not f.name.startswith("_")}
    return names


ENGINE_CLASSES = {"EngineActor"}  # the one class whose methods Ray exposes
# the components an engine actor is made of: the actor's methods hand their calls to theirs (same names)
ENGINE_PARTS = {"EngineServing", "EnginePairs", "EngineVerify", "EngineLoad", "EngineProcesses"}
# engine methods no other class has (a coordinator's `register` or a transfer side's `checksums` stay out of the check)
ENGINE_ONLY = remote_methods(ENGINE_CLASSES) - remote_methods(None, exclude=ENGINE_CLASSES | ENGINE_PARTS | {"EngineClient"})


def actor_calls(source: str) -> list[tuple[int, str]]:
    """(line, method) of every `x.method.remote(...)` and `x.method.options(...).remote(...)` in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"):
            continue
        target = node.func.value
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "options":
            target = target.func.value
        if isinstance(target, ast.Attribute):
            out.append((node.lineno, target.attr))
    return out


@pytest.mark.parametrize("path", [p for p in sorted([*SOURCES, *TESTS]) if p != CLIENT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_engines_are_called_only_through_the_engine_client(path):
    calls = [(line, m) for line, m in actor_calls(path.read_text()) if m in ENGINE_ONLY]
    assert not calls, f"{path.relative_to(ROOT)} calls engine actor methods directly (use EngineClient): {calls}"


def test_the_engine_client_check_sees_a_direct_call():
    """The oracle can fail: the engine methods it knows, and what a direct call would be judged."""
    assert {"prefill", "submit_decode", "decode_channel", "load", "busy", "transfer_totals"} <= ENGINE_ONLY
    assert "register" not in ENGINE_ONLY  # the coordinator has one too
    source = "h.load.remote()\nh.decode_channel.options(num_returns='streaming').remote('c')\nclient.load()\n"
    assert [m for _, m in actor_calls(source) if m in ENGINE_ONLY] == ["load", "decode_channel"]


def test_every_engine_method_has_a_client_method():
    from actors.clients.engine_client import EngineClient

    assert not remote_methods(ENGINE_CLASSES) - set(dir(EngineClient)), "engine methods EngineClient does not offer"


# ---- the coordinator is reached only through actors/clients/coordinator_client.py ------------------------------
COORDINATOR_CLIENT = ROOT / "actors" / "clients" / "coordinator_client.py"


def actor_classes() -> set[str]:
    """Classes whose methods are called with `.remote`: Ray actors and Serve deployments (by decorator)."""
    names = set(ENGINE_CLASSES)
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any("remote" in ast.unparse(d) or "deployment" in ast.unparse(d)
                                                      for d in node.decorator_list):
                names.add(node.name)
    return names


# coordinator methods no other actor has (plain classes' names - the router's `routes` - do not count)
COORDINATOR_ONLY = remote_methods({"CoordinatorActor"}) - remote_methods(actor_classes() - {"CoordinatorActor"})


@pytest.mark.parametrize("path", [p for p in sorted([*SOURCES, *TESTS]) if p != COORDINATOR_CLIENT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_coordinator_is_called_only_through_its_client(path):
    calls = [(line, m) for line, m in actor_calls(path.read_text()) if m in COORDINATOR_ONLY]
    assert not calls, f"{path.relative_to(ROOT)} calls coordinator actor methods directly (use CoordinatorClient): {calls}"


def test_the_coordinator_client_check_sees_a_direct_call():
    """The oracle can fail: the coordinator methods it knows, and what a direct call would be judged."""
    assert "CoordinatorActor" in actor_classes() and "HTTPFrontend" in actor_classes()
    assert {"routes", "describe", "engine_failed", "claim_engine_id", "pool_events", "deregister"} <= COORDINATOR_ONLY
    source = "c.routes.remote()\nc.engine_failed.options(name='x').remote('d')\nclient.routes()\n"
    assert [m for _, m in actor_calls(source) if m in COORDINATOR_ONLY] == ["routes", "engine_failed"]


def test_every_coordinator_method_has_a_client_method():
    from actors.clients.coordinator_client import CoordinatorClient

    assert not remote_methods({"CoordinatorActor"}) - set(dir(CoordinatorClient)), \
        "coordinator methods CoordinatorClient does not offer"


# ---- the connector's workers: one module names their methods -----------------------------------------------------
def _worker_methods() -> tuple[set[str], set[str]]:
    """(the `pd_` methods `PlannedPullWorker` defines, the names `PD_METHODS` lets `pd_call` run), read from the
    source (importing the connector would import vLLM)."""
    tree = ast.parse((ROOT / "actors" / "engine" / "connector.py").read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PlannedPullWorker")
    defined = {f.name for f in worker.body if isinstance(f, ast.FunctionDef) and f.name.startswith("pd_")}
    allowed = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PD_METHODS")
    return defined, {c.value for c in ast.walk(allowed.value) if isinstance(c, ast.Constant)}


def test_every_connector_worker_method_has_a_ranks_method():
    """`ConnectorRanks` (what the engine actor calls) and the worker's `pd_` methods (what runs on each rank) are the
    same set, and `pd_call` runs exactly those."""
    from actors.engine.connector_ranks import ConnectorRanks

    defined, allowed = _worker_methods()
    ranks = {f"pd_{name}" for name in vars(ConnectorRanks) if not name.startswith("_")}
    assert defined == allowed == ranks, (defined ^ ranks, allowed ^ ranks)


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name not in ("connector.py", "connector_ranks.py")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_but_the_ranks_names_a_worker_method(path):
    _, allowed = _worker_methods()
    named = [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Constant) and n.value in allowed]
    assert not named, f"{path.relative_to(ROOT)} names connector worker methods (call them through ConnectorRanks): {named}"


def test_the_worker_method_check_sees_a_name():
    _, allowed = _worker_methods()
    source = 'async def f(self):\n    return await self._call("pd_install_pair", 1)\n'
    assert [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and n.value in allowed] == \
        ["pd_install_pair"]


if __name__ == "__main__":  # the import picture: each directory, its layer, and the directories it imports
    for d, targets in sorted(picture().items(), key=lambda kv: -LAYERS[layer_of_file(ROOT / kv[0] / "x.py")]):
        print(f"{d:22} ({layer_of_file(ROOT / d / 'x.py')})  -> " + ", ".join(f"{t} ({n})" for t, n in sorted(targets.items())))

"""Shared pieces of the real-size tests: vLLM's own server as the oracle (`cluster.cli.oracle`), prompts, and each
whole byte class of a transfer overwritten with noise."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import ray

from cluster.cli.oracle import TOLERANCE, Checked, reference_gaps
from tests.pd_helpers import CONTROL, PDCluster, gather, run_pair, whole_byte_classes

MAX_TOKENS = 8


@contextmanager
def vllm_server(model_dir, name: str):
    """vLLM's own OpenAI server on `model_dir` (`cluster.cli.bench.targets.server_process`: eager, bfloat16, 2048
    tokens, no prefix caching), started at once; yields a function that waits for it to answer (so that it starts
    while the engines do) and returns an `openai.OpenAI` client. Stopped on exit."""
    import tempfile
    from pathlib import Path

    import openai

    from actors.engine.settings import free_port
    from cluster.cli.bench.targets import server_process, stop_processes, wait_http

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="hpd-reference-")) / "server.log"
    proc = server_process(str(model_dir), name, 1, port, log)

    def ready():
        try:
            took = wait_http(f"http://127.0.0.1:{port}", [proc], 600)
        except Exception:
            print(log.read_text()[-4000:])
            raise
        print(f"vLLM's server on {name}: answering after another {took:.0f} s")
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=600)

    try:
        yield ready
    finally:
        stop_processes([proc])


@contextmanager
def real_pd(build: str, layout: list[tuple[str, int]], namespace: str, **cluster_kwargs):
    """A real-size build (`cluster.cli.real_model.BUILT`, built on first use), vLLM's server on it started first and
    the engines of `layout` (`PDCluster`, `cluster_kwargs` to it) meanwhile; yields (the cluster, its `Reference`)."""
    from cluster.cli.real_model import ensure_real_model

    model = ensure_real_model(build)
    with vllm_server(model, f"{build}-ref") as ready:
        cluster = PDCluster(model, layout, namespace, **cluster_kwargs)
        try:
            print(f"engine startup seconds: {cluster.startup_s}")
            yield cluster, Reference(ready(), f"{build}-ref")
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def pd(served) -> PDCluster:
    """The module's cluster: each real-size module defines `served` with `real_pd` and imports this fixture."""
    return served[0]


@pytest.fixture(scope="module")
def reference(served) -> "Reference":
    """vLLM's server on the module's build (see `pd`)."""
    return served[1]


class Reference:
    """vLLM's server as the oracle: teacher-forced gaps of (prompt, output), each pair asked once."""

    def __init__(self, client, name: str):
        self.client, self.name, self._seen = client, name, {}

    def check(self, prompt: list[int], output: list[int]) -> Checked:
        key = (tuple(prompt), tuple(output))
        if key not in self._seen:
            self._seen[key] = reference_gaps(self.client, self.name, prompt, output)
        return Checked(list(prompt), list(output), self._seen[key])

    def assert_right(self, prompt: list[int], output: list[int], what: str) -> None:
        assert len(output) == MAX_TOKENS, f"{what}: {len(output)} tokens, {MAX_TOKENS} asked for"
        got = self.check(prompt, output)
        bad = got.first_over(TOLERANCE)
        assert bad is None, (f"{what}: token {bad} of {output} is {got.gaps[bad]:.2f} nats below vLLM's top choice "
                             f"(gaps {[round(g, 2) for g in got.gaps]})")


def document(seed: int, n: int) -> list[int]:
    """BOS and n - 1 seeded random token ids (any but the specials)."""
    from cluster.cli.tiny_circuit import VOCAB_SIZE

    rng = random.Random(seed)
    return [1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(n - 1)]


def block_size(pd: PDCluster) -> int:
    sizes = {r["layout"]["block_size"] for h in pd.engines.values() for r in ray.get(h.registration()).ranks}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def corrupted_classes(pd: PDCluster, reference: Reference, prefill: str, decode_key: tuple[str, int],
                      length: int, seed: int) -> dict[str, Checked]:
    """Each whole byte class of the transfer (conv, recurrent, attention K, attention V, the padding control)
    overwritten with noise on the decode engine right after its read lands, first token from the decode engine (it
    reads the state after all but the last prompt token, so every output token depends on what it read): the
    teacher-forced result of each. Each class gets a prompt of its own (`length` tokens), so that no engine's prefix
    cache serves one class's request from another's (a hit would leave fewer pages read, and noise with them)."""
    decode = pd.engines[decode_key]
    router = pd.routers["decode"]
    out = {}
    for i, (name, specs) in enumerate(whole_byte_classes(ray.get(decode.registration())).items()):
        ray.get(decode.transfer_stats())  # (drained: the next call lists this request's reads only)
        ray.get(decode.corrupt_next_read(specs, 100 + i))
        prompt = document(seed + i, length)
        output = gather([run_pair(router, prefill, pd.engine_id(*decode_key), prompt, MAX_TOKENS)])[0]
        reads = ray.get(decode.transfer_stats())
        assert reads and all(r["ok"] for r in reads), f"{name}: the request read nothing, so the noise waits: {reads}"
        out[name] = reference.check(prompt, output)
    return out


def assert_every_class_seen(results: dict[str, Checked]) -> None:
    print("worst teacher-forced gap (nats) with each byte class overwritten:",
          {name: round(r.worst, 2) for name, r in results.items()})
    assert {"conv", "recurrent", "attention K", "attention V"} <= set(results)
    unseen = {name: [round(g, 2) for g in r.gaps] for name, r in results.items()
              if name != CONTROL and r.first_over(TOLERANCE) is None}
    assert unseen == {}, f"noise in these byte classes passed the oracle: {unseen}"
    if CONTROL in results:
        assert results[CONTROL].first_over(TOLERANCE) is None, "noise in bytes the model never reads changed the output"

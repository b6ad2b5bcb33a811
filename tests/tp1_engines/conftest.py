"""One set of engines for this folder's two modules, started once: a coordinator and four TP 1 engines of the tiny
GDN hybrid (prefill-a, prefill-b, decode-a, decode-b) that share the 2 cores.

What each module needs of them, both set for both: prefix caching with small block pools, so that eviction comes
soon (test_cache_routing.py), and an engine that judges itself stuck within STALL_S past its slowest step plus a
coordinator that takes out an engine silent for UNRESPONSIVE_S (test_hung_engines.py). test_cache_routing.py runs
first (pytest's order in a folder): test_hung_engines.py takes engines out of the coordinator as it goes, and says
which it expects. Either module run alone starts the engines for itself."""

from __future__ import annotations

import pytest

from tests.tp1_engines.shared import Engines


@pytest.fixture(scope="package")
def tp1_engines(ray_local, gdn_model) -> Engines:
    engines = Engines(str(gdn_model))
    yield engines
    engines.stop()

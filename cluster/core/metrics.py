"""Prometheus metrics of the HTTP service: its own request counters and latency histograms, plus the cluster's state
(pool sizes, transfer totals) collected from the coordinator and engines when /metrics is scraped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: they double the output and nobody graphs them


def sample_value(text: str, name: str) -> str | None:
    """The value of the series `name` (with its labels, when it has any: 'pd_degraded{role="prefill"}') in a scraped
    /metrics page; None when the page has none."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return line.rsplit(" ", 1)[1]
    return None


@dataclass
class TransferTotals:
    """An engine's running totals since it started (`EngineActor.transfer_totals`; the front end sums them over the
    engines for /metrics): a decode engine's reads - one transfer per request and decode rank (a read that found its
    whole prompt in the decode engine's own cache moves nothing and is not counted), bytes, descriptors, seconds in
    NIXL -, its `transfer.verify` outcomes and seconds, any engine's prompt tokens found in its own prefix cache
    (a prefill engine: not computed; a decode engine: not read), and what it computed and predicted."""

    transfers: int = 0
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    verified: int = 0
    verify_failures: int = 0
    verify_seconds: float = 0.0
    cached_prompt_tokens: int = 0
    # cache-aware routing's check (`cluster.core.prefix`): prompt tokens an engine computed itself (past its prefix
    # cache's hit), the hit its prefix record predicted, and the prefills whose real hit differed from the prediction
    computed_prompt_tokens: int = 0
    predicted_prompt_tokens: int = 0
    mispredicted: int = 0

    def __add__(self, other: TransferTotals) -> TransferTotals:
        return TransferTotals(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})


# what /metrics exports of the summed TransferTotals, as pd_transfer_<field>
TRANSFER_COUNTERS = {
    "transfers": "NIXL transfers completed (one per request and decode rank)",
    "bytes": "Bytes read over NIXL by decode engines",
    "descriptors": "NIXL descriptors posted by decode engines",
    "seconds": "Seconds spent in NIXL transfers (sum over decode ranks)",
    "verified": "Requests whose transferred bytes matched the prefill side's (transfer.verify)",
    "verify_failures": "Requests whose transferred bytes differed from the prefill side's (failed before their first "
                       "token, transfer.verify)",
}


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServiceMetrics:
    """One registry per HTTP front end. `cluster_state` is set by the caller just before each scrape:
    {"pools": {(role, state): count}, "transfers": TransferTotals summed over the engines, "cached_prompt_tokens":
    {role: n}, "retried": n, "failed_over": n, "first_from_prefill": n, "local_prefill": n,
    "colocated": {role: n}, "degraded": role serving whole requests or None,
    "scaling": the coordinator's `pools()` (decision counts, each pool's latest signal, the last decisions)}."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pd_requests", "Generation requests by outcome (HTTP status, or disconnected)",
                                ["status"], registry=r)
        self.disconnects = Counter("pd_client_disconnects", "Requests whose client went away before the end", registry=r)
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter("pd_completion_tokens", "Generated tokens", registry=r)
        self.inflight = Gauge("pd_requests_in_flight", "Requests being served now", registry=r)
        self.ttft = Histogram("pd_time_to_first_token_seconds", "Request received to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pd_inter_token_latency_seconds", "Time between consecutive tokens of a request", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pd_request_seconds", "Request received to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.cluster_state: dict[str, Any] = {}
        r.register(_ClusterCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ClusterCollector:
    def __init__(self, owner: ServiceMetrics):
        self.owner = owner

    def collect(self):
        state = self.owner.cluster_state
        pools = GaugeMetricFamily("pd_pool_engines", "Engines registered with the coordinator", labels=["role", "state"])
        for (role, st), n in sorted(state.get("pools", {}).items()):
            pools.add_metric([role, st], n)
        yield pools
        scaling = state.get("scaling", {})
        decisions = CounterMetricFamily("pd_scaling_decisions", "Autoscaling decisions by pool and direction",
                                        labels=["role", "direction"])
        for d in scaling.get("decisions", []):
            decisions.add_metric([d["role"], d["direction"]], float(d["count"]))
        yield decisions
        target = GaugeMetricFamily("pd_pool_target_engines", "Engines each pool's autoscaler aims for", labels=["role"])
        load = GaugeMetricFamily("pd_pool_load", "Each pool's autoscaling signal, summed over its engines "
                                 "(cache_usage: the fullest engine)", labels=["role", "signal"])
        for role, sig in sorted(scaling.get("signals", {}).items()):
            target.add_metric([role], float(sig.get("target", 0)))
            for name in ("queued_prompt_tokens", "running_requests", "cache_usage"):
                if name in sig:
                    load.add_metric([role, name], float(sig[name]))
        yield target
        yield load
        last = GaugeMetricFamily("pd_pool_last_scaling_decision_timestamp_seconds",
                                 "When each pool last scaled, with the decision and its reason",
                                 labels=["role", "direction", "before", "after", "reason"])
        latest: dict[str, dict[str, Any]] = {}
        for d in scaling.get("last_decisions", []):
            latest[d["role"]] = d
        for role, d in sorted(latest.items()):
            last.add_metric([role, d["direction"], str(d["before"]), str(d["after"]), d["reason"]], float(d["time"]))
        yield last
        for name, key, help_ in (
                ("pd_requests_retried", "retried", "Requests retried on another pair after an engine failure"),
                ("pd_requests_failed_over", "failed_over", "Streams continued on another pair after their engine "
                 "failed mid-stream"),
                ("pd_requests_waited_for_engine", "waited_for_capacity", "Streams failing over that found no "
                 "ready engine and waited for one to join (routing.failover_wait_s)"),
                ("pd_engines_avoided", "suspected", "Engines a request found stuck (alive, not serving) that new "
                 "requests then avoided where another engine could serve them, for PD_ENGINE_UNRESPONSIVE_S"),
                ("pd_requests_on_last_routes", "stale_routed", "Requests routed on the coordinator's last routes "
                 "while it did not answer (restarting)"),
                ("pd_first_tokens_from_prefill", "first_from_prefill", "Requests whose first token the prefill "
                 "engine sampled (transfer.first_token_from_prefill); the others' came from the decode engine"),
                ("pd_routing_views", "routing_views", "Cache-aware choices that asked the engines what they hold "
                 "(routing.policy cache, more than one engine to choose from)"),
                ("pd_routing_unasked", "routing_unasked", "Cache-aware choices that did not ask the engines: none "
                 "of them may hold the prompt's first block (routed on load at once)"),
                ("pd_routing_view_seconds", "routing_view_seconds", "Seconds those choices waited for the engines' "
                 "answers (the routing's own cost in time to first token)"),
                ("pd_routing_view_failures", "routing_view_failures", "Engines that did not answer what they hold "
                 "within 0.5 s (the choice went on without them)"),
                ("pd_requests_local_prefill", "local_prefill", "Requests their decode engine prefilled itself, with no "
                 "transfer: it reached the first token sooner (transfer.local_prefill_speed), their prefill engine was "
                 "backlogged (transfer.local_prefill_queue), their decode engine idle (transfer.local_prefill_when_idle) "
                 "or it resumed a longer prefix")):
            counter = CounterMetricFamily(name, help_)
            counter.add_metric([], float(state.get(key, 0)))
            yield counter
        routing = CounterMetricFamily("pd_routing_decisions", "Prefill engines chosen by this front end's router, by "
                                      "reason: hit (the engine resumes a prefix), spread (a longer prefix sits on a "
                                      "busier engine), load (nobody holds any of the prompt; or routing.policy load), "
                                      "only (one prefill engine could take it), local (its decode engine resumes more of it "
                                      "and prefills it itself)",
                                      labels=["reason"])
        for reason, n in sorted(state.get("routing", {}).items()):
            routing.add_metric([reason], float(n))
        yield routing
        per_pool = (  # (family, name, help, value of a pool)
            (CounterMetricFamily, "pd_requests_colocated", "Requests served whole by one engine while no prefill/decode "
             "pair was ready (degraded mode), by that engine's pool", lambda r: state.get("colocated", {}).get(r, 0)),
            (GaugeMetricFamily, "pd_degraded", "1 while requests are served whole by one pool's engines (no "
             "prefill/decode pair ready), by that pool", lambda r: state.get("degraded") == r),
            (CounterMetricFamily, "pd_cached_prompt_tokens", "Prompt tokens an engine found in its own prefix cache (a "
             "prefill engine: not computed; a decode engine: not read), by pool",
             lambda r: state.get("cached_prompt_tokens", {}).get(r, 0)),
            (CounterMetricFamily, "pd_computed_prompt_tokens", "Prompt tokens an engine computed itself (past its "
             "prefix cache's hit; a decode engine: those it prefilled itself), by pool",
             lambda r: state.get("computed_prompt_tokens", {}).get(r, 0)),
            (CounterMetricFamily, "pd_prefix_predicted_tokens", "Prompt tokens the engines' prefix records predicted "
             "a prefill would resume (cache-aware routing), by pool",
             lambda r: state.get("predicted_prompt_tokens", {}).get(r, 0)),
            (CounterMetricFamily, "pd_prefix_mispredictions", "Prefills whose real prefix-cache hit differed from "
             "what the engine's prefix record predicted (routing.policy cache), by pool",
             lambda r: state.get("mispredicted", {}).get(r, 0)),
        )
        for family, name, help_, value in per_pool:
            fam = family(name, help_, labels=["role"])
            for role in ("prefill", "decode"):
                fam.add_metric([role], float(value(role)))
            yield fam
        t = state.get("transfers") or TransferTotals()
        for key, help_ in TRANSFER_COUNTERS.items():
            fam = CounterMetricFamily(f"pd_transfer_{key}", help_)
            fam.add_metric([], float(getattr(t, key)))
            yield fam

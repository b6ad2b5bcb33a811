"""Cores as devices: the arithmetic of giving a CPU engine's tensor-parallel ranks cores of their own.

On GPU hosts each engine owns its GPUs; on CPU hosts an engine that owns nothing computes on whatever cores the
kernel gives it, and a prefill engine's long prompt then stalls a decode engine's steps exactly as if both ran on
one GPU. An engine of TP N that owns its cores takes `N * cores_per_rank` cores of its node; rank r computes on the
r-th run of `cores_per_rank` of them (`omp_bind`: vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND). Which cores are free is
known only on the node (`actors.host.cores` holds them with file locks that die with their holder); this module is the
pure part: core-list syntax and the binding string.
"""

from __future__ import annotations


class CoreSpecError(ValueError):
    pass


def parse_cores(text: str) -> tuple[int, ...]:
    """Linux cpu-list syntax ("0-3,8,10-11") as sorted distinct core ids."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise CoreSpecError(f"not a core list: {text!r} (write it like 0-3,8)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise CoreSpecError(f"not a core list: {text!r} ({part} runs backwards)")
        cores.update(range(first, last + 1))
    if not cores:
        raise CoreSpecError(f"not a core list: {text!r} (no core named)")
    return tuple(sorted(cores))


def format_cores(cores: tuple[int, ...] | list[int]) -> str:
    """The inverse of `parse_cores`, with runs folded: (0, 1, 2, 5) -> "0-2,5"."""
    out: list[str] = []
    ids = sorted(set(cores))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def cores_needed(tp: int, cores_per_rank: int = 1) -> int:
    if tp < 1 or cores_per_rank < 1:
        raise CoreSpecError(f"tp and cores_per_rank must be >= 1, got {tp} and {cores_per_rank}")
    return tp * cores_per_rank


def omp_bind(cores: tuple[int, ...] | list[int], tp: int) -> str:
    """vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND for an engine of TP `tp` that owns `cores`: one '|'-separated list per
    rank, each rank a contiguous share of the (sorted) cores - (0, 1) at TP 2 -> "0|1", (4, 5, 6, 7) at TP 2 ->
    "4-5|6-7", (2, 3) at TP 1 -> "2-3"."""
    ids = sorted(cores)
    if not ids or len(ids) % tp:
        raise CoreSpecError(f"{len(ids)} core(s) {format_cores(ids) or '-'} cannot be split evenly over {tp} rank(s)")
    per = len(ids) // tp
    return "|".join(format_cores(ids[r * per:(r + 1) * per]) for r in range(tp))


def shared_bind(cores: tuple[int, ...] | list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine that shares its node's `cores` with everything else: the ranks split
    the cores evenly (a remainder unused), or, with more ranks than cores, take them in turn - (0, 1) at TP 1 ->
    "0-1", at TP 2 -> "0|1", at TP 4 -> "0|1|0|1"."""
    ids = sorted(cores)
    if not ids:
        raise CoreSpecError("no cores to bind to")
    if tp > len(ids):
        return "|".join(str(ids[r % len(ids)]) for r in range(tp))
    return omp_bind(ids[:len(ids) - len(ids) % tp], tp)


def rank_cores(bind: str, rank: int) -> tuple[int, ...] | None:
    """The cores TP rank `rank` computes on under a VLLM_CPU_OMP_THREADS_BIND `bind` ("0-1", "0|1", "4-5|6-7"): its
    '|'-separated list (vLLM indexes them by local rank; one list serves every rank). None where the binding names
    no cores ("auto", "nobind", unset)."""
    bind = bind.strip()
    if bind in ("", "auto", "nobind"):
        return None
    lists = bind.split("|")
    return parse_cores(lists[rank] if rank < len(lists) else lists[0])

"""Fail-closed transfers (`transfer.verify` in deploy.yaml): which requests a decode engine verifies.

A verified request's decode side computes a CRC-32 of every byte range it read, per (decode rank, prefill rank,
region), and compares each with the prefill side's CRC of the same ranges before the request may run a step: the
prefill engine still holds the blocks then (the decode side's "read done" notifications wait for the verdict). A
mismatch fails the request before any token exists; the router retries it once, on another pair when there is one.

The sample is a pure function of the prefill side's request id, so the decode engine's workers and its actor agree on
it without a message: `sampled(request_id, fraction)`.
"""

from __future__ import annotations

import zlib

VERIFY_ENV = "PD_TRANSFER_VERIFY"  # the decode engine's fraction of requests to verify (its actor and workers read it)
VERIFY_TIMEOUT_S = 30.0  # a verified read whose verdict has not come by then fails its request
TRANSFER_VERIFY_FAILED = "TransferVerifyFailed"  # the kind of a decode engine's error for a request that failed it


def verify_fraction(value: object) -> float:
    """`transfer.verify` as a fraction in [0, 1]: off / false / 0 -> 0, all / true / 1 -> 1, or a number in between.
    Raises ValueError on anything else."""
    if value is None or value is False:
        return 0.0
    if value is True:
        return 1.0
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("", "off", "false", "no", "none"):
            return 0.0
        if word in ("all", "on", "true", "yes"):
            return 1.0
        try:
            value = float(word)
        except ValueError:
            raise ValueError(f"verify must be off, all or a fraction in [0, 1], got {value!r}") from None
    if isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise ValueError(f"verify must be off, all or a fraction in [0, 1], got {value!r}")


def sampled(request_id: str, fraction: float) -> bool:
    """Whether the request whose prefill-side id is `request_id` is verified at `fraction` (deterministic)."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    return zlib.crc32(request_id.encode()) < fraction * (1 << 32)

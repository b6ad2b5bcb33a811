"""`python -m cluster check-outputs` without servers: its arguments are checked and a server it cannot reach is named
in a one-line error (exit 2), not a traceback. The check itself runs live in tests/test_real_size*.py."""

from __future__ import annotations

import subprocess
import sys

from actors.engine.settings import free_port
from cluster.cli.oracle import Checked, random_prompts, report


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster", "check-outputs", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_server_that_does_not_answer_is_named_with_its_role():
    target, reference = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    r = run("--target", target, "--reference", reference, "--model", "m", "--vocab", "1024", "--prompts", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: target ({target}/v1/completions)"), r.stderr


def test_counts_must_be_positive_and_the_vocabulary_given():
    r = run("--target", "x", "--reference", "y", "--model", "m", "--vocab", "1024", "--max-tokens", "0")
    assert r.returncode == 2 and "--max-tokens must be >= 1" in r.stderr
    r = run("--target", "x", "--reference", "y", "--model", "m")
    assert r.returncode == 2 and "--vocab" in r.stderr
    r = run("--target", "x", "--reference", "y", "--model", "m", "--vocab", "3")
    assert r.returncode == 2 and "--vocab must be > 3" in r.stderr


def test_the_first_token_over_the_tolerance_and_a_short_output_are_reported():
    got = Checked([1, 2], [5, 6, 7], [0.0, 0.3, 12.0])
    assert got.first_over(1.0) == 2 and got.first_over(0.2) == 1 and got.first_over(20) is None and got.worst == 12.0
    assert not got.short and Checked([1], [5], [0.0], wanted=2).short  # fewer tokens than asked for fails
    assert "token 2 (7) is 12.00 nats below" in report([got], 1.0) and "1 tokens, 2 asked for" in report(
        [Checked([1], [5], [0.0], wanted=2)], 1.0)
    prompts = random_prompts(3, 50, 1024, seed=4)
    assert prompts == random_prompts(3, 50, 1024, seed=4) and len({tuple(p) for p in prompts}) == 3
    assert all(len(p) == 50 and 3 <= min(p) and max(p) < 1024 for p in prompts)

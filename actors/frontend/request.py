"""A request in the front end, as the router runs it: one object from routing through prefill, transfer, decode and
failover, instead of its prompt, parameters, id and the engines to avoid passed along one by one.

`Request` is the request across its tries (n = 1): what the caller sent, the pair it is pinned to if any, the engines
it failed on, and the tokens the caller already has. `Request.attempt` makes each try an `Attempt`: the prompt and
parameters the engines get this time (after a failover, the prompt plus the tokens already sent and the rest of the
request: `actors.frontend.failover.continuation_params`), and the engines' request id for it.
`Attempt.after_first_token` is the decode engine's part of a try whose first token the prefill engine sampled."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.frontend.failover import continuation_params


@dataclass
class Request:
    """One request across its tries. `avoid` and `prefer_not` grow as tries fail; `sent` as tokens reach the caller
    (delta outputs)."""

    prompt: list[int]  # as the caller sent it
    params: Any  # vLLM SamplingParams, as the caller asked
    rid: str  # the caller's request id (the engines get one per try: `attempt`)
    pair: tuple[str, str] | None = None  # (prefill engine id, decode engine id) it is pinned to: not retried elsewhere
    avoid: set[str] = field(default_factory=set)  # engines a try failed on: left out of later tries
    prefer_not: set[str] = field(default_factory=set)  # prefill engines whose transfer failed verification: used last
    sent: list[int] = field(default_factory=list)  # tokens the caller already has
    retried: int = 0  # tries begun again after a failure before any token reached the caller
    failed_over: int = 0  # tries that continued the request elsewhere after tokens had reached the caller

    def attempt(self) -> Attempt:
        """The next try. Its engines' request id is unique per try whatever the caller's (a client may reuse its
        X-Request-Id; two requests with one id on an engine would share outputs and aborts); once tokens were sent,
        its prompt is the caller's plus them, and its parameters ask for the rest."""
        rid = f"{self.rid}-{uuid.uuid4().hex[:8]}" + (f"-retry{self.retried}" if self.retried else "")
        if not self.sent:
            return Attempt(self, self.prompt, self.params, rid)
        return Attempt(self, self.prompt + self.sent, continuation_params(self.params, len(self.sent)), rid,
                       len(self.sent))


@dataclass(frozen=True)
class Attempt:
    """One try on one pair (or one engine alone): the prompt and parameters the engines get, their request id, and
    how many of the prompt's last tokens are output the caller already has (`continued`)."""

    request: Request
    prompt: list[int]
    params: Any
    rid: str
    continued: int = 0

    def after_first_token(self, ids: list[int]) -> Attempt:
        """The decode engine's part once the prefill engine has sampled the first tokens `ids` (sent to the caller):
        the prompt plus them, the rest of the request."""
        rest = continuation_params(self.params, len(ids))
        return dataclasses.replace(self, prompt=self.prompt + list(ids), params=rest,
                                   continued=self.continued + len(ids))

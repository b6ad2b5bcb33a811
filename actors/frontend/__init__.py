"""The request path in the front end: vLLM's OpenAI server over the cluster (`server`), its ASGI layers (`guards`)
and /health (`health`), the router (`router`: one `request.Request` through routing, prefill, transfer, decode and
failover), which pair takes a request (`pair_choice`) and the rules of continuing one elsewhere (`failover`).
Imports from `actors.host`, `actors.clients` and `actors.engine` (the decode channel's front-end end)."""

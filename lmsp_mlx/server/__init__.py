"""The Quart app: routes, auth, SSE framing, and the /v1 compatibility routes."""

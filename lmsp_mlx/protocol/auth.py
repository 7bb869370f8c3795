"""The names docs/api.md's Tokens and scopes fixes: the scopes a token may hold, and the owner
of what requests without a token create (a service with no tokens configured serves one
local owner). Owners key stored responses, tasks, KV bindings and remembered calls."""

SCOPES = frozenset({"responses:write", "responses:read", "models:read", "admin"})
RESERVED = frozenset({"tools:execute"})  # LMSP reserves it for services that run tools; this one does not
LOCAL_OWNER = "local"

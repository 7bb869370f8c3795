"""The response service: one response from request to result (run), the conversation it
renders (conversation, compaction), the item events it folds (items), the state clients
carry sealed (sealing), background tasks and idempotency (tasks), and the state they
share (state). It knows no HTTP: every function takes the `ServerState` and the caller's
owner as parameters, and raises `Problem`s for the HTTP layer to send."""

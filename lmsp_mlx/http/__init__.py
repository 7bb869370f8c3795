"""The HTTP layer: the Quart app and one module per wire API (LMSP, /v1 Responses, Chat,
text completions), with what they share: auth, web origins, body reading, SSE framing,
problem documents and the OpenAPI document. Only this layer knows Quart; it turns requests
into calls of the response service (lmsp_mlx/service) with the server's state and the
caller's owner, and the service's results and errors into HTTP."""

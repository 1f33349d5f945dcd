"""Faces of rewind for agents that do not import it: an HTTP API (`rewind serve`), an MCP
server (`rewind mcp`, and /mcp inside `rewind serve`) and the HTTP client behind
`Sandbox.connect`. All are thin: every verb is a call into the SDK or the engine.

    wire.py       the JSON shapes and the error <-> problem+json mapping all three share
    api.py        the HTTP app (FastAPI), its auth and Idempotency-Key handling
    mcpserver.py  the MCP tools
    client.py     Sandbox.connect: the SDK's verbs over HTTP
"""

"""`ember serve`: an OpenAI-compatible HTTP server around one engine.

protocol.py reads and checks request bodies (constraints.py their grammar fields, tools.py
their tools; errors.py is the error they raise), call_stream.py cuts a streamed reply into
content and tool-call deltas, responses.py writes OpenAI's response objects,
sessions.py picks the KV session a prompt extends, worker.py runs requests one at a time on
the engine's own thread, server.py is the Starlette app (routes, API key, errors, streaming).
Only server.py imports Starlette.
"""

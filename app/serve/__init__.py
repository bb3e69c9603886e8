"""`ember serve`: an OpenAI-compatible HTTP server around one engine.

protocol.py reads and checks request bodies, responses.py writes OpenAI's response objects,
sessions.py picks the KV session a prompt extends, worker.py runs requests one at a time on
the engine's own thread, server.py is the Starlette app (routes, API key, errors, streaming).
Only server.py imports Starlette.
"""

"""Reward serving: `polyrl serve-reward` puts any registered reward behind HTTP.

server.py (the FastAPI app, limits, a background-thread runner), batching.py (merging concurrent requests into
scorer calls), codec.py (images on the wire; also used by the `http` reward client). Importing this package
imports no web framework: only `server` does.
"""

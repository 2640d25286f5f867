"""Reward serving: `polyrl serve-reward` puts any registered reward behind HTTP.

server.py (the FastAPI app, limits and memory budgets, a background-thread runner), batching.py (merging
concurrent requests into bounded scorer calls, small requests first), connections.py (header deadline and
connection limit on top of uvicorn's h11 protocol). Media on the wire (images, video, audio) is
`polyrl.rewards.codec`, shared with the `http` reward client (the rewards package never imports this one).
Importing this package imports no web framework: only `server` and `connections` do.
"""

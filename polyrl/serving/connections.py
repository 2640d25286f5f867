"""Connection limits for the reward server: uvicorn's h11 protocol plus what its options lack.

uvicorn gives `limit_concurrency` (a request is refused while that many connections are open or requests in
progress), `timeout_keep_alive` (an idle connection after a response is closed) and the h11 header size limit.
It has no deadline for a request's headers: a connection that never sends, or sends a byte now and then, is held
forever. `GuardedH11Protocol` adds that deadline, and answers the `limit_concurrency` refusal as the app answers
every error (JSON `{"detail": ...}`, here with `Retry-After`) instead of uvicorn's plain-text 503. The body's
deadline is the app's (`server.py`): uvicorn hands the body to it chunk by chunk.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

RETRY_AFTER_S = 1  # what a refused client is told to wait (a busy server frees up within a scorer call or so)


def json_error(status: int, reason: str, detail: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (written straight to the socket: for the
    moments when no request cycle exists to answer through)."""
    body = json.dumps({"detail": detail, "request_id": None}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a JSON 503 over `limit_concurrency`.

    A request's headers must be complete within `header_timeout_s` of the connection opening, or of the first byte
    after the previous response: otherwise the connection is closed (after a 408 when part of a request came)."""

    header_timeout_s: float = 10.0  # set per server by `guarded_protocol`

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.max_concurrency, self.limit_concurrency = self.limit_concurrency, None  # checked in `_limited` below
        self.app = self._limited(self.app)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0

    # -------------------------------------------------------------------------------- header deadline
    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._waiting_for_headers():
            return
        if self._header_bytes:  # a slow client mid-request gets told why; an idle one is just closed
            self.transport.write(json_error(408, "Request Timeout", f"the request headers did not arrive within "
                                                                    f"{self.header_timeout_s:g} s"))
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers():
            self._arm_header_timer()
            self._header_bytes += len(data)
        super().data_received(data)
        if not self._waiting_for_headers():  # the headers are complete: the app's body deadline takes over
            self._cancel_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    # -------------------------------------------------------------------------------- concurrency limit
    def _limited(self, app):
        async def limited(scope, receive, send):
            # the same test as uvicorn's, made from inside the request's own task (so it counts itself)
            limit = self.max_concurrency
            if limit is not None and scope["type"] == "http" and (
                    len(self.connections) > limit or len(self.tasks) > limit):
                body = json.dumps({"detail": f"busy: more than {limit} connections or requests at once "
                                             f"(--max-connections); retry later", "request_id": None}).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"retry-after", str(RETRY_AFTER_S).encode()),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        return limited


def guarded_protocol(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """`GuardedH11Protocol` with this server's header deadline (uvicorn takes a protocol class, not an instance)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": float(header_timeout_s)})

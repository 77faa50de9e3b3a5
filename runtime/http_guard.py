"""uvicorn's HTTP/1.1 protocol with a deadline on reading each request.

uvicorn times out a connection only while it is idle after a response (keep-alive). A connection
that is opened and never sends, or sends a request a byte at a time (slowloris), or stops halfway
through its body, is held open forever: each holds a file descriptor, and at the process's limit
(1024 by default) the server stops accepting anyone. Here a request must arrive whole, headers
and body, within `read_timeout` seconds of the connection opening or of its first byte after a
response; the time a response takes (a long generation, a stream) is not counted.

On the deadline: a connection that sent nothing is closed, one cut off inside its headers is told
408 and closed (as nginx's client_header_timeout does), one cut off inside its body is closed,
which the route waiting for that body sees as the client going away.
"""

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_READ_TIMEOUT_S = 60.0  # a 64 MiB body (the body limit) needs ~1 MiB/s

_TIMEOUT_BODY = b"the request did not arrive in time; resend it\n"
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


class GuardedH11Protocol(H11Protocol):
    read_timeout = REQUEST_READ_TIMEOUT_S

    @classmethod
    def with_timeout(cls, seconds: float) -> type["GuardedH11Protocol"]:
        return type(cls.__name__, (cls,), {"read_timeout": float(seconds)})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._reading() and self._deadline is None:  # the first byte after a response
            self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        super().data_received(data)
        if not self._reading():
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        answered = self.cycle
        super().on_response_complete()  # parses what was pipelined behind the answered request
        # a pipelined request, whole headers or not, came with the previous one: its clock runs already
        pipelined = self.cycle is not answered or self.conn.trailing_data[0]
        if self._deadline is None and pipelined and self._reading() and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _reading(self) -> bool:
        """Between two requests, or inside one whose body is still coming."""
        return self.cycle is None or self.cycle.response_complete or self.cycle.more_body

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if not self._reading() or self.transport.is_closing():
            return
        in_headers = self.cycle is None or self.cycle.response_complete
        if in_headers and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_TIMED_OUT)
        self.logger.info("closed a connection whose request did not arrive within %.0f s", self.read_timeout)
        self.transport.close()

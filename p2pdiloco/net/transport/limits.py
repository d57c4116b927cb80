"""The limits the server holds every inbound request to, on a stream of its own
(:mod:`p2pdiloco.net.transport.serving`) or in a session
(:mod:`p2pdiloco.net.transport.session_serving`): deadlines, requests served at once, the
tarpit of blocked peers (the rules: ``serving``'s module docstring), and :class:`_Drop`, a
request that is not served. Each serving module takes the numbers by name: a test that changes
one sets it on the module whose rule it exercises.
"""

from __future__ import annotations

HEADER_TIMEOUT = 10.0  # seconds an inbound stream may take to deliver its request header
LINGER_TIMEOUT = 5.0  # seconds a server waits for the caller to close after the answer
LINGER_DISCARD_BYTES = 8 << 20  # bytes a server reads and discards while it lingers, at most
TARPIT_S = 10.0  # seconds a blocked peer's stream is held unanswered before it is closed ...
TARPIT_PER_PEER = 16  # ... for this many of its streams at once (the others are closed at once)
TARPIT_MAX = 256  # ... and this many in all
MAX_STREAMS_PER_PEER = 16  # requests served at once for one peer (mm.join holds one ~2 min)
MAX_STREAMS = 512  # requests served at once in all


class _Drop(Exception):
    """An inbound request that is not served: counted under ``reason``; answered ``message``
    unless ``answer`` is false (the stream is gone)."""

    def __init__(self, reason: str, message: str, answer: bool = True):
        super().__init__(message)
        self.reason, self.answer = reason, answer

"""The slow-reader fault of `kvserve bench chaos`: clients that open a stream and never read it.

Each is a greedy streamed chat completion on a raw socket whose receive buffer is small and
whose segment size is small too (the kernel sizes the server's send buffer from it), so the
kernel's buffers are full after a few hundred KB; each token's chunk carries MAX_TOP
alternatives (about 1.7 KB) and the completion ignores EOS, so the server keeps writing until
its write has waited `--stream-stall-timeout` (chaos_target.STALL_S) and it aborts the
request. The sockets stay open, unread, until the front has counted every one of them as a
stall (or STALL_WAIT_S passed); then they are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvserve.services.bench.sweeps.chaos_counters import read
from kvserve.shared.sampling_params import MAX_TOP

if TYPE_CHECKING:
    from kvserve.services.bench.sweeps.chaos_rig import Rig

STALLED = 4  # streams opened and never read
STALL_WAIT_S = 120.0  # after the fault window, how long the front may take to abort them all
MAX_TOKENS = 2000


def open_unread_stream(base_url: str) -> socket.socket:
    """A streamed chat request sent on a socket that is then never read."""
    body = {
        "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": MAX_TOP,
        "stream": True,
    }
    return post_unread(base_url, "/v1/chat/completions", body)


def post_unread(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """POST `body` as JSON on a socket that is then never read: a small receive buffer, and a
    small segment size, from which the kernel sizes the server's send buffer, so that the
    kernel's buffers are full after a few hundred KB."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, port))
    sock.sendall(head + data)
    return sock


async def slow_readers(rig: Rig, secs: float) -> None:
    """STALLED unread streams opened at once, held through the fault window and then until the
    front has aborted them all (its stall counter up by STALLED), or STALL_WAIT_S more."""
    before = (await read(rig)).stalls
    socks = [await asyncio.to_thread(open_unread_stream, rig.target.base_url)
             for _ in range(STALLED)]  # fmt: skip
    try:
        await asyncio.sleep(secs)
        deadline = time.monotonic() + STALL_WAIT_S
        while before is not None and time.monotonic() < deadline:
            now = (await read(rig)).stalls
            if now is not None and now >= before + STALLED:
                break
            await asyncio.sleep(0.5)
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

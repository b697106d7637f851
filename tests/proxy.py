"""A TCP forwarder on loopback that can take the network away: every connection through it is
cut, and new ones are reset, for a window of time. Put between a client and a real server (moto's
S3 endpoint), it makes the outages the storage code must ride out: a dropped connection mid-transfer
and an endpoint that cannot be reached at all.

    with CutProxy(moto_port) as proxy:          # clients use proxy.url instead of the server's
        proxy.cut(20)                           # now: 20 s without a network
        proxy.cut_after(200_000, seconds=2)     # or: once 200 kB went to clients, 2 s without
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class CutProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down_until = 0.0
        self._cut_at: tuple[int, float] | None = None  # (bytes to clients, seconds) of a pending cut
        self.bytes_to_clients = 0
        self.connections = 0  # accepted while the network was up
        self.refused = 0  # reset while it was down
        self.cuts: list[tuple[float, int]] = []  # (time.monotonic() of each cut, bytes_to_clients then)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    # -- control ------------------------------------------------------------------------------

    def cut(self, seconds: float) -> None:
        """Drop every open connection now and reset new ones for ``seconds``."""
        with self._lock:
            self._down_until = time.monotonic() + seconds
            self.cuts.append((time.monotonic(), self.bytes_to_clients))
            conns, self._open = list(self._open), set()
        for c in conns:
            _reset(c)

    def cut_after(self, nbytes: int, seconds: float) -> None:
        """``cut(seconds)`` as soon as ``nbytes`` more bytes went from the server to clients."""
        with self._lock:
            self._cut_at = (self.bytes_to_clients + nbytes, seconds)

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            conns, self._open = list(self._open), set()
        for c in conns:
            _reset(c)

    def __enter__(self) -> "CutProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- forwarding -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # a client that gave up before it was accepted (ECONNABORTED)
            if self.down:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, upstream))
            ended = [0]  # directions of this pair that are done: the second one closes both sockets
            threading.Thread(target=self._pump, args=(client, upstream, False, ended), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True, ended), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool, ended: list[int]) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:  # a peer finished sending: pass the end on, let the other direction finish
                    if self.down:
                        break
                    dst.shutdown(socket.SHUT_WR)
                    with self._lock:
                        ended[0] += 1
                        if ended[0] < 2:
                            return
                    for s in (src, dst):
                        self._forget(s)
                        s.close()
                    return
                if self.down:
                    break
                dst.sendall(data)
                if to_client:
                    self._count(len(data))
        except OSError:
            pass
        for s in (src, dst):  # cut, or a peer reset: reset both sides
            self._forget(s)
            _reset(s)

    def _forget(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)

    def _count(self, n: int) -> None:
        fire = None
        with self._lock:
            self.bytes_to_clients += n
            if self._cut_at is not None and self.bytes_to_clients >= self._cut_at[0]:
                fire, self._cut_at = self._cut_at[1], None
        if fire is not None:
            self.cut(fire)


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped network looks to the peer."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass

"""The wire format of the STIP parties (``core.stip.parties``): length-prefixed frames over TCP sockets.

A frame is ``[8-byte length][4-byte header length][JSON header][raw bytes]``; the header names the message kind,
the payload's dtype and shape; tensors travel as raw little-endian bytes. :class:`Link` is one socket to a named
peer with byte counters; every wait has a timeout and an error names the peer.
"""

from __future__ import annotations

import io
import json
import socket
import struct

import torch

__all__ = ["DTYPES", "Link", "decode_body", "encode_frame", "from_bytes", "to_bytes"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "bfloat16": torch.bfloat16,
}


def encode_frame(kind: str, payload: torch.Tensor | bytes | None = None) -> bytes:
    """``[8-byte len][4-byte header len][JSON header][raw bytes]``; tensors as contiguous CPU bytes."""
    if isinstance(payload, torch.Tensor):
        t = payload.detach().cpu().contiguous()
        header = {"kind": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    else:
        header = {"kind": kind, "dtype": "bytes" if payload is not None else None, "shape": None}
        raw = payload or b""
    h = json.dumps(header).encode()
    body = struct.pack(">I", len(h)) + h + raw
    return struct.pack(">Q", len(body)) + body


def decode_body(body: bytes) -> tuple[str, torch.Tensor | bytes | None]:
    """``(kind, payload)`` of a frame's body (the frame without its 8-byte length)."""
    (hlen,) = struct.unpack(">I", body[:4])
    header = json.loads(body[4 : 4 + hlen])
    raw = body[4 + hlen :]
    if header["dtype"] is None:
        return header["kind"], None
    if header["dtype"] == "bytes":
        return header["kind"], raw
    dtype = DTYPES[header["dtype"]]
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return header["kind"], t.view(dtype).reshape(header["shape"]).clone()


def to_bytes(obj: object) -> bytes:
    """``obj`` as ``torch.save`` bytes (a party's package or report)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict:
    """The inverse of :func:`to_bytes` (``weights_only``: tensors and plain containers only)."""
    return torch.load(io.BytesIO(data), weights_only=True)


class Link:
    """One socket to a named peer, with byte counters and timeouts naming the peer."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.sock, self.peer, self.sent, self.received = sock, peer, 0, 0
        sock.settimeout(timeout_s)

    def send(self, kind: str, payload: torch.Tensor | bytes | None = None) -> None:
        frame = encode_frame(kind, payload)
        try:
            self.sock.sendall(frame)
        except OSError as exc:
            raise ConnectionError(f"lost connection to {self.peer} while sending ({exc})") from exc
        self.sent += len(frame)

    def _exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except TimeoutError as exc:
                raise TimeoutError(f"no message from {self.peer} within {self.sock.gettimeout()} s") from exc
            except OSError as exc:
                raise ConnectionError(f"lost connection to {self.peer} ({exc})") from exc
            if not chunk:
                raise ConnectionError(f"connection to {self.peer} closed")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self) -> tuple[str, torch.Tensor | bytes | None]:
        (n,) = struct.unpack(">Q", self._exact(8))
        body = self._exact(n)
        self.received += 8 + n
        return decode_body(body)

"""The wire format of the STIP parties (``core.stip.parties``): length-prefixed frames over TCP sockets.

A frame is ``[8-byte length][4-byte header length][JSON header][raw bytes]``; the header names the message kind,
the payload's dtype and shape; tensors travel as raw little-endian bytes. :class:`Link` is one socket to a named
peer with byte counters; every wait has a timeout and an error names the peer.

Authentication (:func:`client_handshake`, :func:`server_handshake`): before anything else is exchanged, both ends
of a link prove that they hold the link's shared secret (32 bytes from ``secrets.token_bytes``, never recorded)
with the three-pass mutual challenge-response of ISO/IEC 9798-4 over HMAC-SHA256 (RFC 2104), the construction of
``multiprocessing.connection``'s ``authkey`` (which uses HMAC-MD5 before Python 3.12)::

    client -> server  hello     role                      (the party the client claims to be)
    server -> client  challenge Ns                        (32 random bytes)
    client -> server  response  Nc || HMAC(K, "client" | role | Ns | Nc)
    server -> client  welcome   HMAC(K, "server" | role | Ns | Nc)    or  refused  reason

Digests are compared with ``hmac.compare_digest``; frames before authentication are capped at
:data:`HANDSHAKE_MAX_BYTES`. A wrong or missing secret raises :class:`AuthenticationError` on both ends, with the
reason. Only the opening is authenticated: frames after it carry no MAC and are not encrypted (loopback sockets
between the parties' processes; across machines the links would need TLS).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import secrets
import socket
import struct
from collections.abc import Mapping

import torch

from core.errors import PrivbenchError

__all__ = [
    "DTYPES",
    "HANDSHAKE_MAX_BYTES",
    "KEY_BYTES",
    "AuthenticationError",
    "Link",
    "accept_authenticated",
    "client_handshake",
    "decode_body",
    "encode_frame",
    "from_bytes",
    "new_key",
    "read_hello",
    "server_handshake",
    "to_bytes",
]

KEY_BYTES = 32
NONCE_BYTES = 32
HANDSHAKE_MAX_BYTES = 1024
_MAC_LABEL = b"privbench-stip-link/1"

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

    def recv(self, max_bytes: int | None = None) -> tuple[str, torch.Tensor | bytes | None]:
        """The next frame; ``max_bytes`` refuses a longer one (``ValueError``) before reading its body."""
        (n,) = struct.unpack(">Q", self._exact(8))
        if max_bytes is not None and n > max_bytes:
            raise ValueError(f"frame of {n} bytes from {self.peer} exceeds the limit of {max_bytes}")
        body = self._exact(n)
        self.received += 8 + n
        return decode_body(body)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- authentication


class AuthenticationError(PrivbenchError):
    """A link's opening handshake failed: the peer lacks (or we lack) the link's shared secret."""


def new_key() -> bytes:
    """A fresh link secret: ``KEY_BYTES`` bytes from the OS CSPRNG."""
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, side: bytes, role: str, n_server: bytes, n_client: bytes) -> bytes:
    msg = b"|".join((_MAC_LABEL, side, role.encode(), n_server, n_client))
    return hmac.new(key, msg, hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) < 16:
        raise AuthenticationError(f"a link secret must be at least 16 bytes, got {type(key).__name__}")


def _handshake_frame(link: Link, expected: str) -> bytes:
    """The payload of the next handshake frame of kind ``expected`` (``refused`` raises with its reason)."""
    try:
        kind, payload = link.recv(max_bytes=HANDSHAKE_MAX_BYTES)
    except (ValueError, KeyError, struct.error) as exc:  # oversized or malformed: not our protocol
        raise AuthenticationError(f"malformed handshake from {link.peer} ({exc})") from exc
    if kind == "refused" and isinstance(payload, bytes):
        raise AuthenticationError(f"{link.peer} refused this connection: {payload.decode(errors='replace')}")
    if kind != expected or not isinstance(payload, bytes):
        raise AuthenticationError(f"expected a {expected!r} handshake frame from {link.peer}, got {kind!r}")
    return payload


def client_handshake(link: Link, role: str, key: bytes) -> None:
    """Open ``link`` as party ``role``: prove ``key`` to the server, and check that the server holds it too."""
    _check_key(key)
    link.send("hello", role.encode())
    n_server = _handshake_frame(link, "challenge")
    if len(n_server) != NONCE_BYTES:
        raise AuthenticationError(f"challenge from {link.peer} has {len(n_server)} bytes, expected {NONCE_BYTES}")
    n_client = secrets.token_bytes(NONCE_BYTES)
    link.send("response", n_client + _mac(key, b"client", role, n_server, n_client))
    proof = _handshake_frame(link, "welcome")
    if not hmac.compare_digest(proof, _mac(key, b"server", role, n_server, n_client)):
        raise AuthenticationError(f"{link.peer} did not prove the link's secret; connection dropped")


def read_hello(link: Link, roles: tuple[str, ...]) -> str:
    """The role a new connection claims (first frame); a frame that is no hello from one of ``roles`` is refused."""
    try:
        payload = _handshake_frame(link, "hello")
        role = payload.decode()
    except (AuthenticationError, UnicodeDecodeError) as exc:
        _refuse(link, f"no hello from one of {roles}")
        raise AuthenticationError(f"refused a connection: no hello from one of {roles} ({exc})") from exc
    if role not in roles:
        _refuse(link, f"unexpected party {role!r}")
        raise AuthenticationError(f"refused a connection claiming to be {role!r}; expected one of {roles}")
    return role


def server_handshake(link: Link, role: str, key: bytes) -> None:
    """Authenticate a connection that claimed ``role`` (:func:`read_hello`) against ``key``; on a wrong or missing
    secret the client is told (``refused``), the socket closed and :class:`AuthenticationError` raised."""
    _check_key(key)
    n_server = secrets.token_bytes(NONCE_BYTES)
    link.send("challenge", n_server)
    try:
        response = _handshake_frame(link, "response")
    except AuthenticationError as exc:
        _refuse(link, "no response to the challenge")
        raise AuthenticationError(f"refused a connection claiming to be {role}: {exc}") from exc
    n_client, digest = response[:NONCE_BYTES], response[NONCE_BYTES:]
    if len(n_client) != NONCE_BYTES or not hmac.compare_digest(digest, _mac(key, b"client", role, n_server, n_client)):
        _refuse(link, "wrong or missing secret")
        raise AuthenticationError(f"refused a connection claiming to be {role}: wrong or missing secret")
    link.send("welcome", _mac(key, b"server", role, n_server, n_client))
    link.peer = role


def accept_authenticated(link: Link, keys: Mapping[str, bytes]) -> str:
    """:func:`read_hello` then :func:`server_handshake` with the claimed role's key; returns the role."""
    role = read_hello(link, tuple(keys))
    server_handshake(link, role, keys[role])
    return role


def _refuse(link: Link, reason: str) -> None:
    try:
        link.send("refused", reason.encode())
    except (ConnectionError, OSError):
        pass  # the intruder is gone already
    link.close()

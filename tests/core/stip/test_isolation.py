"""The STIP parties are really apart: each spawned party holds only its own material (checked against the plaintext
model and the secrets by digest of every tensor alive in its process), and no link opens without its secret."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from core.stip.keys import draw_keys
from core.stip.parties import PartyError, run_stip
from core.stip.processes import tensor_digest
from core.stip.transform import permute_model, random_permutation
from core.stip.wire import (
    AuthenticationError,
    Link,
    accept_authenticated,
    client_handshake,
    new_key,
)
from tests.core.stip.tiny import stip_gpt2

PROMPT = [5, 17, 42, 3, 9]


@pytest.fixture(scope="module")
def model():
    return stip_gpt2()


def _keys(model, design):
    return draw_keys(model, design, source=lambda n: random_permutation(n, 3))  # test-only seeded secrets


def _digests(tensors) -> set[str]:
    return {tensor_digest(t) for t in tensors}


def _plaintext_secrets(model, keys) -> set[str]:
    """What the cloud must never hold: the plaintext embedding table and head, and every plaintext tensor the
    transform changes (a tensor it leaves as it is, e.g. a zero bias, reveals nothing)."""
    plain = _digests(model.state_dict().values())
    transformed = _digests(permute_model(model, keys.pi, rho=keys.rho).state_dict().values())
    return (plain - transformed) | _digests([model.get_input_embeddings().weight, model.lm_head.weight])


def _held(result) -> dict[str, set[str]]:
    return {p: {h["sha256"] for h in hs} for p, hs in result.holdings.items()}


@pytest.mark.parametrize("design", ["user_embed", "vocab_perm"])
def test_each_spawned_party_holds_only_its_own_material(model, design):
    keys = _keys(model, design)
    r = run_stip(model, PROMPT, 2, design=design, keys=keys, timeout_s=120, audit=True)
    assert r.tokens_match and r.refused_connections == 0
    held = _held(r)
    forbidden = _plaintext_secrets(model, keys)
    secrets_ = _digests([keys.pi, *keys.rho, *([] if keys.sigma is None else [keys.sigma])])
    embed = tensor_digest(model.get_input_embeddings().weight)
    assert embed in held["P1"] and forbidden <= held["P1"]  # the inventory sees the developer's plaintext model
    assert not held["P2"] & forbidden, "the cloud holds plaintext weights"
    assert not held["P2"] & secrets_, "the cloud holds a secret permutation"
    blocks = {
        tensor_digest(v)
        for m in (model, permute_model(model, keys.pi, rho=keys.rho))
        for k, v in m.state_dict().items()
        if ".h." in k or "ln_f" in k
    }
    assert not held["P3"] & blocks, "the user holds block weights"
    if design == "user_embed":
        assert {embed, tensor_digest(keys.pi)} <= held["P3"]
    else:
        assert embed not in held["P3"] and tensor_digest(keys.sigma) in held["P3"]
        assert tensor_digest(keys.pi) not in held["P3"]


def test_the_check_sees_what_fork_leaks(model):
    """The same check on forked parties (the old start method): P2 inherits the launcher's heap, embedding table
    and every plaintext weight included, and the check finds them."""
    keys = _keys(model, "user_embed")
    r = run_stip(model, PROMPT, 2, keys=keys, timeout_s=60, audit=True, _start_method="fork")
    held = _held(r)
    assert tensor_digest(model.get_input_embeddings().weight) in held["P2"]
    assert _plaintext_secrets(model, keys) <= held["P2"]


def test_a_party_without_the_session_secret_is_refused(model):
    with pytest.raises(PartyError, match="P2 refused this connection: wrong or missing secret") as info:
        run_stip(model, PROMPT, 2, timeout_s=60, _wrong_key="P3")
    assert info.value.party == "P3"


# ---------------------------------------------------------------- the handshake itself


def _pair(server_side):
    """Run ``server_side(link)`` on one end of a socket pair in a thread; return the client link and the result."""
    a, b = socket.socketpair()
    out: dict = {}

    def serve():
        try:
            out["role"] = server_side(Link(b, "client", 5.0))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    return Link(a, "server", 5.0), thread, out


def test_handshake_with_the_secret_opens_the_link():
    key = new_key()
    client, thread, out = _pair(lambda link: accept_authenticated(link, {"P3": key}))
    client_handshake(client, "P3", key)
    thread.join()
    assert out == {"role": "P3"}


@pytest.mark.parametrize("how", ["wrong secret", "other role's secret"])
def test_handshake_with_a_wrong_secret_is_refused(how):
    key, other = new_key(), new_key()
    keys = {"P1": other, "P3": key}
    client, thread, out = _pair(lambda link: accept_authenticated(link, keys))
    with pytest.raises(AuthenticationError, match="refused this connection: wrong or missing secret"):
        client_handshake(client, "P3", new_key() if how == "wrong secret" else other)
    thread.join()
    assert isinstance(out["error"], AuthenticationError) and "claiming to be P3" in str(out["error"])


@pytest.mark.parametrize("first", ["tensor frame", "oversized frame", "unknown role"])
def test_a_connection_without_the_handshake_is_refused(first):
    client, thread, out = _pair(lambda link: accept_authenticated(link, {"P3": new_key()}))
    if first == "tensor frame":
        client.send("x", torch.randn(1, 3, 32))  # straight to the protocol, no hello
    elif first == "oversized frame":
        client.sock.sendall((1 << 40).to_bytes(8, "big"))  # refused before its body is read
    else:
        client.send("hello", b"P2")
    thread.join()
    assert isinstance(out["error"], AuthenticationError) and "refused a connection" in str(out["error"])
    kind, reason = client.recv()  # the client is told why before the socket closes
    assert kind == "refused" and reason.decode().startswith(("no hello", "unexpected party"))


def test_a_server_without_the_secret_is_not_trusted():
    """Mutual: a server that cannot prove the secret (an impostor P2) is dropped by the client."""

    def impostor(link):
        link.recv()  # hello
        link.send("challenge", b"\0" * 32)
        link.recv()  # response
        link.send("welcome", b"\0" * 32)

    client, thread, _ = _pair(impostor)
    with pytest.raises(AuthenticationError, match="did not prove the link's secret"):
        client_handshake(client, "P3", new_key())
    thread.join()

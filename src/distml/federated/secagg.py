"""Secure aggregation: the server learns the sum of the clients' vectors and nothing else.

The protocol is the semi-honest variant of Bonawitz et al. 2017, "Practical Secure Aggregation
for Privacy-Preserving Machine Learning" (CCS '17), in four stages per round:

0. **Advertise keys.** Each client draws two X25519 key pairs: ``c`` to encrypt the shares it
   sends its peers, ``s`` to agree pairwise mask seeds. The mask secret key s_sk_u is
   HKDF-SHA256 of a 16-byte seed r_u, which matches X25519's 128-bit security and lets a
   16-byte secret stand for the 32-byte key. The clients whose keys arrive form U1.
1. **Share keys.** Client u draws a 16-byte self-mask seed b_u and splits b_u and r_u, each on
   its own, t-of-|U1| with Shamir's scheme over the prime field Z_p, p = 2^128 + 51 (the
   smallest prime above 2^128, so every 16-byte secret is a field element; a share is 17 bytes).
   The share for peer v is encrypted with AES-256-GCM under
   HKDF-SHA256(X25519(c_sk_u, c_pk_v)), the ids ``u->v`` bound as associated data, and relayed
   by the server, which cannot read it. The clients whose shares arrive form U2.
2. **Masked input.** Client u sends y_u = x_u + PRG(b_u) + sum_{v in U2, v != u} +-PRG(s_uv)
   mod 2^32, with s_uv = HKDF-SHA256(X25519(s_sk_u, s_pk_v)), the sign + for u < v and - for
   u > v, and PRG = AES-128-CTR keystream read as little-endian uint32 words. The clients whose
   inputs arrive form U3; in the sum over U3 the masks between two survivors cancel.
3. **Unmask.** Each survivor reveals its shares of b_v for v in U3 and of r_u for u in
   U2 \\ U3, never both for one peer. From t of them the server rebuilds the self masks of the
   survivors and, from r_u, the key s_sk_u and the pairwise masks the dropped clients left in
   the survivors' inputs.

**Why a prime field, by hand.** pycryptodome's ``Shamir.split`` does GF(2^128) arithmetic in
pure Python, and with three splits per client (b_u and the two halves of a 32-byte s_sk_u) the
key sharing of a 100-client round took many times the whole plain round. Over Z_p Python's own
integers do the work: a split is Horner's rule at x = 1..n, about a hundredth of the cost, and
the share stage is left dominated by the X25519 exchanges (the figures are in BENCHMARKS.md,
"Federated learning"). The server computes the Lagrange coefficients at 0 once per round, for
the t revealers it uses, and every secret reuses them.

Any t clients suffice at every stage: up to |U1| - t may drop out. There are no signatures and
no consistency round, so the guarantee holds against a server that follows the protocol (and
colludes with fewer than t clients); the checks below are the ones a client can make alone.
Keys are fresh per :class:`SecAggClient`: use one object per client per round.

**Quantisation.** Clients clip each coordinate to [-clip, clip], scale by 2^frac_bits, round to
the nearest integer and wrap into Z_2^32. :class:`SecAggParams` refuses settings where
``max_clients * ceil(clip * 2^frac_bits) >= 2^31``, so the sum of any allowed number of clients
fits a signed 32-bit value and the ring sum is the exact sum of the quantised inputs. Each input
is off by at most 2^-(frac_bits+1) per coordinate, so (without clipping) the aggregate is within
n * 2^-(frac_bits+1) of the float sum per coordinate, plus float32 rounding of the result.

Every message is JSON-able (bytes as base64 text, dicts keyed by ``str(client_id)``); masked
vectors are 1-D ``torch.int64`` tensors holding values in [0, 2^32). Example::

    params = SecAggParams(threshold=2, length=4)
    clients = {i: SecAggClient(i, params) for i in range(3)}
    server = SecAggServer(params, participants=list(clients))
    for i, c in clients.items():
        server.receive_advertisement(i, c.advertise())
    for i, c in clients.items():
        server.receive_shares(i, c.share_keys(server.public_keys()))
    for i, c in clients.items():
        server.receive_masked(i, c.masked_input(torch.full((4,), 0.25), server.shares_for(i)))
    for i, c in clients.items():
        server.receive_unmask(i, c.unmask(server.survivors()))
    server.aggregate()  # tensor([0.75, 0.75, 0.75, 0.75])
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import secrets
from typing import Annotated, Any

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import BaseModel, ConfigDict, Field, model_validator

RING = 2**32
_HALF = 2**31
_SEED = 16  # an AES-128 PRG key, and the seed of a mask secret key
_PRIME = 2**128 + 51  # the smallest prime above 2^128: every 16-byte seed is a field element
_ELEM = 17  # bytes of one element of Z_p
_SHARE = 2 * _ELEM  # share of b_u, then of r_u
_NONCE = 12
_SEALED = _NONCE + _SHARE + 16  # nonce, ciphertext, GCM tag
_KEYS = ("c_pk", "s_pk")

__all__ = ["SecAggClient", "SecAggError", "SecAggParams", "SecAggServer", "dequantize", "quantize"]


class SecAggError(Exception):
    """A protocol step cannot go on safely; the message names the client and the stage."""


class SecAggParams(BaseModel):
    """What every client and the server of one round agree on.

    >>> SecAggParams(threshold=3, length=10, clip=1.0, frac_bits=20, max_clients=1024).max_level
    1048576
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: Annotated[int, Field(ge=2)]  # t: clients needed at every stage
    length: Annotated[int, Field(ge=1)]
    clip: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    frac_bits: Annotated[int, Field(ge=0, le=30)] = 20
    max_clients: Annotated[int, Field(ge=2)] = 1024

    @model_validator(mode="after")
    def _sum_cannot_overflow(self) -> SecAggParams:
        if self.threshold > self.max_clients:
            raise ValueError(f"threshold {self.threshold} > max_clients {self.max_clients}")
        bound = self.max_clients * self.max_level
        if bound >= _HALF:
            raise ValueError(
                f"max_clients {self.max_clients} x ceil(clip {self.clip} x 2^{self.frac_bits}) "
                f"= {bound} >= 2^31 = {_HALF}: the sum could overflow Z_2^32; "
                "lower clip, frac_bits or max_clients"
            )
        return self

    @property
    def max_level(self) -> int:
        """The largest magnitude of one quantised coordinate."""
        return math.ceil(self.clip * 2**self.frac_bits)


def quantize(vec: torch.Tensor, params: SecAggParams) -> torch.Tensor:
    """Fixed point in Z_2^32: clip, scale by 2^frac_bits, round to nearest, wrap; int64 out."""
    if not isinstance(vec, torch.Tensor) or not vec.is_floating_point():
        raise ValueError(f"expected a float tensor, got {type(vec).__name__}")
    if vec.shape != (params.length,):
        raise ValueError(f"expected shape ({params.length},), got {tuple(vec.shape)}")
    if not bool(torch.isfinite(vec).all()):
        raise ValueError("the vector holds NaN or infinity")
    clipped = vec.detach().cpu().double().clamp(-params.clip, params.clip)
    return torch.round(clipped * 2**params.frac_bits).long() % RING


def dequantize(ring: torch.Tensor, params: SecAggParams) -> torch.Tensor:
    """Ring values in [0, 2^32) back to float32; values >= 2^31 are negative."""
    signed = torch.where(ring >= _HALF, ring - RING, ring)
    return (signed.double() / 2**params.frac_bits).float()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, nbytes: int, what: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise SecAggError(f"{what}: not base64 ({e})") from None
    if len(data) != nbytes:
        raise SecAggError(f"{what}: {len(data)} bytes, expected {nbytes}")
    return data


def _client_id(key: Any, what: str) -> int:
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or str(int(key)) != key:
        raise SecAggError(f"{what}: {key!r} is not a client id")
    return int(key)


def _kdf(secret: bytes, label: bytes, nbytes: int) -> bytes:
    return HKDF(hashes.SHA256(), nbytes, salt=None, info=b"distml-secagg " + label).derive(secret)


def _prg(seed: bytes, length: int) -> np.ndarray:
    # Each seed keys one round's masks only, so a fixed counter block is safe.
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(stream.update(bytes(4 * length)), dtype="<u4")


def _exchange(sk: X25519PrivateKey, pk: X25519PublicKey, what: str) -> bytes:
    """X25519, refusing a low-order public key (its shared secret is all zeros, RFC 7748 6.1)
    as the peer's fault, with :class:`SecAggError`."""
    try:
        return sk.exchange(pk)
    except ValueError:
        raise SecAggError(f"{what}: a low-order public key (no shared secret)") from None


def _public_key(raw: bytes, what: str) -> X25519PublicKey:
    """A peer's public key, checked to agree a secret (a low-order point would not)."""
    key = X25519PublicKey.from_public_bytes(raw)
    _exchange(X25519PrivateKey.generate(), key, what)
    return key


def _pair_seed(sk: X25519PrivateKey, pk: X25519PublicKey) -> bytes:
    return _kdf(_exchange(sk, pk, "pairwise mask"), b"pairwise mask", _SEED)


def _mask_key(seed: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(_kdf(seed, b"mask secret key", 32))


def _split(secret: bytes, t: int, n: int) -> list[bytes]:
    """Shares x = 1..n of ``secret`` on a uniformly random polynomial of degree < t over Z_p."""
    # Uniform coefficients besides the secret make any t - 1 shares uniform, whatever the secret.
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(_PRIME) for _ in range(t - 1)]
    coeffs.reverse()
    shares = []
    for x in range(1, n + 1):
        acc = 0
        for c in coeffs:
            acc = (acc * x + c) % _PRIME
        shares.append(acc.to_bytes(_ELEM, "big"))
    return shares


def _lagrange_at_zero(xs: list[int]) -> list[int]:
    """The weights that take the values at distinct nonzero ``xs`` to the value at 0."""
    coeffs = []
    for j, xj in enumerate(xs):
        num = den = 1
        for xm in xs[:j] + xs[j + 1 :]:
            num = num * xm % _PRIME
            den = den * (xm - xj) % _PRIME
        coeffs.append(num * pow(den, -1, _PRIME) % _PRIME)
    return coeffs


def _interpolate(coeffs: list[int], ys: list[int]) -> int:
    return sum(c * y for c, y in zip(coeffs, ys, strict=True)) % _PRIME


def _element(text: Any, what: str) -> int:
    value = int.from_bytes(_unb64(text, _ELEM, what), "big")
    if value >= _PRIME:
        raise SecAggError(f"{what}: {value} is not an element of Z_p (p = 2^128 + 51)")
    return value


def _share_ad(sender: int, receiver: int) -> bytes:
    return f"distml-secagg shares {sender}->{receiver}".encode()


def _public_raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


class SecAggClient:
    """One client's side of one round; each stage may be called once, in order."""

    def __init__(self, client_id: int, params: SecAggParams):
        self.id = client_id
        self.params = params
        self._c_sk = X25519PrivateKey.generate()
        self._s_seed = os.urandom(_SEED)
        self._s_sk = _mask_key(self._s_seed)
        self._stage = "advertise"
        self._peers: dict[int, tuple[X25519PublicKey, X25519PublicKey]] = {}
        self._b = b""
        self._held: dict[int, bytes] = {}  # owner -> this client's share of b_owner and r_owner
        self._boxes: dict[int, AESGCM] = {}  # peer -> the cipher of the shares between the two
        self._u2: set[int] = set()
        self._revealed_b: set[int] = set()
        self._revealed_s: set[int] = set()

    def _error(self, msg: str) -> SecAggError:
        return SecAggError(f"client {self.id}, {self._stage}: {msg}")

    def _enter(self, stage: str, after: str) -> None:
        if self._stage != after:
            raise self._error(f"{stage} is not the next stage (it must follow {after})")
        self._stage = stage

    def _enough(self, count: int, which: str) -> None:
        if count < self.params.threshold:
            raise self._error(f"{count} {which}, fewer than the threshold {self.params.threshold}")

    def advertise(self) -> dict[str, str]:
        """Stage 0: this client's two public keys."""
        return {"c_pk": _b64(_public_raw(self._c_sk)), "s_pk": _b64(_public_raw(self._s_sk))}

    def share_keys(self, keys: dict[str, dict[str, str]]) -> dict[str, str]:
        """Stage 1: given every advertisement (U1), the encrypted shares for each peer."""
        self._enter("share_keys", after="advertise")
        if not isinstance(keys, dict) or keys.get(str(self.id)) != self.advertise():
            raise self._error("the key list does not hold this client's own keys")
        raw: dict[int, tuple[bytes, bytes]] = {}
        for key, adv in keys.items():
            peer = _client_id(key, f"client {self.id}, share_keys")
            if not isinstance(adv, dict) or set(adv) != set(_KEYS):
                raise self._error(f"client {peer}'s advertisement is malformed")
            raw[peer] = tuple(_unb64(adv[k], 32, f"client {peer}'s {k}") for k in _KEYS)
        self._enough(len(raw), "clients advertised keys")
        if len(raw) > self.params.max_clients:
            raise self._error(
                f"{len(raw)} clients, more than max_clients {self.params.max_clients}"
            )
        if len({k for pair in raw.values() for k in pair}) != 2 * len(raw):
            raise self._error("two advertised public keys are equal")
        self._peers = {
            p: (
                _public_key(c, f"client {self.id}: client {p}'s c_pk"),
                _public_key(s, f"client {self.id}: client {p}'s s_pk"),
            )
            for p, (c, s) in raw.items()
        }
        self._b = os.urandom(_SEED)
        order = sorted(self._peers)
        t, n = self.params.threshold, len(order)
        # Shamir index i + 1 belongs to the i-th client of U1 in id order, on both sides. The two
        # seeds are split apart so that a peer can reveal one without the other.
        b_shares, s_shares = _split(self._b, t, n), _split(self._s_seed, t, n)
        out: dict[str, str] = {}
        for peer, b_share, s_share in zip(order, b_shares, s_shares, strict=True):
            if peer == self.id:
                self._held[peer] = b_share + s_share
                continue
            # The same key opens the peer's shares in the next stage: one key exchange, not two.
            secret = _exchange(self._c_sk, self._peers[peer][0], f"client {self.id}, share_keys")
            key = _kdf(secret, b"share encryption", 32)
            self._boxes[peer] = AESGCM(key)
            nonce = os.urandom(_NONCE)
            sealed = self._boxes[peer].encrypt(nonce, b_share + s_share, _share_ad(self.id, peer))
            out[str(peer)] = _b64(nonce + sealed)
        return out

    def masked_input(self, vector: torch.Tensor, inbox: dict[str, str]) -> torch.Tensor:
        """Stage 2: given the shares addressed to this client (from U2), the masked input."""
        ring = quantize(vector, self.params)
        self._enter("masked_input", after="share_keys")
        for key, text in inbox.items():
            sender = _client_id(key, f"client {self.id}, masked_input")
            if sender not in self._peers or sender == self.id:
                raise self._error(f"shares from client {sender}, who is not a peer in U1")
            blob = _unb64(text, _SEALED, f"client {self.id}: the shares from client {sender}")
            try:
                self._held[sender] = self._boxes[sender].decrypt(
                    blob[:_NONCE], blob[_NONCE:], _share_ad(sender, self.id)
                )
            except InvalidTag:
                raise self._error(
                    f"the shares from client {sender} fail authentication (tampered or misrouted)"
                ) from None
        self._u2 = {self.id, *(int(k) for k in inbox)}
        self._enough(len(self._u2), "clients in U2 (sent shares)")
        masked = ring.numpy().astype(np.uint32)
        masked += _prg(self._b, self.params.length)
        for peer in self._u2 - {self.id}:
            mask = _prg(_pair_seed(self._s_sk, self._peers[peer][1]), self.params.length)
            if self.id < peer:
                masked += mask
            else:
                masked -= mask
        return torch.from_numpy(masked.astype(np.int64))

    def unmask(self, survivors: list[int], dropped: list[int] | None = None) -> dict[str, Any]:
        """Stage 3: shares of b for ``survivors`` (U3) and of the seed of s_sk for ``dropped``
        (default U2 \\ U3). May be asked again, but never for both shares of one peer."""
        if self._stage not in ("masked_input", "unmask"):
            raise self._error("unmask must follow masked_input")
        self._stage = "unmask"
        alive = set(survivors)
        gone = self._u2 - alive if dropped is None else set(dropped)
        if len(alive) != len(survivors) or (dropped is not None and len(gone) != len(dropped)):
            raise self._error("a client is listed twice")
        if self.id not in alive:
            raise self._error("this client is not among the survivors")
        if not alive <= self._u2 or not gone <= self._u2:
            raise self._error(f"clients {sorted((alive | gone) - self._u2)} never shared keys here")
        self._enough(len(alive), "survivors")
        both = (alive | self._revealed_b) & (gone | self._revealed_s)
        if both:
            raise self._error(f"asked for both the b and the s_sk share of clients {sorted(both)}")
        self._revealed_b |= alive
        self._revealed_s |= gone
        return {
            "b": {str(u): _b64(self._held[u][:_ELEM]) for u in sorted(alive)},
            "s": {str(u): _b64(self._held[u][_ELEM:]) for u in sorted(gone)},
        }


class SecAggServer:
    """The server's side of one round. The first call of :meth:`public_keys`,
    :meth:`shares_for` and :meth:`survivors` closes U1, U2 and U3 (a call that finds fewer than
    t clients raises and closes nothing); later messages for a closed stage are refused."""

    def __init__(self, params: SecAggParams, participants: list[int]):
        if len(set(participants)) != len(participants):
            raise ValueError(f"participants {participants} repeat a client")
        if not all(isinstance(c, int) and c >= 0 for c in participants):
            raise ValueError(f"participants {participants}: client ids are ints >= 0")
        if not params.threshold <= len(participants) <= params.max_clients:
            raise ValueError(
                f"{len(participants)} participants: need threshold {params.threshold} <= n <= "
                f"max_clients {params.max_clients}"
            )
        self.params = params
        self.participants = set(participants)
        self._ads: dict[int, dict[str, str]] = {}
        self._shares: dict[int, dict[str, str]] = {}
        self._sum = np.zeros(params.length, dtype=np.uint32)
        self._masked: set[int] = set()
        self._reveals: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        self._u1: list[int] | None = None
        self._u2: list[int] | None = None
        self._u3: list[int] | None = None
        self._total: torch.Tensor | None = None
        self._left: set[int] = set()  # said they are gone: no stage waits for them

    def _check(self, client_id: int, stage: str, members: Any, open_: bool, seen: Any) -> None:
        if members is None or not open_:
            raise SecAggError(f"client {client_id}, {stage}: the stage is not open")
        if client_id not in members:
            raise SecAggError(f"client {client_id}, {stage}: not in the current set of clients")
        if client_id in self._left:
            raise SecAggError(f"client {client_id}, {stage}: left the round")
        if client_id in seen:
            raise SecAggError(f"client {client_id}, {stage}: duplicate message")

    def _close(self, stage: str, arrived: Any) -> list[int]:
        if len(arrived) < self.params.threshold:
            raise SecAggError(
                f"{stage}: {len(arrived)} clients, fewer than the threshold {self.params.threshold}"
            )
        return sorted(arrived)

    def waiting_for(self) -> set[int]:
        """The clients the open stage still expects a message from (empty once all is done)."""
        if self._u1 is None:
            expected = self.participants - set(self._ads)
        elif self._u2 is None:
            expected = set(self._u1) - set(self._shares)
        elif self._u3 is None:
            expected = set(self._u2) - self._masked
        elif self._total is None:
            expected = set(self._u3) - set(self._reveals)
        else:
            expected = set()
        return expected - self._left

    def leave(self, client_id: int) -> None:
        """``client_id`` is gone: no stage waits for it and none takes its messages. What it
        sent before stays, so a client that leaves after sharing its keys is a dropout the
        others' shares unmask."""
        self._left.add(client_id)

    def receive_advertisement(self, client_id: int, adv: dict[str, str]) -> None:
        self._check(client_id, "advertise", self.participants, self._u1 is None, self._ads)
        if not isinstance(adv, dict) or set(adv) != set(_KEYS):
            raise SecAggError(f"client {client_id}, advertise: expected the keys {_KEYS}")
        keys = [_unb64(adv[k], 32, f"client {client_id}, advertise: {k}") for k in _KEYS]
        for k, raw in zip(_KEYS, keys, strict=True):
            _public_key(raw, f"client {client_id}, advertise: {k}")
        if keys[0] == keys[1] or any(
            adv[k] in (other["c_pk"], other["s_pk"]) for other in self._ads.values() for k in _KEYS
        ):
            raise SecAggError(f"client {client_id}, advertise: a public key already advertised")
        self._ads[client_id] = dict(adv)

    def public_keys(self) -> dict[str, dict[str, str]]:
        if self._u1 is None:
            self._u1 = self._close("advertise", self._ads)
        return {str(u): self._ads[u] for u in self._u1}

    def receive_shares(self, client_id: int, out: dict[str, str]) -> None:
        self._check(client_id, "share_keys", self._u1, self._u2 is None, self._shares)
        expected = {str(v) for v in self._u1 if v != client_id}
        if not isinstance(out, dict) or set(out) != expected:
            raise SecAggError(f"client {client_id}, share_keys: need shares for exactly U1 - self")
        for peer, text in out.items():
            _unb64(text, _SEALED, f"client {client_id}, share_keys: the shares for {peer}")
        self._shares[client_id] = dict(out)

    def close_shares(self) -> list[int]:
        """Fix U2, the clients whose shares arrived (as the first :meth:`shares_for` does)."""
        if self._u2 is None:
            self._u2 = self._close("share_keys", self._shares)
        return list(self._u2)

    def shares_for(self, client_id: int) -> dict[str, str]:
        self.close_shares()
        if client_id not in self._u2:
            raise SecAggError(f"client {client_id}, share_keys: did not send shares (not in U2)")
        return {str(u): self._shares[u][str(client_id)] for u in self._u2 if u != client_id}

    def receive_masked(self, client_id: int, masked: torch.Tensor) -> None:
        self._check(client_id, "masked_input", self._u2, self._u3 is None, self._masked)
        what = f"client {client_id}, masked_input"
        if not isinstance(masked, torch.Tensor) or masked.dtype != torch.int64:
            raise SecAggError(f"{what}: expected a torch.int64 tensor")
        if masked.shape != (self.params.length,):
            raise SecAggError(
                f"{what}: shape {tuple(masked.shape)}, expected ({self.params.length},)"
            )
        if bool(((masked < 0) | (masked >= RING)).any()):
            raise SecAggError(f"{what}: values outside [0, 2^32)")
        self._sum += masked.detach().cpu().numpy().astype(np.uint32)
        self._masked.add(client_id)

    def survivors(self) -> list[int]:
        if self._u3 is None:
            self._u3 = self._close("masked_input", self._masked)
        return list(self._u3)

    def receive_unmask(self, client_id: int, reveal: dict[str, Any]) -> None:
        self._check(client_id, "unmask", self._u3, self._total is None, self._reveals)
        what = f"client {client_id}, unmask"
        dropped = set(self._u2) - set(self._u3)
        if not isinstance(reveal, dict) or set(reveal) != {"b", "s"}:
            raise SecAggError(f"{what}: expected the keys 'b' and 's'")
        parsed = []
        for kind, owners in (("b", self._u3), ("s", dropped)):
            part = reveal[kind]
            if not isinstance(part, dict) or set(part) != {str(u) for u in owners}:
                raise SecAggError(f"{what}: the {kind} shares must be for exactly {sorted(owners)}")
            parsed.append({int(u): _element(v, f"{what}, {kind}[{u}]") for u, v in part.items()})
        self._reveals[client_id] = (parsed[0], parsed[1])

    def aggregate_ring(self) -> torch.Tensor:
        """The sum over U3 of the quantised inputs, in [0, 2^32), as int64."""
        if self._total is not None:
            return self._total
        if self._u3 is None:
            raise SecAggError("unmask: the survivors are not fixed yet")
        t = self.params.threshold
        if len(self._reveals) < t:
            raise SecAggError(f"unmask: {len(self._reveals)} reveals, fewer than the threshold {t}")
        chosen = sorted(self._reveals)[:t]  # t shares fix a degree t - 1 polynomial; more cost more
        coeffs = _lagrange_at_zero([self._u1.index(v) + 1 for v in chosen])

        def combine(kind: int, owner: int) -> bytes:
            seed = _interpolate(coeffs, [self._reveals[v][kind][owner] for v in chosen])
            if seed >> (8 * _SEED):
                # Honest shares always rebuild a 16-byte seed, so only a wrong share lands here.
                raise SecAggError(f"unmask: a seed rebuilt for client {owner} exceeds 16 bytes")
            return seed.to_bytes(_SEED, "big")

        total = self._sum.copy()
        for u in self._u3:
            total -= _prg(combine(0, u), self.params.length)
        s_pk = {
            v: X25519PublicKey.from_public_bytes(_unb64(self._ads[v]["s_pk"], 32, "s_pk"))
            for v in self._u3
        }
        for u in sorted(set(self._u2) - set(self._u3)):
            sk = _mask_key(combine(1, u))
            # Without signatures this is the only check on the shares: a wrong one shows here.
            if _b64(_public_raw(sk)) != self._ads[u]["s_pk"]:
                raise SecAggError(f"unmask: the rebuilt mask key of client {u} is not its own")
            for v in self._u3:
                mask = _prg(_pair_seed(sk, s_pk[v]), self.params.length)
                # Survivor v added PRG(s_uv) when v < u and subtracted it when v > u.
                if v < u:
                    total -= mask
                else:
                    total += mask
        self._total = torch.from_numpy(total.astype(np.int64))
        return self._total

    def aggregate(self) -> torch.Tensor:
        """The float32 sum over U3 of the (dequantised) inputs."""
        return dequantize(self.aggregate_ring(), self.params)

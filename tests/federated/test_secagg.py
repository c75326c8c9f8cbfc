"""Secure aggregation (Bonawitz et al. 2017): the exact-sum oracle, dropouts, what the server
sees, and the refusals. Every message goes through JSON on its way, as it would over HTTP."""

from __future__ import annotations

import base64
import json
import os
import random

import pytest
import torch

from distml.federated import secagg
from distml.federated.secagg import (
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    dequantize,
    quantize,
)

P = secagg._PRIME


def wire(msg):
    return json.loads(json.dumps(msg))


def b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(secagg._ELEM, "big")).decode()


def unb64(text: str) -> int:
    return int.from_bytes(base64.b64decode(text), "big")


def rebuild(points: dict[int, int]) -> int:
    """The module's reconstruction: the value at 0 from shares keyed by their x."""
    xs = sorted(points)
    return secagg._interpolate(secagg._lagrange_at_zero(xs), [points[x] for x in xs])


def value_at(points: dict[int, int], z: int) -> int:
    """Plain Lagrange evaluation at z over Z_p, written apart from the module's code."""
    total = 0
    for xj, yj in points.items():
        weight = 1
        for xm in points:
            if xm != xj:
                weight = weight * (z - xm) * pow(xj - xm, -1, P) % P
        total += weight * yj
    return total % P


def client_ids(n: int) -> list[int]:
    # Sparse, unordered ids: the Shamir index of a client is its rank in U1, not its id.
    return random.Random(n).sample(range(1000), n)


class Round:
    """One round driven in-process, stage by stage, so a test can stop or tamper in between."""

    def __init__(self, n: int, t: int, length: int = 512, seed: int = 0, **params):
        self.params = SecAggParams(threshold=t, length=length, **params)
        gen = torch.Generator().manual_seed(seed)
        self.ids = client_ids(n)
        self.inputs = {i: torch.rand(length, generator=gen) * 2 - 1 for i in self.ids}
        self.clients = {i: SecAggClient(i, self.params) for i in self.ids}
        self.server = SecAggServer(self.params, self.ids)

    def advertise(self, ids=None) -> dict:
        for i in self.ids if ids is None else ids:
            self.server.receive_advertisement(i, wire(self.clients[i].advertise()))
        return wire(self.server.public_keys())

    def share_keys(self, ids=None) -> None:
        keys = self.advertise()
        for i in keys if ids is None else ids:
            self.server.receive_shares(int(i), wire(self.clients[int(i)].share_keys(keys)))

    def masked_input(self, ids=None) -> list[int]:
        self.share_keys()
        for i in self.ids if ids is None else ids:
            masked = self.clients[i].masked_input(self.inputs[i], wire(self.server.shares_for(i)))
            self.server.receive_masked(i, masked)
        return self.server.survivors()

    def unmask(self, dropped_before_input=(), reveal=None) -> list[int]:
        alive = [i for i in self.ids if i not in dropped_before_input]
        survivors = self.masked_input(alive)
        for i in survivors if reveal is None else reveal(survivors):
            self.server.receive_unmask(i, wire(self.clients[i].unmask(survivors)))
        return survivors

    def plain_ring_sum(self, ids) -> torch.Tensor:
        return sum(quantize(self.inputs[i], self.params) for i in ids) % secagg.RING


@pytest.mark.parametrize("n", [5, 7, 10])
def test_aggregate_is_the_exact_sum_of_the_quantised_inputs(n):
    r = Round(n, t=n // 2 + 1)
    survivors = r.unmask()
    assert survivors == sorted(r.ids)
    assert torch.equal(r.server.aggregate_ring(), r.plain_ring_sum(r.ids))
    float_sum = sum(r.inputs[i].double() for i in r.ids)
    total = r.server.aggregate()
    assert total.dtype == torch.float32
    bound = n * 2.0 ** -(r.params.frac_bits + 1) + 2**-23 * float_sum.abs()  # + float32 rounding
    assert ((total.double() - float_sum).abs() <= bound).all()


def test_dropouts_after_sharing_keys_leave_exactly_the_survivors_sum():
    r = Round(8, t=5)
    dropped = r.ids[:3]  # n - t: the most the round survives
    survivors = r.unmask(dropped_before_input=dropped)
    assert set(survivors) == set(r.ids) - set(dropped)
    assert torch.equal(r.server.aggregate_ring(), r.plain_ring_sum(survivors))


def test_a_client_that_leaves_is_no_longer_waited_for_and_its_shares_still_unmask_it():
    r = Round(6, t=4)
    r.share_keys()
    r.server.close_shares()  # the masked stage opens: it waits for all six
    gone = r.ids[0]
    assert gone in r.server.waiting_for()
    r.server.leave(gone)
    assert gone not in r.server.waiting_for()
    with pytest.raises(SecAggError, match="left the round"):
        masked = r.clients[gone].masked_input(r.inputs[gone], wire(r.server.shares_for(gone)))
        r.server.receive_masked(gone, masked)
    alive = r.ids[1:]
    for i in alive:
        r.server.receive_masked(i, r.clients[i].masked_input(r.inputs[i], r.server.shares_for(i)))
    assert r.server.waiting_for() == set()  # the masked stage is complete without it
    survivors = r.server.survivors()
    for i in survivors:
        r.server.receive_unmask(i, wire(r.clients[i].unmask(survivors)))
    assert torch.equal(r.server.aggregate_ring(), r.plain_ring_sum(alive))


def test_dropouts_during_unmask_need_only_t_reveals():
    r = Round(8, t=5)
    survivors = r.unmask(dropped_before_input=r.ids[:1], reveal=lambda s: s[2:])
    assert len(survivors) == 7
    assert torch.equal(r.server.aggregate_ring(), r.plain_ring_sum(survivors))


@pytest.mark.parametrize("stage", ["advertise", "share_keys", "masked_input", "unmask"])
def test_more_than_n_minus_t_dropouts_fail_the_round(stage):
    r = Round(6, t=4)
    few = r.ids[:3]
    with pytest.raises(SecAggError, match="fewer than the threshold 4"):
        if stage == "advertise":
            r.advertise(few)
        elif stage == "share_keys":
            r.share_keys(few)
            r.server.shares_for(few[0])
        elif stage == "masked_input":
            r.masked_input(few)
        else:
            r.unmask(reveal=lambda s: s[:3])
            r.server.aggregate()


def test_a_masked_update_looks_uniform_and_uncorrelated_with_the_plain_one():
    length = 20_000
    r = Round(3, t=2, length=length)
    ramp = torch.linspace(-1, 1, length)  # a strongly structured input
    r.inputs = {i: ramp for i in r.ids}
    r.share_keys()
    i = r.ids[0]
    masked = r.clients[i].masked_input(ramp, wire(r.server.shares_for(i))).double()
    plain = dequantize(quantize(ramp, r.params), r.params).double()
    corr = torch.corrcoef(torch.stack([masked, plain]))[0, 1]
    assert abs(float(corr)) < 0.05
    assert abs(float(masked.mean()) / 2**31 - 1) < 0.02
    assert abs(float(masked.std()) / (2**32 / 12**0.5) - 1) < 0.02  # the std of U[0, 2^32)
    assert int(masked.min()) >= 0 and int(masked.max()) < 2**32


def test_client_refuses_to_reveal_both_shares_of_one_peer():
    r = Round(6, t=3)
    survivors = r.masked_input()
    me, peer = survivors[0], survivors[1]
    client = r.clients[me]
    with pytest.raises(SecAggError, match=rf"both the b and the s_sk share of clients \[{peer}\]"):
        client.unmask(survivors, dropped=[peer])
    client.unmask(survivors)  # the honest request is still answered...
    with pytest.raises(SecAggError, match="both"):
        client.unmask([s for s in survivors if s != peer])  # ...but never contradicted later


def test_client_refuses_too_few_survivors_and_peers_it_never_met():
    r = Round(6, t=4)
    survivors = r.masked_input(r.ids[:5])
    client = r.clients[survivors[0]]
    with pytest.raises(SecAggError, match="3 survivors, fewer than the threshold 4"):
        client.unmask(survivors[:3])
    with pytest.raises(SecAggError, match="never shared keys"):
        client.unmask(survivors + [10_000])
    with pytest.raises(SecAggError, match="not among the survivors"):
        r.clients[survivors[1]].unmask([s for s in survivors if s != survivors[1]])


def test_client_refuses_a_key_list_below_the_threshold_or_without_its_own_keys():
    r = Round(5, t=3)
    ads = {str(i): r.clients[i].advertise() for i in r.ids[:2]}
    with pytest.raises(SecAggError, match="2 clients advertised keys, fewer than the threshold"):
        r.clients[r.ids[0]].share_keys(ads)
    with pytest.raises(SecAggError, match="own keys"):
        r.clients[r.ids[4]].share_keys(ads)


def test_server_refuses_masked_inputs_that_do_not_fit():
    r = Round(4, t=2, length=64)
    r.share_keys()
    i, j = r.ids[:2]
    good = r.clients[i].masked_input(r.inputs[i], r.server.shares_for(i))
    bad = {
        "shape": torch.zeros(63, dtype=torch.int64),
        "int64": good.to(torch.int32),
        "int64 tensor": good.tolist(),
        r"outside \[0, 2\^32\)": torch.full((64,), 2**32, dtype=torch.int64),
    }
    for message, masked in bad.items():
        with pytest.raises(SecAggError, match=message):
            r.server.receive_masked(i, masked)
    with pytest.raises(SecAggError, match="not in the current set"):
        r.server.receive_masked(10_000, good)
    r.server.receive_masked(i, good)
    with pytest.raises(SecAggError, match="duplicate"):
        r.server.receive_masked(i, good)
    r.server.receive_masked(j, r.clients[j].masked_input(r.inputs[j], r.server.shares_for(j)))
    r.server.survivors()
    late = r.ids[2]
    with pytest.raises(SecAggError, match="not open"):
        r.server.receive_masked(late, good)


def test_server_refuses_messages_out_of_turn_or_of_the_wrong_shape():
    r = Round(4, t=3)
    with pytest.raises(SecAggError, match="not in the current set"):
        r.server.receive_advertisement(10_000, r.clients[r.ids[0]].advertise())
    with pytest.raises(SecAggError, match="expected the keys"):
        r.server.receive_advertisement(r.ids[0], {"c_pk": "AAAA"})
    with pytest.raises(SecAggError, match="not base64"):
        r.server.receive_advertisement(r.ids[0], {"c_pk": "!!", "s_pk": "!!"})
    keys = r.advertise()
    with pytest.raises(SecAggError, match="not open"):
        r.server.receive_advertisement(r.ids[0], r.clients[r.ids[0]].advertise())
    out = r.clients[r.ids[0]].share_keys(keys)
    with pytest.raises(SecAggError, match="exactly U1 - self"):
        r.server.receive_shares(r.ids[0], dict(list(out.items())[:-1]))
    with pytest.raises(SecAggError, match="not the next stage"):
        r.clients[r.ids[0]].share_keys(keys)  # a second set of shares would be a second secret


def test_server_refuses_reveals_for_the_wrong_clients():
    r = Round(5, t=3)
    survivors = r.masked_input(r.ids[:4])
    reveal = wire(r.clients[survivors[0]].unmask(survivors))
    missing = {"b": dict(list(reveal["b"].items())[1:]), "s": reveal["s"]}
    with pytest.raises(SecAggError, match="the b shares must be for exactly"):
        r.server.receive_unmask(survivors[0], missing)
    with pytest.raises(SecAggError, match="the s shares must be for exactly"):
        r.server.receive_unmask(survivors[0], {"b": reveal["b"], "s": {}})


def test_tampered_or_misrouted_shares_fail_decryption():
    r = Round(4, t=2)
    r.share_keys()
    a, b, c = r.ids[:3]
    inbox = r.server.shares_for(a)
    blob = bytearray(base64.b64decode(inbox[str(b)]))
    blob[20] ^= 1
    tampered = {**inbox, str(b): base64.b64encode(bytes(blob)).decode()}
    with pytest.raises(SecAggError, match=f"shares from client {b} fail authentication"):
        r.clients[a].masked_input(r.inputs[a], tampered)
    misrouted = {**r.server.shares_for(c), str(b): r.server.shares_for(a)[str(b)]}
    with pytest.raises(SecAggError, match="fail authentication"):
        r.clients[c].masked_input(r.inputs[c], misrouted)


def test_a_corrupted_mask_key_share_is_caught_by_the_server():
    r = Round(5, t=3)
    survivors = r.masked_input(r.ids[:4])
    dropped = str(r.ids[4])
    for i in survivors:
        reveal = wire(r.clients[i].unmask(survivors))
        if i == survivors[0]:
            reveal["s"][dropped] = b64((unb64(reveal["s"][dropped]) + 1) % P)
        r.server.receive_unmask(i, reveal)
    with pytest.raises(SecAggError, match=f"rebuilt mask key of client {dropped}"):
        r.server.aggregate()


def test_overflow_prone_params_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"1024 x ceil\(clip 1.0 x 2\^21\) = 2147483648 >= 2\^31"):
        SecAggParams(threshold=2, length=1, clip=1.0, frac_bits=21, max_clients=1024)
    edge = SecAggParams(threshold=2, length=1, clip=2**30 - 1, frac_bits=0, max_clients=2)
    assert 2 * edge.max_level == 2**31 - 2
    with pytest.raises(ValueError, match="= 2147483648 >= 2"):
        SecAggParams(threshold=2, length=1, clip=2**30, frac_bits=0, max_clients=2)
    with pytest.raises(ValueError, match="max_clients 2"):
        SecAggServer(edge, participants=[0, 1, 2])
    with pytest.raises(ValueError):
        SecAggParams(threshold=1, length=1)  # one share would be the secret itself


def test_quantize_clips_rounds_and_wraps_negatives():
    params = SecAggParams(threshold=2, length=5, clip=2.0, frac_bits=4)
    vec = torch.tensor([0.5, -0.5, 3.0, -3.0, 0.03])
    ring = quantize(vec, params)
    assert ring.dtype == torch.int64
    assert ring.tolist() == [8, 2**32 - 8, 32, 2**32 - 32, 0]
    assert dequantize(ring, params).tolist() == [0.5, -0.5, 2.0, -2.0, 0.0]
    with pytest.raises(ValueError, match="NaN"):
        quantize(torch.tensor([0.0, 0.0, float("nan"), 0.0, 0.0]), params)
    with pytest.raises(ValueError, match="shape"):
        quantize(torch.zeros(4), params)


def test_server_refuses_shares_that_are_not_field_elements():
    r = Round(5, t=3)
    survivors = r.masked_input(r.ids[:4])
    dropped, owner = str(r.ids[4]), str(survivors[1])
    reveal = wire(r.clients[survivors[0]].unmask(survivors))
    with pytest.raises(SecAggError, match=rf"b\[{owner}\]: {P} is not an element of Z_p"):
        r.server.receive_unmask(survivors[0], {**reveal, "b": {**reveal["b"], owner: b64(P)}})
    short = base64.b64encode(os.urandom(16)).decode()
    with pytest.raises(SecAggError, match=rf"s\[{dropped}\]: 16 bytes, expected 17"):
        r.server.receive_unmask(survivors[0], {**reveal, "s": {dropped: short}})
    r.server.receive_unmask(survivors[0], reveal)


def test_server_refuses_a_rebuilt_seed_longer_than_16_bytes():
    r = Round(4, t=2)
    survivors = r.masked_input()
    first, second = survivors[:2]  # only these two reveal, so the server rebuilds from them
    reveals = {i: wire(r.clients[i].unmask(survivors)) for i in (first, second)}
    c_first, _ = secagg._lagrange_at_zero([sorted(r.ids).index(i) + 1 for i in (first, second)])
    # Shift the first share so that the rebuilt b of client `first` is exactly 2^128.
    b = int.from_bytes(r.clients[first]._b, "big")
    share = unb64(reveals[first]["b"][str(first)])
    reveals[first]["b"][str(first)] = b64((share + (2**128 - b) * pow(c_first, -1, P)) % P)
    for i in (first, second):
        r.server.receive_unmask(i, reveals[i])
    with pytest.raises(SecAggError, match=f"seed rebuilt for client {first} exceeds 16 bytes"):
        r.server.aggregate()


@pytest.mark.parametrize("t", [2, 5, 60])
def test_any_t_of_n_shares_rebuild_the_secret(t):
    rng = random.Random(t)
    n = 100
    for secret in (os.urandom(16), bytes(16), b"\xff" * 16):
        shares = secagg._split(secret, t, n)
        assert len(shares) == n and {len(s) for s in shares} == {secagg._ELEM}
        values = [int.from_bytes(s, "big") for s in shares]
        assert max(values) < P
        for k in (t, t, t + 1, n):  # more than t shares lie on the same polynomial
            xs = rng.sample(range(1, n + 1), k)
            assert rebuild({x: values[x - 1] for x in xs}).to_bytes(16, "big") == secret


@pytest.mark.parametrize("t", [2, 3, 8])
def test_t_minus_1_shares_fit_every_secret(t):
    rng = random.Random(t)
    n = 12
    secret = os.urandom(16)
    values = [int.from_bytes(s, "big") for s in secagg._split(secret, t, n)]
    seen = {x: values[x - 1] for x in rng.sample(range(1, n + 1), t - 1)}
    assert rebuild(seen) != int.from_bytes(secret, "big")
    for other in (secret, os.urandom(16), bytes(16)):
        # The polynomial through (0, other) and the seen shares has degree < t: a full sharing
        # of `other` that agrees with everything a coalition of t - 1 holds.
        forged = {
            x: value_at({0: int.from_bytes(other, "big"), **seen}, x) for x in range(1, n + 1)
        }
        assert all(forged[x] == y for x, y in seen.items())
        for k in (t, t + 1):
            xs = rng.sample(range(1, n + 1), k)
            assert rebuild({x: forged[x] for x in xs}).to_bytes(16, "big") == other


# Small-order points of Curve25519 (the u-coordinates whose X25519 gives the all-zero secret):
# 0, 1, the two points of order 8, and p - 1, p, p + 1 (RFC 7748 section 6.1; Bernstein's list).
LOW_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    (2**255 - 19 - 1).to_bytes(32, "little"),
    (2**255 - 19).to_bytes(32, "little"),
    (2**255 - 19 + 1).to_bytes(32, "little"),
]


@pytest.mark.parametrize("key", LOW_ORDER, ids=range(len(LOW_ORDER)))
def test_server_refuses_a_low_order_public_key(key):
    params = SecAggParams(threshold=2, length=4)
    server = SecAggServer(params, [0, 1, 2])
    good = SecAggClient(1, params).advertise()
    server.receive_advertisement(1, good)
    bad = {"c_pk": base64.b64encode(key).decode(), "s_pk": good["s_pk"]}
    with pytest.raises(SecAggError, match="low-order"):
        server.receive_advertisement(
            0, wire(bad | {"s_pk": SecAggClient(0, params).advertise()["s_pk"]})
        )
    with pytest.raises(SecAggError, match="already advertised"):
        server.receive_advertisement(
            2, wire(SecAggClient(2, params).advertise() | {"s_pk": good["s_pk"]})
        )
    assert server.waiting_for() == {0, 2}  # nothing of theirs was kept


def test_a_peers_low_order_key_is_a_protocol_error_for_the_client_not_a_crash():
    params = SecAggParams(threshold=2, length=4)
    clients = {i: SecAggClient(i, params) for i in range(3)}
    keys = {str(i): c.advertise() for i, c in clients.items()}
    keys["2"] = {"c_pk": base64.b64encode(bytes(32)).decode(), "s_pk": keys["2"]["s_pk"]}
    with pytest.raises(SecAggError, match="low-order"):
        clients[0].share_keys(wire(keys))

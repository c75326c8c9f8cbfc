"""Partitioners: every example exactly once, and the skew each one promises."""

import pytest
import torch

from distml.data import digits
from distml.federated.partition import partition

LABELS = digits("train").tensors[1]


def classes_per_client(parts):
    return [len(set(LABELS[p].tolist())) for p in parts]


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "shards:2"])
def test_every_example_goes_to_exactly_one_client(spec):
    parts = partition(LABELS, 100, spec, seed=1)
    assert len(parts) == 100 and min(map(len, parts)) >= 2
    assert sorted(i for p in parts for i in p) == list(range(len(LABELS)))
    assert parts == partition(LABELS, 100, spec, seed=1)
    assert parts != partition(LABELS, 100, spec, seed=2)


def test_iid_sizes_are_equal_and_shards_give_k_classes():
    sizes = [len(p) for p in partition(LABELS, 100, "iid")]
    assert max(sizes) - min(sizes) <= 1
    shards = partition(LABELS, 100, "shards:2")
    # Sorted shards of ~7 examples each hold one class, two where a class boundary falls.
    assert max(classes_per_client(shards)) <= 4
    assert sum(classes_per_client(shards)) / 100 < 2.5
    assert sum(classes_per_client(partition(LABELS, 100, "iid"))) / 100 > 7


def test_smaller_dirichlet_alpha_means_more_label_skew():
    skew = {a: sum(classes_per_client(partition(LABELS, 50, f"dirichlet:{a}"))) / 50
            for a in (0.1, 1.0, 100.0)}  # fmt: skip
    assert skew[0.1] < skew[1.0] < skew[100.0]
    assert skew[100.0] > 9


@pytest.mark.parametrize(
    "spec, clients, message",
    [
        ("dirichlet:0", 10, "expected iid, dirichlet:ALPHA"),
        ("shards:1.5", 10, "expected iid"),
        ("zipf", 10, "expected iid"),
        ("iid", 10_000, "cannot give 10000 clients"),
    ],
)
def test_bad_partitions_are_refused(spec, clients, message):
    with pytest.raises(ValueError, match=message):
        partition(torch.zeros(1000, dtype=torch.long), clients, spec)

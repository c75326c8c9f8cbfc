"""The digits come from a cached copy, equal to scikit-learn's own, and a damaged copy is mended."""

import subprocess
import sys

import pytest
import torch

from distml.data import digits
from distml.data.datasets import CACHE_ENV, digits_arrays


def test_the_cached_digits_are_scikit_learns(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits  # slow to import: not at collection

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    bunch = load_digits()
    expected = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    for _ in range(2):  # the first call writes the copy, the second reads it
        images, labels = digits_arrays()
        assert (tmp_path / "digits-v1.safetensors").is_file()
        assert torch.equal(images.float().unsqueeze(1) / 16.0, expected)
        assert labels.tolist() == bunch.target.tolist()
    x, y = digits("all").tensors
    assert torch.equal(x, expected) and y.tolist() == bunch.target.tolist()

    (tmp_path / "digits-v1.safetensors").write_bytes(b"half a file")
    assert torch.equal(digits_arrays()[0], images)
    assert torch.equal(digits_arrays()[0], images)  # rewritten whole


@pytest.mark.distributed
def test_a_process_reading_the_cache_does_not_import_scikit_learn(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    digits_arrays()  # cached here; the process below reads the copy
    code = (
        "import sys; from distml.data import digits; digits('train'); "
        "print('sklearn' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.strip() == "False", run.stderr

"""A served model answers as the plain module does: the channels-last layout a convolutional
image model is served in changes the speed, not the values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model, save_model

from distml.models import MLP, DigitsCNN
from distml.serve.model import load_served_model


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_a_convolutional_model_is_served_channels_last_with_the_plain_modules_values(
    digits_cnn_checkpoint, rows
):
    served = load_served_model(digits_cnn_checkpoint, "digits-cnn")
    plain = DigitsCNN().eval()
    load_model(plain, str(digits_cnn_checkpoint))
    conv = served.module.features[2].weight  # 16 channels in: the layouts differ
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()

    x = torch.randn(rows, 1, 8, 8, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        expected = plain(x)
    torch.testing.assert_close(served.predict(x), expected)


def test_a_model_without_convolutions_keeps_its_layout(tmp_path):
    path = tmp_path / "mlp.safetensors"
    save_model(MLP((64, 32, 10)), str(path))
    served = load_served_model(path, "digits-mlp")
    assert served.memory_format is torch.contiguous_format
    x = torch.randn(5, 1, 8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(served.predict(x), served.module(x))

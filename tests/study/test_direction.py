"""study/direction.py: how much of an update touches the base weights' principal directions."""
import pytest
import torch

import lora
import model as M
from study import direction


def adapter_with(model, folder, layer, pairs):
    """An adapter on model whose only change is sum of outer products u v^T (pairs), at layer."""
    lora.add_lora(model, rank=4, alpha=4)  # scale 1
    target = lora.lora_layers(model)[layer]
    with torch.no_grad():
        for i, (u, v) in enumerate(pairs):
            target.lora_B["default"][:, i] = u.float()
            target.lora_A["default"][i] = v.float()
        for other in lora.lora_layers(model).values():
            if other is not target:
                other.lora_B["default"].zero_()
    lora.save_adapter(model, folder)
    return folder


def test_the_principal_share_is_one_on_the_top_directions_zero_off_them_and_a_mean_by_energy(tiny_model, tmp_path):
    bases = direction.principal_bases(tiny_model)
    layer = "model.layers.0.mlp.up_proj"  # (128, 64): 6 of 64 singular directions are principal
    u, v = bases[layer]
    assert u.shape == (128, 6) and v.shape == (64, 6) and len(bases) == 7 * 2
    weight = M.load(tiny_model)[0].get_submodule(layer).weight.double()
    U, S, Vh = torch.linalg.svd(weight, full_matrices=False)
    top, low = (U[:, 0], Vh[0]), (U[:, -1], Vh[-1])
    share = lambda name, pairs: direction.principal_share(
        adapter_with(M.load(tiny_model)[0], str(tmp_path / name), layer, pairs), bases)
    assert share("top", [top]) == pytest.approx(1.0, abs=1e-6)
    assert share("low", [low]) == pytest.approx(0.0, abs=1e-6)
    # the top left direction against a low right one still touches the principal subspace
    assert share("half", [(U[:, 0], Vh[-1])]) == pytest.approx(1.0, abs=1e-6)
    assert share("both", [top, (2 * U[:, -1], Vh[-1])]) == pytest.approx(1 / 5, abs=1e-6)  # energy 1 and 4
    untrained = str(tmp_path / "zero")
    model = M.load(tiny_model)[0]
    lora.add_lora(model, rank=4, alpha=4)
    lora.save_adapter(model, untrained)  # B = 0: no change at all
    assert direction.principal_share(untrained, bases) is None

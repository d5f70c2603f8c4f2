"""The direction of an update beside its size: how much of it touches the base weights'
principal directions. RL's updates keep off them and SFT's do not, in Qwen-family models (Zhu
et al. 2025, "The Path Not Taken", arXiv 2511.08567); the frontier and size studies read it
beside the update norm, so that a reader sees whether the arms differ in where their updates
go as well as in how far.
"""
import os

import torch

import lora
import model as M
from plumbing.files import read_safetensors_file

PRINCIPAL = 0.1  # a weight's principal subspace: its top tenth of singular directions


def principal_bases(model_name):
    """module name -> (U, V): each linear weight's top PRINCIPAL of left and right singular
    vectors (at least one), in float64, from the base model's files."""
    folder, state = M.model_folder(model_name), {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(read_safetensors_file(os.path.join(folder, name)))
    bases = {}
    for key, weight in state.items():
        if key.endswith("_proj.weight") and weight.dim() == 2:
            u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
            k = max(1, round(PRINCIPAL * len(s)))
            bases[key[:-len(".weight")]] = (u[:, :k], vh[:k].T)
    return bases


def principal_share(folder, bases):
    """The share of the update's squared norm, over every layer the adapter in folder adapts,
    that touches the base's principal subspaces: 1 - ||(I - U U^T) dW (I - V V^T)||^2 / ||dW||^2
    summed over layers (0: every change off the principal directions; None: no change)."""
    total = off = 0.0
    for module, scale, A, B in lora.adapter_updates(folder):
        change = scale * (B.double() @ A.double())
        u, v = bases[module]
        rest = change - u @ (u.T @ change)
        rest = rest - (rest @ v) @ v.T
        total += change.pow(2).sum().item()
        off += rest.pow(2).sum().item()
    return 1 - off / total if total else None

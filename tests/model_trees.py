"""Small hand-written module trees for plan tests (no transformers)."""

from __future__ import annotations

import torch
from torch import nn


class Leaf(nn.Module):
    """One weight (and optionally a bias) of ``n`` elements."""

    def __init__(self, n: int = 4, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        if bias:
            self.bias = nn.Parameter(torch.zeros(n))


class Norm(Leaf):
    pass


class Block(nn.Module):
    """``Block(attn=Leaf, mlp=Leaf, norm=Norm)``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Leaf()
        self.mlp = Leaf()
        self.norm = Norm()


class Net(nn.Module):
    """``Net(embed=Leaf, layers=ModuleList[Block x n], head=Leaf)``."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = Leaf()
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = Leaf()


def tree_from_spec(shape: dict) -> nn.Module:
    """``{"p": [3, 2], "kids": [shape, ...]}`` -> a module with params of those sizes and kids ``c0, c1…``."""
    mod = nn.Module()
    for i, n in enumerate(shape.get("p", [])):
        mod.register_parameter(f"w{i}", nn.Parameter(torch.zeros(n)))
    for i, kid in enumerate(shape.get("kids", [])):
        mod.add_module(f"c{i}", tree_from_spec(kid))
    return mod

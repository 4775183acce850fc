"""Small modules shared by the fp4_linear and q4_linear sibling-fusion tests."""

import torch


class SiblingsOnALinear(torch.nn.Module):
    """Two siblings (a, b) reading the output of another linear (proj) directly."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.a = torch.nn.Linear(width, width // 2, bias=False)
        self.b = torch.nn.Linear(width, width // 2, bias=False)

    def forward(self, x):
        h = self.proj(x)
        return self.a(h) * self.b(h)

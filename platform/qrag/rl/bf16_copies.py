"""bf16 copies of the learner's encoders for its passes without gradients (``learner.bf16_copies``).

Under autocast an fp32 encoder casts every weight to bf16 at every linear layer, and runs its layer
norms and residual adds in fp32: for the passes that only act and bootstrap (the online encoders
acting, the target encoders' values) that is extra memory traffic and extra kernels, paid by the
largest passes of an update. A bf16 copy of the module runs them in bf16 throughout. The copies are
refreshed from the fp32 weights once per update, after the previous update's optimiser step and
target move, so each acting pass sees the weights it would have seen.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class Bf16Copies:
    """One bf16, eval-mode copy per encoder module, refreshed by :meth:`refresh`."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self._copies: dict[int, tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]] = {}

    def of(self, module: nn.Module) -> nn.Module:
        """``module``'s copy (made on first use), as fresh as the last :meth:`refresh`."""
        key = id(module)  # the learner's encoders live as long as it does
        if key not in self._copies:
            twin = copy.deepcopy(module).to(self.dtype).eval().requires_grad_(False)
            for p in twin.parameters():
                p.grad = None  # a gradient the module held when copied is not the copy's
            pairs = zip([*module.parameters(), *module.buffers()], [*twin.parameters(), *twin.buffers()])
            floating = [(s, t) for s, t in pairs if s.is_floating_point()]  # integer buffers never change
            self._copies[key] = (twin, [s for s, _ in floating], [t for _, t in floating])
        return self._copies[key][0]

    @torch.no_grad()
    def refresh(self) -> None:
        """Every copy's weights from its module's current ones (one fused copy per module)."""
        for _, sources, targets in self._copies.values():
            torch._foreach_copy_(targets, sources)

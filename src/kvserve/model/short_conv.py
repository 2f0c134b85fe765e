"""LFM2's gated short convolution as a RecurrentMixer.

in_proj gives B, C and x per token; B * x runs through a depthwise causal convolution of width K (the
config's conv_kernel, LFM2's L_cache) over the sequence, whose first rows read the sequence's previous
K - 1 inputs from its state; C times the convolution goes through out_proj. The state per sequence is
those last K - 1 inputs, [hidden, K - 1].

Every row of the step, decode or prefill, is computed by the same gather and reduction: a row's output
depends on its own K inputs only, so it has the same bits in any batch and whether its sequence's
earlier tokens were computed in this step or read from the state.
"""

import torch

from kvserve.model.linear import Linear
from kvserve.model.recurrent import SequenceRows, StateSpec


class ShortConv:
    def __init__(
        self, in_proj: Linear, out_proj: Linear, weight: torch.Tensor, bias: torch.Tensor | None, hidden: int
    ) -> None:
        """`weight` [hidden, K] (the checkpoint's [hidden, 1, K] squeezed); `bias` [hidden] or None."""
        self.in_proj = in_proj
        self.out_proj = out_proj
        self.hidden = hidden
        self.kernel = int(weight.shape[-1])
        # [K, hidden]: the window's rows in token order, oldest first.
        self.weight = weight.t().contiguous()
        self.bias = bias
        self.spec = StateSpec(((hidden, self.kernel - 1),), weight.dtype)

    def forward(self, x: torch.Tensor, rows: SequenceRows, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        (state,) = states
        h, k = self.hidden, self.kernel
        bcx = self.in_proj(x, rows.decodes)
        b, c, v = bcx[:, :h], bcx[:, h : 2 * h], bcx[:, 2 * h :]
        bx = b * v
        t = x.shape[0]
        s = rows.num_sequences
        if t == s:
            return self.out_proj(c * self._decodes(bx, rows.slots.to(x.device), state), rows.decodes)
        starts = rows.starts.to(x.device)
        slots = rows.slots.to(x.device)
        lengths = starts[1:] - starts[:-1]
        seq = torch.repeat_interleave(torch.arange(s, device=x.device), lengths)
        offset = torch.arange(t, device=x.device) - starts[seq]
        # Row r reads the inputs at offsets offset - (K - 1) .. offset of its sequence; those before the
        # sequence's first row come from its state, laid out before the step's rows in `source`.
        rel = offset[:, None] + torch.arange(1 - k, 1, device=x.device)[None, :]
        past = state[slots].transpose(1, 2).reshape(s * (k - 1), h)
        source = torch.cat((past.to(bx.dtype), bx))
        index = torch.where(
            rel >= 0, s * (k - 1) + starts[seq][:, None] + rel, seq[:, None] * (k - 1) + (k - 1) + rel
        )
        windows = source[index]  # [T, K, hidden]
        conv = (windows * self.weight).sum(dim=1)
        if self.bias is not None:
            conv = conv + self.bias
        # Each sequence's state is now the last K - 1 inputs its last row read, itself included.
        last = index[starts[1:] - 1, 1:]  # [S, K - 1]
        state[slots] = source[last].transpose(1, 2).to(state.dtype)
        return self.out_proj(c * conv, rows.decodes)

    def _decodes(self, bx: torch.Tensor, slots: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The convolution where each sequence is one row: its window is its state and then the row,
        the same [rows, K, hidden] windows and reduction as `forward` builds (the same bits)."""
        past = state[slots].transpose(1, 2).to(bx.dtype)  # [S, K - 1, hidden]
        windows = torch.cat((past, bx.unsqueeze(1)), dim=1)
        conv = (windows * self.weight).sum(dim=1)
        if self.bias is not None:
            conv = conv + self.bias
        state[slots] = windows[:, 1:].transpose(1, 2).to(state.dtype)
        return conv

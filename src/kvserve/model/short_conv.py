"""LFM2's gated short convolution as a RecurrentMixer.

in_proj gives B, C and x per token; B * x runs through a depthwise causal convolution of width K (the
config's conv_kernel, LFM2's L_cache) over the sequence, whose first rows read the sequence's previous
K - 1 inputs from its state; C times the convolution goes through out_proj. The state per sequence is
those last K - 1 inputs, [hidden, K - 1].

The longer sequences' rows are computed by one gather and reduction: a row's output depends on its own K
inputs only, so it has the same bits in any batch and whether its sequence's earlier tokens were computed
in this step or read from the state. A one-row sequence (a decode) takes the native step where the
products are native (kvserve.model.native_mixer), the one the native decoder runs.
"""

import torch

from kvserve.model.kernel_abi import MIXER_KINDS, MixerStruct
from kvserve.model.linear import Linear
from kvserve.model.native_mixer import NativeStep, mix, native_library
from kvserve.model.recurrent import SequenceRows, StateSpec
from kvserve.model.spec import MIXER_SHORT_CONV


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
        # [hidden, K] and the bias, float32, for the native step.
        self.taps = weight.contiguous()
        small = [self.taps] if bias is None else [self.taps, bias]
        lib = native_library([in_proj, out_proj], small)
        self.native: NativeStep | None = None
        if lib is not None:
            struct = MixerStruct(kind=MIXER_KINDS[MIXER_SHORT_CONV], channels=hidden, kernel=self.kernel)
            struct.conv = self.taps.data_ptr()
            struct.conv_bias = None if bias is None else bias.data_ptr()
            self.native = NativeStep(lib, struct)

    def forward(self, x: torch.Tensor, rows: SequenceRows, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        bcx = self.in_proj(x, rows.decodes)
        gated = mix(
            self.native, lambda t, r: self._convolve(t[0], r, states[0]), [bcx], rows, states, self.hidden
        )
        return self.out_proj(gated.to(x.dtype), rows.decodes)

    def _convolve(self, bcx: torch.Tensor, rows: SequenceRows, state: torch.Tensor) -> torch.Tensor:
        """C times the convolution of B * x, [T, hidden], of the input product's rows `bcx` [T, 3 * hidden]
        by sequence; each sequence's window is left holding its last K - 1 inputs."""
        h, k = self.hidden, self.kernel
        b, c, v = bcx[:, :h], bcx[:, h : 2 * h], bcx[:, 2 * h :]
        bx = b * v
        t = bcx.shape[0]
        s = rows.num_sequences
        starts = rows.starts.to(bcx.device)
        slots = rows.slots.to(bcx.device)
        lengths = starts[1:] - starts[:-1]
        seq = torch.repeat_interleave(torch.arange(s, device=bcx.device), lengths)
        offset = torch.arange(t, device=bcx.device) - starts[seq]
        # Row r reads the inputs at offsets offset - (K - 1) .. offset of its sequence; those before the
        # sequence's first row come from its state, laid out before the step's rows in `source`.
        rel = offset[:, None] + torch.arange(1 - k, 1, device=bcx.device)[None, :]
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
        return c * conv

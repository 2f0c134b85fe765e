"""Qwen3.5's Gated DeltaNet: a linear-attention layer whose per-sequence state has a fixed size.

For each token, from the normed hidden row x:
- q, k, v = in_proj_qkv(x), through a depthwise causal convolution of K taps over the sequence's last K
  inputs, then silu; q and k are l2-normalized per head, q scaled by k_head_dim ** -0.5.
- beta = sigmoid(in_proj_b(x)) (how much of the new value is written) and the decay in log space
  g = A * softplus(in_proj_a(x) + dt_bias), with A = -exp(A_log) < 0, per value head.
- the delta rule on the state S [k_head_dim, v_head_dim] per value head:
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
- the output o, RMS-normed per head and multiplied by silu(in_proj_z(x)) (the gated norm, whose weight
  multiplies as it is, not as 1 + w), then out_proj.

A sequence's state is two tensors (`GatedDeltaNet.spec`): its convolution window, the last K - 1 inputs
[conv_dim, K - 1], and the delta-rule state [num_v_heads, k_head_dim, v_head_dim], both float32 whatever
the compute dtype (the recurrence runs in float32, as the reference does).

A prefill runs the chunked form of the delta rule: the sequence in chunks of 64 tokens, each chunk's
intra-chunk terms as matrix products and one triangular solve for all chunks at once, then one step per
chunk that reads and writes the state. Writing u_t for the value a token writes,
  u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s)
with G the decay summed within the chunk and S0 the state before it, so (I + A) U = V_beta - W S0 with
A strictly lower triangular: U = (I + A)^-1 V_beta - (I + A)^-1 W S0, and then
  o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s,
  S_end = exp(G_end) S0 + sum_s exp(G_end - G_s) k_s u_s^T.
Every exponent is of a decay summed forwards (<= 0), so nothing overflows. A one-row sequence (a decode)
takes the recurrence itself, in place on its slot of the pool (no copy of its state).

A sequence's rows and state are the same bits alone or in any batch, where the products are (the native
block products are): each longer sequence is chunked on its own, each decode stepped on its own (calls of
the same shapes whatever the batch), and the elementwise gates run on rows padded to whole vector
iterations (`rowwise`).
"""

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.errors import ModelLoadError
from kvserve.model.linear import Linear
from kvserve.model.recurrent import SequenceRows, StateSpec
from kvserve.model.spec import GatedDeltaNetConfig, ModelConfig
from kvserve.model.weights import ModelWeights, Rows

CHUNK = 64
# The l2 norm's epsilon, inside the square root, as the reference's kernels take it.
L2_EPS = 1e-6


# The elements torch's vectorized elementwise loops take per iteration, at most (AVX-512: two vectors of
# 16 floats); past the last whole iteration it computes exp, sigmoid and the like with scalar functions of
# other last bits.
_LANES = 32


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) elementwise, each row's bits the same in any batch: rows [T, n] (n not a multiple of _LANES)
    are padded to whole iterations, so a row never straddles the loop's tail (which row lands there
    depends on how many rows the batch has)."""
    width = x.shape[-1]
    if width % _LANES == 0:
        return fn(x)
    padded = F.pad(x, (0, -width % _LANES))
    return fn(padded)[..., :width]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] over its last dimension times `weight` [D], then times silu(gate)."""
    silu = rowwise(F.silu, gate.reshape(gate.shape[0], -1)).view(gate.shape)
    return F.rms_norm(x, (x.shape[-1],), weight, eps) * silu


def deltanet_state_spec(config: GatedDeltaNetConfig) -> StateSpec:
    """A layer's state per sequence: its convolution window [conv_dim, K - 1] and its delta-rule state
    [num_v_heads, k_head_dim, v_head_dim], float32."""
    c = config
    shapes = ((c.conv_dim, c.conv_kernel - 1), (c.num_v_heads, c.k_head_dim, c.v_head_dim))
    return StateSpec(shapes=shapes, dtype=torch.float32)


class GatedDeltaNet:
    """One Gated DeltaNet layer (a `RecurrentMixer`). Products: `qkv` (hidden -> conv_dim), `z` (hidden ->
    value_dim), `b` and `a` (hidden -> num_v_heads), `out` (value_dim -> hidden). Tensors: `conv` [conv_dim,
    K], `decay` A [num_v_heads] (negative: -exp(A_log)), `dt_bias` [num_v_heads], `norm` [v_head_dim]."""

    def __init__(
        self,
        config: GatedDeltaNetConfig,
        eps: float,
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
        out: Linear,
        conv: torch.Tensor,
        decay: torch.Tensor,
        dt_bias: torch.Tensor,
        norm: torch.Tensor,
    ) -> None:
        c = config
        if c.num_v_heads % c.num_k_heads:
            raise ValueError(f"{c.num_v_heads} value heads are not a multiple of {c.num_k_heads} key heads")
        self.config = c
        self.eps = eps
        self.qkv, self.z, self.b, self.a, self.out = qkv, z, b, a, out
        self.conv = conv.float().contiguous()
        self.decay = decay.float()
        self.dt_bias = dt_bias.float()
        self.norm = norm.float()
        self.spec = deltanet_state_spec(c)

    def forward(self, x: torch.Tensor, rows: SequenceRows, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; each sequence's slots of `states` (its conv window and delta-rule
        state) are read and left holding the state after its last row."""
        c = self.config
        if len(states) != 2 or any(
            s.dim() != len(shape) + 1 or tuple(s.shape[1:]) != shape
            for s, shape in zip(states, self.spec.shapes, strict=False)
        ):
            found = [tuple(s.shape[1:]) for s in states]
            expected = list(self.spec.shapes)
            raise ValueError(f"a Gated DeltaNet state of shapes {found} per slot, not {expected}")
        conv_state, delta_state = states
        starts = rows.starts.tolist()
        lengths = [e - s for s, e in itertools.pairwise(starts)]
        decodes = rows.decodes
        n = x.shape[0]
        mixed = self._convolve(self.qkv(x, decodes).float(), rows, lengths, conv_state)
        q, k, v = torch.split(mixed, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = self._per_value_head(l2_normalize(q.view(n, c.num_k_heads, c.k_head_dim))) * c.k_head_dim**-0.5
        k = self._per_value_head(l2_normalize(k.view(n, c.num_k_heads, c.k_head_dim)))
        v = v.reshape(n, c.num_v_heads, c.v_head_dim)
        beta = rowwise(torch.sigmoid, self.b(x, decodes).float())
        g = self.decay * rowwise(F.softplus, self.a(x, decodes).float() + self.dt_bias)
        if len(lengths) == n:
            # A decode step (every sequence one row, in order): no gather of the rows, no scatter back.
            return self._output(recurrent_step(q, k, v, g, beta, delta_state, rows.slots), x, decodes)
        o = torch.empty_like(v)
        single = [j for j, length in enumerate(lengths) if length == 1]
        if single:
            at = rows.starts[single]
            slots = rows.slots[single]
            o[at] = recurrent_step(q[at], k[at], v[at], g[at], beta[at], delta_state, slots)
        # Each longer sequence on its own: its bits depend on its rows alone, not on the batch's others.
        for j, length in enumerate(lengths):
            if length > 1:
                span = slice(starts[j], starts[j] + length)
                qj, kj, vj, gj, bj = (t[span] for t in (q, k, v, g, beta))
                o[span] = chunked_delta_rule(qj, kj, vj, gj, bj, delta_state, rows.slots[j : j + 1])
        return self._output(o, x, decodes)

    def _output(self, o: torch.Tensor, x: torch.Tensor, decodes: int) -> torch.Tensor:
        """The delta rule's output o [T, H, Dv] through the gated norm and out_proj."""
        c = self.config
        n = x.shape[0]
        z = self.z(x, decodes).float().view(n, c.num_v_heads, c.v_head_dim)
        normed = gated_rms_norm(o, z, self.norm, self.eps).to(x.dtype)
        return self.out(normed.view(n, c.value_dim), decodes)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[T, num_k_heads, D] -> [T, num_v_heads, D]: each value head's key head, in the weights' order."""
        c = self.config
        repeats = c.num_v_heads // c.num_k_heads
        if repeats == 1:
            return x
        return x.repeat(1, repeats, 1) if c.v_heads_tiled else x.repeat_interleave(repeats, dim=1)

    def _convolve(
        self, mixed: torch.Tensor, rows: SequenceRows, lengths: list[int], conv_state: torch.Tensor
    ) -> torch.Tensor:
        """silu of the causal depthwise convolution of `mixed` [T, conv_dim], each sequence's rows after its
        window; each window is left holding its sequence's last K - 1 inputs.

        All sequences at once: a buffer holds each sequence's window and then its rows, so tap i of row t
        reads the buffer K - 1 - i rows before t's own place."""
        taps = self.conv.shape[1]
        width = taps - 1
        seqs = len(lengths)
        if seqs == mixed.shape[0] and width:
            return self._convolve_decodes(mixed, rows.slots, conv_state)
        device = mixed.device
        order = torch.arange(seqs, device=device)
        seq_of_row = torch.repeat_interleave(order, torch.tensor(lengths, device=device))
        place = torch.arange(mixed.shape[0], device=device) + width * (seq_of_row + 1)
        window = (rows.starts[:-1] + width * order).unsqueeze(1) + torch.arange(width, device=device)
        buffer = mixed.new_empty((mixed.shape[0] + seqs * width, mixed.shape[1]))
        buffer[window.reshape(-1)] = conv_state[rows.slots].transpose(1, 2).reshape(-1, mixed.shape[1])
        buffer[place] = mixed
        out = buffer[place - width] * self.conv[:, 0]
        for i in range(1, taps):
            out.addcmul_(buffer[place - width + i], self.conv[:, i])
        last = (rows.starts[1:] + width * order).unsqueeze(1) + torch.arange(width, device=device)
        conv_state.index_copy_(0, rows.slots, buffer[last].transpose(1, 2).to(conv_state.dtype))
        return rowwise(F.silu, out)

    def _convolve_decodes(
        self, mixed: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor
    ) -> torch.Tensor:
        """`_convolve` where each sequence is one row: the same products in the same order (the same
        bits) on each row's window read straight from its state, which then shifts by one."""
        taps = self.conv.shape[1]
        # [K - 1, S, conv_dim], oldest first: each tap's rows contiguous, as `_convolve`'s buffer holds them.
        past = conv_state[slots].permute(2, 0, 1).contiguous()
        out = past[0] * self.conv[:, 0]
        for i in range(1, taps - 1):
            out.addcmul_(past[i], self.conv[:, i])
        out.addcmul_(mixed, self.conv[:, taps - 1])
        window = torch.cat((past[1:], mixed.unsqueeze(0).to(conv_state.dtype))).permute(1, 2, 0)
        conv_state.index_copy_(0, slots, window)
        return rowwise(F.silu, out)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token of each of n sequences: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]; `state`
    [slots, H, Dk, Dv] is updated in place at `slots`. Returns o [n, H, Dv].

    Sequence by sequence on its slot itself: no copy of the states, and each sequence's products are
    calls of the same shapes whatever the batch (a batched matmul over every sequence could take
    another kernel, hence other last bits, for another number of sequences)."""
    decay = rowwise(torch.exp, g)
    out = torch.empty_like(v)
    for j, slot in enumerate(slots.tolist()):
        s = state[slot]  # [H, Dk, Dv], a view into the pool
        s.mul_(decay[j].view(-1, 1, 1))
        predicted = torch.bmm(k[j].unsqueeze(1), s).squeeze(1)
        written = predicted.neg_().add_(v[j]).mul_(beta[j].unsqueeze(-1))
        s.baddbmm_(k[j].unsqueeze(2), written.unsqueeze(1))
        out[j] = torch.bmm(q[j].unsqueeze(1), s).squeeze(1)
    return out


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot: torch.Tensor,
) -> torch.Tensor:
    """The delta rule over one sequence's rows, in chunks of CHUNK, from and back into `state` at `slot`
    (a one-element index). q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H]. Returns o [T, H, Dv].

    The rows are padded at the end to whole chunks: a padded row has k = v = 0, beta = 0 and g = 0, so it
    writes nothing and decays nothing, and the state after the last chunk is the state after the last
    row."""
    length, heads, dv = v.shape
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length

    def layout(x: torch.Tensor) -> torch.Tensor:
        """Rows of x [T, H, ...] -> [H, chunks, CHUNK, ...], zero past the end."""
        padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return padded.view(chunks, CHUNK, *x.shape[1:]).movedim(2, 0).contiguous()

    qc, kc, vc, gc, bc = (layout(t) for t in (q, k, v, g, beta))
    decay = gc.cumsum(dim=-1)  # G: [H, chunks, CHUNK]
    diff = decay.unsqueeze(-1) - decay.unsqueeze(-2)  # G_t - G_s at [t, s]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair_decay = diff.masked_fill(~causal, float("-inf")).exp()
    # I + A, A strictly lower: the solve takes the unit diagonal as given.
    system = torch.tril((kc @ kc.transpose(-1, -2)) * pair_decay * bc.unsqueeze(-1), diagonal=-1)
    rhs = torch.cat((vc * bc.unsqueeze(-1), kc * (bc * decay.exp()).unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, reads = solved[..., :dv], solved[..., dv:]
    attn = (qc @ kc.transpose(-1, -2)) * pair_decay
    q_decayed = qc * decay.exp().unsqueeze(-1)
    last = decay[..., -1:]
    k_tail = kc * (last - decay).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)  # [H, chunks, 1, 1]
    s = state[slot[0]].to(torch.float32)
    out = torch.empty_like(vc)
    for i in range(chunks):
        u = values[:, i] - reads[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ u
        s = s * chunk_decay[:, i] + k_tail[:, i].transpose(-1, -2) @ u
    state.index_copy_(0, slot, s.unsqueeze(0).to(state.dtype))
    return out.movedim(0, 2).reshape(chunks * CHUNK, heads, dv)[:length]


# A layer's tensors in a Hugging Face checkpoint, after `model.layers.{i}.`. A GGUF's are mapped onto
# these names, but for its A, stored as -exp(A_log) (`DECAY`).
PREFIX = "linear_attn."
DECAY = PREFIX + "A"


def gated_deltanet(weights: ModelWeights, config: ModelConfig, prefix: str) -> GatedDeltaNet:
    """The Gated DeltaNet layer at `prefix` (`model.layers.{i}.`), its products through `weights.linear`
    (a GGUF's blocks read natively) and its small tensors in float32, each checked against the config."""
    c = config.deltanet
    if c is None:
        raise ValueError(f"the {config.architecture} config has no Gated DeltaNet layers")
    hidden = config.hidden_size
    p = prefix + PREFIX

    def linear(name: str, rows: int, inputs: int = hidden) -> Linear:
        return weights.linear([Rows(p + name + ".weight", rows)], inputs)

    def small(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return weights.tensor(name, shape).float()

    conv_name = p + "conv1d.weight"
    if conv_name not in weights.tensors:
        raise ModelLoadError(conv_name, "tensor missing from the weight files")
    # [C, 1, K] in a checkpoint (a Conv1d's weight), [C, K] in a GGUF.
    conv_shape = tuple(weights.tensors[conv_name].shape)
    as_stored = (c.conv_dim, 1, c.conv_kernel)
    conv = small(conv_name, as_stored if conv_shape == as_stored else (c.conv_dim, c.conv_kernel))
    if prefix + DECAY in weights.tensors:
        decay = small(prefix + DECAY, (c.num_v_heads,))
    else:
        decay = -small(p + "A_log", (c.num_v_heads,)).exp()
    # A decay rate of 0 or more would grow the state without bound (and overflow the chunked form).
    if not bool((decay < 0).all()):
        raise ModelLoadError(p + "A_log", "the decay rates -exp(A_log) must be negative and finite")
    return GatedDeltaNet(
        c,
        config.rms_norm_eps,
        qkv=linear("in_proj_qkv", c.conv_dim),
        z=linear("in_proj_z", c.value_dim),
        b=linear("in_proj_b", c.num_v_heads),
        a=linear("in_proj_a", c.num_v_heads),
        out=linear("out_proj", hidden, c.value_dim),
        conv=conv.reshape(c.conv_dim, c.conv_kernel),
        decay=decay,
        dt_bias=small(p + "dt_bias", (c.num_v_heads,)),
        # The gated norm multiplies by its weight as stored, in a GGUF too: not a ModelWeights.norm.
        norm=weights.tensor(p + "norm.weight", (c.v_head_dim,)),
    )

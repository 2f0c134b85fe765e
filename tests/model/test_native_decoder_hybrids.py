"""gpt-oss, LFM2 and Qwen3.5 (dense and MoE) decode through the one-call native decoder: greedy runs of
several sequences at different lengths, one joining mid-run (its prompt in a step beside the others'
decodes), and a lone sequence, each over 34 decode steps.

- The native decoder gives the per-op path's bits (logits, and the recurrent states left in the pool),
  since the per-op path runs a decode's recurrent step, clamped SwiGLU, output gate and shared expert
  through the decoder's own C functions.
- Against the per-op path with those pieces in torch (the recurrent layers' torch forms, the reference the
  parity tests hold to transformers'), the logits are within 1e-5 of their scale and the greedy tokens
  equal.

gpt-oss and LFM2 load from GGUF files the tests write (gpt-oss's experts in MXFP4, LFM2 in F32); Qwen3.5
from its safetensors, its products as q8_0 blocks.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.mlp import ClampedSwiGlu
from kvserve.model.moe import SparseMoe
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from kvserve.model.shared_expert import SharedExpertMoe
from kvserve.model.transformer import Transformer
from tests.helpers import save_tiny_model
from tests.model.family_cases import FAMILY_KINDS
from tests.model.gguf_families import tiny_vocabulary, write_family_gguf
from tests.model.test_families_gpt_oss import tiny_gpt_oss, write_gguf

STEPS = 34
BLOCK = 4
QWEN3_5 = FAMILY_KINDS["qwen3_5-hybrid"][1]


def _gpt_oss(folder: str) -> tuple[str, str]:
    model = tiny_gpt_oss(folder + "/hf", sliding_window=5, num_hidden_layers=3)
    path = folder + "/gpt-oss.gguf"
    write_gguf(model, path)
    return path, "gguf"


def _lfm2(folder: str) -> tuple[str, str]:
    vocabulary = tiny_vocabulary("lfm2")
    hf = save_tiny_model(
        folder + "/hf",
        "lfm2",
        **FAMILY_KINDS["lfm2-hybrid"][1],
        intermediate_size=256,
        vocab_size=len(vocabulary),
        bos_token_id=vocabulary.bos,
        eos_token_id=vocabulary.eos,
        pad_token_id=vocabulary.eos,
    )
    path = folder + "/lfm2.gguf"
    write_family_gguf(hf, path, "lfm2", quantized=False)
    return path, "gguf"


def _qwen3_5(folder: str) -> tuple[str, str]:
    return save_tiny_model(folder, "qwen3_5", **QWEN3_5, num_key_value_heads=2), "q8_0"


def _qwen3_5_moe(folder: str) -> tuple[str, str]:
    moe = {
        **{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"},
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    }
    return save_tiny_model(folder, "qwen3_5_moe", **moe, num_key_value_heads=2), "q8_0"


MODELS: dict[str, Callable[[str], tuple[str, str]]] = {
    "gpt_oss": _gpt_oss,
    "lfm2": _lfm2,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
}


@pytest.fixture(scope="module")
def model_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[LoadedModel, str]]:
    made: dict[str, tuple[LoadedModel, str]] = {}

    def get(name: str) -> tuple[LoadedModel, str]:
        if name not in made:
            path, weight_dtype = MODELS[name](str(tmp_path_factory.mktemp(name)))
            made[name] = load_model(path, default_cache_dir()), weight_dtype
        return made[name]

    return get


def torch_pieces(transformer: Transformer) -> None:
    """The per-op path with the pieces the decoder shares with it computed in torch."""
    transformer.decoder = None
    transformer._native_lib = None
    for layer in transformer.layers:
        if layer.mixer is not None:
            layer.mixer.native = None  # type: ignore[attr-defined]
        mlp = layer.mlp
        if isinstance(mlp, SharedExpertMoe):
            mlp.native = None
            mlp = mlp.routed
        if isinstance(mlp, SparseMoe):
            for expert in mlp.experts:
                if isinstance(expert, ClampedSwiGlu):
                    expert.native = None


class Counted:
    """The transformer's decoder, counting its calls (so a test knows the steps meant for it took it)."""

    def __init__(self, transformer: Transformer) -> None:
        decoder = transformer.decoder
        assert decoder is not None
        self.decoder = decoder
        self.kv = decoder.kv
        self.calls = 0
        transformer.decoder = self  # type: ignore[assignment]

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.decoder(*args)


def greedy(runner: ModelRunner, lengths: list[int], join: int | None) -> tuple[torch.Tensor, list[list[int]]]:
    """Sequences of `lengths` prompt tokens (the last one joins at decode step `join`, where given),
    decoded greedily for STEPS steps; returns every step's logits [STEPS + 1, ...] flattened in order and
    the sequences."""
    vocab = runner.transformer.config.vocab_size
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    per_seq = -(-(max(lengths) + STEPS + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]
    live = list(range(len(seqs) - 1)) if join is not None else list(range(len(seqs)))

    def chunk(i: int, prompt: bool) -> SequenceChunk:
        s = seqs[i]
        ids, start = (s, 0) if prompt else (s[-1:], len(s) - 1)
        return SequenceChunk(ids, start, tables[i], True, state_slot=i + 1)

    out = runner.execute(ForwardBatch(prefills=[chunk(i, True) for i in live])).sampled
    logits = [out.reshape(-1)]
    for step in range(STEPS):
        for i, row in zip(live, out, strict=True):
            seqs[i].append(int(row.argmax()))
        batch = ForwardBatch(decodes=[chunk(i, False) for i in live])
        if step == join:
            batch.prefills.append(chunk(len(seqs) - 1, True))
            live.append(len(seqs) - 1)
        out = runner.execute(batch).sampled
        logits.append(out.reshape(-1))
    return torch.cat(logits), seqs


def runner_of(model: LoadedModel, weight_dtype: str, sequences: int) -> ModelRunner:
    blocks = sequences * (-(-(64 + STEPS) // BLOCK))
    return ModelRunner(
        model,
        blocks,
        BLOCK,
        256,
        "cpu",
        "float32",
        weight_dtype,
        "native",
        kv_dtype="float32",
        num_state_slots=sequences + 1,
    )


@pytest.mark.parametrize("lengths", [[7], [5, 13, 9]], ids=["one sequence", "three, one joining"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_decodes_through_the_native_decoder_equal_the_per_op_path(
    model_of: Callable[[str], tuple[LoadedModel, str]], name: str, lengths: list[int]
) -> None:
    model, weight_dtype = model_of(name)
    join = 10 if len(lengths) > 1 else None
    runs = []
    for kind in ("native", "per-op", "torch pieces"):
        runner = runner_of(model, weight_dtype, len(lengths))
        transformer = runner.transformer
        assert transformer.decoder is not None
        if kind == "native":
            counter = Counted(transformer)
        elif kind == "per-op":
            transformer.decoder = None
        else:
            torch_pieces(transformer)
        logits, seqs = greedy(runner, lengths, join)
        states = [] if runner.state is None else runner.state.read_slot(1)
        runs.append((logits, seqs, states))
    # An attention-only model's every step took the decoder, prompts included; a hybrid's every
    # decode-only step: all but the prompts' step and the joining one.
    assert counter.calls == (STEPS - (join is not None) if model.config.hybrid else STEPS + 1)
    (native, native_seqs, native_states), (per_op, per_op_seqs, per_op_states), (ref, ref_seqs, _) = runs
    assert torch.equal(native, per_op) and native_seqs == per_op_seqs
    assert all(torch.equal(a, b) for a, b in zip(native_states, per_op_states, strict=True))
    # Within 1e-5 of the logits' scale (about 8 here): 34 steps of a recurrence carry the last bits.
    assert float((native - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert native_seqs == ref_seqs


@pytest.mark.parametrize("speculative", ["off", "suffix"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_engine_with_the_native_decoder_replies_the_per_op_tokens(
    model_of: Callable[[str], tuple[LoadedModel, str]], name: str, speculative: str
) -> None:
    """An engine (prefix caching with its state checkpoints, drafts verified as chunks where asked) gives
    the same greedy replies with the decoder as without: requests that share a prompt's start, repeat
    one, and run side by side."""
    model, weight_dtype = model_of(name)
    vocab = model.config.vocab_size
    base = [(7 * j) % vocab for j in range(12)]
    prompts = [base + [(3 * i + j) % vocab for j in range(n)] for i, n in enumerate((3, 9, 3, 5))]
    prompts[2] = list(prompts[0])

    def replies(native: bool) -> list[list[int]]:
        config = EngineConfig(weight_dtype=weight_dtype, kv_cache_memory=2**23, speculative=speculative)
        engine = Engine.from_config(config, model=model)
        try:
            transformer = engine.runner.transformer
            assert transformer.decoder is not None
            if not native:
                transformer.decoder = None
            tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
            for rid, prompt in zip(tokens, prompts, strict=True):
                engine.add_request(rid, prompt, SamplingParams(max_tokens=20, temperature=0))
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    tokens[delta.request_id].extend(delta.token_ids)
            return list(tokens.values())
        finally:
            engine.close()

    assert replies(native=True) == replies(native=False)

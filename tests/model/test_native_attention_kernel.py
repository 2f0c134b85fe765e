"""The native attention kernel: equal to SDPA over each row's gathered context, bitwise
batch-invariant, and optional (the engine falls back to the portable path where it cannot be built)."""

import logging
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import default_cache_dir
from kvserve.model import kv_quant
from kvserve.model.loader import LoadedModel
from kvserve.model.native_attention import KernelUnavailableError, PagedAttentionKernel
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from kvserve.model.torch_attention import TorchAttention
from tests.model.attention_cases import Case, cases, inputs, reference

pytestmark = pytest.mark.usefixtures("one_thread")


def kernel(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> PagedAttentionKernel:
    return PagedAttentionKernel.load(default_cache_dir(), torch.device("cpu"), dtype, kv_dtype)


@settings(max_examples=80, deadline=None)
@given(case=cases(), dtype=st.sampled_from(["float64", "float32", "float32 with a float16 cache"]))
def test_kernel_equals_attention_over_each_rows_gathered_context(case: Case, dtype: str) -> None:
    compute = torch.float64 if dtype == "float64" else torch.float32
    args = inputs(case, compute)
    kv_dtype = None
    if dtype.endswith("float16 cache"):
        kv_dtype = torch.float16
        args = dict(args, k_cache=args["k_cache"].half(), v_cache=args["v_cache"].half())
    got = kernel(compute, kv_dtype)(**args)
    tolerance = 1e-12 if dtype == "float64" else 2e-5
    torch.testing.assert_close(got.double(), reference(args, case), atol=tolerance, rtol=tolerance)


@settings(max_examples=60, deadline=None)
@given(
    case=cases(),
    dtype=st.sampled_from(["float64", "float32", "float32 with a q8_0 cache"]),
    big=st.booleans(),
)
def test_attention_sinks_join_each_heads_softmax(case: Case, dtype: str, big: bool) -> None:
    """gpt-oss's sinks, small or larger than every score (the max is then the sink's), on the generic
    and the vector paths; a row alone is its bits in the batch."""
    compute = torch.float64 if dtype == "float64" else torch.float32
    args = inputs(case, compute)
    kv_dtype = None
    if dtype.endswith("q8_0 cache"):
        if case.dim % 32:
            return
        kv_dtype = torch.uint8
        k, v = (kv_quant.quantize(args[n]) for n in ("k_cache", "v_cache"))
        args = dict(args, k_cache=k, v_cache=v)
    gen = torch.Generator().manual_seed(case.seed)
    sinks = torch.randn(case.heads, generator=gen) * (20.0 if big else 1.0)
    attend = kernel(compute, kv_dtype)
    got = attend(**args, sinks=sinks)
    expected_args = (
        args
        if kv_dtype is None
        else dict(
            args,
            k_cache=kv_quant.values(args["k_cache"], compute),
            v_cache=kv_quant.values(args["v_cache"], compute),
        )
    )
    tolerance = 1e-12 if dtype == "float64" else 2e-5
    torch.testing.assert_close(
        got.double(), reference(expected_args, case, sinks), atol=tolerance, rtol=tolerance
    )
    r = len(case.lens) - 1
    alone = dict(args, q=args["q"][r:], tables=args["tables"][r:], lens=args["lens"][r:])
    assert torch.equal(attend(**alone, sinks=sinks)[0], got[r])


@settings(max_examples=30, deadline=None)
@given(case=cases(), half=st.booleans())
def test_a_row_is_bitwise_the_same_alone_in_any_batch_and_at_any_thread_count(case: Case, half: bool) -> None:
    args = inputs(case, torch.float32)
    kv_dtype = torch.float16 if half else None
    if half:
        args = dict(args, k_cache=args["k_cache"].half(), v_cache=args["v_cache"].half())
    attend = kernel(torch.float32, kv_dtype)
    batch = attend(**args)
    for r in range(len(case.lens)):
        alone = dict(
            args, q=args["q"][r : r + 1], tables=args["tables"][r : r + 1], lens=args["lens"][r : r + 1]
        )
        assert torch.equal(attend(**alone)[0], batch[r])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(attend(**args), batch)
    finally:
        torch.set_num_threads(threads)


def _decode_logits(runner: ModelRunner, others: list[list[int]]) -> torch.Tensor:
    """Logits of one fixed decode (sequence 0 at position 40), run together with prefill chunks and
    decodes of other lengths whose prompts are `others`."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 4096, (41,), generator=gen).tolist()
    table = list(range(0, 16))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:40], 0, table, False)]))
    decodes = [SequenceChunk(prompt[40:], 40, table, True)]
    prefills = []
    for i, ids in enumerate(others):
        other = list(range(16 * (i + 1), 16 * (i + 2)))
        if i % 2:
            prefills.append(SequenceChunk(ids, 0, other, True))
        else:
            runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:-1], 0, other, False)]))
            decodes.append(SequenceChunk(ids[-1:], len(ids) - 1, other, True))
    return runner.execute(ForwardBatch(decodes=decodes, prefills=prefills)).sampled[0]


@pytest.mark.parametrize("weight_dtype", ["float16", "int8"])
def test_a_decodes_logits_are_bitwise_the_same_whatever_else_is_in_the_step(
    tiny_model: LoadedModel, weight_dtype: str
) -> None:
    """The default path (row-invariant linears, the native kernel) makes a decode's logits independent
    of the batch: here other decodes of 5..60 tokens of context and prefill chunks in the same step."""
    runner = ModelRunner(tiny_model, 200, 4, 256, "cpu", "float32", weight_dtype, "native")
    gen = torch.Generator().manual_seed(4)
    alone = _decode_logits(runner, [])
    for count in (1, 2, 5):
        lengths = torch.randint(5, 60, (count,), generator=gen).tolist()
        others = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in lengths]
        assert torch.equal(_decode_logits(runner, others), alone)


def test_the_portable_path_is_not_batch_invariant(tiny_model: LoadedModel) -> None:
    """Why the kernel exists: the portable path pads decodes to the longest one, which changes the
    reduction and so the last bits of the logits. (If this starts to hold, the README's note on what
    varies can go.)"""
    runner = ModelRunner(tiny_model, 200, 4, 256, "cpu", "float32", "float16", "torch")
    gen = torch.Generator().manual_seed(4)
    alone = _decode_logits(runner, [])
    others = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (57, 9, 33)]
    assert not torch.equal(_decode_logits(runner, others), alone)


def test_without_a_compiler_auto_falls_back_and_native_refuses(
    tiny_model: LoadedModel, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(tiny_model, 8, 4, 32, "cpu", "float32", "float32", "auto", str(tmp_path))
    assert isinstance(runner.attention, TorchAttention)
    assert "falls back to the portable torch path" in caplog.text
    with pytest.raises(KernelUnavailableError):
        ModelRunner(tiny_model, 8, 4, 32, "cpu", "float32", "float32", "native", str(tmp_path))


def test_unsupported_dtypes_use_the_portable_path(tiny_model: LoadedModel) -> None:
    runner = ModelRunner(tiny_model, 8, 4, 32, "cpu", "bfloat16", "float32", "auto")
    assert isinstance(runner.attention, TorchAttention)
    with pytest.raises(KernelUnavailableError, match="float32 and float64"):
        ModelRunner(tiny_model, 8, 4, 32, "cpu", "bfloat16", "float32", "native")


@pytest.mark.parametrize("weight_dtype", ["float16", "q8_0"])
def test_a_tokens_logits_are_bitwise_the_same_from_a_prefill_or_a_decode(
    tiny_model: LoadedModel, weight_dtype: str
) -> None:
    """A prefill token is one of the kernel's rows, as its decode would be, and the linears are
    row-invariant: so the last token's logits do not depend on whether its context was computed in the
    same step, in an earlier chunk, or by a decode (q8_0: a step of decodes alone runs the native
    decoder, one C call for every layer)."""
    runner = ModelRunner(tiny_model, 200, 4, 256, "cpu", "float32", weight_dtype, "native")
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 4096, (61,), generator=gen).tolist()
    tables = [list(range(16 * i, 16 * (i + 1))) for i in range(3)]
    whole = runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt, 0, tables[0], True)])).sampled[0]
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, tables[1], False)]))
    decoded = runner.execute(ForwardBatch(decodes=[SequenceChunk(prompt[-1:], 60, tables[1], True)])).sampled[
        0
    ]
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:25], 0, tables[2], False)]))
    chunked = runner.execute(
        ForwardBatch(prefills=[SequenceChunk(prompt[25:], 25, tables[2], True)])
    ).sampled[0]
    assert torch.equal(decoded, whole)
    assert torch.equal(chunked, whole)


def test_a_prefill_chunks_logits_are_bitwise_the_same_beside_any_decodes(tiny_model: LoadedModel) -> None:
    """Each prefill chunk attends on its own and the linears are row-invariant, so a chunk's logits do
    not depend on the decodes beside it."""
    runner = ModelRunner(tiny_model, 200, 4, 256, "cpu", "float32", "float16", "native")
    gen = torch.Generator().manual_seed(6)
    chunk = torch.randint(0, 4096, (23,), generator=gen).tolist()
    alone = runner.execute(ForwardBatch(prefills=[SequenceChunk(chunk, 0, list(range(8)), True)])).sampled
    decodes = []
    for i, n in enumerate((7, 40, 19)):
        ids = torch.randint(0, 4096, (n,), generator=gen).tolist()
        table = list(range(16 * (i + 1), 16 * (i + 2)))
        runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:-1], 0, table, False)]))
        decodes.append(SequenceChunk(ids[-1:], n - 1, table, True))
        chunked = ForwardBatch(
            decodes=list(decodes), prefills=[SequenceChunk(chunk, 0, list(range(8)), True)]
        )
        assert torch.equal(runner.execute(chunked).sampled[-1], alone[0])


def test_a_call_with_more_partials_than_one_wave_splits_its_rows_bitwise() -> None:
    """One call's chunk partials are bounded (the kernel takes its rows in waves of at most 8 MiB of
    partials): a batch of 1,200 rows of four chunks each (sharing most of their blocks, to keep the pool
    small) spans two waves, and every row is bitwise what it is alone."""
    lens = [680 + r % 20 for r in range(1200)]
    case = Case(heads=8, kv_heads=1, dim=64, block_size=16, lens=lens, shared=640, seed=5)
    args = inputs(case, torch.float32)
    attend = kernel(torch.float32)
    batch = attend(**args)
    # 993 rows' partials fill the first wave.
    for r in (0, 1, 992, 993, 994, 1199):
        alone = dict(
            args, q=args["q"][r : r + 1], tables=args["tables"][r : r + 1], lens=args["lens"][r : r + 1]
        )
        assert torch.equal(attend(**alone)[0], batch[r])


@pytest.mark.parametrize("half", [False, True])
def test_a_prefill_chunks_rows_reading_one_table_are_each_their_decode(half: bool) -> None:
    """A prefill chunk passes its sequence's one table to every row (a row stride of 0) and each token's
    own length: on the vector path, over several chunks that the rows share, each row is bitwise the
    row its decode would be."""
    case = Case(heads=9, kv_heads=3, dim=64, block_size=16, lens=[600], shared=0, seed=9)
    args = inputs(case, torch.float32)
    if half:
        args = dict(args, k_cache=args["k_cache"].half(), v_cache=args["v_cache"].half())
    attend = kernel(torch.float32, torch.float16 if half else None)
    q = torch.randn(100, 9, 64, generator=torch.Generator().manual_seed(10))
    lens = torch.arange(501, 601)
    chunk = attend(**dict(args, q=q, tables=args["tables"].expand(100, -1), lens=lens))
    for r in (0, 1, 50, 99):
        decode = attend(**dict(args, q=q[r : r + 1], lens=lens[r : r + 1]))
        assert torch.equal(decode[0], chunk[r])

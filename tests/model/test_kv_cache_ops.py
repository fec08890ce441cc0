"""Model-runner block operations: copy-on-write block copies and swap out / in to the host pool."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.request import Request
from kvfleet.model.layers.kv_cache import FP8KVCache, block_storage
from kvfleet.model.runner import ModelRunner
from kvfleet.sampling_params import SamplingParams

NUM_BLOCKS = 12
BLOCK = 4
DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def _runner(loaded, kv_cache_dtype: str = "auto", num_blocks: int = NUM_BLOCKS) -> ModelRunner:
    return ModelRunner(loaded, BLOCK, num_blocks, kv_cache_dtype=kv_cache_dtype)


def _fill_random(runner: ModelRunner, seed: int = 0) -> None:
    """Distinct random content in every block of every layer (quantized for fp8 pools)."""
    g = torch.Generator().manual_seed(seed)
    for k, v in runner.kv_caches:
        for c in (k, v):
            x = torch.randn(c.shape, generator=g) * 3
            if isinstance(c, FP8KVCache):
                c.data.copy_((x / c.scale).to(c.dtype))
            else:
                c.copy_(x)


def _snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [block_storage(c).clone() for kv in runner.kv_caches for c in kv]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_copy_blocks_bit_exact_and_reads_before_writes(smollm2_loaded, kv_dtype):
    r = _runner(smollm2_loaded, kv_dtype)
    _fill_random(r)
    before = _snapshot(r)
    # 1 -> 5, and a chain 2 -> 3 -> 4: block 4 must get block 3's *old* content.
    r.copy_blocks([(1, 5), (2, 3), (3, 4)])
    after = _snapshot(r)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(_bits(a[5]), _bits(b[1]))
        assert torch.equal(_bits(a[3]), _bits(b[2]))
        assert torch.equal(_bits(a[4]), _bits(b[3]))
        for i in (0, 1, 2, 6, 7, 8, 9, 10, 11):
            assert torch.equal(_bits(a[i]), _bits(b[i]))
    if kv_dtype != "auto":
        assert all(c.scale == 1.0 and c.dtype == r.kv_caches[0][0].dtype for kv in r.kv_caches for c in kv)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_swap_out_in_round_trip_bit_exact(smollm2_loaded, kv_dtype):
    r = _runner(smollm2_loaded, kv_dtype)
    # A non-default per-tensor scale on the fp8 pools: it belongs to the pool and is shared by the
    # host pool, so a swapped block must dequantize to the same values after it comes back.
    for kv in r.kv_caches:
        for c in kv:
            if isinstance(c, FP8KVCache):
                c.scale = 0.125
    _fill_random(r, seed=1)
    r.allocate_swap_space(5)
    assert r.num_host_blocks == 5 and len(r.swap_caches) == len(r.kv_caches)
    assert r.swap_caches[0][0].device.type == "cpu"
    assert r.swap_caches[0][0].dtype == block_storage(r.kv_caches[0][0]).dtype
    before = _snapshot(r)
    deq_before = [c.gather(torch.tensor([2, 7]), torch.float32) for kv in r.kv_caches for c in kv
                  if isinstance(c, FP8KVCache)]
    r.swap_out([(2, 4), (7, 0)])
    _fill_random(r, seed=2)  # the device blocks are reused by someone else meanwhile
    r.swap_in([(4, 9), (0, 1)])
    after = _snapshot(r)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(_bits(a[9]), _bits(b[2]))
        assert torch.equal(_bits(a[1]), _bits(b[7]))
    deq_after = [c.gather(torch.tensor([9, 1]), torch.float32) for kv in r.kv_caches for c in kv
                 if isinstance(c, FP8KVCache)]
    for x, y in zip(deq_before, deq_after, strict=True):
        assert torch.equal(x, y)
    # The per-block byte size of the host pool equals that of a KV block.
    per_block = sum(t[0].numel() * t[0].element_size() for pair in r.swap_caches for t in pair)
    assert per_block == ModelRunner.swap_bytes_per_block(r.config, BLOCK, torch.float32, kv_dtype)
    assert per_block == ModelRunner.kv_cache_bytes_per_block(r.config, BLOCK, torch.float32, kv_dtype)


def test_invalid_ids_raise_and_leave_pools_untouched(smollm2_loaded):
    r = _runner(smollm2_loaded)
    _fill_random(r)
    before = _snapshot(r)
    with pytest.raises(ValueError, match="no host swap pool"):
        r.swap_out([(0, 0)])
    with pytest.raises(ValueError, match=">= 0"):
        r.allocate_swap_space(-1)
    r.allocate_swap_space(3)
    bad = [
        (r.copy_blocks, [(0, NUM_BLOCKS)], "out of range"),
        (r.copy_blocks, [(-1, 2)], "out of range"),
        (r.copy_blocks, [(0, 2), (1, 2)], "duplicate"),
        (r.copy_blocks, [(0.0, 2)], "must be an int"),
        (r.copy_blocks, [(True, 2)], "must be an int"),
        (r.copy_blocks, [(1, 2, 3)], "pairs"),
        (r.swap_out, [(0, 3)], "host block 3 out of range"),
        (r.swap_out, [(NUM_BLOCKS, 0)], "device block"),
        (r.swap_out, [(0, 1), (2, 1)], "duplicate host block"),
        (r.swap_in, [(3, 0)], "host block 3 out of range"),
        (r.swap_in, [(0, 5), (1, 5)], "duplicate device block"),
    ]
    for fn, pairs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn(pairs)
    # A valid swap_out with an invalid block copy in the same step: nothing is applied.
    with pytest.raises(ValueError, match="block_copies"):
        r.execute(SchedulerOutput(swap_out=[(1, 0)], block_copies=[(0, 99)]))
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(r), strict=True))
    assert all(not h.any() for pair in r.swap_caches for h in pair)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))


def _prefill(r: ModelRunner, req: Request, n: int, table: list[int]) -> None:
    r.compute_logits(SchedulerOutput(scheduled=[ScheduledRequest(req, 0, n, table, False)]))


def _decode_logits(r: ModelRunner, req: Request, pos: int, table: list[int], **ops) -> torch.Tensor:
    sched = SchedulerOutput(scheduled=[ScheduledRequest(req, pos, 1, table, True)], **ops)
    return r.compute_logits(sched)[req.request_id]


@pytest.mark.parametrize("kv_dtype", ("auto", "fp8_e4m3"))
def test_execute_applies_swap_out_then_swap_in_then_copies_before_forward(smollm2_loaded, hf_tokenizer, kv_dtype):
    prompt = hf_tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"][:9]
    assert len(prompt) == 9
    # Reference: prompt prefilled into blocks [1, 2], next token decoded through [1, 2, 3].
    ref_runner = _runner(smollm2_loaded, kv_dtype)
    req = _req("a", prompt)
    _prefill(ref_runner, req, 8, [1, 2])
    ref = _decode_logits(ref_runner, req, 8, [1, 2, 3])

    r = _runner(smollm2_loaded, kv_dtype)
    r.allocate_swap_space(4)
    req = _req("b", prompt)
    _prefill(r, req, 8, [4, 5])
    # A step with no scheduled request but block moves: they are applied (blocks 4, 5 -> host 0, 1).
    assert r.execute(SchedulerOutput(swap_out=[(4, 0), (5, 1)])) == {}
    _fill_random(r, seed=3)  # the device pool is overwritten while the request is swapped out
    # One step: swap 7 -> host 2 (must read host 0/1 *after* that swap-out of 7 and not clobber
    # them), swap host 0, 1 back into 6, 7, then copy 6, 7 -> 8, 9, then decode through [8, 9, 10].
    # Any other order, or a forward before the moves, gives different K/V for the prompt.
    out = _decode_logits(r, req, 8, [8, 9, 10], swap_out=[(7, 2)], swap_in=[(0, 6), (1, 7)],
                         block_copies=[(6, 8), (7, 9)])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # And the order matters: had the copies run before swap-in, blocks 8, 9 would hold random data.
    bad = _runner(smollm2_loaded, kv_dtype)
    bad.allocate_swap_space(4)
    _prefill(bad, req, 8, [4, 5])
    bad.swap_out([(4, 0), (5, 1)])
    _fill_random(bad, seed=3)
    bad.copy_blocks([(6, 8), (7, 9)])
    bad.swap_in([(0, 6), (1, 7)])
    wrong = _decode_logits(bad, req, 8, [8, 9, 10])
    assert (wrong - ref).abs().max() > 1e-2

"""StreamingLLM quality check: perplexity of a long real text with attention sinks vs the full cache.

StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"):
``--kv-eviction streaming --sink-tokens S --streaming-window N`` keeps the first ``S`` tokens
and the last ``N``. The paper's evidence that the sinks matter is perplexity on long text: plain
window attention (``S = 0``) degrades once the first tokens leave the cache, sinks + window stays
close to the full cache. We measure the same with kvfleet's own runner and KV cache manager.

Method (teacher forcing): the text is tokenized (no chat template, no BOS added), cut to
``--num-tokens`` tokens, and fed through :meth:`ModelRunner.compute_token_logits` in prefill
chunks of ``--chunk`` tokens; a real :class:`KVCacheManager` allocates the blocks and, in
streaming mode, frees the evicted ones exactly as in serving. Row ``i`` of the logits predicts
token ``i + 1``; perplexity = ``exp(mean NLL)`` over positions ``1 .. L-1`` ("all") and over
the tokens predicted by queries at positions ``>= S + N`` (the evicted regime, where the variants
differ; positions before that are identical by construction). The full cache (all ``L`` tokens
attended) is the reference; it fits since ``L`` is ~2k tokens. Acceptance (issue 3): the
whole-text perplexity of every variant with sinks within 10 % of the full cache's; the
evicted-regime ratio is reported beside it.

Oracle (``--recompute-stride K``, default 32, 0 = off): the paper's "sliding window with
re-computation" baseline, which rebuilds the cache of the last ``S + N`` tokens from scratch
(positions ``0 .. S+N-1``) for every predicted token. It is exact but quadratic, so it is
evaluated at every ``K``-th position ``>= S + N`` only; the table beside it gives the full cache
and the sinks variant on the same positions. StreamingLLM should match it: a gap between
streaming and the full cache that the oracle shares is lost long-range context (e.g. a text
that repeats passages farther apart than the window), not an error of the eviction.

Default text: ``/usr/share/common-licenses/GPL-3`` (Debian's copy of the GNU GPL v3, ~7.5k
tokens; the first 2,048 are used), else the Python installation's ``LICENSE.txt``; ``--text``
picks another file. The path and its sha256 are printed with the results.

Usage: python benchmarks/streaming_ppl.py [--num-tokens 2048] [--windows 256 512] [--sinks 4]
    [--chunk 128] [--text FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ACCEPT_RATIO = 1.10  # streaming perplexity within 10 % of the full cache's


def default_text() -> Path:
    """The first long real text found on this machine (see the module docstring).

    Raises:
        FileNotFoundError: none of the candidates exists.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = [Path("/usr/share/common-licenses/GPL-3"), stdlib / "LICENSE.txt",
                  Path(sys.base_prefix) / "LICENSE.txt"]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"no default text found ({', '.join(map(str, candidates))}); pass --text FILE")


def teacher_forced_nll(runner, ids: list[int], chunk: int, sinks: int, window: int | None,
                       block_size: int) -> tuple[list[float], int]:
    """Negative log-likelihood (nats) of ``ids[1:]`` given the prefix, fed in prefill chunks.

    Args:
        runner: a :class:`~kvfleet.model.runner.ModelRunner` (streaming or not).
        ids: token ids, ``L >= 2``.
        chunk: tokens per prefill chunk.
        sinks, window: the KV cache manager's eviction (``window=None``: keep everything).
        block_size: the runner's block size.

    Returns:
        ``(nll, peak_blocks)``: float list of length ``L - 1`` (entry ``i`` for token ``i + 1``),
        and the most blocks the request held at once.
    """
    import torch

    from kvfleet.engine.core.kv_cache_manager import KVCacheManager
    from kvfleet.engine.core.scheduler_output import ScheduledRequest
    from kvfleet.engine.request import Request
    from kvfleet.sampling_params import SamplingParams

    mgr = KVCacheManager(runner.num_blocks, block_size, sliding_window=window, sink_tokens=sinks)
    req = Request("ppl", list(ids), SamplingParams(max_tokens=1))
    target = torch.tensor(ids[1:] + [0], dtype=torch.long)
    nll: list[float] = []
    peak = 0
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        if not mgr.allocate_slots(req, n):
            raise RuntimeError(f"pool of {runner.num_blocks} blocks too small at position {start}")
        peak = max(peak, mgr.pool.num_used_blocks)
        logits = runner.compute_token_logits(ScheduledRequest(req, start, n, list(mgr.get_block_table("ppl")),
                                                              False))
        lp = torch.log_softmax(logits, dim=-1)
        nll.extend((-lp.gather(1, target[start:start + n, None])[:, 0]).tolist())
        req.num_computed_tokens += n
    mgr.free(req)
    return nll[: len(ids) - 1], peak


def ppl(nll: list[float]) -> float:
    """``exp(mean(nll))``."""
    return math.exp(sum(nll) / len(nll))


def recompute_nll(loaded, ids: list[int], positions: list[int], context: int, block_size: int) -> list[float]:
    """NLL of token ``i + 1`` for each ``i`` in ``positions``, predicted from the ``context``
    tokens ending at ``i`` recomputed from scratch (a fresh cache at positions ``0 ..
    context-1``; the "sliding window with re-computation" oracle of StreamingLLM)."""
    from kvfleet.model.runner import ModelRunner

    runner = ModelRunner(loaded, block_size, -(-(context + 1) // block_size) + 1)
    out = []
    for i in positions:
        nll, _ = teacher_forced_nll(runner, ids[i - context + 1:i + 2], context + 1, 0, None, block_size)
        out.append(nll[-1])
    return out


def run(num_tokens: int = 2048, windows: tuple[int, ...] = (256, 512), sinks: int = 4, chunk: int = 128,
        block_size: int = 16, text: Path | None = None, model: str = "smollm2-135m-instruct",
        loaded=None, recompute_stride: int = 0) -> dict:
    """Measure and return the results (see the module docstring); prints nothing.

    Raises:
        ValueError: the text has fewer than ``num_tokens`` tokens.
    """
    import torch

    from kvfleet.model.loader import load_model
    from kvfleet.model.runner import ModelRunner

    path = Path(text) if text is not None else default_text()
    raw = path.read_bytes()
    if loaded is None:
        loaded = load_model(model, dtype=torch.float32)
    ids = loaded.tokenizer.encode(raw.decode("utf-8", errors="replace"))
    if len(ids) < num_tokens:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than --num-tokens {num_tokens}")
    ids = ids[:num_tokens]
    nblocks = -(-num_tokens // block_size) + 1
    rows = []
    t0 = time.perf_counter()
    full, full_peak = teacher_forced_nll(ModelRunner(loaded, block_size, nblocks), ids, chunk, 0, None, block_size)
    rows.append({"variant": "full cache", "sinks": None, "window": None, "peak_blocks": full_peak,
                 "ppl_all": ppl(full), "seconds": time.perf_counter() - t0})
    for n in windows:
        for s in (sinks, 0):
            t0 = time.perf_counter()
            runner = ModelRunner(loaded, block_size, nblocks, streaming=(s, n))
            nll, peak = teacher_forced_nll(runner, ids, chunk, s, n, block_size)
            # tokens predicted by queries at positions >= s + n (nll[i] is the query at position i)
            tail0 = s + n
            rows.append({"variant": f"sinks {s} + window {n}" if s else f"window {n}, no sinks",
                         "sinks": s, "window": n, "peak_blocks": peak, "ppl_all": ppl(nll),
                         "ppl_tail": ppl(nll[tail0:]), "full_ppl_tail": ppl(full[tail0:]),
                         "ratio_all": ppl(nll) / ppl(full), "ratio_tail": ppl(nll[tail0:]) / ppl(full[tail0:]),
                         "seconds": time.perf_counter() - t0})
            if s and recompute_stride:
                sample = list(range(s + n, len(ids) - 1, recompute_stride))
                rec = recompute_nll(loaded, ids, sample, s + n, block_size)
                rows[-1]["oracle"] = {"positions": len(sample), "stride": recompute_stride,
                                      "ppl_recompute": ppl(rec), "ppl_streaming": ppl([nll[i] for i in sample]),
                                      "ppl_full": ppl([full[i] for i in sample])}
    accepted = all(r["ratio_all"] <= ACCEPT_RATIO for r in rows if r["sinks"])
    return {"text": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "model": model,
            "num_tokens": num_tokens, "chunk": chunk, "block_size": block_size, "accept_ratio": ACCEPT_RATIO,
            "accepted": accepted, "rows": rows, "torch_threads": torch.get_num_threads()}


def format_table(res: dict) -> str:
    lines = [f"text: {res['text']} (sha256 {res['sha256']}), first {res['num_tokens']} tokens; model "
             f"{res['model']}, fp32, prefill chunks of {res['chunk']}, block size {res['block_size']}",
             "",
             "| variant | peak blocks | ppl (all) | vs full | ppl (pos >= S+N) | full (pos >= S+N) | vs full |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["sinks"] is None:
            lines.append(f"| {r['variant']} | {r['peak_blocks']} | {r['ppl_all']:.3f} | 1.000 | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['peak_blocks']} | {r['ppl_all']:.3f} | {r['ratio_all']:.3f} | "
                         f"{r['ppl_tail']:.3f} | {r['full_ppl_tail']:.3f} | {r['ratio_tail']:.3f} |")
    oracle = [r for r in res["rows"] if r.get("oracle")]
    if oracle:
        lines += ["", "| on every K-th position >= S+N | positions | full cache | StreamingLLM | "
                      "window of S+N recomputed (oracle) |", "|---|---:|---:|---:|---:|"]
        for r in oracle:
            o = r["oracle"]
            lines.append(f"| {r['variant']} (K={o['stride']}) | {o['positions']} | {o['ppl_full']:.3f} | "
                         f"{o['ppl_streaming']:.3f} | {o['ppl_recompute']:.3f} |")
    lines.append("")
    verdict = "PASS" if res["accepted"] else "FAIL"
    lines.append(f"acceptance (perplexity of every sinks variant over the whole text within "
                 f"{100 * (res['accept_ratio'] - 1):.0f} % of the full cache's): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-tokens", type=int, default=2048)
    ap.add_argument("--windows", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--recompute-stride", type=int, default=32,
                    help="evaluate the recomputed-window oracle at every K-th position (0 = off)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.sinks < 1 or min(args.windows) < 1 or args.chunk < 1 or args.num_tokens < 2 or args.recompute_stride < 0:
        ap.error("--sinks, --windows and --chunk must be >= 1, --num-tokens >= 2, --recompute-stride >= 0")
    res = run(args.num_tokens, tuple(args.windows), args.sinks, args.chunk, args.block_size, args.text, args.model,
              recompute_stride=args.recompute_stride)
    res["command"] = " ".join(shlex.quote(a) for a in ["python", "benchmarks/streaming_ppl.py", *sys.argv[1:]])
    print(f"$ {res['command']}")
    print(format_table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0 if res["accepted"] else 1


if __name__ == "__main__":
    sys.exit(main())

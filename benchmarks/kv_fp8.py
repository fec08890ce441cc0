"""fp8 KV cache accuracy: greedy agreement and logprob drift of fp8_e4m3 / fp8_e5m2 against fp32.

Workload: 8 real chat prompts (SmolLM2-135M-Instruct's chat template), greedy, 64 new tokens
(``ignore_eos``, so every sequence is exactly 64 tokens), fp32 compute, the same weights.

- Greedy agreement: the engine (``--kv-cache-dtype``) generates for all prompts at once; we report
  the fraction of output positions whose token equals fp32's and the fraction of the 8 full
  64-token sequences that are identical. (Once a sequence diverges, later tokens are conditioned
  on a different prefix, so token agreement counts position-wise matches after divergence too.)
- Teacher-forced drift: prompt + fp32's 64 tokens are fed to a runner of each KV dtype (prompt as
  one prefill, the continuation in chunks of 16 so that attention reads the K/V back from the
  cache); for each of the 64 positions we take the log-probability of the token fp32 chose and
  report mean and max ``|logprob_fp8 - logprob_fp32|`` and the top-1 agreement.
- Mean common prefix: tokens generated before a sequence first differs from fp32's. Each first
  divergence is checked against the teacher-forced run (it must fall on a position where fp8's
  top-1 differs from fp32's token), which cross-checks the decode path against the prefill path.

Usage: python benchmarks/kv_fp8.py [--max-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain in simple terms how a vaccine trains the immune system.",
    "Write a short poem about the ocean at night.",
    "Give me three tips for writing clean Python code.",
    "Why is the sky blue? Answer in two or three sentences.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a simple tomato pasta sauce?",
    "What are the main differences between a list and a tuple in Python?",
]

KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")


def chat_ids(tokenizer, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return ids[0].tolist()


def greedy(loaded, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str) -> list[list[int]]:
    """Greedy ``max_tokens`` continuations of every prompt, batched in one engine."""
    from kvfleet.config import CacheConfig, EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.sampling_params import SamplingParams

    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20, kv_cache_dtype=kv_cache_dtype))
    engine = LLMEngine(cfg, loaded=loaded)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return [outs[str(i)] for i in range(len(prompts))]


def teacher_forced_logprobs(loaded, prompt: list[int], continuation: list[int], kv_cache_dtype: str,
                            block_size: int = 16, chunk: int = 16):
    """float32 ``[len(continuation), vocab]`` log-probabilities of the positions that predict each
    continuation token, with ``prompt + continuation`` fed through a fresh runner whose KV cache is
    in ``kv_cache_dtype`` (the prompt as one prefill, the continuation in chunks of ``chunk``)."""
    import torch

    from kvfleet.engine.core.scheduler_output import ScheduledRequest
    from kvfleet.engine.request import Request
    from kvfleet.model.runner import ModelRunner
    from kvfleet.sampling_params import SamplingParams

    ids = prompt + continuation
    nb = (len(ids) + block_size - 1) // block_size
    runner = ModelRunner(loaded, block_size, nb, kv_cache_dtype=kv_cache_dtype)
    req = Request("tf", ids, SamplingParams(temperature=0.0, max_tokens=1))
    table = list(range(nb))
    bounds = [0, len(prompt)] + list(range(len(prompt) + chunk, len(ids), chunk)) + [len(ids)]
    rows = []
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            rows.append(runner.compute_token_logits(ScheduledRequest(req, a, b - a, table, False)))
    logits = torch.cat(rows)  # row i predicts token i + 1
    return torch.log_softmax(logits[len(prompt) - 1: len(ids) - 1], dim=-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    import torch

    from kvfleet.model.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    prompts = [chat_ids(loaded.tokenizer, p) for p in PROMPTS]
    ref = greedy(loaded, prompts, args.max_tokens, "auto")
    ref_lp = [teacher_forced_logprobs(loaded, p, c, "auto") for p, c in zip(prompts, ref)]
    print("fp32 reference done", file=sys.stderr, flush=True)
    results = {}
    for kv in KV_DTYPES:
        out = greedy(loaded, prompts, args.max_tokens, kv)
        print(f"{kv}: greedy done", file=sys.stderr, flush=True)
        same_tok = sum(sum(a == b for a, b in zip(r, o)) for r, o in zip(ref, out))
        total = sum(len(r) for r in ref)
        same_seq = sum(r == o for r, o in zip(ref, out))
        prefix = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, out)]
        drifts, top1, n, explained = [], 0, 0, 0
        for p, c, lp_ref, d0 in zip(prompts, ref, ref_lp, prefix):
            lp = teacher_forced_logprobs(loaded, p, c, kv)
            # Up to its first divergence the engine saw fp32's exact prefix, so the divergence must
            # sit where the teacher-forced fp8 top-1 differs from fp32's token (a consistency check
            # of the engine's decode path against the chunked-prefill path).
            explained += d0 < len(c) and int(lp[d0].argmax()) != c[d0]
            tgt = torch.tensor(c)[:, None]
            drifts.append((lp.gather(1, tgt) - lp_ref.gather(1, tgt)).abs().squeeze(1))
            top1 += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
            n += len(c)
        d = torch.cat(drifts)
        results[kv] = {
            "token_agreement": same_tok / total,
            "sequence_agreement": same_seq / len(ref),
            "mean_common_prefix": sum(prefix) / len(prefix),
            "divergences_at_teacher_forced_flip": f"{explained}/{sum(d < args.max_tokens for d in prefix)}",
            "teacher_forced_top1": top1 / n,
            "logprob_drift_mean": float(d.mean()),
            "logprob_drift_max": float(d.max()),
        }
    cmd = "python benchmarks/kv_fp8.py" + (f" --max-tokens {args.max_tokens}" if args.max_tokens != 64 else "")
    print(f"# {cmd}")
    print(f"# SmolLM2-135M-Instruct, fp32 compute, {len(PROMPTS)} chat prompts x {args.max_tokens} greedy tokens, "
          f"torch {torch.__version__}")
    print("| kv dtype | token agreement | identical sequences | mean common prefix (tokens) | "
          "teacher-forced top-1 | mean abs logprob drift | max abs logprob drift |")
    print("|---|---|---|---|---|---|---|")
    for kv, r in results.items():
        print(f"| {kv} | {r['token_agreement']:.3f} | {r['sequence_agreement'] * len(ref):.0f}/{len(ref)} | "
              f"{r['mean_common_prefix']:.1f} | {r['teacher_forced_top1']:.3f} | {r['logprob_drift_mean']:.4f} | "
              f"{r['logprob_drift_max']:.4f} |")
    print("# divergences at a teacher-forced flip: "
          + ", ".join(f"{kv} {r['divergences_at_teacher_forced_flip']}" for kv, r in results.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

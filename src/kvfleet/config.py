"""Engine configuration (validated dataclasses). Flag names follow vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.utils import parse_bytes

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block (``--block-size``).
        num_kv_blocks: explicit pool size in blocks (``--num-kv-blocks``); wins over memory.
        kv_cache_memory_bytes: bytes for the KV pool of all layers (``--kv-cache-memory``),
            used when ``num_kv_blocks`` is None.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory_bytes, str):
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be > 0")


@dataclass
class SchedulerConfig:
    """Continuous-batching scheduler settings.

    Attributes:
        max_num_seqs: most requests running in one step (``--max-num-seqs``).
        max_num_batched_tokens: per-step token budget, prefill chunks plus decodes
            (``--max-num-batched-tokens``).
        max_model_len: longest sequence (prompt + output) in tokens; None = the model's context
            length, capped by the pool's capacity (resolved by the engine).
        max_waiting_requests: bound of the waiting queue; over it ``add_request`` raises
            :class:`~kvfleet.errors.QueueFullError` (``--max-waiting-requests``). None = unbounded.
        enable_chunked_prefill: split long prompts into chunks that share a step with decodes.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting_requests: int | None = 1024
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    Attributes:
        model: GGUF file, Hugging Face folder (config.json + *.safetensors + tokenizer) or the
            short name of a packaged model (``smollm2-135m-instruct``).
        served_model_name: name reported by the API (default: the short name or file stem).
        dtype: compute / KV dtype: ``float32`` (default on CPU) or ``bfloat16``.
        seed: global seed for requests without their own.
        num_threads: torch intra-op threads (None = torch's default).
    """

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

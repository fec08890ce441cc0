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
        enable_prefix_caching: reuse the KV of cached prompt prefixes
            (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``).
        prefix_cache: prefix index: ``hash`` (chained block hashes, vLLM) or ``radix``
            (token-granular radix tree, SGLang's RadixAttention) (``--prefix-cache``).
        swap_space_bytes: host memory for the swap pool used by swap preemption
            (``--swap-space``, GiB on the command line); 0 = none.
        kv_eviction: ``none``, or ``streaming``: StreamingLLM (Xiao et al. 2024) keeps the
            first ``sink_tokens`` tokens (attention sinks) plus the last ``streaming_window``
            tokens, so a sequence can grow past ``max_model_len`` in bounded memory
            (``--kv-eviction``, ``--sink-tokens``, ``--streaming-window``).
        kv_cache_dtype: KV storage dtype (``--kv-cache-dtype``): ``auto`` (the model dtype),
            ``fp8_e4m3`` or ``fp8_e5m2`` (1 byte per element with a per-tensor scale).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 * 2**30
    enable_prefix_caching: bool = True
    prefix_cache: str = "hash"
    swap_space_bytes: int = 0
    kv_eviction: str = "none"
    sink_tokens: int = 4
    streaming_window: int = 1024
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory_bytes, str):
            self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory_bytes)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be > 0")
        if self.prefix_cache not in ("hash", "radix"):
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {self.prefix_cache!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.kv_eviction not in ("none", "streaming"):
            raise ValueError(f"kv_eviction must be 'none' or 'streaming', got {self.kv_eviction!r}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.streaming_window < 1:
            raise ValueError(f"streaming_window must be >= 1, got {self.streaming_window}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8_e4m3 or fp8_e5m2, got {self.kv_cache_dtype!r}")


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
        preemption_mode: ``recompute`` (drop the KV, recompute it later) or ``swap`` (move the
            KV to the host swap pool; recompute when that is full) (``--preemption-mode``).
        scheduling_policy: ``fcfs``, or ``lpm`` (longest prefix match first, SGLang; falls back
            to FCFS when more than ``lpm_max_queue`` requests wait) (``--scheduling-policy``).
        lpm_max_queue: waiting-queue length above which ``lpm`` falls back to FCFS.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting_requests: int | None = 1024
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    lpm_max_queue: int = 128

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'lpm', got {self.scheduling_policy!r}")
        if self.lpm_max_queue < 0:
            raise ValueError(f"lpm_max_queue must be >= 0, got {self.lpm_max_queue}")


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
        quantization: ``none`` (weights in ``dtype``) or ``int8`` (W8A8 dynamic int8 projections
            and LM head on the CPU, :mod:`kvfleet.model.layers.quantization`; needs float32).
    """

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None
    quantization: str = "none"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.scheduler.preemption_mode == "swap" and not self.cache.swap_space_bytes:
            raise ValueError("--preemption-mode swap needs a host swap pool: set --swap-space GIB > 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in ("none", "int8"):
            raise ValueError(f"quantization must be 'none' or 'int8', got {self.quantization!r}")
        if self.quantization == "int8" and self.dtype != "float32":
            raise ValueError(f"--quantization int8 needs --dtype float32 (fbgemm's int8 kernels take float32 "
                             f"activations), got {self.dtype}")

"""Model loading: a GGUF file, a Hugging Face folder or a packaged short name -> :class:`LoadedModel`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet.model.config import ModelConfig

logger = logging.getLogger("kvfleet.model")

GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A model ready for the runner.

    Attributes:
        model: our :class:`~kvfleet.model.families.llama.LlamaForCausalLM` (llama / mistral /
            qwen2) or :class:`~kvfleet.model.families.gemma3.Gemma3ForCausalLM`, in eval mode.
        config: its architecture.
        tokenizer: a transformers tokenizer (None only with ``load_tokenizer=False``).
        chat_template: Jinja chat template (GGUF metadata ``tokenizer.chat_template`` or the
            tokenizer's), or None.
        path: the GGUF file or the folder.
        sha256: sha256 of the GGUF file; for a folder, over its ``*.safetensors`` files in name order.
        format: ``"gguf"`` or ``"safetensors"``.
        name: short display name (file stem or folder name).
    """

    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Any
    chat_template: str | None
    path: Path
    sha256: str
    format: str
    name: str


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


#: version of the converted-GGUF cache layout (:func:`converted_cache_dir`); bump when the
#: conversion (names, fusing, q/k un-permutation, norm offsets) changes.
CONVERTED_CACHE_VERSION = 1
_CONVERTED_MARKER = ".complete"


def converted_cache_dir(sha256: str, dtype: torch.dtype) -> Path | None:
    """Where a GGUF's converted model is cached: ``<cache>/converted/<sha256>-v<N>-<dtype>/``
    holding ``config.json`` (the :class:`ModelConfig`), ``model.safetensors`` (our model's own
    ``state_dict`` in ``dtype``: dequantized, q/k un-permuted, q/k/v and gate/up fused) and
    ``meta.json`` (chat template). Loading it takes under a second (tensors assigned as read, no
    copies) where parsing and dequantizing the GGUF takes ~9 s for SmolLM2 (``gguf.GGUFReader``
    builds every metadata field element by element). None when ``KVFLEET_CONVERTED_CACHE=0``:
    every start converts then."""
    if os.environ.get("KVFLEET_CONVERTED_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from kvfleet.model.registry import cache_dir

    tag = str(dtype).removeprefix("torch.")
    return cache_dir() / "converted" / f"{sha256}-v{CONVERTED_CACHE_VERSION}-{tag}"


def _read_converted(cache: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig, str | None] | None:
    if not (cache / _CONVERTED_MARKER).exists():
        return None
    try:
        from safetensors.torch import load_file

        cfg = ModelConfig(**json.loads((cache / "config.json").read_text()))
        meta = json.loads((cache / "meta.json").read_text())
        net = model_class(cfg)(cfg, dtype=dtype)
        net.load_state_dict(load_file(str(cache / "model.safetensors")), strict=True, assign=True)
        return net, cfg, meta.get("chat_template")
    except Exception as e:  # noqa: BLE001 - damaged or stale in any way (SafetensorError...): convert again
        logger.warning("ignoring converted-model cache %s: %s", cache, e)
        shutil.rmtree(cache, ignore_errors=True)
        return None


def _write_converted(cache: Path, net: torch.nn.Module, cfg: ModelConfig, chat_template: str | None) -> None:
    from safetensors.torch import save_file

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        try:
            (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
            (tmp / "meta.json").write_text(json.dumps({"chat_template": chat_template}))
            save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(tmp / "model.safetensors"))
            (tmp / _CONVERTED_MARKER).touch()
            os.replace(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cache / _CONVERTED_MARKER).exists():
                raise
    except OSError as e:  # another process won, or a read-only cache: only costs time
        logger.warning("could not cache the converted model in %s: %s", cache, e)


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The model family implementing ``config.architecture``: ``Gemma3ForCausalLM`` for gemma3,
    ``LlamaForCausalLM`` for llama / mistral / qwen2."""
    if config.architecture == "gemma3":
        from kvfleet.model.families.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from kvfleet.model.families.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _start_quantization(net: torch.nn.Module, method: str) -> Any:
    """Quantize ``net`` in a background thread; returns a future (``result()`` re-raises)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    if method == "none":
        done: Future = Future()
        done.set_result(0)
        return done
    from kvfleet.model.layers.quantization import quantize_model

    pool = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-quantize")
    future = pool.submit(quantize_model, net, method)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def _tokenizer_cache(sha: str) -> Path:
    """Built GGUF tokenizers are cached (SmolLM2: 12 s to build, Gemma 3: ~20 s) under the kvfleet
    cache folder, keyed by the file's sha256 and the transformers version."""
    import transformers

    from kvfleet.model.registry import cache_dir

    return cache_dir() / "tokenizers" / f"{sha}-transformers-{transformers.__version__}"


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, *,
               load_tokenizer: bool = True, quantization: str = "none") -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        model: a GGUF file, a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer
            files) or a packaged short name (``smollm2-135m-instruct``, ``gemma-3-270m``, see
            :func:`kvfleet.model.registry.resolve_model_path`).
        dtype: parameter / compute dtype (GGUF tensors are dequantized to float32 first).
        load_tokenizer: set False to skip building the tokenizer (seconds for GGUF); tests use it.
        quantization: ``none`` or ``int8`` (:func:`kvfleet.model.layers.quantization.quantize_model`);
            for a GGUF it runs in a thread while the tokenizer loads (the kernels release the GIL).

    Raises:
        FileNotFoundError: the path does not exist (or the packaged model is not installed), or a
            folder lacks ``config.json``.
        ValueError: unsupported architecture, a folder without ``*.safetensors``, a file that is
            not GGUF, or weights that do not match the config.
    """
    from kvfleet.model.registry import resolve_model_path, sha256_file

    path = resolve_model_path(str(model)) if not Path(model).exists() else Path(model)
    path = path.resolve()
    t0 = time.monotonic()
    tokenizer = None
    if path.is_dir():
        from kvfleet.model.loader.safetensors import folder_sha256, load_folder_tokenizer, read_hf_folder

        cfg, weights = read_hf_folder(path)
        fmt, name = "safetensors", path.name
        sha = folder_sha256(path)
        chat_template = None
        if load_tokenizer:
            tokenizer = load_folder_tokenizer(path)
            chat_template = getattr(tokenizer, "chat_template", None)
        net = model_class(cfg)(cfg, dtype=dtype)
        net.load_hf_weights(weights)
        del weights
    else:
        if not _is_gguf(path):
            raise ValueError(f"{path} is neither a GGUF file nor a model folder")
        from kvfleet.model.loader.gguf import load_gguf_tokenizer, read_gguf

        fmt, name = "gguf", path.stem
        sha = sha256_file(path)
        converted = converted_cache_dir(sha, dtype)
        cached = _read_converted(converted, dtype) if converted is not None else None
        if cached is not None:
            net, cfg, chat_template = cached
        else:
            cfg, weights, chat_template = read_gguf(path)
            net = model_class(cfg)(cfg, dtype=dtype)
            net.load_hf_weights(weights)
            del weights
            if converted is not None:
                _write_converted(converted, net, cfg, chat_template)
        quantizing = _start_quantization(net, quantization)
        if load_tokenizer:
            tokenizer = load_gguf_tokenizer(path, cache_dir=_tokenizer_cache(sha),
                                            architecture=cfg.architecture)
            if chat_template is None:
                chat_template = getattr(tokenizer, "chat_template", None)
        n = quantizing.result()
        if quantization != "none":
            logger.info("quantization %s: %d layers (packed while the tokenizer loaded)", quantization, n)
        quantization = "none"
    if quantization != "none":
        from kvfleet.model.layers.quantization import quantize_model

        n = quantize_model(net, quantization)
        logger.info("quantization %s: %d layers", quantization, n)
    net.eval()
    logger.info("loaded %s model %s (%s, %d layers) from %s sha256=%s in %.1fs", fmt, name, cfg.architecture,
                cfg.num_hidden_layers, path, sha, time.monotonic() - t0)
    return LoadedModel(model=net, config=cfg, tokenizer=tokenizer, chat_template=chat_template, path=path,
                       sha256=sha, format=fmt, name=name)


__all__ = ["LoadedModel", "load_model", "model_class"]

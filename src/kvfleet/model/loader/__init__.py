"""Model loading: a GGUF file, a Hugging Face folder or a packaged short name -> :class:`LoadedModel`."""

from __future__ import annotations

import logging
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


# Architectures whose GGUF tokenizer takes long to build (Gemma 3: 262,144 tokens, ~20 s): cached
# under the kvfleet cache folder, keyed by the file's sha256 and the transformers version.
_CACHED_TOKENIZER_ARCHS = ("gemma3",)


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    """The model family implementing ``config.architecture``: ``Gemma3ForCausalLM`` for gemma3,
    ``LlamaForCausalLM`` for llama / mistral / qwen2."""
    if config.architecture == "gemma3":
        from kvfleet.model.families.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from kvfleet.model.families.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _tokenizer_cache(config: ModelConfig, sha: str) -> Path | None:
    if config.architecture not in _CACHED_TOKENIZER_ARCHS:
        return None
    import transformers

    from kvfleet.model.registry import cache_dir

    return cache_dir() / "tokenizers" / f"{sha}-transformers-{transformers.__version__}"


def load_model(model: str | Path, dtype: torch.dtype = torch.float32, *,
               load_tokenizer: bool = True) -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        model: a GGUF file, a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer
            files) or a packaged short name (``smollm2-135m-instruct``, ``gemma-3-270m``, see
            :func:`kvfleet.model.registry.resolve_model_path`).
        dtype: parameter / compute dtype (GGUF tensors are dequantized to float32 first).
        load_tokenizer: set False to skip building the tokenizer (seconds for GGUF); tests use it.

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
    else:
        if not _is_gguf(path):
            raise ValueError(f"{path} is neither a GGUF file nor a model folder")
        from kvfleet.model.loader.gguf import load_gguf_tokenizer, read_gguf

        cfg, weights, chat_template = read_gguf(path)
        fmt, name = "gguf", path.stem
        sha = sha256_file(path)
        if load_tokenizer:
            tokenizer = load_gguf_tokenizer(path, cache_dir=_tokenizer_cache(cfg, sha),
                                            architecture=cfg.architecture)
            if chat_template is None:
                chat_template = getattr(tokenizer, "chat_template", None)
    net = model_class(cfg)(cfg, dtype=dtype)
    net.load_hf_weights(weights)
    del weights
    net.eval()
    logger.info("loaded %s model %s (%s, %d layers) from %s sha256=%s in %.1fs", fmt, name, cfg.architecture,
                cfg.num_hidden_layers, path, sha, time.monotonic() - t0)
    return LoadedModel(model=net, config=cfg, tokenizer=tokenizer, chat_template=chat_template, path=path,
                       sha256=sha, format=fmt, name=name)


__all__ = ["LoadedModel", "load_model", "model_class"]

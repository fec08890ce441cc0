"""Hugging Face folder reader: ``config.json`` + ``*.safetensors`` (+ tokenizer files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from kvfleet.model.config import ModelConfig


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's ``*.safetensors`` files sorted by name.

    Raises:
        ValueError: there are none.
    """
    files = sorted(Path(folder).glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors files")
    return files


def folder_sha256(folder: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 over the folder's ``*.safetensors`` files, concatenated in name order (hex)."""
    h = hashlib.sha256()
    for f in safetensors_files(folder):
        with open(f, "rb") as fh:
            while b := fh.read(chunk):
                h.update(b)
    return h.hexdigest()


def read_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` and every ``*.safetensors`` file of a Hugging Face model folder.

    Returns:
        ``(config, weights)`` with weights keyed by their Hugging Face names, dtype as stored.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: no safetensors files, or an unsupported ``model_type``.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    files = safetensors_files(folder)
    cfg = ModelConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return cfg, weights


def load_folder_tokenizer(folder: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder)``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))

"""Convert a GGUF model into a Hugging Face folder (config, safetensors, tokenizer) for vLLM.

transformers loads a GGUF with ``gguf_file=`` (dequantizing its weights); the quantizer it
attaches is dropped before ``save_pretrained`` so the folder holds plain weights that any
engine reads. Usage: python gguf_to_hf.py MODEL OUT_DIR [--dtype float32|bfloat16]
(MODEL: a GGUF path or a packaged short name such as smollm2-135m-instruct).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file or packaged short name")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="saved weight dtype")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfleet.model.registry import resolve_model_path

    path = resolve_model_path(args.model)
    if path.is_dir():
        print(f"{path} is already a folder; nothing to convert", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The GGUF loader marks the model as quantized; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = dtype
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out} ({args.dtype})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

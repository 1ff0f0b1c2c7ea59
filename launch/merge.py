"""`python -m launch.merge runs/<run> --out merged/`: the run's adapter folded into its base model.

The result is a plain Hugging Face checkpoint (weights as safetensors, the config, the tokenizer
or processor with its chat template) that `transformers`, `vllm serve merged/` or `--model
merged/` of another run load with no adapter. The base model is the one the adapter records (its
adapter_config.json) unless --model says otherwise; the merge is PEFT's `merge_and_unload`, done
in float32 and saved in --dtype. Serving the adapter without merging it: docs/serving.md.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro


@dataclass
class MergeArgs:
    run: Annotated[str, tyro.conf.Positional]
    """A run directory, or a saved adapter (the run's <logdir>/adapter)."""
    out: str
    """Directory to write the merged checkpoint to (created; must be empty if it exists)."""
    model: str | None = None
    """Base model (default: the one recorded in the adapter)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the saved weights ("auto": the base checkpoint's own)."""


def merge(args: MergeArgs) -> Path:
    """Write the merged checkpoint; SystemExit saying what is wrong with the input."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    from launch.config import Config
    from launch.eval import adapter_dir
    from launch.parts import resolve_policy
    from policy.adapter import read_adapter
    from policy.load import load_model
    from policy.vision import is_vision

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"error: --out {out} exists and is not an empty directory")
    try:
        adapter = read_adapter(adapter_dir(args.run))
        base = resolve_policy(Config(learners=1, model=args.model or adapter.base_model))
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    config = AutoConfig.from_pretrained(base)
    saved = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        getattr(torch, saved) if isinstance(saved, str) else saved)
    model = load_model(base, "float32")
    try:
        merged = PeftModel.from_pretrained(model, str(adapter.path)).merge_and_unload()
    except (ValueError, RuntimeError, KeyError) as exc:
        raise SystemExit(f"error: the adapter in {adapter.path} cannot be applied to {base}: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    merged.to(dtype).save_pretrained(out)  # safetensors
    _save_tokenizer(base, out, vision=is_vision(config))
    (out / "tandem-merge.json").write_text(json.dumps(
        {"adapter": str(Path(adapter.path).resolve()), "version": adapter.version, "base_model": base,
         "dtype": str(dtype).removeprefix("torch.")}, indent=1) + "\n")
    return out


def _save_tokenizer(base: str, out: Path, vision: bool) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    if vision:
        AutoProcessor.from_pretrained(base).save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def main(args: MergeArgs) -> Path:
    out = merge(args)
    print(f"merged {args.run} into {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}), "
          f"serve it with `vllm serve {out}`, or train from it with --model {out}")
    return out


if __name__ == "__main__":
    main(tyro.cli(MergeArgs, prog="python -m launch.merge"))
    sys.exit(0)

"""Loading a policy: a built-in tiny model or any Hugging Face causal LM or vision-language model.

`--model` takes a local path, a Hugging Face Hub id (resolved once, by the
driver, to its snapshot directory in the Hugging Face cache: `resolve_model`),
or a built-in: `builtin:tiny` (the randomly initialised tiny model, built into
the cache on first use) / `builtin:maze` (the tiny model after the supervised
maze warm start; the launcher builds it into the cache with launch/warmstart.py,
since training it takes the actors' and the learner's code), and their
vision-language pair `builtin:tiny-vlm` / `builtin:vlm` (the image-maze warm
start). Nothing is downloaded for the built-ins; policy/cache.py has the cache.

A vision-language model (a config with a `vision_config`) loads with
`AutoModelForImageTextToText`; its LoRA adapter covers the language model only,
the vision tower and connector frozen (`LoraSpec.vision_tower` adapts them too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from policy.cache import build_once, cache_dir, is_built

BUILTIN_DIRS = {"builtin:tiny": "tiny-v1", "builtin:maze": "maze-sft-v2",
                "builtin:tiny-vlm": "tiny-vlm-v3", "builtin:vlm": "image-maze-sft-v6"}
"""Each built-in's directory under `cache_dir()`. A new name whenever what is built changes, so
that an old cache entry is never taken for the new one."""

BUILTIN = tuple(BUILTIN_DIRS)


MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
"""What is fetched of a Hub repository: config, tokenizer, chat template and safetensors weights
(not the .bin / .pth / GGUF copies many repositories also hold)."""


class ModelNotFound(ValueError):
    """`--model` names no model this machine can load; the message says what to do."""


def resolve_model(name: str) -> str:
    """Turn `--model` into a local directory `from_pretrained` loads without the network: a
    built-in (built on first use), a local checkpoint directory, or a Hub id resolved once to its
    snapshot in the Hugging Face cache (downloaded there unless HF_HUB_OFFLINE is set).
    ModelNotFound, saying what to do, when there is none."""
    if name == "builtin:tiny":
        from policy.tiny import save_tiny

        return str(build_once(cache_dir() / BUILTIN_DIRS[name], save_tiny))
    if name == "builtin:tiny-vlm":
        from policy.tiny import save_tiny_vlm

        return str(build_once(cache_dir() / BUILTIN_DIRS[name], save_tiny_vlm))
    if name in ("builtin:maze", "builtin:vlm"):
        path = cache_dir() / BUILTIN_DIRS[name]
        if not is_built(path):
            env = "maze" if name == "builtin:maze" else "image-maze"
            raise FileNotFoundError(
                f"the {env} warm start is not built yet at {path}; the launcher builds it "
                f"(python -m launch.warmstart --env {env})")
        return str(path)
    if name.startswith("builtin:"):
        raise ValueError(f"unknown built-in model {name!r}; choose one of {BUILTIN}")
    path = Path(name).expanduser()
    if path.exists() or not _hub_id(name):
        return _model_dir(name, path)
    return _hub_snapshot(name)


def _hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub repository id ("org/name" or "name"), not as a path."""
    import re

    return (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith(".")
            and ".." not in name and not name.endswith("."))


def _model_dir(name: str, path: Path) -> str:
    if not path.is_dir():
        raise ModelNotFound(f"--model {name}: no such directory. Pass a Hugging Face checkpoint directory "
                            "(with config.json) or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {name}: {path.resolve()} is not a Hugging Face model directory (no "
                            "config.json in it). Pass the directory that holds config.json and the weights")
    return str(path.resolve())  # every part, on every node, reads the same absolute path


def _hub_snapshot(repo: str, cache: str | None = None, revision: str | None = None) -> str:
    """The directory of `repo`'s snapshot in the Hugging Face cache (`cache`, default the user's),
    fetched first when the Hub can be reached; ModelNotFound saying what to do otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    elsewhere = (f"download it on a machine with network (hf download {repo}, or huggingface-cli download "
                 f"{repo}) and pass its directory as --model, or copy that machine's Hugging Face cache here")
    try:
        found = snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES)
    except GatedRepoError:
        raise ModelNotFound(f"--model {repo}: the Hub repository is gated; accept its terms on huggingface.co "
                            "and log in (hf auth login) or set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(f"--model {repo}: the Hub at {constants.ENDPOINT} has no such model (or it is "
                            "private: log in with hf auth login or set HF_TOKEN). Check the id, or pass a "
                            "local checkpoint directory") from None
    except IncompleteSnapshotError as exc:
        raise ModelNotFound(f"--model {repo}: its copy in the Hugging Face cache is incomplete and the Hub "
                            f"cannot be reached to finish it ({str(exc).splitlines()[0]}); {elsewhere}") from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(f"--model {repo}: not in the Hugging Face cache ({cache or constants.HF_HUB_CACHE}) "
                                f"and HF_HUB_OFFLINE is set, so it cannot be downloaded: {elsewhere}; or unset "
                                "HF_HUB_OFFLINE to download it") from None
        why = exc.__cause__ or exc
        raise ModelNotFound(f"--model {repo}: the Hub at {constants.ENDPOINT} could not be reached "
                            f"({type(why).__name__}: {str(why).splitlines()[0][:200]}) and it is not in the "
                            f"Hugging Face cache; check the network (HF_ENDPOINT, proxies), or {elsewhere}") from None
    path = Path(found)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelNotFound(f"--model {repo}: its snapshot {path} has no config.json or no .safetensors weights "
                            "(Tandem loads safetensors only); convert the checkpoint and pass its directory")
    return str(path)


def hub_snapshot_of(path: str | Path) -> tuple[str, str, str] | None:
    """(repo id, revision, cache directory) when `path` is a snapshot in a Hugging Face cache
    (<cache>/models--org--name/snapshots/<revision>), else None: a node that lacks the snapshot
    fetches that revision into the same cache path (launch/cluster.py)."""
    path = Path(path)
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    return path.parent.parent.name[len("models--"):].replace("--", "/"), path.name, str(path.parents[2])


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_chat(path: str, template_kwargs: dict | None = None, tools: list[dict] | None = None,
              tool_format: str = "auto"):
    """The `Chat` of the model at `path`: its tokenizer's template, and for a vision-language
    model its image scheme (policy/vision.py); with `tools`, the environment's tools (tool-call mode)."""
    from policy.chat import Chat
    from policy.vision import scheme_for

    return Chat(load_tokenizer(path), template_kwargs, scheme=scheme_for(path), tools=tools, tool_format=tool_format)


def model_class(config):
    """The transformers auto class for `config`: image-text-to-text for a vision-language model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from policy.vision import is_vision

    return AutoModelForImageTextToText if is_vision(config) else AutoModelForCausalLM


def pad_id(config) -> int:
    """The padding token of a model's config: its own, else its text model's (Qwen-VL configs keep
    it there only), else 0 (padding is masked, so any id does)."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pad or 0


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    """The whole model at `path` in `dtype` ("float32", "bfloat16") on `device`: what actors,
    engines and tests load. The learner does not: learner/model.py loads it once, on rank 0's CPU,
    and keeps only each rank's FSDP shard on its device."""
    import torch
    from transformers import AutoConfig

    from policy.attention import use_gqa_sdpa

    model = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=getattr(torch, dtype))
    use_gqa_sdpa(model)
    return model.to(device)


VISION_TOWER = r".*\.(vision_model|connector|visual)(\..*)?"
"""PEFT's `exclude_modules` for a vision-language model whose vision side stays frozen: the
vision tower and the connector (module names as PEFT sees them: Idefics3's `vision_model` and
`connector`; Qwen-VL's `visual`, which holds its merger too)."""


@dataclass
class LoraSpec:
    """The LoRA adapter trained by the learner and applied by the actors."""

    rank: int = 32
    """LoRA rank r."""
    alpha: float = 64.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters; "all-linear" means every linear layer but the output head."""
    vision_tower: bool = False
    """On a vision-language model, adapt the vision tower and connector too (by default only
    the language model gets adapters, as in the published run: the vision side stays frozen)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--learner.lora.rank must be at least 1, got {self.rank}")

    def peft_config(self, vision: bool = False):
        """PEFT's LoraConfig; `vision`: for a vision-language model (its vision side excluded
        unless `vision_tower`)."""
        from peft import LoraConfig

        targets = self.target_modules
        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, bias="none",
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            exclude_modules=VISION_TOWER if vision and not self.vision_tower else None,
            task_type="CAUSAL_LM")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
                "vision_tower": self.vision_tower}


def with_lora(model, spec: LoraSpec):
    """Wrap `model` with a fresh (identity) LoRA adapter."""
    from peft import get_peft_model

    from policy.vision import is_vision

    return get_peft_model(model, spec.peft_config(vision=is_vision(model.config)))

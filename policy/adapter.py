"""The adapter: one version of the policy's LoRA adapter (`Adapter`), and its format on disk.

`Adapter` is the one adapter type: the learner snapshots it, the weight channel (weights/)
carries it, engines load it, and `read_adapter` gives it back from a directory. On disk it is
a directory in PEFT's format:

    <dir>/adapter_model.safetensors   the tensors, under PEFT's state-dict names
    <dir>/adapter_config.json         PEFT's LoraConfig, with the adapted modules named
    <dir>/tandem.json                 {"version": v}: the policy version of the adapter

The learner saves its adapter this way (`<run dir>/adapter`), `launch.eval` and the
driver read it back, and the vLLM engine writes each version it receives this way
to tmpfs for vLLM to load; this module is the only code that knows the layout.
PEFT's `PeftModel.from_pretrained` and vLLM's `LoRARequest` load such a directory
as it is (tandem.json is ours; both ignore it).

Design decisions:
- The config comes from the LoRA spec and the tensors alone, never from a live
  PEFT model, so the learner and an actor write the same bytes for the same
  adapter. "all-linear" is a shorthand that PEFT resolves against a model and
  vLLM does not: the modules are named explicitly, from the tensors' names
  (which is also what PEFT records once it has resolved it).
- Sets become sorted lists and the JSON is indented, so that a saved config is
  stable from run to run and reads well.
- Tensors are written as given (after `contiguous().cpu()`): whoever saves
  chooses the dtype (the learner its training dtype, an actor the wire's).
- Reading an adapter back gives its whole LoRA spec (`Adapter.lora_spec`:
  rank, alpha, target modules), so an engine is built with the adapter as it
  was trained. A config the engines cannot apply as written (a module pattern
  instead of names, tensors of other modules than it names, PEFT options such
  as DoRA that `LoraSpec` has no field for) is refused there, not evaluated as
  something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy.load import VISION_TOWER, LoraSpec

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
VERSION_FILE = "tandem.json"
UNSUPPORTED = ("use_dora", "use_rslora", "layers_to_transform", "rank_pattern", "alpha_pattern",
               "modules_to_save")
"""PEFT config fields that change what an adapter computes and that no LoraSpec sets."""


@dataclass
class Adapter:
    """One version of the policy's LoRA adapter: from the learner, over the weight channel, or
    read back from its directory."""

    version: int
    """The policy version: the number of adapters the learner had published with this one."""
    base_model: str
    """The base model it was trained on (`base_model_name_or_path` of its config)."""
    config: dict[str, Any]
    """PEFT's adapter config (`r`, `lora_alpha`, `target_modules`, ...)."""
    tensors: dict  # name -> torch.Tensor (PEFT state-dict names)
    path: Path | None = None
    """The directory it was read from (None for one that never was on disk)."""

    def lora_spec(self) -> LoraSpec:
        """The LoRA spec it was trained with (rank, alpha, target modules), to build an engine
        or a learner for it; ValueError naming the adapter and what an engine could not apply."""
        config = self.config
        where = self.path / CONFIG_FILE if self.path is not None else f"adapter version {self.version}"
        weights = self.path / WEIGHTS_FILE if self.path is not None else "the adapter"
        try:
            rank, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: no usable LoRA rank `r` and `lora_alpha` ({exc!r})") from None
        targets = config.get("target_modules")
        if targets == "all-linear":
            targets = ["all-linear"]
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
            # PEFT also takes a regular expression here; LoraSpec, and so the engines, take names.
            raise ValueError(f"{where}: target_modules is {targets!r}; Tandem applies a list of module "
                             "names (such as [\"q_proj\", \"v_proj\"]) or \"all-linear\"")
        adapted = _modules(self.tensors)
        if targets != ["all-linear"] and adapted != set(targets):
            raise ValueError(f"{where}: target_modules {sorted(targets)}, but the tensors of "
                             f"{weights} adapt {sorted(adapted)}")
        ranks = {t.shape[0] for name, t in self.tensors.items() if ".lora_A." in name and t.dim() == 2}
        if ranks - {rank}:
            raise ValueError(f"{where}: r is {rank}, but the tensors of {weights} have "
                             f"rank {sorted(ranks)}")
        exclude = config.get("exclude_modules")
        if exclude not in (None, VISION_TOWER):
            raise ValueError(f"{where}: exclude_modules is {exclude!r}; Tandem excludes only a vision-language "
                             f"model's vision side ({VISION_TOWER!r})")
        unsupported = [k for k in UNSUPPORTED if config.get(k)]
        if unsupported:
            raise ValueError(f"{where}: sets {', '.join(f'{k}={config[k]!r}' for k in unsupported)}, which "
                             "Tandem's engines do not apply (they apply rank, alpha and target modules only)")
        try:
            return LoraSpec(rank=rank, alpha=alpha, target_modules=list(targets),
                            vision_tower=exclude is None and _vision_adapter(self.tensors))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def _modules(tensors: dict) -> set[str]:
    """The names of the modules an adapter's tensors adapt (`...self_attn.q_proj.lora_A.weight`: q_proj)."""
    return {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors}


def _vision_adapter(tensors: dict) -> bool:
    """Whether `tensors` adapt a vision-language model (its language model sits under a name of its own)."""
    return any(".text_model." in name or ".language_model." in name for name in tensors)


def adapter_config(spec: LoraSpec, tensors: dict, base_model: str) -> dict[str, Any]:
    """PEFT's adapter config for `tensors`, an adapter of `spec` on `base_model`."""
    config = spec.peft_config(vision=_vision_adapter(tensors)).to_dict()
    config["target_modules"] = sorted(_modules(tensors))
    config["base_model_name_or_path"] = base_model
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}


def write_adapter(path: str | Path, tensors: dict, spec: LoraSpec, base_model: str, version: int) -> Path:
    """Write adapter `version` (`tensors` of `spec` on `base_model`) as the directory `path`
    (created if needed; the files of an adapter already there are replaced)."""
    from safetensors.torch import save_file

    if not tensors:
        raise ValueError(f"adapter v{version} has no tensors: nothing to save "
                         "(does the LoRA config target any module of the model?)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
    config = adapter_config(spec, tensors, base_model)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    (path / VERSION_FILE).write_text(json.dumps({"version": version}))
    return path


def read_adapter(path: str | Path) -> Adapter:
    """The adapter saved in the directory `path`; FileNotFoundError that names the missing file,
    ValueError for a file that is not what it should be."""
    from safetensors.torch import load_file

    path = Path(path)
    for name in (WEIGHTS_FILE, CONFIG_FILE, VERSION_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} holds no {name}: not an adapter saved by Tandem "
                                    "(the learner saves one at <run dir>/adapter)")
    try:
        version = int(json.loads((path / VERSION_FILE).read_text())["version"])
        config = json.loads((path / CONFIG_FILE).read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: unreadable {VERSION_FILE} or {CONFIG_FILE}: {exc!r}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_FILE} holds no JSON object")
    tensors = load_file(str(path / WEIGHTS_FILE))
    return Adapter(version, config.get("base_model_name_or_path") or "", config, tensors, path)

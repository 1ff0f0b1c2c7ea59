"""Training for the Tinker API: one base model, one LoRA adapter and one optimizer per training
client, on Tandem's learner code.

The base model is loaded once (policy/load.py) and wrapped by PEFT; every training client is a
named adapter on it (PEFT's multi-adapter model), made active for that client's calls only, with
its own AdamW over its own parameters: clients never share a trainable tensor, so one client's
steps cannot move another's adapter. Log-probs are the learner's (learner/logprobs.py
`target_logprobs`: the chunked head and log-softmax the FSDP learner uses); the losses are the
API's (serve/losses.py). Gradients accumulate over forward_backward calls until optim_step, as
the API specifies.

One thread calls into a Trainer at a time (serve/app.py runs every model call on one worker).

Departures and limits, each refused with a clear error rather than done differently: one process
(no FSDP ranks: `--learners` above 1 is refused), token inputs only, LoRA only, the Adam family
of optimizers only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from learner.logprobs import target_logprobs
from policy.adapter import read_adapter, write_adapter
from policy.load import LoraSpec, load_model, pad_id
from serve.losses import INPUTS, loss_fn

LORA_ALPHA = 32.0
"""LoRA's scaling numerator for every client (the API sets only the rank)."""

ATTN = ("self_attn", "attention", "attn")
MLP = ("mlp", "feed_forward", "ffn")


class UserError(ValueError):
    """The caller asked for something wrong (answered with the API's category "user")."""


@dataclass
class LoraChoice:
    """A training client's LoRA config as the API states it."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def to_dict(self) -> dict:
        return dict(rank=self.rank, seed=self.seed, train_mlp=self.train_mlp, train_attn=self.train_attn,
                    train_unembed=self.train_unembed)


def linear_kinds(model) -> dict[str, str]:
    """The module names (last part) of a plain model's linear layers, each with its kind: "attn",
    "mlp" or "unembed" (the output head); layers of no such kind are left out."""
    head = model.get_output_embeddings()
    kinds = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if module is head:
            kinds[parts[-1]] = "unembed"
        elif any(p in ATTN for p in parts):
            kinds[parts[-1]] = "attn"
        elif any(p in MLP for p in parts):
            kinds[parts[-1]] = "mlp"
    return kinds


def target_modules(kinds: dict[str, str], choice: LoraChoice) -> list[str]:
    """The linear modules that `choice` adapts: attention's, the MLP's, the output head, as asked."""
    wanted = {k for k, on in (("attn", choice.train_attn), ("mlp", choice.train_mlp),
                              ("unembed", choice.train_unembed)) if on}
    names = sorted(name for name, kind in kinds.items() if kind in wanted)
    if not names:
        raise UserError(f"the LoRA config {choice.to_dict()} adapts no layer of this model")
    return names


class Trainer:
    """The base model and the adapters of every training client.

    Usage::

        trainer = Trainer(model_dir)
        trainer.create("m1", LoraChoice(rank=8, seed=0))   # PEFT adapter names: no "lora" in them
        out = trainer.forward_backward("m1", data, "cross_entropy", {}, forward_only=False)
        trainer.optim_step("m1", {"learning_rate": 1e-3})
        trainer.save("m1", Path("ckpt"), optimizer=True, base_model=model_dir)
    """

    def __init__(self, model_path: str, threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.base = load_model(model_path)
        self.vocab = self.base.get_output_embeddings().weight.shape[0]
        self.pad = pad_id(self.base.config)
        self.kinds = linear_kinds(self.base)  # before PEFT adds linear layers of its own
        self.peft = None  # the PEFT model, made with the first adapter
        self.specs: dict[str, LoraSpec] = {}
        self.choices: dict[str, LoraChoice] = {}
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.steps: dict[str, int] = {}

    # -- adapters ---------------------------------------------------------------
    def create(self, name: str, choice: LoraChoice) -> None:
        """A fresh adapter `name` (A Kaiming-uniform drawn from `choice.seed`, B zero) and its optimizer."""
        from peft import get_peft_model

        if choice.rank < 1:
            raise UserError(f"LoRA rank must be at least 1, got {choice.rank}")
        spec = LoraSpec(rank=choice.rank, alpha=LORA_ALPHA, target_modules=target_modules(self.kinds, choice))
        with torch.random.fork_rng(devices=[]):
            if choice.seed is not None:
                torch.manual_seed(choice.seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, spec.peft_config(), adapter_name=name)
            else:
                self.peft.add_adapter(name, spec.peft_config())
        self.specs[name], self.choices[name] = spec, choice
        self.optimizers[name] = torch.optim.AdamW(self._params(name), lr=0.0, betas=(0.9, 0.95), eps=1e-12,
                                                  weight_decay=0.0)
        self.steps[name] = 0

    def delete(self, name: str) -> None:
        """Free adapter `name`: its LoRA layers, optimizer state and step count (a finished session's)."""
        import warnings

        if name not in self.specs:
            return
        with warnings.catch_warnings():  # "adapter ... was active ...": each call activates its own anyway
            warnings.simplefilter("ignore", UserWarning)
            self.peft.delete_adapter(name)
        for table in (self.specs, self.choices, self.optimizers, self.steps):
            table.pop(name, None)

    def _params(self, name: str) -> list[torch.nn.Parameter]:
        marker = f".{name}."
        params = [p for n, p in sorted(self.peft.named_parameters()) if marker in n]
        assert params, f"adapter {name} has no parameters"
        return params

    def _activate(self, name: str) -> None:
        if name not in self.specs:
            raise UserError(f"no model {name!r} on this service")
        self.peft.set_adapter(name)  # also marks only this adapter's parameters trainable

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's state-dict names (a copy)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().clone() for k, v in state.items()}

    # -- training ---------------------------------------------------------------
    def _batch(self, data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        """inputs, targets, attention [b, T] (right-padded) and each datum's inputs as tensors."""
        if not data:
            raise UserError("forward_backward got no data")
        width = max(len(d.tokens) for d in data)
        inputs = torch.full((len(data), width), self.pad, dtype=torch.long)
        targets = torch.zeros((len(data), width), dtype=torch.long)
        attention = torch.zeros((len(data), width), dtype=torch.long)
        per_datum = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise UserError(f"datum {i} has no tokens")
            target = d.inputs.get("target_tokens")
            if target is None:
                raise UserError(f"datum {i} has no loss_fn_inputs['target_tokens']")
            for key, value in d.inputs.items():
                if len(value) != n:
                    raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {len(value)} values for "
                                    f"{n} input tokens; each must have one per input token")
            for what, ids in (("model_input", np.asarray(d.tokens)), ("target_tokens", target)):
                if not np.issubdtype(ids.dtype, np.integer):
                    raise UserError(f"datum {i}: {what} must be integer token ids, got {ids.dtype}")
                bad = ids[(ids < 0) | (ids >= self.vocab)]
                if bad.size:
                    raise UserError(f"datum {i}: {what} holds token id {int(bad[0])}, outside the "
                                    f"vocabulary [0, {self.vocab})")
            inputs[i, :n] = torch.tensor(d.tokens, dtype=torch.long)
            targets[i, :n] = torch.from_numpy(target.astype(np.int64))
            attention[i, :n] = 1
            per_datum.append({k: torch.from_numpy(v.astype(np.float32)) for k, v in d.inputs.items()
                              if k != "target_tokens"})
        return inputs, targets, attention, per_datum

    def forward_backward(self, name: str, data, loss: str, config: dict, forward_only: bool):
        """Per datum its target tokens' log-probs [N], and the metrics {"loss:sum"}; without
        `forward_only` the loss's gradient is added to the adapter's."""
        try:
            fn = loss_fn(loss, config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        self._activate(name)
        inputs, targets, attention, per_datum = self._batch(data)
        for i, d in enumerate(per_datum):
            missing = [k for k in INPUTS[loss][1:] if k not in d and not (loss == "cross_entropy" and k == "weights")]
            if missing:
                raise UserError(f"datum {i}: {loss} needs loss_fn_inputs {missing}")
        self.peft.train()
        with torch.set_grad_enabled(not forward_only):
            logp = target_logprobs(self.peft, inputs, targets, attention)  # [b, T]
            total = logp.new_zeros(())
            out = []
            for i, d in enumerate(data):
                n = len(d.tokens)
                datum_loss, _ = fn(logp[i, :n], per_datum[i], config)
                total = total + datum_loss
                out.append(logp[i, :n].detach().float().numpy())
            if not forward_only:
                total.backward()
        return out, {"loss:sum": float(total.detach())}

    def optim_step(self, name: str, adam: dict) -> dict[str, float]:
        """One AdamW step of the adapter with this call's parameters (learning_rate, beta1, beta2,
        eps, weight_decay, grad_clip_norm), then its gradients are zeroed."""
        self._activate(name)
        opt = self.optimizers[name]
        lr, wd = float(adam.get("learning_rate", 1e-4)), float(adam.get("weight_decay", 0.0))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        eps, clip = float(adam.get("eps", 1e-12)), float(adam.get("grad_clip_norm", 0.0))
        if lr < 0 or wd < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise UserError(f"Adam parameters out of range: learning_rate {lr}, betas {betas}, eps {eps}, "
                            f"weight_decay {wd}")
        for group in opt.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        params = self._params(name)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[name] += 1
        return {"grad_norm:mean": float(norm)}

    # -- state on disk ----------------------------------------------------------
    def save(self, name: str, path: Path, optimizer: bool, base_model: str) -> None:
        """The adapter (policy/adapter.py's format), the API's LoRA config and, with `optimizer`,
        the optimizer's state, in the directory `path`."""
        write_adapter(path, self.tensors(name), self.specs[name], base_model, self.steps[name])
        meta = {"lora": self.choices[name].to_dict(), "step": self.steps[name], "optimizer": optimizer}
        if optimizer:
            torch.save(self.optimizers[name].state_dict(), path / "optimizer.pt")
        (path / "tinker.json").write_text(json.dumps(meta, indent=2))

    def load(self, name: str, path: Path, optimizer: bool) -> None:
        """Adapter `name` (created here if new) from the directory `path`, with its optimizer's
        state when `optimizer` (UserError if the checkpoint has none)."""
        from peft import set_peft_model_state_dict

        meta = json.loads((path / "tinker.json").read_text())
        if optimizer and not meta.get("optimizer"):
            raise UserError(f"{path.name} was saved without optimizer state (save_weights_for_sampler "
                            "saves weights only; save_state saves both)")
        if name not in self.specs:
            self.create(name, LoraChoice(**meta["lora"]))
        adapter = read_adapter(path)
        if adapter.lora_spec().rank != self.specs[name].rank:
            raise UserError(f"the checkpoint has LoRA rank {adapter.lora_spec().rank}, the model "
                            f"{self.specs[name].rank}")
        result = set_peft_model_state_dict(self.peft, adapter.tensors, adapter_name=name)
        if list(result.unexpected_keys):
            raise UserError(f"the checkpoint adapts layers this model's adapter lacks: {result.unexpected_keys[:3]}")
        self.optimizers[name] = torch.optim.AdamW(self._params(name), lr=0.0, betas=(0.9, 0.95), eps=1e-12)
        if optimizer:
            self.optimizers[name].load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.steps[name] = int(meta.get("step", 0))

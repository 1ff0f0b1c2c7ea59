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


def adam_params(adam: dict) -> tuple[float, tuple[float, float], float, float, float]:
    """(learning rate, betas, eps, weight decay, gradient clip norm) of the API's AdamParams, with
    its defaults; UserError when one is out of range."""
    lr, wd = float(adam.get("learning_rate", 1e-4)), float(adam.get("weight_decay", 0.0))
    betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
    eps, clip = float(adam.get("eps", 1e-12)), float(adam.get("grad_clip_norm", 0.0))
    if lr < 0 or wd < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"Adam parameters out of range: learning_rate {lr}, betas {betas}, eps {eps}, "
                        f"weight_decay {wd}")
    return lr, betas, eps, wd, clip


class Trainer:
    """The base model and the adapters of every training client.

    Usage::

        trainer = Trainer(model_dir)                       # or Trainer(model_dir, ranks=...) on rank 0
        trainer.create("m1", LoraChoice(rank=8, seed=0))   # PEFT adapter names: no "lora" in them
        out = trainer.forward_backward("m1", data, "cross_entropy", {}, forward_only=False)
        trainer.optim_step("m1", {"learning_rate": 1e-3})
        trainer.save("m1", Path("ckpt"), optimizer=True, base_model=model_dir)
        trainer.close()

    The public calls check the request, send it to the other ranks (rank 0, `ranks` given) and
    run it; the other ranks run what rank 0 sends through `apply`.
    """

    def __init__(self, model_path: str, threads: int = 0, ranks=None, dtype: str = "auto") -> None:
        from learner.model import resolve_dtype

        if threads:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.ranks = ranks  # serve/ranks.py Ranks, or None: one process
        if ranks is None:
            self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
            self.dtype = resolve_dtype(dtype, self.device)
            self.base = load_model(model_path, dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        else:
            from learner.model import build_policy

            self.device = ranks.device
            self.dtype = resolve_dtype(dtype, self.device)
            self.base, _ = build_policy(model_path, None, ranks.mesh, self.device, self.dtype)
        self.vocab = self.base.get_output_embeddings().weight.shape[0]
        self.pad = pad_id(self.base.config)
        self.kinds = linear_kinds(self.base)  # before PEFT adds linear layers of its own
        self.peft = None  # the PEFT model, made with the first adapter
        self.specs: dict[str, LoraSpec] = {}
        self.choices: dict[str, LoraChoice] = {}
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.steps: dict[str, int] = {}

    @property
    def world(self) -> int:
        return 1 if self.ranks is None else self.ranks.world

    def _lead(self, op: str, **args) -> None:
        """Rank 0: send call `op` to the other ranks (nothing with one rank, or on the others)."""
        if self.ranks is not None and self.ranks.rank == 0:
            self.ranks.lead(op, args)

    def apply(self, op: str, args: dict) -> None:
        """Ranks 1..N-1: run call `op` as rank 0 sent it (serve/ranks.py `follow`)."""
        from serve.wire import decode_data

        if op == "create":
            self._create(args["name"], LoraChoice(**args["choice"]), args["seed"])
        elif op == "delete":
            self.delete(args["name"])
        elif op == "forward_backward":
            self._forward_backward(args["name"], decode_data(args["data"]), args["loss"], args["config"],
                                   args["forward_only"])
        elif op == "optim_step":
            self._optim_step(args["name"], args["adam"])
        elif op == "load":
            self._load(args["name"], Path(args["path"]), args["optimizer"])
        else:
            raise ValueError(f"unknown call {op!r} from rank 0")

    def _collective(self, op: str, run, **args):
        """Send `op` and run it here: an error after the others have it leaves the ranks out of
        step, so with several ranks it stops the service (Ranks.fail) besides failing the call."""
        self._lead(op, **args)
        try:
            return run()
        except Exception as exc:
            if self.world > 1:
                self.ranks.fail(f"{op} failed on rank 0 after the other ranks began it: {type(exc).__name__}: {exc}")
            raise

    def close(self) -> None:
        """Rank 0: the other ranks stop and the group ends."""
        if self.ranks is not None and self.ranks.rank == 0:
            self.ranks.lead("stop", {})
            self.ranks.close(clean=True)

    # -- adapters ---------------------------------------------------------------
    def create(self, name: str, choice: LoraChoice) -> None:
        """A fresh adapter `name` (A Kaiming-uniform drawn from `choice.seed`, B zero) and its optimizer."""
        if choice.rank < 1:
            raise UserError(f"LoRA rank must be at least 1, got {choice.rank}")
        target_modules(self.kinds, choice)  # refused here, before any rank moves
        seed = choice.seed
        if seed is None and self.world > 1:  # every rank must draw the same adapter
            seed = int(torch.randint(0, 2**62, ()))
        self._lead("create", name=name, choice=choice.to_dict(), seed=seed)
        self._create(name, choice, seed)

    def _create(self, name: str, choice: LoraChoice, seed: int | None) -> None:
        from peft import get_peft_model

        spec = LoraSpec(rank=choice.rank, alpha=LORA_ALPHA, target_modules=target_modules(self.kinds, choice))
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, spec.peft_config(), adapter_name=name)
            else:
                self.peft.add_adapter(name, spec.peft_config())
        self.specs[name], self.choices[name] = spec, choice
        self._new_optimizer(name)
        self.steps[name] = 0

    def _new_optimizer(self, name: str) -> None:
        self.optimizers[name] = torch.optim.AdamW(self._params(name), lr=0.0, betas=(0.9, 0.95), eps=1e-12,
                                                  weight_decay=0.0)

    def delete(self, name: str) -> None:
        """Free adapter `name`: its LoRA layers, optimizer state and step count (a finished session's)."""
        import warnings

        if name not in self.specs:
            return
        self._lead("delete", name=name)
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
        """The adapter's tensors under PEFT's state-dict names (a copy, on the CPU)."""
        from peft import get_peft_model_state_dict

        # From the adapter's parameters, not the model's state_dict(): under FSDP that would run its
        # hooks on this rank alone.
        params = {n: p for n, p in self.peft.named_parameters() if f".{name}." in n}
        state = get_peft_model_state_dict(self.peft, state_dict=params, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    # -- training ---------------------------------------------------------------
    def _check(self, data, loss: str) -> None:
        """Refuse data this loss cannot train on (UserError), before any rank moves."""
        if not data:
            raise UserError("forward_backward got no data")
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
            missing = [k for k in INPUTS[loss][1:] if k not in d.inputs
                       and not (loss == "cross_entropy" and k == "weights")]
            if missing:
                raise UserError(f"datum {i}: {loss} needs loss_fn_inputs {missing}")

    def _batch(self, data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        """inputs, targets, attention [b, T] (right-padded, on the device) and each datum's inputs."""
        width = max(len(d.tokens) for d in data)
        inputs = torch.full((len(data), width), self.pad, dtype=torch.long)
        targets = torch.zeros((len(data), width), dtype=torch.long)
        attention = torch.zeros((len(data), width), dtype=torch.long)
        per_datum = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            inputs[i, :n] = torch.tensor(d.tokens, dtype=torch.long)
            targets[i, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            attention[i, :n] = 1
            per_datum.append({k: torch.from_numpy(v.astype(np.float32)).to(self.device) for k, v in d.inputs.items()
                              if k != "target_tokens"})
        return inputs.to(self.device), targets.to(self.device), attention.to(self.device), per_datum

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head for learner/logprobs.py: under FSDP its weight is the root unit's,
        unsharded first (a no-op while it is), as the FSDP learner's `_head` does."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.base, FSDPModule):
            self.base.unshard()
        return self.peft.get_output_embeddings()(hidden)

    def _reshard(self) -> None:
        """Under FSDP, end a call with every unit sharded (the root stays gathered after its forward
        otherwise): each rank then starts the next call in the same state, whatever ran between."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.base, FSDPModule):
            self.base.reshard()

    def forward_backward(self, name: str, data, loss: str, config: dict, forward_only: bool):
        """Per datum its target tokens' log-probs [N], and the metrics {"loss:sum"}; without
        `forward_only` the loss's gradient is added to the adapter's."""
        from serve.wire import encode_data

        try:
            loss_fn(loss, config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if name not in self.specs:
            raise UserError(f"no model {name!r} on this service")
        self._check(data, loss)
        return self._collective("forward_backward", lambda: self._forward_backward(name, data, loss, config, forward_only),
                                name=name, data=encode_data(data) if self.world > 1 else [], loss=loss,
                                config=config, forward_only=forward_only)

    def _rows(self, n: int) -> list[int]:
        """This rank's datums of `n`: a contiguous share."""
        if self.ranks is None:
            return list(range(n))
        return [int(i) for i in np.array_split(np.arange(n), self.world)[self.ranks.rank]]

    def _forward_backward(self, name: str, data, loss: str, config: dict, forward_only: bool):
        from serve.wire import Datum

        fn = loss_fn(loss, config)
        self._activate(name)
        rows = self._rows(len(data))
        # A rank with no datum still runs one forward (FSDP's gathers are collectives): a stand-in, loss 0.
        local = [data[i] for i in rows] or [Datum([self.pad], {"target_tokens": np.zeros(1, dtype=np.int64)})]
        inputs, targets, attention, per_datum = self._batch(local)
        self.peft.train()
        with torch.set_grad_enabled(not forward_only):
            logp = target_logprobs(self.peft, inputs, targets, attention, head=self._head).float()  # [b, T]
            total = logp.sum() * 0.0
            for j in range(len(rows)):
                n = len(local[j].tokens)
                datum_loss, _ = fn(logp[j, :n], per_datum[j], config)
                total = total + datum_loss
            if not forward_only:
                total.backward()
        self._reshard()
        logp, total = logp.detach().cpu(), total.detach().cpu().reshape(1)
        if self.world == 1:
            return [logp[i, :len(d.tokens)].numpy() for i, d in enumerate(data)], {"loss:sum": float(total)}
        width = max(len(d.tokens) for d in data)
        full = torch.zeros((len(data), width + 1), dtype=torch.float32)  # the last column: the rank's loss
        for j, i in enumerate(rows):
            full[i, :len(data[i].tokens)] = logp[j, :len(data[i].tokens)]
        full[0, width] = total[0]
        self.ranks.sum(full)
        return ([full[i, :len(d.tokens)].numpy() for i, d in enumerate(data)],
                {"loss:sum": float(full[0, width])})

    def optim_step(self, name: str, adam: dict) -> dict[str, float]:
        """One AdamW step of the adapter with this call's parameters (learning_rate, beta1, beta2,
        eps, weight_decay, grad_clip_norm), then its gradients are zeroed."""
        if name not in self.specs:
            raise UserError(f"no model {name!r} on this service")
        adam_params(adam)  # refused here, before any rank moves
        return self._collective("optim_step", lambda: self._optim_step(name, adam), name=name, adam=adam)

    def _optim_step(self, name: str, adam: dict) -> dict[str, float]:
        import torch.distributed as dist

        self._activate(name)
        opt = self.optimizers[name]
        lr, betas, eps, wd, clip = adam_params(adam)
        for group in opt.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        params = self._params(name)
        if self.world > 1:  # the ranks' gradients summed in one collective: the sum over every datum
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for p, g in zip(params, flat.split([g.numel() for g in grads])):
                p.grad = g.view_as(p).clone()
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps[name] += 1
        return {"grad_norm:mean": float(norm)}

    # -- state on disk ----------------------------------------------------------
    def save(self, name: str, path: Path, optimizer: bool, base_model: str) -> None:
        """The adapter (policy/adapter.py's format), the API's LoRA config and, with `optimizer`,
        the optimizer's state, in the directory `path` (rank 0's copy: every rank's is the same)."""
        write_adapter(path, self.tensors(name), self.specs[name], base_model, self.steps[name])
        meta = {"lora": self.choices[name].to_dict(), "step": self.steps[name], "optimizer": optimizer}
        if optimizer:
            torch.save(self.optimizers[name].state_dict(), path / "optimizer.pt")
        (path / "tinker.json").write_text(json.dumps(meta, indent=2))

    def load(self, name: str, path: Path, optimizer: bool) -> None:
        """Adapter `name` (created here if new) from the directory `path`, with its optimizer's
        state when `optimizer` (UserError if the checkpoint has none). Every rank reads the files."""
        self._lead("load", name=name, path=str(path), optimizer=optimizer)
        self._load(name, path, optimizer)

    def _load(self, name: str, path: Path, optimizer: bool) -> None:
        from peft import set_peft_model_state_dict

        meta = json.loads((path / "tinker.json").read_text())
        if optimizer and not meta.get("optimizer"):
            raise UserError(f"{path.name} was saved without optimizer state (save_weights_for_sampler "
                            "saves weights only; save_state saves both)")
        adapter = read_adapter(path)
        choice = LoraChoice(**meta["lora"])
        if name in self.specs and adapter.lora_spec().rank != self.specs[name].rank:
            raise UserError(f"the checkpoint has LoRA rank {adapter.lora_spec().rank}, the model "
                            f"{self.specs[name].rank}")
        if name not in self.specs:
            self._create(name, choice, choice.seed)
        tensors = {k: v.to(self.device) for k, v in adapter.tensors.items()}
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=name)
        if list(result.unexpected_keys):
            raise UserError(f"the checkpoint adapts layers this model's adapter lacks: {result.unexpected_keys[:3]}")
        self._new_optimizer(name)
        if optimizer:
            self.optimizers[name].load_state_dict(torch.load(path / "optimizer.pt", weights_only=True,
                                                             map_location=self.device))
        self.steps[name] = int(meta.get("step", 0))

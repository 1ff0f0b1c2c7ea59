"""The GPU memory arithmetic of vLLM engines (actors/gpu_memory.py): engines sharing a GPU, an
engine beside a colocated learner, its wake, and the lock that starts engines one at a time.
Pure arithmetic and a real lock file; the same checks on a real GPU: bench/gpu_check.py."""

import fcntl

import pytest

from actors.gpu_memory import (CONTEXT_BYTES, GIB, check_room_beside, check_shared_fraction, check_start_beside,
                               check_wake, fits_awake, largest_fraction, largest_shared_fraction, lock_path, one_at_a_time)


def test_engines_sharing_a_gpu_leave_room_for_each_cuda_context():
    # 0.5 of an 80 GiB GPU is 40 GiB; the context's 1 GiB leaves 39 GiB = 0.4875 of it: 0.48
    assert largest_shared_fraction(0.5, 80 * GIB) == 0.48
    assert largest_shared_fraction(0.25, 24 * GIB) == 0.20  # 0.25 - 1/24 = 0.2083
    for total in (16 * GIB, 24 * GIB, 80 * GIB, 141 * GIB):
        for share in (0.5, 0.25, 1 / 3):
            fraction = largest_shared_fraction(share, total)
            engines = round(1 / share)
            assert engines * (fraction * total + CONTEXT_BYTES) <= total  # they all fit, contexts counted
            check_shared_fraction(fraction, share, total)


def test_a_fraction_equal_to_the_share_is_refused_with_the_fraction_that_fits():
    with pytest.raises(ValueError, match=r"--actor.memory-fraction 0.5 with --actor.gpus 0.5 on a GPU of 80.0 GiB.*"
                                         r"set --actor.memory-fraction 0.48 or less"):
        check_shared_fraction(0.5, 0.5, 80 * GIB)
    check_shared_fraction(0.45, 0.5, 80 * GIB)  # the README's example fits
    check_shared_fraction(0.95, 1.0, 80 * GIB)  # a whole GPU: vLLM's own check decides


def test_an_engine_beside_a_learner_gets_what_the_rank_leaves_less_its_context():
    # 80 GiB GPU, the learner rank holds 30 GiB and contexts take 1: 49 GiB free for the engine's
    # process, 48 after its context = 0.6 of the GPU
    free = 49 * GIB
    assert largest_fraction(free, 80 * GIB) == 0.6
    check_start_beside(0.6, free, 80 * GIB, held=30 * GIB)
    with pytest.raises(ValueError, match=r"--actor.memory-fraction 0.85 beside the learner rank: the GPU has 80.0 "
                                         r"GiB, the rank holds 30.0 GiB and 49.0 GiB are free.*set "
                                         r"--actor.memory-fraction 0.6 or less"):
        check_start_beside(0.85, free, 80 * GIB, held=30 * GIB)
    with pytest.raises(ValueError, match="the learner leaves no room for an engine: use more --learners"):
        check_start_beside(0.1, GIB // 2, 80 * GIB, held=79 * GIB)


def test_the_room_beside_a_model_is_measured_after_the_cache_is_emptied(monkeypatch):
    """The allocator's cache holds 20 GiB the rank no longer uses: vLLM needs them free, so they are
    returned before the free memory is read (the CUDA calls stand in for a GPU this machine lacks)."""
    import torch

    gpu = {"free": 29 * GIB, "cached": 20 * GIB}

    def empty_cache():
        gpu["free"] += gpu.pop("cached", 0)

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gpu["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * GIB)
    check_room_beside(0.6, "cuda:0")  # 49 GiB free after emptying: 0.6 fits
    with pytest.raises(ValueError, match=r"--actor.memory-fraction 0.85 beside the learner rank.*0.6 or less"):
        check_room_beside(0.85, "cuda:0")


def test_a_wake_that_does_not_fit_stops_with_what_to_lower():
    check_wake(free=50 * GIB, needed=50 * GIB, held=20 * GIB, total=80 * GIB, fraction=0.6)
    # 8 GiB short of 80: 0.1 of the GPU, and 0.01 more for the rounding: 0.6 - 0.1 - 0.01
    with pytest.raises(RuntimeError, match=r"needs 50.0 GiB to wake, but 42.0 GiB of the GPU's 80.0 GiB are free "
                                           r"while the learner rank holds 28.0 GiB.*to 0.49 or less"):
        check_wake(free=42 * GIB, needed=50 * GIB, held=28 * GIB, total=80 * GIB, fraction=0.6)


def test_a_colocated_engine_stays_awake_only_where_it_fits_beside_the_learner_s_step():
    """--actor.sleep auto (launch/colocate.py): after the first step, with the engine asleep and the
    learner's cache emptied, the engine stays awake from then on when what it holds awake, the
    step's growth over what the rank keeps and a twentieth of the GPU fit in what is free."""
    total = 141 * GIB  # an H200
    # 8 FSDP ranks of an 8B model: the rank keeps 6 GiB, its step peaks at 30 GiB, 134 GiB are free;
    # the engine holds 60 GiB awake: 60 + 24 + 7.05 = 91.05 GiB fit
    assert fits_awake(60 * GIB, peak=30 * GIB, held=6 * GIB, free=134 * GIB, total=total)
    # one rank holding the whole model: 40 GiB kept, the step peaks at 90, 100 GiB are free: 60 + 50 + 7.05 do not
    assert not fits_awake(60 * GIB, peak=90 * GIB, held=40 * GIB, free=100 * GIB, total=total)
    # right at the edge: the margin decides (80 GiB GPU: 4 GiB margin)
    assert fits_awake(30 * GIB, peak=20 * GIB, held=10 * GIB, free=44 * GIB, total=80 * GIB)
    assert not fits_awake(30 * GIB, peak=20 * GIB, held=10 * GIB, free=44 * GIB - 1, total=80 * GIB)
    assert fits_awake(30 * GIB, peak=5 * GIB, held=10 * GIB, free=34 * GIB, total=80 * GIB)  # no growth: no negative room


def test_engines_on_one_gpu_take_its_lock_one_at_a_time(tmp_path):
    path = lock_path("3,1", str(tmp_path))
    assert path == str(tmp_path / "tandem-gpu-3.lock")
    assert lock_path("GPU-5f1c2a90-aa", str(tmp_path)).endswith("tandem-gpu-GPU-5f1c2a90-aa.lock")
    assert lock_path(None) is None and lock_path("") is None
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES names a device as '../x'"):
        lock_path("../x")
    with one_at_a_time(path):
        with open(path) as other:  # another engine's open file: flock excludes it, in any process
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the engine has started
    with one_at_a_time(None):  # no GPU named: nothing to hold
        pass


@pytest.mark.slow
@pytest.mark.gpu
def test_two_engines_started_at_once_share_a_gpu_with_the_fraction_tandem_allows(tiny_model, chat):
    """On a GPU: an engine asking for its whole share is refused before vLLM starts; two engines
    at the largest fraction that fits start together (one after the other, by the GPU's lock)."""
    import threading

    import torch

    pytest.importorskip("vllm")
    from actors.engine import SamplingParams
    from actors.engines import make_engine
    from policy.load import LoraSpec

    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(ValueError, match="more than its share"):
        make_engine("vllm", tiny_model, LoraSpec(rank=8), device="cuda", memory_fraction=0.5, gpu_share=0.5)
    fraction = largest_shared_fraction(0.5, total)
    engines, errors = [None, None], []

    def start(i):
        try:
            engines[i] = make_engine("vllm", tiny_model, LoraSpec(rank=8), device="cuda", seed=i, gpu_share=0.5,
                                     memory_fraction=fraction, max_model_len=1024, enforce_eager=True)
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        prompt = chat.prompt_ids([{"role": "user", "content": "start"}])
        for e in engines:
            assert e.generate([prompt], SamplingParams(4, chat.stop_ids, 0.7))[0].tokens
    finally:
        for e in engines:
            if e is not None:
                e.close()

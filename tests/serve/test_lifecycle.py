"""Finished sessions free their clients; a missing seq_id is not waited for forever.

A session ends at `sessions/{id}/finish` (the SDK's `with ServiceClient()` exit) or when it goes
silent; its training clients' adapters and optimizer state and its sampling sessions are then
freed. A request held behind a seq_id that never comes fails after `--seq-wait-s`, naming it."""

import time

import httpx
import numpy as np
import pytest
from tinker import types

from serve.service import Service
from serve.trainer import LoraChoice, UserError
from tests.serve.conftest import KEY, start_service


def post(served, path, **kw):
    return httpx.post(served.url + "/api/v1/" + path, headers={"X-API-Key": KEY}, timeout=60, **kw)


def health(served) -> dict:
    return httpx.get(served.url + "/api/v1/healthz", headers={"X-API-Key": KEY}, timeout=60).json()


def datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)})


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """A service of its own: a missing seq_id is waited for 2 s here (300 s by default)."""
    s = start_service(tiny_model, tmp_path_factory.mktemp("lifecycle"), "--poll-s", "2", "--seq-wait-s", "2")
    yield s
    s.stop()


def test_finish_frees_adapters_optimizers_and_samplers(served, tiny_model):
    with served.client() as client:
        first = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=0)
        second = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=1)
        first.forward_backward([datum([5, 6, 7, 8])], "cross_entropy").result()
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        first.save_weights_and_get_sampling_client()
        held = health(served)
        assert (held["training_clients"], held["adapters"], held["optimizers"]) == (2, 2, 2), held
        assert held["sampling_sessions"] == 1 and held["live_sessions"] == 1, held
        model_id = first.model_id
        assert second.get_info().lora_rank == 8
    for _ in range(600):  # the free runs on the worker after the session's queued requests
        after = health(served)
        if after["training_clients"] == 0:
            break
        time.sleep(0.2)
    assert after == {"status": "ok", "live_sessions": 0, "training_clients": 0, "adapters": 0, "optimizers": 0,
                     "sampling_sessions": 0}, after
    late = post(served, "optim_step", json={"model_id": model_id, "seq_id": 99, "type": "optim_step",
                                            "adam_params": {"learning_rate": 0.01}})
    assert late.status_code == 400 and "session has finished" in late.json()["error"], late.text


def test_a_missing_seq_id_fails_the_requests_behind_it(served, tiny_model):
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=2)

        def step(seq):  # seq_id 1 (the SDK's next) is never sent
            r = post(served, "optim_step", json={"model_id": tc.model_id, "seq_id": seq, "type": "optim_step",
                                                 "adam_params": {"learning_rate": 0.01}})
            assert r.status_code == 200, r.text
            for _ in range(300):
                done = post(served, "retrieve_future", json={"request_id": r.json()["request_id"]})
                if done.status_code != 408:
                    return done.json()
            raise AssertionError(f"request seq_id {seq} still pending")

        refused = step(3)
        assert refused["category"] == "user" and "seq_id 1 of model" in refused["error"], refused
        assert "never arrived" in refused["error"] and "[3]" in refused["error"], refused
        assert "metrics" in step(4)  # the model goes on after the gap
        late = post(served, "optim_step", json={"model_id": tc.model_id, "seq_id": 1, "type": "optim_step",
                                                "adam_params": {"learning_rate": 0.01}})
        assert late.status_code == 400 and "below its next one" in late.json()["error"], late.text


def test_a_silent_session_is_finished_and_freed(tiny_model, tmp_path):
    service = Service(tiny_model, "builtin:tiny", tmp_path, threads=1, session_timeout_s=600)
    try:
        silent, alive = service.create_session(), service.create_session()
        for sid in (silent, alive):
            service.futures[service.submit(service.create_model_job(sid, 0, LoraChoice(rank=4)))].result()
        gone = f"{silent}:train:0"
        service.add_sampler(f"{silent}:sample:0", None, service.snapshot(gone))
        later = time.time() + 601  # the reaper's clock, moved on; `alive` heartbeats just then
        service.sessions[alive]["heartbeat"] = later
        service.reap(now=later)
        service.futures[service.submit(lambda: None)].result()  # after the free the reap queued
        assert service.sessions[silent]["finished"] == "heartbeat timeout"
        assert service.sessions[alive]["finished"] is None
        assert list(service.models) == [f"{alive}:train:0"] and service.samplers == {}
        assert len(service.trainer.specs) == len(service.trainer.optimizers) == 1
        with pytest.raises(UserError, match="heartbeat timeout"):
            service.model(gone)
        with pytest.raises(UserError, match="has finished"):
            service.live(silent)
    finally:
        service.close()


def test_results_are_kept_for_a_while_then_dropped_with_their_retry_keys(tiny_model, tmp_path):
    """A result is kept `keep_s` after it finishes, 60 s after its first retrieval; dropping it
    drops the keys a retry would find it by (a model's seq_ids, creation keys)."""
    service = Service(tiny_model, "builtin:tiny", tmp_path, threads=1, keep_s=600)
    try:
        sid = service.create_session()
        create = service.submit(service.create_model_job(sid, 0, LoraChoice(rank=4)), key=("create", sid, 0))
        service.futures[create].result()
        model_id = f"{sid}:train:0"
        step = service.submit_ordered(model_id, 1, lambda: {"stepped": True})
        assert service.futures[step].result() == {"stepped": True}
        service.retrieved(create)  # handed to the client; `step` never was
        now = time.time()
        service.sessions[sid]["heartbeat"] = now + 601  # the session stays alive throughout
        service.reap(now=now + 61)
        assert create not in service.futures and step in service.futures
        assert service.submit(lambda: None, key=("create", sid, 0)) != create  # its key went with it
        assert service.model(model_id).seen == {1: step}
        service.reap(now=now + 601)
        assert step not in service.futures and service.model(model_id).seen == {}
        with pytest.raises(UserError, match="below its next one"):  # a retry of seq_id 1 now: refused as old
            service.submit_ordered(model_id, 1, lambda: None)
    finally:
        service.close()


def test_a_sampling_session_unused_for_the_session_timeout_is_freed(tiny_model, tmp_path):
    service = Service(tiny_model, "builtin:tiny", tmp_path, threads=1, session_timeout_s=600)
    try:
        sid = service.create_session()
        service.futures[service.submit(service.create_model_job(sid, 0, LoraChoice(rank=4)))].result()
        for k in range(2):  # the RL loop's sampler a step, each a snapshot of the weights
            service.add_sampler(f"{sid}:sample:{k}", None, service.snapshot(f"{sid}:train:0"))
        now = time.time()
        service.samplers[f"{sid}:sample:1"].last_used = now + 500  # still in use
        service.sessions[sid]["heartbeat"] = now + 601
        service.reap(now=now + 601)
        assert list(service.samplers) == [f"{sid}:sample:1"]
        with pytest.raises(UserError, match="unused for 600 s"):
            service.sampling(f"{sid}:sample:0")
        assert service.sampling(f"{sid}:sample:1").last_used >= now
    finally:
        service.close()


def test_retrieving_a_request_that_is_unknown_or_dropped_says_why(served):
    r = post(served, "retrieve_future", json={"request_id": "0" * 32})
    assert r.status_code == 404 and "results are kept 600 s" in r.json()["error"], r.text

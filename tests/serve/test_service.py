"""The service skeleton through the real SDK and raw HTTP: capabilities, sessions, heartbeats and
finish, the API key, futures (408 while pending), per-model seq_id order and retried requests,
bad input refused with the service alive."""

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.serve.conftest import KEY


def post(served, path, key=KEY, headers=None, **kw):
    return httpx.post(served.url + "/api/v1/" + path, headers={"X-API-Key": key, **(headers or {})}, timeout=30, **kw)


def datum(tokens, targets, weights=None):
    inputs = {"target_tokens": np.asarray(targets, dtype=np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs=inputs)


def test_capabilities_session_and_finish(served, tiny_model):
    caps = tinker.RestClient(base_url=served.url, api_key=KEY).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert tiny_model in names and all(m.trainable and m.sampleable for m in caps.supported_models)
    with served.client() as client:  # exits through sessions/{id}/finish
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=0).result()
        assert tc.get_info().model_data.tokenizer_id == tiny_model
        assert tc.get_tokenizer().encode("ab")  # the tokenizer loads from the served directory
        session = client.holder.get_session_id()
        assert post(served, "session_heartbeat", json={"session_id": session}).status_code == 200
    gone = post(served, "session_heartbeat", json={"session_id": session})
    assert gone.status_code == 410, gone.text  # the SDK stops its heartbeat loop on 410


def test_api_key_is_required(served):
    for key in ("", "tml-wrong"):
        r = post(served, "create_session", key=key, json={"tags": [], "user_metadata": None, "sdk_version": "x"})
        assert r.status_code == 401 and r.json()["category"] == "user"
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=served.url, api_key="tml-wrong").create_lora_training_client(
            base_model="x", rank=1).result()


def test_seq_order_pending_future_and_retry(served, tiny_model):
    with served.client() as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=1).result()

        def body(seq):
            req = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=[datum([5, 6, 7], [6, 7, 8])],
                                                                  loss_fn="cross_entropy"),
                model_id=tc.model_id, seq_id=seq)
            return forward_backward_request_to_proto(req).SerializeToString()

        headers = {"Content-Type": "application/x-protobuf"}
        second = post(served, "forward_backward", content=body(2), headers=headers).json()
        again = post(served, "forward_backward", content=body(2), headers=headers).json()
        assert again["request_id"] == second["request_id"]  # a retried request is the same request
        pending = post(served, "retrieve_future", json={"request_id": second["request_id"]})
        assert pending.status_code == 408 and pending.json()["queue_state"] == "active"  # held for seq 1
        step = post(served, "optim_step", json={"model_id": tc.model_id, "seq_id": 1, "type": "optim_step",
                                                "adam_params": {"learning_rate": 0.01}}).json()
        done = post(served, "retrieve_future", json={"request_id": step["request_id"]})
        assert done.status_code == 200 and "metrics" in done.json()
        result = post(served, "retrieve_future", json={"request_id": second["request_id"]},
                      headers={"Accept": "application/x-protobuf"})
        assert result.headers["content-type"] == "application/x-protobuf"
        assert post(served, "retrieve_future", json={"request_id": "nope"}).status_code == 404


def test_bad_input_is_refused_and_the_service_goes_on(served, tiny_model):
    bad = {
        "token outside the vocabulary": ([datum([5, 6, 100000], [6, 7, 8])], "cross_entropy", None),
        "mismatched lengths": ([datum([5, 6, 7], [6, 7])], "cross_entropy", None),
        "unknown loss": ([datum([5, 6, 7], [6, 7, 8])], "cispo", None),
        "ppo without advantages": ([datum([5, 6, 7], [6, 7, 8])], "ppo", None),
        "unread config": ([datum([5, 6, 7], [6, 7, 8])], "cross_entropy", {"clip_low_threshold": 0.5}),
    }
    with served.client() as client:
        for what, (data, loss, config) in bad.items():
            tc = client.create_lora_training_client(base_model=tiny_model, rank=4).result()
            with pytest.raises(tinker.RequestFailedError) as err:
                tc.forward_backward(data, loss, config).result()
            assert err.value.category == types.RequestErrorCategory.User, what
        with pytest.raises(tinker.BadRequestError):
            client.create_lora_training_client(base_model="not/served", rank=4).result()
        malformed = post(served, "forward_backward", content=b"\xff\xff not a protobuf",
                         headers={"Content-Type": "application/x-protobuf"})
        assert malformed.status_code == 400 and malformed.json()["category"] == "user"
        assert post(served, "optim_step", content=b"{").status_code == 400
        huge = post(served, "create_session", content=b"x" * (2 << 20))  # the test service takes 1 MiB
        assert huge.status_code == 413
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4).result()
        out = tc.forward_backward([datum([5, 6, 7], [6, 7, 8])], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])

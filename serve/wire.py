"""The Tinker API's protobuf bodies: forward_backward requests in, forward_backward and sample
results out.

The schema is the SDK's own (`tinker.proto.tinker_public_pb2`, installed with the `tinker` extra),
never a copy, so a schema change in the SDK shows up here as a failing test rather than as bytes
silently read by an old layout. Everything else the API sends is JSON, validated with the SDK's
pydantic request types (serve/app.py).

A request's tensors are checked as they are decoded: dense only, float32 / int64 (the public
dtypes), one dimension whose length matches the datum's tokens. A body that breaks any of these
is a `WireError`, which the service answers as a user error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinker.proto import tinker_public_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that is not a well-formed request: the caller's error, with what is wrong."""


@dataclass
class Datum:
    tokens: list[int]
    """The model input: the token ids of its text chunks, in order."""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """`loss_fn_inputs` by name, each 1-D."""


def encode_data(data: list[Datum]) -> list[dict]:
    """Datums as msgpack-able maps (arrays as dtype and raw bytes), for the learner ranks' control
    group (serve/ranks.py)."""
    return [{"tokens": [int(t) for t in d.tokens],
             "inputs": {k: [np.asarray(v).dtype.str, np.ascontiguousarray(v).tobytes()] for k, v in d.inputs.items()}}
            for d in data]


def decode_data(maps: list[dict]) -> list[Datum]:
    """`encode_data`'s maps back as Datums."""
    return [Datum(m["tokens"], {k: np.frombuffer(raw, dtype=np.dtype(dtype)) for k, (dtype, raw) in m["inputs"].items()})
            for m in maps]


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(name: str, t: pb.Tensor) -> np.ndarray:
    if t.HasField("sparse_csr"):
        raise WireError(f"loss_fn_inputs[{name!r}] is a sparse tensor; this service takes dense ones")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}] has dtype {t.dtype}; send float32 or int64")
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise WireError(f"loss_fn_inputs[{name!r}]: {len(t.dense)} bytes is no whole number of {np.dtype(dtype)}")
    array = np.frombuffer(t.dense, dtype=dtype)
    shape = list(t.shape)
    if shape and shape != [array.size]:
        raise WireError(f"loss_fn_inputs[{name!r}] has shape {shape}; this service takes 1-D [N] tensors "
                        f"({array.size} values were sent)")
    return array


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """The request in `body` (the SDK's ForwardBackwardRequest); WireError for a malformed one."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its DecodeError and others
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # v2 supersedes the float-only map
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: a model_input chunk of kind {kind!r}; this service takes "
                                "encoded_text (token) chunks only")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise WireError(f"datum {i}: encoded_text tokens are not whole int32 values")
            tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
        inputs = {name: _tensor(name, t) for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """The SDK's ForwardBackwardOutput: per datum its target tokens' log-probs ("logprobs", float32
    [N]) in one ArrayRecord, and the metrics (each key named "<name>:<reduction>")."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    tensor = record.fields["logprobs"]
    tensor.data = b"".join(a.tobytes() for a in arrays)
    tensor.offsets = offsets.tobytes()
    tensor.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True when a stop token or string ended it; False when it reached max_tokens."""


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """The SDK's SampleResponse: each sequence's tokens, their sampled log-probs and why it
    ended; the prompt's log-probs (NaN where there is none: position 0) when asked for."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()

"""Wire types: round trips, and decoding that rejects what does not follow the schema."""

import msgpack
import numpy as np
import pytest

from replay.wire import (MAX_IMAGE_SIDE, MAX_IMAGES, WireError, decode_group, encode_group, group_blob,
                         group_parts, pack, unpack)

from tests.replay.helpers import (IMAGE_SHAPES, assert_same_images, bad_image_blobs, frame, make_group, make_image_group,
                                  with_turn_states)


def test_group_round_trip_is_exact():
    g = make_group(version=3, seed=1)
    back = decode_group(bytes(encode_group(g)))
    assert back.group_id == g.group_id and back.version == g.version == 3
    for a, b in zip(g.trajectories, back.trajectories):
        for f in ("tokens", "logprobs", "mask", "versions"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert (a.reward, a.turns, a.finish_reason, a.version) == (b.reward, b.turns, b.finish_reason, b.version)


def test_a_trajectory_without_model_tokens_has_the_version_it_started_under():
    """An environment that failed before the first turn leaves only observation tokens; their
    version is the episode's, on the trajectory as in the group replay checks (not 0)."""
    g = make_group(version=3, seed=1)
    t = g.trajectories[0]
    t.mask[:] = 0
    assert t.version == 3
    back = decode_group(bytes(encode_group(g)))
    assert back.trajectories[0].version == back.version == 3


def test_decoded_arrays_are_views_of_the_blob():
    blob = encode_group(make_group(seed=2))
    back = decode_group(memoryview(blob))
    assert not back.trajectories[0].tokens.flags.writeable
    assert np.shares_memory(back.trajectories[0].tokens, np.frombuffer(blob, np.uint8))


def test_a_multi_turn_image_group_round_trips_exactly_as_views_of_the_blob():
    g = make_image_group(seed=4)
    blob = encode_group(g)
    header, payload = group_parts(blob)
    assert header["images"] == [[list(s) for s in shapes] for shapes in IMAGE_SHAPES]
    n = sum(len(t.tokens) for t in g.trajectories)
    pixels = b"".join(image.tobytes() for t in g.trajectories for image in t.images)
    assert bytes(payload[13 * n:]) == pixels  # after the token arrays, row-major H×W×3, in order
    back = decode_group(memoryview(blob))
    assert_same_images(g, back)
    assert [len(t.images) for t in back.trajectories] == [3, 0, 1, 2]
    assert all(np.shares_memory(image, np.frombuffer(blob, np.uint8)) for image in back.trajectories[0].images)
    for a, b in zip(g.trajectories, back.trajectories):
        for f in ("tokens", "logprobs", "mask", "versions"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert bytes(encode_group(back)) == bytes(blob)


def test_a_group_without_images_is_the_blob_it_was_before_images():
    """No image shapes in the header, the token arrays alone in the payload: blobs written before
    images existed decode exactly as they did, and text groups are still written that way."""
    g = make_group(seed=5)
    header = {"v": 1, "group_id": g.group_id, "task": g.task, "actor": g.actor, "meta": {},
              "lens": [40] * 4, "rewards": [t.reward for t in g.trajectories], "turns": [3] * 4,
              "finish": ["terminated"] * 4}
    payload = b"".join(np.concatenate([getattr(t, f) for t in g.trajectories]).tobytes()
                       for f in ("tokens", "versions", "logprobs", "mask"))
    old = frame(header, payload)
    assert bytes(encode_group(g)) == old
    back = decode_group(old)
    assert all(t.images == [] for t in back.trajectories) and back.version == g.version
    for a, b in zip(g.trajectories, back.trajectories):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    assert decode_group(frame({**header, "images": [[], [], [], []]}, payload)).trajectories[0].images == []


def test_each_turns_state_and_reward_round_trip_exactly():
    g = with_turn_states(make_group(seed=6))
    blob = encode_group(g)
    header, _ = group_parts(blob)
    assert header["anchors"][1] == [1, (1 << 63) - 1, 7] and header["turn_rewards"][3] == [0.0, -0.5, 3.0]
    back = decode_group(memoryview(blob))
    for a, b in zip(g.trajectories, back.trajectories):
        assert (a.anchors, a.turn_rewards) == (b.anchors, b.turn_rewards)
    assert bytes(encode_group(back)) == bytes(blob)
    plain = decode_group(encode_group(make_group(seed=6)))  # not recorded: absent, and empty lists
    assert all(t.anchors == [] and t.turn_rewards == [] for t in plain.trajectories)


@pytest.mark.parametrize("image, message", [
    (np.zeros((4, 4, 3), np.float32), "uint8 array"),
    (np.zeros((4, 4), np.uint8), "uint8 array"),
    (np.zeros((4, 4, 4), np.uint8), "uint8 array"),
    (np.zeros((4, 4, 3), np.int64), "uint8 array"),
    ([[[0, 0, 0]]], "got list"),
    (np.zeros((0, 4, 3), np.uint8), "each side must be 1 to"),
    (np.zeros((1, MAX_IMAGE_SIDE + 1, 3), np.uint8), "each side must be 1 to"),
])
def test_encoding_refuses_an_image_that_is_not_uint8_rgb_within_the_bounds(image, message):
    g = make_image_group()
    g.trajectories[3].images.insert(1, image)
    with pytest.raises(WireError, match=f"trajectory 3's image 1 .*{message}"):
        encode_group(g)


def test_encoding_refuses_too_many_images_and_a_group_over_the_frame_cap():
    g = make_image_group()
    g.trajectories[1].images = [np.zeros((1, 1, 3), np.uint8)] * (MAX_IMAGES + 1)
    with pytest.raises(WireError, match=f"trajectory 1 has {MAX_IMAGES + 1} images"):
        encode_group(g)
    side = MAX_IMAGE_SIDE
    g.trajectories[1].images = [np.zeros((side, side, 3), np.uint8)] * 2  # 96 MiB of pixels
    with pytest.raises(WireError, match="exceeds the"):
        encode_group(g, alloc=lambda n: pytest.fail("allocated a blob over the cap"))


@pytest.mark.parametrize("case", range(len(bad_image_blobs())))
def test_malformed_image_groups_are_rejected(case):
    blob, message = bad_image_blobs()[case]
    with pytest.raises(WireError, match=message):
        decode_group(blob)


def corrupt(mutate_header=None, mutate_payload=None, group=None) -> bytes:
    """A valid group blob (of `group`, else `make_group()`) with its header or payload changed."""
    header, payload = group_parts(encode_group(group or make_group()))
    payload = bytearray(payload)
    if mutate_header:
        mutate_header(header)
    if mutate_payload:
        mutate_payload(payload)
    n = len(payload) // 13
    blob = group_blob(header, n)
    blob[len(blob) - len(payload):] = payload
    return bytes(blob)


def _set(view, dtype, field_index, value, n):
    offset = [0, 4 * n, 8 * n, 12 * n][field_index]
    np.frombuffer(view, dtype, count=n, offset=offset)[0] = value


@pytest.mark.parametrize("blob, message", [
    (lambda: corrupt(lambda h: h["lens"].__setitem__(0, 999)), "payload length"),
    (lambda: corrupt(lambda h: h["rewards"].__setitem__(0, float("nan"))), "finite"),
    (lambda: corrupt(lambda h: h["finish"].__setitem__(0, "exploded")), "finish reason"),
    (lambda: corrupt(lambda h: h["meta"].update(outcome_spread=float("inf"))), "outcome_spread"),
    (lambda: corrupt(lambda h: h["meta"].update(outcome_spread=-1.0)), "outcome_spread"),
    (lambda: corrupt(lambda h: h.pop("turns")), "turns"),
    (lambda: corrupt(lambda h: h["turns"].pop()), "'turns' has 3 entries for 4"),
    (lambda: corrupt(lambda h: h.update(lens=[], rewards=[], turns=[], finish=[])), "trajectories"),
    (lambda: corrupt(lambda h: h["anchors"][2].pop(), group=with_turn_states(make_group())),
     "trajectory 2 has 3 turns but 2 anchors and 3 turn rewards"),
    (lambda: corrupt(lambda h: h["turn_rewards"][0].__setitem__(1, float("inf")), group=with_turn_states(make_group())),
     "turn rewards must be finite"),
    (lambda: corrupt(lambda h: h["anchors"][0].__setitem__(0, -1), group=with_turn_states(make_group())), "anchors"),
    (lambda: corrupt(lambda h: h.pop("turn_rewards"), group=with_turn_states(make_group())),
     "one entry per trajectory"),
    (lambda: corrupt(lambda h: h.update(group_id="")), "group_id"),
    (lambda: corrupt(lambda h: h.update(v=99)), "schema"),
    (lambda: corrupt(mutate_payload=lambda p: _set(p, "<i4", 0, -5, len(p) // 13)), "negative token"),
    (lambda: corrupt(mutate_payload=lambda p: _set(p, "<i4", 1, -1, len(p) // 13)), "versions"),
    (lambda: corrupt(mutate_payload=lambda p: _set(p, "<f4", 2, float("nan"), len(p) // 13)), "log-probs"),
    (lambda: corrupt(mutate_payload=lambda p: _set(p, "<f4", 2, 3.0, len(p) // 13)), "log-probs"),
    (lambda: corrupt(mutate_payload=lambda p: _set(p, "u1", 3, 2, len(p) // 13)), "mask"),
    (lambda: bytes(encode_group(make_group()))[:-1], "payload length"),
    (lambda: b"TGRP\xff\xff\xff\x00" + b"x" * 10, "header length"),
    (lambda: msgpack.packb({"v": 1, "group_id": "g"}), "magic"),
    (lambda: b"", "too short"),
])
def test_malformed_groups_are_rejected(blob, message):
    with pytest.raises(WireError, match=message):
        decode_group(blob())


def test_frames_outside_the_schema_are_rejected():
    with pytest.raises(WireError):
        unpack(b"\xc1\x00garbage")
    with pytest.raises(WireError, match="schema"):
        unpack(msgpack.packb({"v": 99, "type": "push"}))
    with pytest.raises(WireError, match="unexpected"):
        unpack(pack("shutdown"), ("push",))
    with pytest.raises(WireError, match="cap"):
        unpack(b"\x00" * (64 << 20) + b"\x00")


def test_no_pickle_anywhere_on_the_wire():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    for part in ("replay", "actors", "learner", "launch", "envs", "policy"):
        for path in (root / part).rglob("*.py"):
            assert not re.search(r"^\s*(import pickle|from pickle|import cloudpickle)", path.read_text(), re.M), path


def test_requests_decode_to_their_typed_struct_and_bad_fields_name_the_field_and_request_id():
    from replay.messages import Credit, Sample, decode_request
    from replay.wire import pack_parts

    req, blobs = decode_request(pack_parts("sample", id=7, step=1, rank=0, version=2, acked=[[0, 0]]))
    assert isinstance(req, Sample) and (req.id, req.step, req.acked, blobs) == (7, 1, [(0, 0)], [])
    assert isinstance(decode_request(pack_parts("credit", id=1, actor="a", n=3))[0], Credit)
    for fields, name in [({"type": "credit", "actor": "a", "n": 0}, "n"),
                         ({"type": "credit", "actor": "", "n": 1}, "actor"),
                         ({"type": "sample", "step": -1, "rank": 0, "version": 0}, "step"),
                         ({"type": "sample", "step": 0, "rank": 0, "version": 0, "acked": [[0, 0]] * 65}, "acked"),
                         ({"type": "shutdown"}, "type")]:
        header = msgpack.packb({"v": 1, "id": 9, "blobs": 0, **fields})
        with pytest.raises(WireError, match=name) as info:
            decode_request([header])
        assert info.value.id == 9
    with pytest.raises(WireError, match="blob count"):
        decode_request(pack_parts("push", [b"x"])[:1])


def test_replies_decode_to_their_typed_struct_and_bad_ones_are_refused():
    from replay.messages import Batch, Granted, decode_reply
    from replay.wire import pack_parts

    reply, blobs = decode_reply(pack_parts("batch", [b"g"], id=4, epoch="e", step=0, version=1,
                                           refs=[None, ["arena", 4096, 10]]))
    assert isinstance(reply, Batch) and reply.refs == [None, ("arena", 4096, 10)] and blobs == [b"g"]
    assert decode_reply(pack_parts("credit", versions=[0, 1]))[0] == Granted(v=1, versions=[0, 1])
    for fields, name in [({"type": "credit", "versions": [-1]}, "versions"),
                         ({"type": "acks", "acks": [[1]]}, "acks"),
                         ({"type": "batch", "step": 0, "version": 0, "refs": [["a", -1, 1]]}, "refs"),
                         ({"type": "pickle"}, "type")]:
        with pytest.raises(WireError, match=name):
            decode_reply([msgpack.packb({"v": 1, "blobs": 0, **fields})])

"""Wire types: round trips, and decoding that rejects what does not follow the schema."""

import msgpack
import numpy as np
import pytest

from replay.wire import Group, WireError, pack, unpack

from tests.replay.helpers import make_group


def test_group_round_trip_is_exact():
    g = make_group(version=3, seed=1)
    frame = pack("push", id=1, group=g.to_wire())
    back = Group.from_wire(unpack(frame)["group"])
    assert back.group_id == g.group_id and back.version == 3
    for a, b in zip(g.trajectories, back.trajectories):
        for f in ("tokens", "logprobs", "mask", "versions"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert (a.reward, a.turns, a.finish_reason) == (b.reward, b.turns, b.finish_reason)


def corrupt(mutate):
    obj = make_group().to_wire()
    mutate(obj)
    return obj


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o["trajectories"][0]["tokens"].update(n=999), "length"),
    (lambda o: o["trajectories"][0]["mask"].update(dtype="float32"), "dtype"),
    (lambda o: o["trajectories"][0].update(reward=float("nan")), "finite"),
    (lambda o: o["trajectories"][0].update(finish_reason="exploded"), "finish reason"),
    (lambda o: o["trajectories"][0].pop("turns"), "turns"),
    (lambda o: o.update(trajectories=[]), "trajectories"),
    (lambda o: o.update(group_id=""), "group_id"),
    (lambda o: o["trajectories"][0].update(tokens=b"raw"), "array"),
])
def test_malformed_groups_are_rejected(mutate, message):
    with pytest.raises(WireError, match=message):
        Group.from_wire(corrupt(mutate))


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

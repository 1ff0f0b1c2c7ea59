"""The SDK's RestClient against the service: training runs with their last checkpoints, the
checkpoint listings (paths that load back, still listed by a service restarted over the same
files), deletion, weights info, sessions, and bad ids and paths refused with the service going on."""

import json
import shutil
import time

import pytest
import tinker
from tinker import types

from tests.serve.conftest import KEY, start_service
from tests.serve.test_training import DATA, step

META = {"renderer_name": "role_colon", "purpose": "rest-test"}


@pytest.fixture(scope="module")
def run(served, tiny_model):
    """A live session whose training client saved two states and one sampler checkpoint."""
    with served.client(user_metadata={"who": "test_runs"}) as client:
        tc = client.create_lora_training_client(base_model=tiny_model, rank=4, seed=3, user_metadata=META).result()
        step(tc, DATA)
        first = tc.save_state("first").result().path
        sampler = tc.save_weights_for_sampler("first").result().path
        step(tc, DATA)
        second = tc.save_state("second").result().path
        yield {"client": client, "tc": tc, "id": tc.model_id, "session": client.holder.get_session_id(),
               "first": first, "sampler": sampler, "second": second}


def rest(served) -> tinker.RestClient:
    return tinker.RestClient(base_url=served.url, api_key=KEY)


def all_pages(call, limit: int) -> list:
    items, offset = [], 0
    while True:
        page = call(limit=limit, offset=offset).result()
        got = page.training_runs if hasattr(page, "training_runs") else page.checkpoints
        items.extend(got)
        assert page.cursor.offset == offset and page.cursor.limit == limit
        offset += limit
        if offset >= page.cursor.total_count:
            return items


def test_training_run_with_its_last_checkpoints(served, run, tiny_model):
    r = rest(served)
    got = r.get_training_run(run["id"]).result()
    assert (got.training_run_id, got.base_model, got.is_lora, got.lora_rank) == (run["id"], tiny_model, True, 4)
    assert got.model_owner == run["session"] and got.user_metadata == META and not got.corrupted
    assert got.last_checkpoint.tinker_path == run["second"] and got.last_checkpoint.checkpoint_type == "training"
    assert got.last_sampler_checkpoint.tinker_path == run["sampler"]
    assert got.last_sampler_checkpoint.checkpoint_type == "sampler"
    assert r.get_training_run_by_tinker_path(run["sampler"]).result() == got
    with pytest.warns(FutureWarning):  # the cookbook's way in: ServiceClient.create_rest_client()
        by_path = run["client"].create_rest_client().get_training_run_by_tinker_path(run["first"]).result()
    assert by_path.user_metadata["renderer_name"] == "role_colon"
    listed = r.list_training_runs(limit=100).result()
    assert run["id"] in [t.training_run_id for t in listed.training_runs]
    assert listed.cursor.total_count == len(listed.training_runs)
    paged = all_pages(r.list_training_runs, limit=1)
    assert [t.training_run_id for t in paged] == [t.training_run_id for t in listed.training_runs]


def test_checkpoints_are_listed_and_load_back(served, run):
    r = rest(served)
    listed = r.list_checkpoints(run["id"]).result().checkpoints
    assert [c.tinker_path for c in listed] == [run["second"], run["sampler"], run["first"]]  # newest first
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("weights/second", "training"), ("sampler_weights/first", "sampler"), ("weights/first", "training")]
    assert all(c.size_bytes > 0 for c in listed)
    assert listed[1].size_bytes < listed[2].size_bytes  # sampler weights hold no optimizer state
    everyone = all_pages(r.list_user_checkpoints, limit=2)
    assert [c.tinker_path for c in everyone] == [c.tinker_path for c in r.list_user_checkpoints().result().checkpoints]
    assert [c for c in everyone if c.tinker_path.startswith(f"tinker://{run['id']}/")] == listed
    client = run["client"]
    loaded = client.create_training_client_from_state_with_optimizer(run["first"]).result()
    assert loaded.get_info().lora_rank == 4
    sampled = client.create_sampling_client(model_path=run["sampler"]).result().sample(
        types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, stop=[])).result()
    assert len(sampled.sequences[0].tokens) == 3


def test_weights_info(served, run, tiny_model):
    info = rest(served).get_weights_info_by_tinker_path(run["sampler"]).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (tiny_model, True, 4)
    assert info.train_mlp and info.train_attn and info.train_unembed


def test_sessions(served, run, tiny_model):
    r = rest(served)
    before = r.get_session(run["session"]).result().sampler_ids
    run["client"].create_sampling_client(model_path=run["sampler"]).result()
    assert run["session"] in r.list_sessions(limit=100).result().sessions
    got = r.get_session(run["session"]).result()
    assert run["id"] in got.training_run_ids and got.user_metadata == {"who": "test_runs"}
    (new,) = set(got.sampler_ids) - set(before)
    assert new.startswith(f"{run['session']}:sample:") and r.get_sampler(new).result().model_path == run["sampler"]
    with served.client() as other:
        tc = other.create_lora_training_client(base_model=tiny_model, rank=2).result()
        newest = r.list_sessions(limit=1).result().sessions
        assert newest == [other.holder.get_session_id()]
        assert r.get_session(newest[0]).result().training_run_ids == [tc.model_id]


def test_delete_removes_and_loads_then_fail(served, run):
    r, client, tc = rest(served), run["client"], run["tc"]
    state = tc.save_state("doomed").result().path
    weights = tc.save_weights_for_sampler("doomed").result().path
    folder = served.logdir / "checkpoints" / run["id"] / "weights" / "doomed"
    assert folder.is_dir()
    r.delete_checkpoint(run["id"], "weights/doomed").result()
    r.delete_checkpoint_from_tinker_path(weights).result()
    assert not folder.exists()
    paths = [c.tinker_path for c in r.list_checkpoints(run["id"]).result().checkpoints]
    assert state not in paths and weights not in paths and run["first"] in paths
    assert state not in [c.tinker_path for c in r.list_user_checkpoints().result().checkpoints]
    with pytest.raises(tinker.RequestFailedError, match="was deleted"):
        client.create_training_client_from_state(state).result()
    with pytest.raises(tinker.NotFoundError, match="was deleted"):
        client.create_sampling_client(model_path=weights).result()
    with pytest.raises(tinker.NotFoundError, match="already deleted"):
        r.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        r.delete_checkpoint(run["id"], "weights/never-saved").result()
    assert tc.save_state("doomed").result().path == state  # the name can be saved again
    assert state in [c.tinker_path for c in r.list_checkpoints(run["id"]).result().checkpoints]
    r.delete_checkpoint_from_tinker_path(state).result()


def test_bad_ids_and_paths_are_refused(served, run):
    r = rest(served)
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        r.get_training_run("session-nobody:train:0").result()
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        r.list_checkpoints("session-nobody:train:0").result()
    with pytest.raises(ValueError):  # refused by the SDK before it sends anything
        r.get_training_run_by_tinker_path("runs/tinker/weights/x")
    with pytest.raises(tinker.BadRequestError, match="not tinker://"):
        r.get_weights_info_by_tinker_path("tinker://../weights/x").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint at"):  # another service's logdir
        r.get_weights_info_by_tinker_path("tinker://session-elsewhere:train:0/weights/final").result()
    with pytest.raises(tinker.NotFoundError, match="no session"):
        r.get_session("session-nobody").result()
    for call in (lambda: r.list_training_runs(limit=-1), lambda: r.list_user_checkpoints(offset=-1),
                 lambda: r.list_sessions(limit=-5)):
        with pytest.raises(tinker.BadRequestError, match="at least 0"):
            call().result()
    with pytest.raises(tinker.BadRequestError, match="projects are not served"):
        r.list_training_runs(project_id="p-1").result()
    with pytest.raises(tinker.BadRequestError, match="weights|sampler_weights"):
        r.delete_checkpoint(run["id"], "first").result()
    for cloud_only in (lambda: r.publish_checkpoint_from_tinker_path(run["first"]),
                       lambda: r.unpublish_checkpoint_from_tinker_path(run["first"]),
                       lambda: r.set_checkpoint_ttl_from_tinker_path(run["first"], 7200)):
        with pytest.raises(tinker.NotFoundError, match="not served by Tandem"):
            cloud_only().result()
    assert len(r.list_checkpoints(run["id"]).result().checkpoints) >= 3  # still serving; nothing deleted


def test_a_restarted_service_lists_what_was_saved(served, run, tiny_model, tmp_path):
    """A second service over a copy of the first's logdir (files as a restart finds them)."""
    r = rest(served)
    gone = run["tc"].save_weights_for_sampler("gone").result().path
    r.delete_checkpoint_from_tinker_path(gone).result()
    before = r.list_checkpoints(run["id"]).result().checkpoints
    run_before = r.get_training_run(run["id"]).result()
    times = served.logdir / "last_requests.json"  # written by the service every few seconds
    deadline = time.monotonic() + 30
    while not (times.is_file() and abs(json.loads(times.read_text()).get(run["id"], 0.0)
                                       - run_before.last_request_time.timestamp()) < 1e-3):
        assert time.monotonic() < deadline, "last_requests.json never held the run's last request"
        time.sleep(0.2)
    logdir = tmp_path / "restarted"
    shutil.copytree(served.logdir, logdir, ignore=shutil.ignore_patterns("*.log"))
    again = start_service(tiny_model, logdir)
    try:
        r2 = rest(again)
        assert r2.list_checkpoints(run["id"]).result().checkpoints == before
        assert run["id"] in [t.training_run_id for t in r2.list_training_runs(limit=100).result().training_runs]
        got = r2.get_training_run(run["id"]).result()
        assert (got.last_checkpoint, got.last_sampler_checkpoint) == (run_before.last_checkpoint,
                                                                       run_before.last_sampler_checkpoint)
        assert got.user_metadata == META and got.base_model == tiny_model
        assert got.last_request_time == run_before.last_request_time
        session = r2.get_session(run["session"]).result()
        assert run["id"] in session.training_run_ids and session.user_metadata == {"who": "test_runs"}
        assert run["session"] in r2.list_sessions(limit=100).result().sessions
        with again.client() as client:
            assert client.create_training_client_from_state_with_optimizer(run["second"]).result()
            with pytest.raises(tinker.NotFoundError, match="was deleted"):
                client.create_sampling_client(model_path=gone).result()
    finally:
        again.stop()

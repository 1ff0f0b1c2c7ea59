"""Shared fixtures. Tests run on CPU, one torch thread per process (the suite shares 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in any process a test starts shows its stacks

import pytest  # noqa: E402


@pytest.fixture
def closing():
    """Register things (sockets, publishers, subscribers) to close when the test ends, last first."""
    things = []
    yield things.append
    for thing in reversed(things):
        thing.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A freshly initialised built-in tiny policy in Hugging Face format."""
    import torch

    from policy.tiny import save_tiny

    torch.set_num_threads(1)
    return str(save_tiny(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def chat(tiny_model):
    from policy import Chat, load_tokenizer

    return Chat(load_tokenizer(tiny_model))


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    """A freshly initialised built-in tiny vision-language policy (Idefics3) in Hugging Face format."""
    import torch

    from policy.tiny import save_tiny_vlm

    torch.set_num_threads(1)
    return str(save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "model"))


@pytest.fixture(scope="session")
def vlm_chat(tiny_vlm):
    from policy.load import load_chat

    return load_chat(tiny_vlm)


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_vl(request, tmp_path_factory) -> str:
    """A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL with random weights in Hugging Face format (tests/policy/qwen_vl.py)."""
    import torch

    from tests.policy.qwen_vl import save_qwen_vl

    torch.set_num_threads(1)
    return str(save_qwen_vl(tmp_path_factory.mktemp(request.param) / "model", request.param))


@pytest.fixture(scope="session")
def qwen_vl_chat(qwen_vl):
    from policy.load import load_chat

    return load_chat(qwen_vl)


def pytest_configure(config):
    from policy.compat import check_torchvision

    try:
        check_torchvision()
    except RuntimeError as exc:
        pytest.exit(str(exc), returncode=2)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)

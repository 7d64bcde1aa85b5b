import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Notebook kernels and CLI subprocesses inherit this: one thread each, like the test workers (one_thread below), so
# two workers on two cores never oversubscribe them (oversubscribed torch threads slow tiny models down several-fold).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Only package registries are reachable here: the hub's clients (notebook 03's kk.load_hf) then fail at once instead of
# retrying for ~25 s, and fall back to the bundled data.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REFERENCE_KK = Path(__file__).resolve().parent / "fixtures" / "kk_reference"


@pytest.fixture(scope="session")
def reference_kk() -> Path:
    """The real K&K records bundled with the tests (tests/fixtures/kk_reference: source and licence in its README)."""
    assert (REFERENCE_KK / "test").is_dir(), f"the K&K test fixture is missing: {REFERENCE_KK}"
    return REFERENCE_KK


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and CI runs two test workers on two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 policy and its tokenizer saved as a local model folder (what load_policy reads)."""
    from tiny import tiny_qwen2, tiny_tokenizer

    tok = tiny_tokenizer()
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_qwen2(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture()
def tiny_model(tokenizer):
    from tiny import tiny_qwen2

    return tiny_qwen2(len(tokenizer))

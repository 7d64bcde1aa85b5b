import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHARED_KK = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kk"


@pytest.fixture(scope="session")
def shared_kk() -> Path:
    """The real K&K records beside the checkout (../shared/reference/kk); tests that need them skip loudly if absent."""
    if not SHARED_KK.is_dir():
        pytest.skip(f"reference K&K records not found at {SHARED_KK}")
    return SHARED_KK


@pytest.fixture(scope="session")
def tokenizer():
    from tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture()
def tiny_model(tokenizer):
    from tiny import tiny_qwen2

    return tiny_qwen2(len(tokenizer))

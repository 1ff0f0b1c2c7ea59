import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def root():
    """A sandbox root the sandbox's uid can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="tandem-test-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)

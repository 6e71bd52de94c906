"""Test-suite settings.

Tiny random-weight models gain nothing from intra-op threads, and OpenMP
threads spinning on a shared 2-core machine make them up to 30x slower, so
tests run torch single-threaded unless a test asks for more (`torch_threads`).
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def torch_threads():
    """Use every core for the duration of a test (tests on the embedded model)."""
    before = torch.get_num_threads()
    import os

    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)

import os

import pytest
import torch


# Leantrain reads LEANTRAIN_* at patch time; a developer's shell must not leak into the tests.
for _name in [n for n in os.environ if n.startswith("LEANTRAIN_")]:
    del os.environ[_name]

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

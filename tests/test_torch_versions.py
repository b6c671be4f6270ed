"""kvt on the newest torch this machine has on disk: .ci/run installs torch 2.13.0 (the CPU wheel README pins),
while requirements.txt admits up to 2.15; this long check runs the method's own tests (the models against
transformers, the fast twins, statistics, the mapper, the handoff) again under torch 2.14.1 in a second
environment, so a change that breaks on today's torch fails CI. (torch 2.15.0, from the registry only, was
run by hand: docs/measurements.md, "Versions".)"""
import subprocess

import pytest

from conftest import run_pytest, second_venv

NEWEST_ON_DISK = "2.14.1"     # this machine's pip constraints cap torch at it; its wheels lie in the local index
METHOD_TESTS = ["tests/test_models.py", "tests/test_rope.py", "tests/test_fast.py", "tests/test_stats.py",
                "tests/test_mapper.py", "tests/test_handoff.py", "tests/test_ridge.py"]


@pytest.mark.slow
def test_the_method_on_the_newest_torch_on_disk(tmp_path):
    """Guards: a torch API kvt leans on changing under it (scaled_dot_product_attention's enable_gqa, the
    safetensors loader's dtypes, torch.linalg's eigh on float64) while CI tests only the pinned 2.13.
    About 4 minutes on 2 cores, most of it installing torch."""
    py = second_venv(tmp_path, f"torch=={NEWEST_ON_DISK}")
    version = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    assert version.startswith(NEWEST_ON_DISK), f"the second environment runs torch {version}"
    run_pytest(py, *METHOD_TESTS)

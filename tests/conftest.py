"""Shared by every test layer. ``tome`` and ``tome_harness`` are installed (editable) by scripts/setup.sh; the
commands in scripts/ that tests import are on the path through pytest's ``pythonpath`` (pyproject.toml).

The default run (``bash scripts/test.sh``) leaves out the tests marked ``slow``; ``bash scripts/test.sh --full``
and CI run them too. Mark a test of your own with ``@pytest.mark.slow``; the heaviest tests of files that do
not mark their own are listed in SLOW below.
"""

import pytest

# Each starts ComfyUI again (a second, third or fourth server), loads the full-size SDXL U-Net (about 10 GB) or
# runs a benchmark in fresh processes that each boot ComfyUI.
SLOW = (
    "tests/comfy/test_sdxl_workflow.py::",
    "tests/comfy/test_bench_smoke.py::test_gpu_table_smoke_runs_on_the_cpu",
    "tests/comfy/test_bench_smoke.py::test_memory_children_see_tome_shrink_attention_and_fail_cleanly_over_a_cap",
    "tests/server/test_client.py::test_a_batch_of_seeds_spreads_over_two_workers_and_a_rerun_skips_it",
    "tests/server/test_client.py::test_a_worker_stopped_mid_batch_has_its_job_done_by_the_other",
    "tests/server/test_client.py::test_a_worker_frozen_mid_job_is_dropped_and_its_job_done_by_the_other",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)

"""Shared by every test layer. ``tome`` and ``tome_harness`` are installed (editable) by scripts/setup.sh; the
commands in scripts/ that tests import are on the path through pytest's ``pythonpath`` (pyproject.toml).

The default run (``bash scripts/test.sh``) leaves out the tests marked ``slow``; ``bash scripts/test.sh --full``
and CI run them too. Mark a test of your own with ``@pytest.mark.slow``; the heaviest tests of files that do
not mark their own are listed in SLOW below.
"""

import pytest

# Each starts ComfyUI again (a second, third or fourth server), loads the full-size SDXL U-Net (about 10 GB),
# runs a benchmark in fresh processes that each boot ComfyUI, samples several SD1.5 graphs through the server, or
# counts the host reads of SDXL's sampling runs (10-80 s each here; the default run keeps one graph of each node,
# the client's basic runs, and the host reads of SD1.5, Flux and Wan).
SLOW = (
    "tests/comfy/test_bench_smoke.py::test_sampler_bench_runs_every_variant",
    "tests/server/test_client_ui.py::test_a_ui_workflow_runs_through_the_client",
    "tests/server/test_client.py::test_ab_runs_per_job_and_records_both_times",
    "tests/server/test_client.py::test_prompts_and_seeds_make_every_pair",
    "tests/server/test_server.py::test_ab_mode_prints_both_times_and_the_difference",
    "tests/server/test_server.py::test_every_sd15_api_workflow_runs_and_saves_an_image[sd15_hires_fix_tome.json]",
    "tests/server/test_server.py::test_every_sd15_api_workflow_runs_and_saves_an_image[sd15_ab_tome.json]",
    "tests/comfy/test_sdxl_workflow.py::",
    "tests/comfy/test_host_reads.py::test_a_node_reads_the_host_at_most_once_per_model_call_and_never_blocks[SDXL-",
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

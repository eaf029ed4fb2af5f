"""A sampling step that never waits on the GPU: what each node adds to a model call, counted on the CPU.

A host read (``float()``, ``.item()``, ``.tolist()``, ``nonzero``) or a blocking
copy makes a GPU's host wait for every queued kernel. Our code may read the
sigma once per model call (never per block or attention call), the run's
schedule in the first call's read where plans are kept across steps; it
makes no blocking copy; and a U-Net block's merge costs no more operators
than tomesd's merge of the same tokens. The
operator counts per model call are held as ceilings (today's counts): a change
that adds operators to every call has to raise them, and say so.
"""

import pytest
import torch

from tome_harness import host_reads

# Host reads per model call, and the most operators per model call, that each node adds (bench/host_reads_bench.py
# prints the table; docs/BENCHMARKS.md "Host reads per model call" has the counts before issue 58 beside them).
# reuse_steps (Advanced) reads the run's schedule in its first call's sigma read, no read of its own; so does the
# token cache (every block, 3 steps, the first 2 whole). DiTs' merged and average-pooled keys keep their lengths
# (tome.norms). share_matching makes one matching per model call and grid.
EXPECTED = {
    ("SD1.5", "Apply ToMe"): (1, 217), ("SD1.5", "Apply ToMe (Advanced)"): (1, 108),
    ("SD1.5", "Apply ToMe (widest scope)"): (1, 257), ("SD1.5", "Apply ToMe (share_matching)"): (1, 61),
    ("SD1.5", "Apply ToDo"): (0, 25), ("SD1.5", "Apply ToDo (average)"): (0, 25),
    ("SDXL", "Apply ToMe"): (1, 432), ("SDXL", "Apply ToMe (Advanced)"): (1, 213),
    ("SDXL", "Apply ToMe (widest scope)"): (1, 512), ("SDXL", "Apply ToMe (share_matching)"): (1, 81),
    ("SDXL", "Apply ToDo"): (0, 50), ("SDXL", "Apply ToDo (average)"): (0, 50),
    ("Flux", "Apply ToMe"): (1, 167), ("Flux", "Apply ToMe (Advanced)"): (1, 112),
    ("Flux", "Apply ToMe (share_matching)"): (1, 117),
    ("Flux", "Apply ToMe (block)"): (1, 122), ("Flux", "Apply ToMe (block, share_matching)"): (1, 82),
    ("Flux", "Apply ToMe (token cache)"): (1, 69),
    ("Flux", "Apply ToDo"): (0, 31), ("Flux", "Apply ToDo (average)"): (0, 41), ("Flux", "Apply ToDo (block)"): (0, 52),
    ("Wan 2.1", "Apply ToMe"): (1, 150), ("Wan 2.1", "Apply ToMe (Advanced)"): (1, 101),
    ("Wan 2.1", "Apply ToMe (share_matching)"): (1, 107),
    ("Wan 2.1", "Apply ToMe (block)"): (1, 135), ("Wan 2.1", "Apply ToMe (block, share_matching)"): (1, 95),
    ("Wan 2.1", "Apply ToMe (token cache)"): (1, 66),
    ("Wan 2.1", "Apply ToDo"): (0, 20), ("Wan 2.1", "Apply ToDo (average)"): (0, 34),
    ("Wan 2.1", "Apply ToDo (block)"): (0, 49),
}


@pytest.fixture(scope="module")
def base_models(comfy_nodes):
    """Each counted model, built once for the module."""
    return {name: host_reads.build_model(name) for name in host_reads.MODELS}


@pytest.mark.parametrize("name,node", list(EXPECTED))
def test_a_node_reads_the_host_at_most_once_per_model_call_and_never_blocks(comfy_nodes, pack, base_models, name,
                                                                            node):
    base = base_models[name]
    host_reads.count_sampling(comfy_nodes, host_reads.patched(pack.models, base, node), name)  # first-run work
    plain = host_reads.count_sampling(comfy_nodes, base, name)
    ours = host_reads.count_sampling(comfy_nodes, host_reads.patched(pack.models, base, node), name)
    added = ours.counts - plain.counts
    reads_per_call, max_ops_per_call = EXPECTED[name, node]
    assert ours.model_calls == host_reads.STEPS
    assert added.host_reads == reads_per_call * ours.model_calls, added.ops
    assert added.blocking_copies == 0, added.ops
    assert added.n_ops <= max_ops_per_call * ours.model_calls, added.ops


def test_a_blocks_merge_costs_no_more_operators_than_tomesds_and_reads_nothing(pack, sd15):
    tokens = torch.randn(2, 1024, 32, generator=torch.Generator().manual_seed(0))
    model = pack.unet.apply_tome(sd15, ratio=0.5)
    call = pack.comfyui.ModelCall(torch.tensor([5.0]))
    call.sigma()  # read once by the model call's first block; this block finds it read
    ours = host_reads.block_merge_counts(model, tokens, (32, 32), model_call={pack.comfyui.CALL_KEY: call})
    theirs = host_reads.tomesd_block_merge_counts(tokens, (32, 32))
    assert (ours.host_reads, ours.blocking_copies) == (0, 0), ours.ops
    assert ours.n_ops <= theirs.n_ops, (ours.ops, theirs.ops)


def test_the_blocks_of_one_model_call_share_one_sigma_read(pack, sd15):
    """Outside our wrapper every block would read the sigma itself; inside, the first read serves them all."""
    model = pack.unet.apply_tome(sd15, ratio=0.5)
    tokens = torch.randn(2, 1024, 32, generator=torch.Generator().manual_seed(0))
    call = pack.comfyui.ModelCall(torch.tensor([5.0, 5.0]))
    reads = [host_reads.block_merge_counts(model, tokens, (32, 32), model_call={pack.comfyui.CALL_KEY: call})
             .host_reads for _ in range(3)]
    alone = host_reads.block_merge_counts(model, tokens, (32, 32)).host_reads
    assert (reads, alone) == ([1, 0, 0], 1)

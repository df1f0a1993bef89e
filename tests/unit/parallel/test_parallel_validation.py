"""A bad layout is refused before any collective, with a message naming the key and the fix."""

import pytest

from triax.errors import ConfigError
from triax.parallel.mesh import Layout, padded_vocab_size, resolve_layout, validate_layout
from triax.testing import run_torchrun

GPT = dict(n_layer=4, n_head=4, block_size=16, batch_size=8)


def check(layout, **kwargs):
    validate_layout(layout, **{**GPT, **kwargs})


def test_minus_one_fills_the_rest():
    assert resolve_layout(-1, 2, 1, 1, 8) == Layout(pp=1, dp_replicate=4, dp_shard=2, tp=1)
    assert resolve_layout(1, -1, 2, 2, 8) == Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2)


@pytest.mark.parametrize("degrees, world, message", [
    ((1, 2, 2, 1), 2, "multiply to 4 but the job has 2"),
    ((-1, -1, 1, 1), 4, "only one parallel degree may take the remaining processes"),
    ((-1, 1, 3, 1), 4, r"not divisible by 3 \(dp_shard=1 x tp=3 x pp=1\)"),
    ((1, 0, 1, 1), 1, "parallel.dp_shard=0 is invalid"),
])
def test_bad_degrees(degrees, world, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve_layout(*degrees, world)
    assert "=-1" not in str(error.value)  # dp_replicate's default, which the user may never have written


@pytest.mark.parametrize("layout, kwargs, message", [
    (Layout(tp=3), {}, r"parallel.tp=3 does not divide model.n_head=4"),
    (Layout(tp=4), {"block_size": 18, "n_head": 8}, r"does not divide the sequence length 18"),
    (Layout(pp=8), {}, r"parallel.pp=8 needs 8 pipeline stages but the model has only 4 layers"),
    (Layout(pp=4), {"pp_schedule": "interleaved_1f1b"}, r"needs 8 pipeline stages but the model has only 4"),
    (Layout(pp=2), {"pp_microbatches": 3}, r"pp_microbatches=3 does not divide trainer.batch_size=8"),
    (Layout(pp=4), {"pp_microbatches": 2, "pp_schedule": "1f1b"}, r"1f1b needs at least pp=4 micro-batches"),
    (Layout(pp=2), {"pp_microbatches": 1, "pp_schedule": "zero_bubble"}, r"zero_bubble needs a multiple of pp=2"),
    (Layout(pp=2), {"pp_schedule": "dualpipe"}, r"pp_schedule='dualpipe' is unknown"),
    (Layout(pp=2), {"grad_accum": 2}, r"grad_accum=2 is not used with parallel.pp > 1"),
    (Layout(pp=2), {"pp_balance": [3, 2]}, r"pp_balance=\[3, 2\] must give 2 positive layer counts"),
    (Layout(pp=2), {"tie_embeddings": True}, r"tie_embeddings=true is not supported with parallel.pp"),
    (Layout(), {"activation_checkpointing": "some"}, r"activation_checkpointing='some' is unknown"),
])
def test_bad_layouts(layout, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check(layout, **kwargs)


@pytest.mark.parametrize("ep, degrees, model, message", [
    (3, dict(dp_shard=6), {}, "parallel.ep=3 does not divide model.num_experts=4"),
    (2, dict(dp_shard=3), {}, "parallel.ep=2 does not divide parallel.dp_shard=3"),
    (2, dict(dp_shard=2, dp_replicate=2), {}, r"composes with parallel.dp_shard only \(got dp_replicate=2, "
                                              r"dp_shard=2, ep=2\)"),
    (2, dict(dp_shard=2, tp=2), {}, "composes with parallel.dp_shard only"),
    (2, dict(dp_shard=2), dict(arch="qwen3", num_experts=0), "which has no experts"),
    (2, dict(dp_shard=2), dict(cpu_offload=True), "not with parallel.cpu_offload=true"),
    (0, dict(), {}, "parallel.ep=0 must be a positive integer"),
    (-1, dict(), {}, "parallel.ep=-1 must be a positive integer"),
])
def test_expert_parallelism_is_validated_with_the_other_degrees(ep, degrees, model, message):
    given = {**dict(dp_replicate=1, dp_shard=1, tp=1, pp=1), **degrees}
    world = given["dp_replicate"] * given["dp_shard"] * given["tp"]
    with pytest.raises(ConfigError, match=message):
        layout = resolve_layout(given["dp_replicate"], given["dp_shard"], given["tp"], given["pp"], world, ep=ep)
        check(layout, **{**dict(arch="mixtral", num_experts=4), **model})


def test_expert_parallelism_is_a_degree_of_the_layout():
    layout = resolve_layout(1, -1, 1, 1, 4, ep=2)
    assert layout == Layout(dp_replicate=1, dp_shard=4, ep=2)
    assert layout.world_size == 4 and layout.dp == 4  # ep borrows dp_shard's ranks: it widens nothing
    assert layout.describe() == "dp_shard=4, ep=2"
    assert Layout(dp_shard=2, cp=2, tp=2).describe() == "dp_shard=2, cp=2, tp=2"
    check(layout, arch="mixtral", num_experts=4)


def test_vocabulary_is_padded_to_a_multiple_of_tp():
    assert padded_vocab_size(65, 1) == 65
    assert padded_vocab_size(65, 2) == 66
    assert padded_vocab_size(65, 4) == 68


@pytest.mark.multiprocess
def test_every_rank_reports_a_bad_layout_and_none_hangs(tmp_path):
    # tp=4 on 2 processes: each rank must report the one-line error and exit, within seconds. Rank 0
    # prints it; a rank leaves it in torchrun's error file, which torchrun's summary shows. torchrun
    # stops the other ranks (SIGTERM, exit code -15) as soon as the first one fails, so on a loaded
    # machine a rank still importing is stopped before it reaches the check: that rank did not hang
    # either, and it is counted as stopped rather than as reporting.
    result = run_torchrun(2, ["-m", "triax", "train", "parallel.tp=4", "parallel.dp_replicate=1",
                              f"trainer.run_dir={tmp_path}", "trainer.max_steps=1"], timeout=120, check=False)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    printed = [line for line in lines if line.startswith("triax: error: parallel degrees")]
    summary = [line for line in lines if "traceback : triax: error: parallel degrees" in line]
    stopped = [line for line in lines if "traceback : Signal 15 (SIGTERM) received" in line]
    assert len(printed) == 1 and len(summary) >= 1, result.stderr[-2000:]
    assert len(summary) + len(stopped) == 2, result.stderr[-2000:]
    assert all("multiply to 4 but the job has 2 process(es)" in line for line in printed + summary)

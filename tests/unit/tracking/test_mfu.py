"""MFU is reported against a stated peak only: a known GPU's data sheet or trainer.peak_flops;
on a CPU without one, tokens/s alone; never a figure above 100%."""

import json

import pytest
import torch

from support.helpers import tiny_overrides
from triax.tracking.throughput import gpu_peak_flops, stated_peak_flops
from triax.config import compose_config
from triax.train.trainer import Trainer


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
    ("NVIDIA H100 NVL", torch.float16, 835e12),
    ("NVIDIA H200", torch.bfloat16, 989.5e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100 80GB PCIe", torch.float32, 19.5e12),  # float32 without TF32: the plain fp32 peak
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12),  # not the L4's: names are matched as words
    ("NVIDIA A10", torch.bfloat16, 125e12),
    ("NVIDIA A10G", torch.bfloat16, None),  # no data sheet: no MFU rather than the A10's or the A100's
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores
    ("Some Future GPU", torch.bfloat16, None),
])
def test_data_sheet_peaks_by_name_and_precision(name, dtype, peak):
    assert gpu_peak_flops(name, dtype) == peak


def test_float32_peak_follows_pytorchs_tf32_setting():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 494.5e12
    finally:
        torch.set_float32_matmul_precision(before)


def test_no_peak_on_a_cpu_unless_the_user_states_one():
    cpu = torch.device("cpu")
    assert stated_peak_flops(cpu, torch.float32, None) is None
    assert stated_peak_flops(cpu, torch.float32, 2e11) == (2e11, "trainer.peak_flops")


def logged(tmp_path, tiny_corpus, capsys, **extra):
    run_dir = tmp_path / "run"
    Trainer(compose_config(tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2, "trainer.log_every": 1,
                                                                   **extra}))).fit()
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return records, capsys.readouterr()


def test_cpu_run_prints_tokens_per_second_without_mfu(tmp_path, tiny_corpus, capsys):
    records, output = logged(tmp_path, tiny_corpus, capsys)
    assert all("tokens_per_s" in r and "mfu" not in r for r in records)
    assert "tok/s" in output.out and "mfu" not in output.out


def test_mfu_against_a_stated_peak_is_a_fraction_of_it(tmp_path, tiny_corpus, capsys):
    records, output = logged(tmp_path, tiny_corpus, capsys, **{"trainer.peak_flops": 1e12})
    assert all(0 < r["mfu"] <= 1 and r["peak_flops_source"] == "trainer.peak_flops" for r in records)
    assert "mfu " in output.out


def test_a_peak_below_what_the_run_achieves_gives_no_mfu_and_one_warning(tmp_path, tiny_corpus, capsys):
    records, output = logged(tmp_path, tiny_corpus, capsys, **{"trainer.peak_flops": 1.0})
    assert not any("mfu" in r for r in records) and "mfu" not in output.out
    assert output.err.count("MFU is left out") == 1

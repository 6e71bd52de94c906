"""The decode benchmark runs end to end on a tiny target and reports every case."""

from __future__ import annotations

import torch

from dspark.bench.decode import format_table, run_decode_bench
from dspark.models.cpu_kernels import cpu_kernels_available
from dspark.models.tiny import tiny_hf_folder


def test_decode_bench_reports_each_case(tmp_path) -> None:
    folder = tiny_hf_folder(tmp_path, seed=0)
    printed: list[str] = []
    result = run_decode_bench(
        str(folder), repeats=2, context=16, cases=((1, 1), (2, 3)), warmup=0, clock="cpu", print_fn=printed.append
    )
    rows = {(t["runtime"], t["dtype"], t["batch"], t["new_tokens"]) for t in result["timings"]}
    expected = [("dspark", "float32"), ("dspark", "bfloat16"), ("matmuls only", "float32"), ("transformers", "float32")]
    if cpu_kernels_available():  # the same runtime without its CPU kernels, for comparison
        expected += [("dspark, CPU kernels off", "float32"), ("matmuls only, CPU kernels off", "float32")]
    for runtime, dtype in expected:
        assert {(runtime, dtype, 1, 1), (runtime, dtype, 2, 3)} <= rows
    assert all(t["ms"] > 0 for t in result["timings"])
    assert printed == [format_table(result)] and "batch 2, q=3" in printed[0]
    assert result["context"] == 16 and result["threads"] == torch.get_num_threads()
    assert [p["new_tokens"] for p in result["paired"]] == [1]  # head to head: the batch-1 cases
    pair = result["paired"][0]
    assert pair["dspark_ms"] > 0 and pair["transformers_ms"] > 0
    assert abs(pair["ratio"] - pair["dspark_ms"] / pair["transformers_ms"]) < 1e-9
    assert "Head to head" in printed[0]

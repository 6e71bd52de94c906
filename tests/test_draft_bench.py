"""The drafting bench runs end to end on a tiny target and reports every
stage it claims to time."""

from __future__ import annotations

from dspark.bench.draft import run_draft_bench
from dspark.models.tiny import tiny_target


def test_draft_bench_reports_each_case():
    target = tiny_target(seed=0, vocab_size=96, hidden_size=32, num_layers=4, heads=4, kv_heads=2)
    lines = []
    res = run_draft_bench(target, gammas=(2, 4), batches=(1, 3), context=8, repeats=1, warmup=0, top_ks=(5,),
                          vocab_sizes=(16,),
                          drafter_config={"num_hidden_layers": 1, "markov_rank": 4}, log=lines.append)
    assert [(c["block_size"], c["batch"]) for c in res["cases"]] == [(2, 1), (2, 3), (4, 1), (4, 3)]
    for case in res["cases"]:
        for key in ("propose_ms", "backbone_ms", "sequential_ms", "sequential_top5_ms", "propose_vocab16_ms", "observe_ms",
                    "verify_ms"):
            assert case[key] > 0, key
        assert case["sequential_share"] > 0  # a timing ratio: its size belongs in the bench output, not a test
    assert res["drafter"]["params"] > 0 and len(lines) == 1 + len(res["cases"])

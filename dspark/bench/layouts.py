"""The attention layouts a GPU runs against the CPU's, timed on one device: the target
forward of mixed batches in one padded call or in calls per query length
(`dspark.bench.mixed`), and a DSpark drafting round whose requests attend in one padded
call per layer or one call per request (`dspark.draft.backbone.attend_in_one_call`).

    python -m dspark.bench.layouts [--device D] [--target DIR] [--repeats N]

The drafter has the shipped default's shape (3 layers, block 7, Markov rank 64, random
weights rounded to float16: speed does not depend on their values), each request with 256
observed context positions. Both layouts compute the same drafts (tests/test_draft_dspark.py)
and the same target logits (tests/test_bench_mixed.py), so only their time differs. On a GPU
`--target` may be a random-weight folder of the target's shape
(`python -m dspark.models.tiny CONFIG_JSON OUT_DIR`): the embedded model's GGUF needs the
`gguf` package to convert. docs/GPU.md has an H200's numbers.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

DRAFTER = {"num_hidden_layers": 3, "block_size": 7, "markov_head_type": "vanilla", "markov_rank": 64}
BATCHES = (1, 8, 32)


@contextlib.contextmanager
def runtime_layouts(device_type: str):
    """Attention laid out as the runtime lays it out on `device_type` ("cpu" or "cuda"),
    whatever device the tensors are on: the target's calls (`attention_groups`) and the
    drafters' (`attend_in_one_call` of the DSpark/DFlash backbone and of the chain drafters).
    Gives a CPU what a GPU runs, for tests and op counts, or times both on one device."""
    from dspark.draft import backbone, chain
    from dspark.models import llama

    groups, one_call = llama.attention_groups, backbone.attend_in_one_call
    llama.attention_groups = lambda qlens, starts, slots, heads, _device: groups(qlens, starts, slots, heads, device_type)
    backbone.attend_in_one_call = chain.attend_in_one_call = lambda _device, n: one_call(device_type, n)
    try:
        yield
    finally:
        llama.attention_groups = groups
        backbone.attend_in_one_call = chain.attend_in_one_call = one_call


def propose_ms(target, batches=BATCHES, context: int = 256, repeats: int = 20, warmup: int = 3) -> list[dict]:
    """Median ms of one `propose` per request count, the GPU's layout (one padded call) and
    the CPU's (a call per request) timed in alternation."""
    from dspark.bench.draft import _observed_states
    from dspark.draft.factory import build_drafter
    from dspark.models.device import synchronize
    from dspark.types import SamplingParams

    drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, **DRAFTER)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.half().float())
    rows = []
    for batch in batches:
        states = _observed_states(drafter, batch, context)
        anchors = torch.arange(batch, dtype=torch.int64, device=drafter.device) + 20
        params = [SamplingParams(temperature=1.0)] * batch
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        times: dict[bool, list[float]] = {True: [], False: []}
        for k in range(warmup + repeats):
            for one_call in (True, False):
                with runtime_layouts("cuda" if one_call else "cpu"):
                    synchronize(drafter.device)
                    start = time.perf_counter()
                    drafter.propose(states, anchors, params, gens)
                    synchronize(drafter.device)
                if k >= warmup:
                    times[one_call].append((time.perf_counter() - start) * 1e3)
        rows.append({"batch": batch, "one_call_ms": statistics.median(times[True]),
                     "per_request_ms": statistics.median(times[False])})
    return rows


def format_propose(rows: list[dict], where: str, repeats: int) -> str:
    lines = [f"ms per DSpark propose (3 layers, block 7, 256 context positions per request), {where}, "
             f"median of {repeats}, the two layouts in alternation",
             "| requests | one padded call (GPU runtime) | a call per request (CPU runtime) | one call / per request |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['one_call_ms']:.2f} | {r['per_request_ms']:.2f} | "
                     f"{r['one_call_ms'] / r['per_request_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """[--device D] [--target DIR] [--repeats N] (no argparse outside cli.py)."""
    from dspark.bench.options import parse_options

    options = parse_options(argv, {"--device": "auto", "--target": "", "--repeats": "20"}, whole=("--repeats",))
    from dspark.bench.mixed import format_rows, run_mixed_bench
    from dspark.models import load_target
    from dspark.models.device import hardware_id, resolve_device

    device, repeats = resolve_device(options["--device"]), int(options["--repeats"])
    target = options["--target"] or None
    where = hardware_id(device)
    print("Command: `" + " ".join(["python -m dspark.bench.layouts", *argv]) + "`")
    loaded = load_target(target, device=str(device))
    print(format_rows(run_mixed_bench(repeats, loaded=loaded), repeats, 256, where))
    print()
    rows = propose_ms(loaded.model, repeats=repeats)
    print(format_propose(rows, where, repeats))


if __name__ == "__main__":
    main(sys.argv[1:])

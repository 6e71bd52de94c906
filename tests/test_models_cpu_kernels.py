"""The target's small-row CPU matmul kernel (dspark/models/csrc/rowgemm.c through
dspark.models.cpu_kernels): the same function as F.linear up to float32 rounding at every row
count, row results independent of the other rows, never stale after the weights change, and a
clear 'off' (never a crash) when it cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.models import cpu_kernels
from dspark.models.cpu_kernels import CpuKernel, disable_cpu_kernels, enable_cpu_kernels, load_rowgemm
from dspark.models.tiny import round_to_block_grid, tiny_state_dict, tiny_target
from dspark.types import RaggedBatch

needs_kernel = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason=cpu_kernels.cpu_kernels_status())


def _kernel(weight: torch.Tensor) -> CpuKernel:
    return CpuKernel(weight, cpu_kernels.rowgemm()[0])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 31, 32, 33, 70])
@pytest.mark.parametrize("shape", [(96, 48), (61, 37), (8, 8), (3, 5)])  # multiples of 8 or not
def test_kernel_matches_f_linear(rows: int, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    kernel = _kernel(weight)
    torch.testing.assert_close(kernel(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert kernel(x.view(1, rows, shape[1])).shape == (1, rows, shape[0])
    assert kernel.fast_calls == (3 if rows <= cpu_kernels.MAX_ROWS else 0)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 32])
def test_float16_panels_give_the_float32_panels_results_bit_for_bit(rows: int) -> None:
    """A weight exact in float16 (a drafter loaded from its float16 checkpoint) is packed in
    float16 and widened on load: the same products, from half the bytes."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(136, 88, generator=gen) * 0.05).half().float()
    bias, x = torch.randn(136, generator=gen), torch.randn(rows, 88, generator=gen)
    half, full = _kernel(weight), CpuKernel(weight, cpu_kernels.rowgemm()[0], formats=())
    assert (half.format, half.panels.dtype) == ("f16", torch.float16) and full.format == "f32"
    assert torch.equal(half(x, bias), full(x, bias))
    torch.testing.assert_close(half(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert half.fast_calls == 2


@needs_kernel
def test_weights_not_exact_in_float16_keep_float32_panels() -> None:
    weight = torch.randn(16, 8)
    weight[3, 2] = 1e6  # overflows float16
    assert _kernel(weight).format == "f32" and _kernel(weight).panels.dtype == torch.float32
    assert _kernel(torch.randn(16, 8) / 3).format == "f32"  # rounds in float16


def _on_grid(shape: tuple[int, int], grid: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return round_to_block_grid(torch.randn(*shape, generator=gen) * 0.2, grid)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 27, 32])
@pytest.mark.parametrize("grid,fmt", [("q4_1", "q4"), ("q8_0", "q8")])
def test_block_quantized_records_give_the_float32_panels_results_bit_for_bit(rows: int, grid: str, fmt: str) -> None:
    """Weights that are exactly a Q4_1 or Q8_0 model's (the embedded target's layers and head)
    are packed as scales and 4- or 8-bit codes and rebuilt exactly in the kernel: the float32
    panels' products, bit for bit, from a fifth or a quarter of the bytes."""
    for shape in ((136, 96), (61, 64), (8, 32)):  # outputs a multiple of 8 or not
        weight = _on_grid(shape, grid, rows)
        gen = torch.Generator().manual_seed(rows + 1)
        bias, x = torch.randn(shape[0], generator=gen), torch.randn(rows, shape[1], generator=gen)
        packed, full = _kernel(weight), CpuKernel(weight, cpu_kernels.rowgemm()[0], formats=())
        assert (packed.format, full.format) == (fmt, "f32")
        assert packed.panels.numel() < full.panels.numel() * 4 * (0.3 if fmt == "q8" else 0.2)  # bytes
        assert torch.equal(packed(x, bias), full(x, bias)) and torch.equal(packed(x), full(x))
        torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_compact_forms_are_used_only_when_they_rebuild_every_weight_exactly() -> None:
    q4 = _on_grid((24, 64), "q4_1", 0)
    assert _kernel(q4).format == "q4"
    assert _kernel(_on_grid((24, 64), "q8_0", 0)).format == "q8"
    assert _kernel(torch.zeros(24, 64)).format == "q4"  # flat blocks: d = 0
    flat = q4.clone()
    flat[3, 32:] = 0.25  # one constant block among ordinary ones
    assert _kernel(flat).format == "q4"
    nudged = q4.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one weight off the grid by one ulp
    assert _kernel(nudged).format == "f32"
    assert _kernel(_on_grid((24, 64), "q4_1", 0)[:, :48]).format == "f32"  # 48 inputs: no whole blocks
    assert _kernel(torch.full((8, 64), float("nan"))).format == "f32"
    codes = torch.randint(0, 16, (8, 64))
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # each block spans 0..15, as llama.cpp's quantizer makes it
    q4_in_half = codes.float() * 0.125 - 1  # on both grids: exact in float16 too
    assert _kernel(q4_in_half).format == "q4"
    assert CpuKernel(q4_in_half, cpu_kernels.rowgemm()[0], formats=("f16",)).format == "f16"


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q8", "f16", "f32"])
def test_results_do_not_depend_on_the_thread_count(fmt: str) -> None:
    """The panels are split between threads; each output is still one FMA chain."""
    weight = {"q4": _on_grid((200, 96), "q4_1", 1), "q8": _on_grid((200, 96), "q8_0", 1),
              "f16": torch.randn(200, 96).half().float(), "f32": torch.randn(200, 96)}[fmt]
    kernel, x = _kernel(weight), torch.randn(11, 96)
    assert kernel.format == fmt
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(kernel(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_block_quantized_model_uses_the_compact_forms_and_matches_the_model_without(tied: bool) -> None:
    plain = tiny_target(4, block_quantized=True, tie_word_embeddings=tied)
    fast = tiny_target(4, block_quantized=True, tie_word_embeddings=tied)
    assert enable_cpu_kernels(fast)
    assert {m.cpu_kernel.format for m in cpu_kernels.target_linears(fast)} == {"q4"}
    assert fast.head_kernel.format == "q8"
    seq, verify = [5, 9, 2, 7, 7, 1, 30, 4], [11, 3, 8, 2, 6, 1]
    for a, b in zip(_forward_logits(plain, seq, verify), _forward_logits(fast, seq, verify)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_wrong_shapes_raise_like_f_linear_instead_of_reaching_the_c_code() -> None:
    weight = torch.randn(16, 8)
    kernel = _kernel(weight)
    with pytest.raises(RuntimeError):
        kernel(torch.randn(2, 4))  # 8 values: would pass a row count check
    with pytest.raises(RuntimeError):
        kernel(torch.randn(2, 8), torch.randn(3))
    assert kernel.fast_calls == 0


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(200, 72, generator=gen), torch.randn(32, 72, generator=gen)
    kernel = _kernel(weight)
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(32)])
    for rows in (2, 3, 8, 9, 17, 32):
        assert torch.equal(kernel(x[:rows]), alone[:rows]), rows


@needs_kernel
def test_kernel_reads_strided_inputs_and_steps_aside_when_its_weight_changes() -> None:
    weight = torch.randn(64, 32)
    kernel = _kernel(weight)
    x = torch.randn(32, 4).T  # a transposed (non-contiguous) [4, 32] input
    torch.testing.assert_close(kernel(x), F.linear(x, weight))
    weight.mul_(-2.0)  # in place: the packed copy is now stale
    torch.testing.assert_close(kernel(x), F.linear(x, weight))
    assert kernel.fast_calls == 1


def _forward_logits(model, seq: list[int], verify: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill, one decode step and one verification forward."""
    cache = model.new_cache(1, 64)
    slot = cache.allocate()
    outs = []
    for chunk in (seq, verify[:1], verify[1:]):
        outs.append(model(RaggedBatch(torch.tensor(chunk), [slot], [len(chunk)]), cache).logits)
    return outs


@needs_kernel
@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen3", False)])
def test_model_with_kernels_matches_model_without(family: str, tied: bool) -> None:
    plain = tiny_target(3, family=family, tie_word_embeddings=tied)
    fast = tiny_target(3, family=family, tie_word_embeddings=tied)
    assert enable_cpu_kernels(fast)
    seq, verify = [5, 9, 2, 7, 7, 1, 30, 4], [11, 3, 8, 2, 6, 1]
    for a, b in zip(_forward_logits(plain, seq, verify), _forward_logits(fast, seq, verify)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert fast.head_kernel.fast_calls > 0


@needs_kernel
def test_reloaded_weights_are_used_not_the_stale_copies() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    other = tiny_target(9)
    model.load_state_dict(tiny_state_dict(other.config, 9))
    seq, verify = [1, 2, 3, 4], [5, 6, 7]
    for a, b in zip(_forward_logits(other, seq, verify), _forward_logits(model, seq, verify)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_converting_a_model_with_kernels_to_bfloat16_still_runs() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    model, reference = model.to(torch.bfloat16), tiny_target(0).to(torch.bfloat16)
    seq, verify = [1, 2, 3, 4], [5, 6, 7]
    for a, b in zip(_forward_logits(reference, seq, verify), _forward_logits(model, seq, verify)):
        assert torch.equal(a, b)  # the kernels step aside: the very same bfloat16 computation


@needs_kernel
def test_disable_removes_every_kernel() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    disable_cpu_kernels(model)
    assert "head_kernel" not in model.__dict__
    assert not any("cpu_kernel" in m.__dict__ for m in model.modules())


def test_no_compiler_means_plain_f_linear(tmp_path, monkeypatch) -> None:
    fn, why = load_rowgemm(cc=str(tmp_path / "no-such-cc"), home=tmp_path)
    assert fn is None and "off" in why
    monkeypatch.setattr(cpu_kernels, "rowgemm", lambda: (None, why))
    model = tiny_target(0)
    assert not enable_cpu_kernels(model) and "head_kernel" not in model.__dict__
    assert not enable_cpu_kernels(tiny_target(0).to(torch.bfloat16))


def test_a_broken_compiler_is_reported_not_raised(tmp_path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    fake.chmod(0o755)
    fn, why = load_rowgemm(cc=str(fake), home=tmp_path)
    assert fn is None and "failed" in why and "internal error" in why
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left to load


@needs_kernel
def test_kernel_builds_once_into_the_dspark_home(tmp_path) -> None:
    fn, why = load_rowgemm(home=tmp_path)
    assert fn is not None, why
    built = list((tmp_path / "kernels").glob("rowgemm-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert load_rowgemm(home=tmp_path)[0] is not None
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


# ---------------------------------------------------------------- block shapes


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q8", "f16", "f32"])
def test_every_block_shape_gives_the_same_bits(fmt: str) -> None:
    """Which block of panels an output is computed in (tuned per machine) never changes it: every
    compiled (rows, panels) shape gives the default shapes' results bit for bit, also where a call
    mixes a group of 8 rows with a remainder and where the panels do not fill the last block."""
    kernels = cpu_kernels.rowgemm()[0]
    weight = {"q4": _on_grid((200, 96), "q4_1", 2), "q8": _on_grid((200, 96), "q8_0", 2),
              "f16": torch.randn(200, 96).half().float(), "f32": torch.randn(200, 96)}[fmt]
    kernel = _kernel(weight)
    assert kernel.format == fmt
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(200, generator=gen)
    try:
        cpu_kernels.apply_blocks(kernels, cpu_kernels.DEFAULT_BLOCKS)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 14):
            x = torch.randn(rows, 96, generator=gen)
            expected = kernel(x, bias)
            last = rows % 8 or 8
            for pb in cpu_kernels.BLOCK_SHAPES[last]:
                assert kernels.set_block[fmt](last, pb)
                assert torch.equal(kernel(x, bias), expected), (rows, pb)
            kernels.set_block[fmt](last, cpu_kernels.DEFAULT_BLOCKS[fmt][last])
    finally:
        cpu_kernels.apply_blocks(kernels, cpu_kernels.blocks_in_use()[0])


@needs_kernel
def test_a_fresh_kernel_starts_on_the_defaults_python_names_and_reports_what_is_set(tmp_path) -> None:
    """DEFAULT_BLOCKS is the tuner's baseline: it must be what csrc/rowgemm.c compiles in."""
    fresh, why = load_rowgemm(home=tmp_path)  # its own copy of the library: untouched state
    assert fresh is not None, why
    for kind, per_rows in cpu_kernels.DEFAULT_BLOCKS.items():
        assert {rows: fresh.get_block[kind](rows) for rows in per_rows} == per_rows, kind
        assert fresh.get_block[kind](0) == 0 and fresh.get_block[kind](9) == 0
        for rows, shapes in cpu_kernels.BLOCK_SHAPES.items():
            for pb in shapes:
                assert fresh.set_block[kind](rows, pb) and fresh.get_block[kind](rows) == pb


@needs_kernel
def test_shapes_the_kernel_was_not_built_with_are_refused() -> None:
    kernels = cpu_kernels.rowgemm()[0]
    for kind in ("q4", "q8", "f16", "f32"):
        for rows, pb in ((0, 1), (9, 1), (2, 3), (7, 2), (8, 2), (1, 0), (1, 16)):
            assert kernels.set_block[kind](rows, pb) == 0
    with pytest.raises(ValueError, match="no block of 3 panels for 2 rows"):
        cpu_kernels.apply_blocks(kernels, {"q4": {2: 3}})


@needs_kernel
def test_block_shapes_are_measured_once_per_model_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    """Measured on the model's own kernels the first time (every row count gets a compiled
    shape), cached per machine and model shape; later loads read the cache; another model shape
    is measured on its own; a damaged cache is measured again, never trusted or fatal."""
    kernels = cpu_kernels.rowgemm()[0]
    calls = []
    real = cpu_kernels.measure_blocks

    def measure(k, products, **kw):
        calls.append(len(products))
        return real(k, products, rounds=1)

    monkeypatch.setattr(cpu_kernels, "measure_blocks", measure)
    model, other = tiny_target(0, block_quantized=True), tiny_target(0, block_quantized=True, vocab_size=128)
    try:
        assert enable_cpu_kernels(model, home=tmp_path, tune=False)
        products = [m.cpu_kernel for m in cpu_kernels.target_linears(model)] + [model.head_kernel]
        blocks, source = cpu_kernels.tuned_blocks(kernels, products, home=tmp_path, mode="")
        assert source.startswith("measured") and calls == [len(products)]
        assert {k: set(v) for k, v in blocks.items()} == {k: set(cpu_kernels.BLOCK_SHAPES) for k in cpu_kernels.DEFAULT_BLOCKS}
        assert all(pb in cpu_kernels.BLOCK_SHAPES[r] for v in blocks.values() for r, pb in v.items())
        again, source = cpu_kernels.tuned_blocks(kernels, products, home=tmp_path, mode="")
        assert again == blocks and source.startswith("cached") and len(calls) == 1
        assert enable_cpu_kernels(model, home=tmp_path)  # what loading does: the cached choice, in use
        assert len(calls) == 1 and cpu_kernels.blocks_in_use()[1].startswith("cached")
        assert enable_cpu_kernels(other, home=tmp_path) and len(calls) == 2  # another shape: its own measurement
        assert cpu_kernels.tuned_blocks(kernels, products, home=tmp_path, mode="tune")[1].startswith("measured")
        assert len(calls) == 3
        path = cpu_kernels._blocks_path(products, tmp_path)
        for damage in ("{not json", '{"blocks": {"q4": {"2": 3}}}', '{"blocks": null}'):
            path.write_text(damage)
            assert cpu_kernels.tuned_blocks(kernels, products, home=tmp_path, mode="")[1].startswith("measured")
        assert len(calls) == 6
        assert cpu_kernels.tuned_blocks(kernels, products, home=tmp_path, mode="default") == (cpu_kernels.DEFAULT_BLOCKS, "default")
        monkeypatch.setenv(cpu_kernels.BLOCKS_ENV, "fastest")
        with pytest.raises(ValueError, match="DSPARK_KERNEL_BLOCKS='fastest'.*'default'"):
            cpu_kernels.tuned_blocks(kernels, products, home=tmp_path)
    finally:
        cpu_kernels.use_blocks(cpu_kernels.DEFAULT_BLOCKS, "default")


def test_candidates_are_the_defaults_then_each_shape_once_for_the_forms_a_model_holds() -> None:
    for rows, shapes in cpu_kernels.BLOCK_SHAPES.items():
        every = cpu_kernels.block_candidates(rows)
        assert every[0] == {k: cpu_kernels.DEFAULT_BLOCKS[k][rows] for k in cpu_kernels.DEFAULT_BLOCKS}
        assert len(every) == len(shapes) + 1 - (len(shapes) == 1)  # f32/f16 and q4/q8 defaults differ below 7 rows
        quantized = cpu_kernels.block_candidates(rows, {"q4", "q8"})
        assert [c["q4"] for c in quantized] == [cpu_kernels.DEFAULT_BLOCKS["q4"][rows]] + [
            pb for pb in shapes if pb != cpu_kernels.DEFAULT_BLOCKS["q4"][rows]]
        assert all(c["f32"] == cpu_kernels.DEFAULT_BLOCKS["f32"][rows] for c in quantized)


def test_the_default_shape_stays_unless_another_is_clearly_faster(monkeypatch) -> None:
    """The tuner's noise guard, on a fake kernel and clock: a shape under 1 % faster than the
    defaults does not replace them; one 10 % faster does; the kernel is left on the defaults."""
    import time

    speeds = {2: {1: 10.0, 2: 9.9, 4: 9.0}, 3: {1: 10.0, 2: 9.95, 3: 9.95, 4: 9.92}}  # ms by panels (q4)
    state = {"t": 0.0, "cost": 0.0, "q4": {}}

    def set_block(rows, pb):
        state["q4"][rows] = pb
        return 1

    class Product:  # one model kernel: a call costs what the current q4 shape for its rows costs
        weight, format = torch.zeros(8, 32), "q4"

        def __call__(self, x):
            rows = x.shape[0]
            state["t"] += speeds.get(rows, {}).get(state["q4"].get(rows), 10.0)

    fake = type("FakeKernels", (), {"set_block": {k: set_block if k == "q4" else (lambda r, p: 1)
                                                  for k in cpu_kernels.DEFAULT_BLOCKS}})
    monkeypatch.setattr(time, "perf_counter", lambda: state["t"])
    result = cpu_kernels.measure_blocks(fake, [Product(), Product()], rounds=3)
    ms, candidates, chosen = result[2]
    assert candidates[chosen]["q4"] == 4  # 10 % faster than one panel at a time
    assert ms[chosen] == 18e3 and ms[0] == 20e3  # two products per pass, fake seconds reported as ms
    ms, candidates, chosen = result[3]
    assert chosen == 0 and candidates[0]["q4"] == cpu_kernels.DEFAULT_BLOCKS["q4"][3]  # under 1 %: defaults
    assert result[1][1][result[1][2]]["q4"] == cpu_kernels.DEFAULT_BLOCKS["q4"][1]
    assert all(state["q4"][rows] == cpu_kernels.DEFAULT_BLOCKS["q4"][rows] for rows in state["q4"])


# ---------------------------------------------------------------- drafters


DRAFTERS = [
    ("dspark", {"block_size": 4, "markov_head_type": "vanilla", "markov_rank": 8}),
    ("dspark", {"block_size": 4, "markov_head_type": "rnn", "markov_rank": 8}),
    ("dflash", {"block_size": 4}),
    ("eagle3", {"block_size": 3}),
    ("mtp", {}),
]


def _propose(drafter, target, draft_vocab: int):
    from dspark.types import SamplingParams

    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(target.config.vocab_size).flip(0), draft_vocab)
    gen = torch.Generator().manual_seed(0)
    t, d = len(drafter.tap_layers), target.config.hidden_size
    states = [drafter.new_state() for _ in range(3)]
    drafter.observe(states, [torch.randint(0, 60, (n,), generator=gen) for n in (5, 9, 7)],
                    [torch.randn(n, t, d, generator=gen) for n in (5, 9, 7)])
    params = [SamplingParams(temperature=1.0)] * 3
    with torch.no_grad():
        return drafter.propose(states, torch.tensor([3, 4, 5]), params, [torch.Generator().manual_seed(i) for i in range(3)])


@needs_kernel
@pytest.mark.parametrize("draft_vocab", [0, 40])
@pytest.mark.parametrize("kind,cfg", DRAFTERS, ids=[f"{k}-{c.get('markov_head_type', '')}" for k, c in DRAFTERS])
def test_drafter_with_kernels_proposes_what_it_proposes_without(kind: str, cfg: dict, draft_vocab: int,
                                                               monkeypatch) -> None:
    from dspark.draft.factory import build_drafter
    from dspark.models.cpu_kernels import enable_drafter_cpu_kernels

    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "off")  # the exact path; the bfloat16 one is tested below
    target = tiny_target(1, vocab_size=64)
    plain = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=2, **cfg).eval()
    fast = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=2, **cfg).eval()
    enable_cpu_kernels(target)
    assert enable_drafter_cpu_kernels(fast, target)
    a, b = _propose(plain, target, draft_vocab), _propose(fast, target, draft_vocab)
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(b.draft_probs, a.draft_probs, rtol=1e-4, atol=1e-5)
    if a.confidences is not None:
        torch.testing.assert_close(b.confidences, a.confidences, rtol=1e-4, atol=1e-5)
    served = [m.cpu_kernel.fast_calls for m in fast.modules() if "cpu_kernel" in m.__dict__]
    assert sum(served) > 0 and fast.__dict__["head_kernel"].fast_calls > 0


@needs_kernel
@pytest.mark.parametrize("kind,cfg", DRAFTERS[:1] + DRAFTERS[2:3], ids=["dspark", "dflash"])
def test_drafter_bf16_path_takes_the_many_row_products(kind: str, cfg: dict, monkeypatch) -> None:
    """DSPARK_DRAFTER_BF16=on: products of DRAFTER_BF16_FROM_ROWS rows or more (three requests' blocks, the
    batched context projection) run as bfloat16 matmuls, fewer rows on the exact kernel. The proposals
    stay close to the float32 drafter's (bfloat16 rounding only), and what the drafter reports as its
    draft probabilities is still a distribution that puts mass on every drafted token."""
    from dspark.draft.factory import build_drafter
    from dspark.models.cpu_kernels import DRAFTER_BF16_FROM_ROWS, CpuKernel, drafter_bf16_from_rows, enable_drafter_cpu_kernels

    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "on")
    assert drafter_bf16_from_rows() == DRAFTER_BF16_FROM_ROWS
    target = tiny_target(1, vocab_size=64)
    plain = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=2, **cfg).eval()
    fast = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=2, **cfg).eval()
    enable_cpu_kernels(target)
    assert enable_drafter_cpu_kernels(fast, target)
    a, b = _propose(plain, target, 40), _propose(fast, target, 40)
    torch.testing.assert_close(b.draft_probs, a.draft_probs, rtol=0.0, atol=0.05)
    sums = b.draft_probs.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    assert bool((b.draft_probs.gather(-1, b.draft_tokens[..., None]) > 0).all())
    kernels = [m.cpu_kernel for m in fast.modules() if "cpu_kernel" in m.__dict__] + [fast.__dict__["head_kernel"]]
    assert sum(k.bf16_calls for k in kernels) > 0 and fast.__dict__["head_kernel"].bf16_calls > 0
    layer = next(m.cpu_kernel for m in fast.modules() if "cpu_kernel" in m.__dict__)
    x = torch.randn(DRAFTER_BF16_FROM_ROWS - 1, layer.weight.shape[1])
    calls = (layer.fast_calls, layer.bf16_calls)
    with torch.no_grad():  # few rows: the exact kernel
        torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    assert (layer.fast_calls, layer.bf16_calls) == (calls[0] + 1, calls[1])
    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "off")
    assert drafter_bf16_from_rows() is None
    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "maybe")
    from dspark.errors import UserError

    with pytest.raises(UserError, match="DSPARK_DRAFTER_BF16='maybe': use auto, on or off"):
        drafter_bf16_from_rows()  # the CLI prints it as one line, no traceback
    assert CpuKernel(layer.weight, cpu_kernels.rowgemm()[0]).weight_bf16 is None  # the target's kernels: never


def test_auto_takes_the_bf16_path_on_amx_cpus_only(monkeypatch) -> None:
    """`auto` follows the CPU's flags: AMX yes; AVX512-BF16 alone (not measured) and plain AVX2 no."""
    from dspark.models import device
    from dspark.models.cpu_kernels import DRAFTER_BF16_FROM_ROWS, drafter_bf16_from_rows

    monkeypatch.delenv("DSPARK_DRAFTER_BF16", raising=False)
    for flags, native, rows in (({"avx2", "amx_bf16", "amx_tile"}, True, DRAFTER_BF16_FROM_ROWS),
                                ({"avx2", "avx512_bf16"}, True, None), ({"avx2", "fma"}, False, None)):
        monkeypatch.setattr(device, "_cpu_flags", lambda flags=flags: flags)
        assert (device.cpu_has_native_bf16(), drafter_bf16_from_rows()) == (native, rows)
        assert drafter_bf16_from_rows("on") == DRAFTER_BF16_FROM_ROWS and drafter_bf16_from_rows("off") is None


@needs_kernel
def test_drafter_kernels_step_aside_for_training() -> None:
    from dspark.draft.factory import build_drafter
    from dspark.models.cpu_kernels import enable_drafter_cpu_kernels

    target = tiny_target(1, vocab_size=64)
    drafter = build_drafter("dflash", target.config, target.embed_tokens, target.lm_head_weight, seed=2, block_size=4)
    enable_cpu_kernels(target)
    assert enable_drafter_cpu_kernels(drafter, target)
    layer = next(m for m in drafter.modules() if "cpu_kernel" in m.__dict__ and m.in_features > 8)
    x = torch.randn(3, layer.in_features)
    layer(x).sum().backward()  # would raise (no grad_fn) if the C kernel had computed it
    assert layer.weight.grad is not None and layer.cpu_kernel.fast_calls == 0


@needs_kernel
def test_a_threaded_kernel_shares_torchs_openmp_runtime() -> None:
    """Built with OpenMP, the kernel must run on torch's own libgomp (one thread pool), never
    on a second runtime whose threads would fight torch's for the cores."""
    from pathlib import Path

    if not cpu_kernels.rowgemm()[0].threaded:
        pytest.skip("the kernel was built without OpenMP here (one thread)")
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps")
    runtimes = {line.split()[-1] for line in maps.read_text().splitlines()
                if any(name in line for name in ("libgomp", "libomp", "libiomp"))}
    assert len(runtimes) == 1, runtimes


@needs_kernel
def test_a_gcc_that_cannot_build_openmp_gives_the_single_threaded_kernel(tmp_path) -> None:
    """A GCC without libgomp's development files: the OpenMP build fails once (remembered),
    and the kernel is built and used on one thread instead of being switched off."""
    import shutil

    real = cpu_kernels._compiler()
    fake = tmp_path / "gcc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "gcc (GCC) 12.2.0"; echo "Free Software Foundation, Inc."; exit 0; fi\n'
        'for a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "ld: cannot find -lgomp" >&2; exit 1; }; done\n'
        f'exec {shutil.which(real) or real} "$@"\n'
    )
    fake.chmod(0o755)
    fn, why = load_rowgemm(cc=str(fake), home=tmp_path)
    assert fn is not None and not fn.threaded, why
    assert len(list((tmp_path / "kernels").glob("*.failed"))) == 1
    assert load_rowgemm(cc=str(fake), home=tmp_path)[0] is not None  # the marker skips the retry
    weight, x = torch.randn(40, 64), torch.randn(3, 64)
    torch.testing.assert_close(CpuKernel(weight, fn)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)

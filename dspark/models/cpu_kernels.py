"""Faster float32 matmuls for the target's small forwards on a CPU.

A decode step multiplies one activation row by every weight matrix, a
verification step a few rows per request: both are bound by reading the
weights from memory, yet the kernels `F.linear` reaches through MKL stay far
from that bound for such shapes on the CPUs measured here (2-core AMD EPYC
Zen 3, AVX2, torch 2.13; docs/BENCHMARKS.md): a 2-row product costs about
twice a 1-row one, 3 rows more than 4.

`csrc/rowgemm.c` is a small AVX2/FMA kernel for 1-48 rows that reads each
weight once per call from a copy packed in panels of 8 outputs (one
contiguous stream), with the partial sums of up to 8 rows in registers. Each
output is one FMA chain over the input index whatever the number of rows or
threads, so a row's result never depends on the other rows of the call.

How many panels it takes at a time for a given number of rows (its block
shape) is chosen per machine and model: `enable_cpu_kernels` times a pass over
the model's own packed weights with each compiled shape (a few seconds, the
first time) and caches the choice in `<dspark home>/kernels/blocks-*.json` for
this kernel build, CPU, thread count and model shape (`tuned_blocks`). The
best shape differs between CPUs (one panel at a time for 2-8 rows on the AMD
EPYC of sessions 1-28; 2-4 panels on the AVX-512 Intel Xeon of session 29,
where that makes a 2-row product 1.2x a 1-row one instead of 1.9x) and never
changes a result. The shapes are global to the process: the last model given
kernels sets them. `DSPARK_KERNEL_BLOCKS=default` keeps the compiled
defaults, `=tune` measures again.

The packed copy takes the fewest bytes that rebuild every float32 weight
exactly (`PACKERS`, checked with the kernel's own arithmetic at packing time):

- q4, 0.75 bytes a weight: every block of 32 inputs is q * d + m with 4-bit
  codes, as in a model converted from a Q4_1 GGUF, such as the embedded
  SmolLM2's decoder layers;
- q8, 1.125 bytes: q * d with 8-bit codes (Q8_0; the embedded model's
  embeddings, hence its tied LM head);
- f16, 2 bytes: values exact in float16 (a drafter from its float16 checkpoint);
- f32, 4 bytes: anything else.

The kernel rebuilds the float32 weight in registers and then does the very
FMA of the f32 path, so all four give bit-identical results; the compact ones
just read a fifth, a quarter or half of the bytes. On the embedded target a
decode step's matmuls take 12-13 ms against 45-51 ms through `F.linear` (2
threads, docs/BENCHMARKS.md).

With GCC the kernel is built with OpenMP, and then links torch's own libgomp
(same soname, already loaded) and splits the panels over
`torch.get_num_threads()` threads of torch's pool; with any other compiler it
runs on one thread.

The kernel is compiled once with the system C compiler (`$CC`, else `cc`)
into `<dspark home>/kernels/` on first use. Without a compiler or on a CPU
without AVX2 and FMA nothing changes: the model runs `F.linear` as before
(as it does with `load_target(..., cpu_kernels=False)`, the CLI's
`--no-cpu-kernel`).

`enable_cpu_kernels(model)` gives each decoder-layer linear and the LM head a
`CpuKernel` holding the packed copy (memory: from a fifth of the weights, for
the embedded target, to as much again); `enable_drafter_cpu_kernels(drafter,
model)` does the same for a drafter's linear layers and its
(draft-vocabulary) LM head, for serving. A kernel answers only for float32
CPU inputs and only while its weight is the one it packed: after
`load_state_dict`, `.to()` or any in-place change it steps aside (`linear`
computes the result), so it can make a forward slower, never wrong. It also
steps aside whenever autograd would need it (training). Results differ from
`F.linear` by float32 rounding only (another summation order), as
`F.linear`'s own kernels differ between row counts.

A drafter's kernels have one more path (`enable_drafter_cpu_kernels`). On a CPU with AMX tiles for
bfloat16 (the only kind of bfloat16 hardware measured so far) a product of `DRAFTER_BF16_FROM_ROWS` rows or more
runs as a bfloat16 matmul with float32 output: the blocks of two or more requests drafted
together, and the batched projection of their committed context. On the AMX CPU of session 38
that makes a drafting round of 2-16 requests 1.3-1.7x faster and the context projection 1.7-2.7x
(one thread); at one request's 7-row block the two are level, so that stays on the kernel
(`python -m dspark.bench.draft_bf16`, docs/DRAFTING.md).
A drafter's arithmetic only decides what is proposed: the verifier is handed the probabilities
the drafts were actually drawn from, so the output distribution does not change. The target
never takes this path: plain decoding and verification must compute the same logits for the
same token. `DSPARK_DRAFTER_BF16` = `auto` (the default: where the CPU has the instructions),
`on` or `off` overrides the choice, as does the `bf16` argument of the drafter loaders.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from dspark.models.layers import linear

DRAFTER_BF16_FROM_ROWS = 8  # a drafter's products of this many rows or more run in bfloat16 where that is fast
MAX_ROWS = 48  # row counts up to this go through the kernel; from about 64 rows F.linear is as fast (docs/BENCHMARKS.md)
PANEL = 8  # outputs per packed panel (one AVX2 register of float32)
ROW_GROUP = 8  # rows multiplied together (csrc ROW_GROUP): a 9th row costs a second pass over W
SOURCE = Path(__file__).parent / "csrc" / "rowgemm.c"
# -O2, not -O3: gcc 12 at -O3 spills the accumulators to the stack on every iteration
CFLAGS = ("-O2", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC")


@dataclass(frozen=True)
class RowGemm:
    """The compiled entry points: y = x @ W.T from float32 panels, float16 panels, or
    block-quantized records (see `PACKERS`)."""

    f32: object  # dspark_rowgemm(x, panels, bias, y, rows, in, out)
    f16: object  # dspark_rowgemm_f16(...), panels of float16 bits
    q4: object  # dspark_rowgemm_q4(...), Q4_1-style records (`pack_q4`)
    q8: object  # dspark_rowgemm_q8(...), Q8_0-style records (`pack_q8`)
    threaded: bool = False  # built with OpenMP: calls split the panels over torch.get_num_threads() threads
    set_block: dict | None = None  # kind -> NAME_set_block(rows, panels): the block shape for that many rows
    get_block: dict | None = None  # kind -> NAME_get_block(rows): the panels per block in use for that many rows


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _openmp_flags(cc_version: str) -> tuple[str, ...]:
    """("-fopenmp",) when the compiler is GCC and torch runs on OpenMP: the kernel then loads
    torch's own libgomp (same soname, already in the process) and shares its thread pool. Any
    other OpenMP runtime would start a second pool fighting torch's threads for the cores, so
    the kernel then stays single-threaded."""
    gcc = "Free Software Foundation" in cc_version and "clang" not in cc_version.lower()
    return ("-fopenmp",) if gcc and "ATen parallel backend: OpenMP" in torch.__config__.parallel_info() else ()


def _build(cc: str, home: str | Path | None) -> Path:
    """Compile csrc/rowgemm.c into the dspark home (once per source, flags and compiler).

    With OpenMP first where `_openmp_flags` allows it; if that build fails (a GCC without
    libgomp's development files, say) the failure is remembered next to the kernels and the
    single-threaded build is used, so later processes do not retry it."""
    from dspark.models.embedded import dspark_home

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    openmp = _openmp_flags(version)
    error = ""
    for flags in ([CFLAGS + openmp] if openmp else []) + [CFLAGS]:
        digest = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags), version]).encode()).hexdigest()[:16]
        out = dspark_home(home) / "kernels" / f"rowgemm-{digest}.so"
        failed = out.with_suffix(".failed")
        if out.is_file():
            return out
        if failed.is_file() and flags != CFLAGS:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp, out)
            return out
        tmp.unlink(missing_ok=True)
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else str(done.returncode)
        if flags != CFLAGS:
            failed.write_text(f"{cc} {' '.join(flags)}: {error}\n")
    raise RuntimeError(f"{cc} failed: {error}")


def load_rowgemm(cc: str | None = None, home: str | Path | None = None) -> tuple[RowGemm | None, str]:
    """(the kernel's entry points, "") or (None, why not). Compiles the kernel when needed.
    (Every AVX2 CPU also has F16C, which the float16 entry point uses.)"""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2", "AVX512"
    ):
        return None, "off (the kernel needs an x86-64 CPU with AVX2 and FMA)"
    cc = cc or _compiler()
    if cc is None:
        return None, "off (no C compiler found: install gcc or set CC)"
    try:
        library = ctypes.CDLL(str(_build(cc, home)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"off (building {SOURCE.name} failed: {err})"
    fns = {kind: getattr(library, "dspark_rowgemm" + suffix) for kind, suffix in
           (("f32", ""), ("f16", "_f16"), ("q4", "_q4"), ("q8", "_q8"))}
    for fn in fns.values():
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4
        fn.restype = None
    suffixes = {"f32": "", "f16": "_f16", "q4": "_q4", "q8": "_q8"}
    setters = {kind: getattr(library, f"dspark_rowgemm{suffix}_set_block") for kind, suffix in suffixes.items()}
    getters = {kind: getattr(library, f"dspark_rowgemm{suffix}_get_block") for kind, suffix in suffixes.items()}
    for fn in setters.values():
        fn.argtypes = [ctypes.c_long, ctypes.c_long]
        fn.restype = ctypes.c_int
    for fn in getters.values():
        fn.argtypes = [ctypes.c_long]
        fn.restype = ctypes.c_int
    return RowGemm(**fns, threaded=bool(library.dspark_rowgemm_openmp()), set_block=setters, get_block=getters), ""


# ------------------------------------------------------------ block shapes, tuned per machine
# The (rows, panels per block) shapes csrc/rowgemm.c is compiled with (its SHAPES) and its
# defaults. Which panels-per-block is fastest for a row count is a property of the CPU and of how
# much of the model's weights its caches hold: on the 2-core AMD EPYC (Zen 3, 32 MiB L3) of
# sessions 1-28 one panel at a time was fastest for 2-8 block-quantized rows inside a forward
# (docs/BENCHMARKS.md, session 22); on the 2-core Intel Xeon with AVX-512 of session 29 that left
# 2-4 rows latency-bound (2 rows cost 1.9x one row, 1.2x with blocks of 4 panels). Synthetic
# weights were tried as the yardstick and chose wrongly: 24 MB of them sit in a 32 MiB L3, the
# 100 MB of the embedded target stream from memory (session 30). So the choice is measured on
# the model's own packed weights, once per model shape, kernel build, CPU and thread count, and
# cached. Results are bit-identical whatever the choice (each output is the same FMA chain).
BLOCK_SHAPES = {1: (1, 2, 4, 8), 2: (1, 2, 4), 3: (1, 2, 3, 4), 4: (1, 2, 3), 5: (1, 2), 6: (1, 2), 7: (1,), 8: (1,)}
DEFAULT_BLOCKS = {
    "f32": {1: 4, 2: 4, 3: 3, 4: 2, 5: 2, 6: 2, 7: 1, 8: 1},
    "f16": {1: 4, 2: 4, 3: 3, 4: 2, 5: 2, 6: 2, 7: 1, 8: 1},
    "q4": {1: 8, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1},
    "q8": {1: 8, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1},
}
TUNE_MARGIN = 0.03  # a shape replaces the default only when it is this much faster (noise guard)
BLOCKS_ENV = "DSPARK_KERNEL_BLOCKS"  # "default": keep the compiled defaults; "tune": measure again


def block_candidates(rows: int, kinds=tuple(DEFAULT_BLOCKS)) -> list[dict]:
    """The choices tried for `rows` rows, as {kind: panels per block}: the defaults first, then
    each compiled shape for every kind at once (a model mostly holds one packed form), leaving
    out those that differ from one another only in kinds not among `kinds` (the forms a model
    holds: the others are never called)."""
    default = {kind: DEFAULT_BLOCKS[kind][rows] for kind in DEFAULT_BLOCKS}
    choices = [default]
    for pb in BLOCK_SHAPES[rows]:
        choice = {kind: pb if kind in kinds else default[kind] for kind in DEFAULT_BLOCKS}
        if choice not in choices:
            choices.append(choice)
    return choices


def _set_rows(kernels: RowGemm, rows: int, choice: dict) -> None:
    for kind, pb in choice.items():
        if not kernels.set_block[kind](rows, pb):
            raise ValueError(f"the kernel has no block of {pb} panels for {rows} rows ({kind})")


def measure_blocks(kernels: RowGemm, products: list, rounds: int = 5) -> dict:
    """{rows: (median ms per candidate, the candidates, index of the chosen one)}: a pass over
    `products` (the model's `CpuKernel`s, as a forward calls them) timed with each of
    `block_candidates(rows)`, candidates interleaved in `rounds` rounds, at the current thread
    count. The defaults stay unless another candidate is TUNE_MARGIN faster. Leaves the kernel
    on the defaults."""
    import statistics
    import time

    result = {}
    with torch.inference_mode():
        kinds = {product.format for product in products}
        for rows in BLOCK_SHAPES:
            candidates = block_candidates(rows, kinds)
            if len(candidates) == 1:
                result[rows] = ([0.0], candidates, 0)
                continue
            xs = {n: torch.randn(rows, n) for n in {p.weight.shape[1] for p in products}}
            times = [[] for _ in candidates]
            for round_ in range(rounds + 1):  # round 0 warms up
                for i, choice in enumerate(candidates):
                    _set_rows(kernels, rows, choice)
                    start = time.perf_counter()
                    for product in products:
                        product(xs[product.weight.shape[1]])
                    if round_:
                        times[i].append((time.perf_counter() - start) * 1e3)
            ms = [statistics.median(t) for t in times]
            best = min(range(len(ms)), key=ms.__getitem__)
            chosen = best if ms[best] < (1 - TUNE_MARGIN) * ms[0] else 0
            _set_rows(kernels, rows, candidates[0])
            result[rows] = (ms, candidates, chosen)
    return result


def _model_signature(products: list) -> str:
    return ",".join(f"{p.format}:{p.weight.shape[0]}x{p.weight.shape[1]}" for p in products)


def _blocks_path(products: list, home=None) -> Path:
    """The cached choice for this kernel build, CPU, thread count and model shape."""
    from dspark.models.device import hardware_id
    from dspark.models.embedded import dspark_home

    parts = [SOURCE.read_text(), " ".join(CFLAGS), hardware_id("cpu"), _model_signature(products)]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return dspark_home(home) / "kernels" / f"blocks-{key}.json"


def _valid_blocks(blocks) -> bool:
    return isinstance(blocks, dict) and set(blocks) == set(DEFAULT_BLOCKS) and all(
        isinstance(blocks[k], dict) and set(blocks[k]) == {str(r) for r in BLOCK_SHAPES}
        and all(isinstance(v, int) and v in BLOCK_SHAPES[int(r)] for r, v in blocks[k].items())
        for k in DEFAULT_BLOCKS)


def tuned_blocks(kernels: RowGemm, products: list, home=None, mode: str | None = None) -> tuple[dict, str]:
    """({kind: {rows: pb}}, where it came from: "default", "cached <file>" or "measured <file>")
    for a model whose kernels are `products`. Reads the cached choice (see `_blocks_path`), else
    measures it (a few seconds, once) and caches it; `mode` (default: $DSPARK_KERNEL_BLOCKS)
    "default" keeps the compiled defaults, "tune" measures again. A cache that cannot be read is
    measured again, never trusted."""
    import json

    mode = (os.environ.get(BLOCKS_ENV, "") if mode is None else mode).strip().lower()
    if mode not in ("", "default", "tune"):
        raise ValueError(f"{BLOCKS_ENV}={mode!r}: use 'default' (the compiled block shapes), 'tune' "
                         "(measure them again) or leave it unset (measured once per machine and model, then cached)")
    if mode == "default" or not products:
        return {k: dict(v) for k, v in DEFAULT_BLOCKS.items()}, "default"
    path = _blocks_path(products, home)
    if mode != "tune":
        try:
            cached = json.loads(path.read_text())["blocks"]
            if _valid_blocks(cached):
                return {k: {int(r): pb for r, pb in v.items()} for k, v in cached.items()}, f"cached {path}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    measured = measure_blocks(kernels, products)
    blocks = {kind: {rows: candidates[chosen][kind] for rows, (_, candidates, chosen) in measured.items()}
              for kind in DEFAULT_BLOCKS}
    record = {"threads": torch.get_num_threads() if kernels.threaded else 1, "model": _model_signature(products),
              "blocks": blocks,
              "ms": {rows: [{"choice": c, "ms": round(t, 3)} for c, t in zip(candidates, ms)]
                     for rows, (ms, candidates, _) in measured.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # whole or not at all: a killed process never leaves half a cache
    return blocks, f"measured {path}"


def apply_blocks(kernels: RowGemm, blocks: dict) -> None:
    """Set the kernel's block shape for every kind and row count (for the whole process)."""
    for kind, per_rows in blocks.items():
        for rows, pb in per_rows.items():
            _set_rows(kernels, rows, {kind: pb})


_IN_USE: dict = {"blocks": {k: dict(v) for k, v in DEFAULT_BLOCKS.items()}, "source": "default"}


@lru_cache(maxsize=1)
def rowgemm() -> tuple[RowGemm | None, str]:
    """This process's kernel: (its entry points, "") or (None, why not); built at the first call,
    with the compiled block shapes (`enable_cpu_kernels` tunes them for the model it is given)."""
    return load_rowgemm()


def use_blocks(blocks: dict, source: str) -> None:
    """Make `blocks` the process's block shapes (they are global to the kernel library)."""
    apply_blocks(rowgemm()[0], blocks)
    _IN_USE.update(blocks={k: dict(v) for k, v in blocks.items()}, source=source)


def blocks_in_use() -> tuple[dict, str]:
    """({kind: {rows: panels per block}}, where they came from) for this process."""
    return {k: dict(v) for k, v in _IN_USE["blocks"].items()}, _IN_USE["source"]


def kernel_blocks() -> str:
    """The block shapes in use, as panels per block for 1..8 rows per kind, and their source."""
    if rowgemm()[0] is None:
        return "no kernel"
    blocks, source = blocks_in_use()
    return "; ".join(f"{k} " + ",".join(str(blocks[k][r]) for r in sorted(blocks[k])) for k in blocks) + f" ({source.split()[0]})"


def cpu_kernels_status() -> str:
    """One line for logs and benchmark headers: on, or off and why."""
    fn, why = rowgemm()
    if fn is None:
        return why
    return (f"on ({SOURCE.name}, 1-{MAX_ROWS} rows, {'OpenMP threads' if fn.threaded else 'one thread'}; "
            f"panels per block for 1-8 rows: {kernel_blocks()})")


def cpu_kernels_available() -> bool:
    return rowgemm()[0] is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 8), in, 8]: panel p holds outputs 8p..8p+7, zero-padded."""
    out, n = weight.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, n, dtype=torch.float32)
    padded[:out] = weight.detach()
    return padded.view(panels, PANEL, n).transpose(1, 2).contiguous()


def exact_in_float16(weight: torch.Tensor) -> bool:
    """Every value survives a round trip through float16 unchanged (no rounding, no overflow)."""
    return bool(torch.equal(weight.detach().half().float(), weight.detach()))


QBLOCK = 32  # inputs per block of a block-quantized record


def _padded_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] -> [ceil(out / 8) * 8, in / 32, 32] (zero rows appended), None when in % 32 != 0."""
    out, n = weight.shape
    if n == 0 or n % QBLOCK:
        return None
    padded = torch.zeros(-(-out // PANEL) * PANEL, n, dtype=torch.float32)
    padded[:out] = weight.detach()
    return padded.view(-1, n // QBLOCK, QBLOCK)


def _records(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-(row, block) scales [rows, blocks, 1] float32 and codes [rows, blocks, C] uint8 ->
    records [panels, blocks, 32 * len(scales) + 8 * C] bytes, panel p holding rows 8p..8p+7."""
    rows, blocks = parts[0].shape[:2]
    out = []
    for part in parts:
        width = part.shape[-1]
        part = part.contiguous().view(torch.uint8) if part.dtype == torch.float32 else part
        # [rows, blocks, width(, 4 bytes)] -> [panels, blocks, width, 8 rows(, 4 bytes)]
        grouped = part.reshape(rows // PANEL, PANEL, blocks, width, -1).permute(0, 2, 3, 1, 4)
        out.append(grouped.reshape(rows // PANEL, blocks, -1))
    return torch.cat(out, dim=-1).contiguous()


def pack_q4(weight: torch.Tensor) -> torch.Tensor | None:
    """Records for `dspark_rowgemm_q4` when every block of 32 inputs of every row is exactly
    w = q * d + m (q in 0..15, float32 product then sum), as in a model dequantized from Q4_1;
    else None. d and m come from the block's minimum and range, and the check is the kernel's
    own arithmetic, so the kernel rebuilds every weight bit for bit."""
    blocks = _padded_blocks(weight)
    if blocks is None:
        return None
    low = blocks.amin(-1, keepdim=True)
    span = blocks - low
    step = (span.amax(-1, keepdim=True) / 15).half().float()  # Q4_1 stores d as float16
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.where(step > 0, span / safe, torch.zeros_like(span)).round_().clamp_(0, 15)
    if not torch.equal(codes * step + low, blocks):
        return None
    nibbles = codes.to(torch.uint8)
    pairs = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # byte j: inputs 2j (low) and 2j+1
    return _records([step, low, pairs])


def pack_q8(weight: torch.Tensor) -> torch.Tensor | None:
    """Records for `dspark_rowgemm_q8` when every block of 32 inputs of every row is exactly
    w = q * d (q in -128..127), as in a model dequantized from Q8_0; else None."""
    blocks = _padded_blocks(weight)
    if blocks is None:
        return None
    step = blocks.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.where(step > 0, blocks / safe, torch.zeros_like(blocks)).round_().clamp_(-128, 127)
    if not torch.equal(codes * step, blocks):
        return None
    return _records([step, codes.to(torch.int8).view(torch.uint8)])


def pack_float16(weight: torch.Tensor) -> torch.Tensor | None:
    """Float16 panels when every value is exact in float16, else None."""
    return pack_panels(weight).half() if exact_in_float16(weight) else None


# the packed forms a kernel tries, fewest bytes per weight first (float32 panels are the fallback):
# q4 0.75, q8 1.125, f16 2, f32 4
PACKERS = {"q4": pack_q4, "q8": pack_q8, "f16": pack_float16}


class CpuKernel:
    """y = x @ weight.T (+ bias) for a fixed float32 CPU weight [out, in], 1-48 rows in C, from
    the most compact packed copy that rebuilds the weight exactly (`PACKERS`), else float32 panels.
    `formats` limits the compact forms tried (all of them by default)."""

    def __init__(self, weight: torch.Tensor, kernels: RowGemm, *, formats: tuple[str, ...] = tuple(PACKERS),
                 bf16_from_rows: int | None = None) -> None:
        self.weight = weight
        # a drafter's products of at least this many rows: bfloat16 matmul, float32 out (None: never)
        self.bf16_from_rows = bf16_from_rows
        self.weight_bf16 = None if bf16_from_rows is None else weight.detach().to(torch.bfloat16)
        self.bf16_calls = 0
        self.format, self.panels = "f32", None
        for name in formats:
            packed = PACKERS[name](weight)
            if packed is not None:
                self.format, self.panels = name, packed
                break
        if self.panels is None:
            self.panels = pack_panels(weight)
        self._fn = getattr(kernels, self.format)
        self._threaded = kernels.threaded
        self._stamp = self._current_stamp()
        self.fast_calls = 0  # products the kernel computed (the rest went through `linear`)

    def _current_stamp(self) -> tuple[int, int]:
        return self.weight.data_ptr(), self.weight._version

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; falls back to `linear` whenever the kernel does not apply."""
        out, n = self.weight.shape
        rows = x.numel() // max(n, 1)
        plain = (
            x.shape[-1] == n  # else `linear` raises the shape error (the C code would read out of bounds)
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self._current_stamp() == self._stamp
            and (bias is None or (bias.dtype == torch.float32 and bias.numel() == out))
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))  # no autograd in C
        )
        if plain and self.bf16_from_rows is not None and rows >= self.bf16_from_rows:
            y = torch.nn.functional.linear(x.reshape(rows, n).to(torch.bfloat16), self.weight_bf16).float()
            if bias is not None:
                y += bias
            self.bf16_calls += 1
            return y.reshape(*x.shape[:-1], out)
        if not (plain and 1 <= rows <= MAX_ROWS):
            return linear(x, self.weight, bias)
        flat = x.reshape(rows, n).contiguous()
        b = None if bias is None else bias.detach().contiguous()
        y = torch.empty(rows, out, dtype=torch.float32)
        threads = torch.get_num_threads() if self._threaded else 1
        self._fn(flat.data_ptr(), self.panels.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), rows, n, out, threads)
        self.fast_calls += 1
        return y.reshape(*x.shape[:-1], out)


def target_linears(model) -> list:
    """A TargetModel's decoder-layer linear modules (each holding `weight` [out, in], `bias`)."""
    return [
        m
        for layer in model.model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def enable_cpu_kernels(model, home=None, tune: bool = True) -> bool:
    """Give a float32 CPU `TargetModel` the small-row kernel (see the module doc), with the block
    shapes tuned for this model on this machine (`tuned_blocks`, cached under `home`; `tune=False`
    leaves the shapes as they are).

    Returns False, changing nothing, when the model is not float32 on the CPU or the kernel is
    unavailable (`cpu_kernels_status()` says why)."""
    kernels = rowgemm()[0]
    if kernels is None or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return False
    for module in target_linears(model):
        module.cpu_kernel = CpuKernel(module.weight, kernels)
    model.head_kernel = CpuKernel(model.lm_head_weight, kernels)
    if tune:
        products = [m.cpu_kernel for m in target_linears(model)] + [model.head_kernel]
        use_blocks(*tuned_blocks(kernels, products, home))
    return True


def has_cpu_kernels(model) -> bool:
    """Whether `enable_cpu_kernels` gave this target model its kernels."""
    return "head_kernel" in getattr(model, "__dict__", {})


def disable_cpu_kernels(model) -> None:
    """Drop the kernels and their packed copies."""
    for module in target_linears(model):
        module.__dict__.pop("cpu_kernel", None)
    model.__dict__.pop("head_kernel", None)


DRAFTER_BF16_CHOICES = ("auto", "on", "off")


def drafter_bf16_from_rows(choice: str | None = None) -> int | None:
    """From how many rows a drafter's products run in bfloat16 (module docstring): `DRAFTER_BF16_FROM_ROWS`
    where the CPU has AMX tiles for bfloat16 (the only kind measured so far), else None. `choice` on / off
    overrides that (None: the environment's `DSPARK_DRAFTER_BF16`, else auto)."""
    from dspark.errors import UserError
    from dspark.models.device import cpu_has_amx_bf16

    name = "drafter bf16 choice" if choice is not None else "DSPARK_DRAFTER_BF16"
    choice = (os.environ.get("DSPARK_DRAFTER_BF16", "auto") if choice is None else choice).strip().lower()
    if choice not in DRAFTER_BF16_CHOICES:
        raise UserError(f"{name}={choice!r}: use auto, on or off")
    if choice == "off" or (choice == "auto" and not cpu_has_amx_bf16()):
        return None
    return DRAFTER_BF16_FROM_ROWS


def enable_drafter_cpu_kernels(drafter, target=None, bf16: str | None = None) -> bool:
    """Give a float32 CPU drafter the kernel on every `Linear` and on its LM head (the draft
    vocabulary's rows, or the target's head kernel when it drafts over the whole vocabulary),
    with the bfloat16 path for many rows where the CPU has it (`drafter_bf16_from_rows(bf16)`).
    For serving: under autograd the kernels step aside. False (nothing changed) as above."""
    from dspark.models.layers import Linear

    kernels = rowgemm()[0]
    if kernels is None or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in drafter.parameters()):
        return False
    bf16_rows = drafter_bf16_from_rows(bf16)
    for module in drafter.modules():
        if isinstance(module, Linear):
            module.cpu_kernel = CpuKernel(module.weight, kernels, bf16_from_rows=bf16_rows)
    drafter.__dict__["cpu_kernels_bf16_rows"] = bf16_rows
    drafter.__dict__["cpu_kernels_target"] = target  # not `drafter.x = target`: that would register a submodule
    if hasattr(drafter, "refresh_head_kernel"):
        drafter.refresh_head_kernel()
    return True

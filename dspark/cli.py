"""`dspark` command line: parse arguments, build config, call the library.

User errors print one line (`dspark: error: ...`) and exit with status 2;
nothing here holds logic of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dspark.errors import UserError


def _add_target_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--target", default=None, help="Hugging Face Llama-family model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--home", default=None, help="dspark home folder for caches (default: $DSPARK_HOME or ~/.cache/dspark)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target weight dtype")
    p.add_argument("--no-cpu-kernel", dest="cpu_kernels", action="store_false",
                   help="compute small-row float32 matmuls with torch instead of dspark's C kernel")
    if device:
        _add_device_arg(p)


def _add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (a CUDA GPU if torch sees one, else the CPU), cpu, cuda or cuda:N; the drafter follows the target")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt with speculative decoding")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--drafter", default="default", help="none | ngram | default | mtp1 | PATH to a drafter folder")
    g.add_argument("--block-size", type=int, default=None, help="draft tokens per round (model-free drafters)")
    g.add_argument("--policy", default="auto",
                   help="verify-length policy: auto (dspark for a drafter with a confidence head, else fixed), "
                        "none, fixed, threshold, dspark, dspark-async")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_target_args(g)
    _add_sampling_args(g)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--drafter", default="default", help="none | ngram | default | mtp1 | PATH")
    s.add_argument("--policy", default="dspark", help="none, fixed, threshold, dspark, dspark-async")
    s.add_argument("--threshold", type=float, default=0.5, help="survival threshold for --policy threshold")
    s.add_argument("--block-size", type=int, default=None, help="draft tokens per round (model-free drafters)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    s.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens per request")
    s.add_argument("--kv-budget-tokens", type=int, default=65536, help="KV-cache tokens across requests")
    _add_target_args(s)

    pr = sub.add_parser("profile", help="measure (or show the cached) steps-per-second curve SPS(B)")
    pr.add_argument("--drafter", default="default")
    pr.add_argument("--block-size", type=int, default=None)
    pr.add_argument("--out", default=None, help="PNG plot path (default: next to the cached table)")
    pr.add_argument("--refresh", action="store_true", help="measure again even if a cached table matches")
    _add_target_args(pr)

    pp = sub.add_parser("prepare", help="regenerate training answers with the target (resumable)")
    pp.add_argument("--prompts", default=None, help="prompt JSON Lines (default: the shipped training prompts)")
    pp.add_argument("--out", default="data/prepared", help="output folder of token shards")
    pp.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    pp.add_argument("--max-new-tokens", type=int, default=384, help="answer length cap")
    pp.add_argument("--temperature", type=float, default=0.7)
    pp.add_argument("--top-p", type=float, default=0.9)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--batch", type=int, default=16, help="requests generated at once")
    pp.add_argument("--target", default=None)
    _add_device_arg(pp)

    t = sub.add_parser("train", help="train a drafter from a recipe in configs/ (resumes by default)")
    t.add_argument("config", help="recipe file, e.g. configs/dspark.toml")
    t.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    t.add_argument("--stop-at-step", type=int, default=None, help="stop early at this step (checkpointed)")
    _add_device_arg(t)
    t.add_argument("--evaluate", metavar="DRAFTER", default=None,
                   help="do not train: print the held-out evaluation of a drafter folder on this recipe's data (JSON)")
    t.add_argument("--eval-features", choices=["online", "cache"], default="online",
                   help="with --evaluate: compute the target's features online, or read them from the recipe's feature cache")

    te = sub.add_parser("train-equal", help="train recipes side by side to the largest equal step budget a deadline "
                        "allows, then score them paired offline")
    te.add_argument("configs", nargs="+", help="training recipes (.toml or .json)")
    te.add_argument("--out", required=True, help="folder for the runs, the derived recipes, logs and the page")
    te.add_argument("--deadline-s", type=float, required=True, help="seconds from start to the end of evaluation")
    te.add_argument("--probe-steps", type=int, default=20, help="steps timed side by side (inside every warm-up)")
    te.add_argument("--max-steps", type=int, default=None, help="cap on the budget")
    te.add_argument("--round-to", type=int, default=50, help="the budget is a multiple of this")
    te.add_argument("--eval-reserve-s", type=float, default=150.0, help="seconds kept for the offline evaluation")
    te.add_argument("--eval-limit", type=int, default=None, help="prompts per benchmark (dspark eval offline --limit)")
    te.add_argument("--eval-max-new-tokens", type=int, default=128,
                    help="answer length of the offline evaluation (128: the CPU trio's pages)")
    te.add_argument("--no-eval", action="store_true", help="train only")
    _add_device_arg(te)

    c = sub.add_parser("calibrate", help="Sequential Temperature Scaling of a drafter's confidence head")
    c.add_argument("drafter", help="drafter folder")
    c.add_argument("--data", default="data/prepared", help="prepared data folder (its held-out part is used)")
    c.add_argument("--holdout-fraction", type=float, default=0.02)
    c.add_argument("--max-sequences", type=int, default=512)
    c.add_argument("--anchors-per-seq", type=int, default=16,
                   help="blocks cut from each held-out sequence (more blocks: steadier temperatures)")
    c.add_argument("--labels", default="realised", choices=["realised", "soft"])
    c.add_argument("--no-write", action="store_true", help="report only; do not store the temperatures")
    c.add_argument("--target", default=None)

    dv = sub.add_parser("draft-vocab", help="rank the target's tokens for a drafter's draft vocabulary (faster drafting)")
    dv.add_argument("drafter", help="dspark or dflash drafter folder")
    dv.add_argument("--data", default="data/prepared", help="prepared data folder (its training part is counted)")
    dv.add_argument("--size", type=int, default=8192, help="draft among this many most frequent tokens; 0 = all")
    dv.add_argument("--holdout-fraction", type=float, default=0.02)
    dv.add_argument("--no-write", action="store_true", help="report the coverage only")

    e = sub.add_parser("eval", help="acceptance length on the paper's benchmarks (or: dspark eval report | offline)")
    e.add_argument("--drafter", default="ngram", help="PATH[,PATH...] or none/ngram/default; 'report' rebuilds docs")
    e.add_argument("--bench", default="all", help="all | math | code | chat | gsm8k,mbpp,...")
    e.add_argument("--limit", type=int, default=None, help="prompts per benchmark (offline: 12 unless given)")
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--results", default=None, help="run JSON folder (eval default runs/eval; report default docs/eval-runs)")
    e.add_argument("--no-baseline", action="store_true", help="skip the --drafter none speed baseline")
    e.add_argument("--json", action="store_true")
    e.add_argument("--top-p", type=float, default=1.0, help="offline: top-p of the target's answers")
    e.add_argument("--answers", default="runs/bench-answers", help="offline: folder caching the target's answers")
    e.add_argument("--no-heldout", action="store_true", help="offline: skip the held-out training prompts")
    e.add_argument("--against", action="append", default=None, metavar="PAGE.json[:LABEL]",
                   help="offline: pair with drafters an earlier run scored, read from its JSON (repeatable)")
    e.add_argument("--exclude", action="append", default=None, metavar="SET/ID[,SET/ID...]",
                   help="offline: prompts left out of scoring, e.g. answers that differ from an --against page's")
    e.add_argument("report", nargs="?", help="'report': rebuild docs/RESULTS.md and figures from saved runs; "
                   "'offline': expected tau of drafters on the target's own answers (no draws)")
    _add_target_args(e)

    b = sub.add_parser("bench", help="benchmarks that print numbers")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="lean runtime vs transformers step time, greedy tokens/s, ngram speedup")
    bd.add_argument("--repeats", type=int, default=10)
    bd.add_argument("--max-new-tokens", type=int, default=128)
    bd.add_argument("--out", default=None, help="also write the report (Markdown) and its JSON here")
    _add_target_args(bd, device=False)  # a CPU benchmark against transformers
    bdr = bsub.add_parser("draft", help="drafting time per round against target verification")
    bdr.add_argument("--repeats", type=int, default=5)
    _add_target_args(bdr)
    bs = bsub.add_parser("serve", help="load generator: throughput vs per-user speed per arm")
    bs.add_argument("--arm", action="append", default=[],
                    help="NAME=DRAFTER:POLICY[:k|threshold] (in-process) or NAME=http://127.0.0.1:PORT; repeatable")
    bs.add_argument("--dspark", default=None, help="trained DSpark drafter (default, or a folder): adds the paper's arms")
    bs.add_argument("--mtp", default=None, help="trained MTP-1 drafter for the mtp1 arm: mtp1 (the shipped one) or a folder")
    bs.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="closed-loop client counts")
    bs.add_argument("--rates", default="", help="open-loop Poisson arrival rates (requests/s), comma separated")
    bs.add_argument("--max-new-tokens", type=int, default=64)
    bs.add_argument("--max-seconds", type=float, default=3600.0, help="no new level starts after this")
    bs.add_argument("--repeats", type=int, default=1,
                    help="sweeps over every level and arm, interleaved (2 or more give each point a noise estimate)")
    bs.add_argument("--requests-per-client", type=int, default=2, help="closed loop: requests per client per level")
    bs.add_argument("--level-seconds", type=float, default=120.0,
                    help="wall-time limit of one (arm, level); requests still running are cancelled")
    bs.add_argument("--no-warmup-pass", dest="warmup_pass", action="store_false",
                    help="skip the untimed pass of every arm at the largest load before timing (it keeps the "
                         "process's first full batch out of the first arm's numbers)")
    bs.add_argument("--interleave", action="store_true",
                    help="in-process: run the arms of each level at once, their engines taking steps in turn, and "
                         "time each arm's throughput on its own steps, so the machine's drift slows every arm alike "
                         "(per-user speeds then include the other arms' steps)")
    bs.add_argument("--think-seconds", type=float, default=0.0,
                    help="closed loop: mean pause of a client before each request (exponential, the same for "
                         "every arm); 0 sends the next request as soon as the last one ends")
    bs.add_argument("--bench", dest="prompt_sets", default="all",  # dest: args.bench names the bench subcommand
                    help="prompt sets replayed: all | math | code | chat | gsm8k,mbpp,...")
    bs.add_argument("--temperature", type=float, default=0.0,
                    help="0 decodes greedily (lossless arms then generate identical tokens); > 0 samples, seeded per request")
    bs.add_argument("--out", default="runs/load", help="folder for JSON and plots")
    bs.add_argument("--name", default="load", help="file stem: OUT/NAME.json, OUT/NAME_throughput_vs_tps.png, ...")
    _add_target_args(bs)
    bt = bsub.add_parser("train-step", help="a recipe's training step per draft vocabulary size, precision and anchor count")
    bt.add_argument("config", help="training recipe, e.g. configs/dspark-960-t1-r256-5l-v8k.toml")
    bt.add_argument("--sizes", default="0,8192", help="draft vocabulary sizes, comma separated (0 = whole vocabulary)")
    bt.add_argument("--precisions", default=None,
                    help="[optim] precision of each arm, comma separated: auto, bf16, fp32 (default: the recipe's own)")
    bt.add_argument("--anchors", default=None,
                    help="[optim] anchors_per_seq of each arm, comma separated (default: the recipe's own)")
    bt.add_argument("--repeats", type=int, default=8, help="timed steps per arm")
    bt.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first")
    bt.add_argument("--out", default=None, help="also write the result as JSON here")
    bf = bsub.add_parser("bigram-fit", help="each Markov start (markov_init) as a bigram model on held-out answers")
    bf.add_argument("--train", default="data/prepared-t1", help="prepared data the starts are computed from")
    bf.add_argument("--heldout", default="data/prepared-t1-4000",
                    help="prepared data whose sequences not in --train are scored")
    bf.add_argument("--last", type=int, default=300, help="score the last N such sequences")
    bf.add_argument("--holdout-fraction", type=float, default=0.02, help="the recipes' [data] holdout_fraction")
    bf.add_argument("--max-len", type=int, default=640, help="the recipes' [data] max_seq_len")
    bf.add_argument("--size", type=int, default=8192, help="draft vocabulary size (tokens in the matrices)")
    bf.add_argument("--rank", type=int, default=256, help="the Markov head's rank")
    bf.add_argument("--shrinks", default="2,5,20", help="pmi+target shrink weights, comma separated")
    bf.add_argument("--json", default="", help="also write the result here")
    bk = bsub.add_parser("soak", help="many streaming clients with cancellations and malformed requests")
    bk.add_argument("--url", required=True, help="a running dspark serve on 127.0.0.1")
    bk.add_argument("--clients", type=int, default=16)
    bk.add_argument("--requests", type=int, default=200)
    bk.add_argument("--max-seconds", type=float, default=300.0)
    return parser


def _sampling(args) -> "SamplingParams":
    from dspark.types import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def cmd_generate(args) -> int:
    from dspark.draft.registry import load_drafter
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.engine.generate import generate
    from dspark.models import load_target
    from dspark.models.chat import encode_prompt
    from dspark.engine.policy import build_policy

    params = _sampling(args)
    if not args.prompt.strip():
        raise UserError("the prompt is empty: pass some text with --prompt")
    if args.block_size is not None and not (1 <= args.block_size <= 64):
        raise UserError(f"--block-size must be in 1..64, got {args.block_size}")
    loaded = load_target(args.target, home=args.home, dtype=_dtype(args.dtype), cpu_kernels=args.cpu_kernels,
                         device=args.device)
    if loaded.tokenizer is None:
        raise UserError(f"the target folder {loaded.path} has no tokenizer files; add them (tokenizer.json) to generate text")
    drafter = load_drafter(args.drafter, loaded.model, block_size=args.block_size, embedded=args.target is None)
    prompt_ids = encode_prompt(loaded.tokenizer, args.prompt, chat=args.chat)
    name = args.policy
    if name == "auto":
        name = "dspark" if drafter.has_confidence else "fixed"
    cost = None
    if name in ("dspark", "dspark-async", "retrospective"):
        from dspark.engine.profile import ProfileSettings, profile_engine

        # batch 1: F(B) for B = 1..G+1 and D(1), measured once per machine and cached
        cost = profile_engine(
            loaded.model, drafter, model_id=f"{loaded.name}@{loaded.path}", drafter_id=f"{args.drafter}:{drafter.name}",
            settings=ProfileSettings(max_requests=1), tokenizer=loaded.tokenizer, home=args.home,
            progress=not args.json,
        ).cost
    policy = build_policy(name, block_size=drafter.block_size, cost=cost)
    engine = Engine(loaded.model, drafter, policy, EngineConfig(max_running=1), tokenizer=loaded.tokenizer)
    result = generate(engine, prompt_ids, params)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(result.text)
        s = result.stats
        print(
            f"[{result.num_generated} tokens in {result.seconds:.2f} s, {result.tokens_per_second:.1f} tok/s, "
            f"tau {s.mean_accepted_length:.2f} over {s.rounds} rounds, drafter {drafter.name}, policy {name}"
            f"{f', {engine.num_draft_skips} steps without drafting' if engine.num_draft_skips else ''}]",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args) -> int:
    from dspark.engine.engine import EngineConfig
    from dspark.server import run_server

    config = EngineConfig(
        max_running=args.max_running, max_seq_len=args.max_seq_len, kv_budget_tokens=args.kv_budget_tokens
    )
    run_server(
        args.target, args.drafter, args.policy, args.host, args.port, args.api_key, home=args.home,
        dtype=args.dtype, cpu_kernels=args.cpu_kernels, device=args.device, block_size=args.block_size,
        threshold=args.threshold, engine_config=config,
    )
    return 0


def cmd_profile(args) -> int:
    from dspark.engine.profile import run_profile

    run_profile(
        args.target, args.drafter, home=args.home, dtype=args.dtype, cpu_kernels=args.cpu_kernels,
        device=args.device, block_size=args.block_size, out_png=args.out, refresh=args.refresh,
    )
    return 0


def cmd_prepare(args) -> int:
    from dspark.train.prepare import run_prepare

    run_prepare(
        args.prompts, args.out, args.target, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, limit=args.limit, batch=args.batch, device=args.device,
    )
    return 0


def cmd_train_equal(args) -> int:
    from dspark.train.equal_budget import EqualBudgetSettings, run_equal_budget

    run_equal_budget(args.configs, EqualBudgetSettings(
        out=args.out, deadline_s=args.deadline_s, probe_steps=args.probe_steps, max_steps=args.max_steps,
        round_to=args.round_to, eval_reserve_s=args.eval_reserve_s, eval_limit=args.eval_limit,
        eval_max_new_tokens=args.eval_max_new_tokens, evaluate=not args.no_eval, device=args.device))
    return 0


def cmd_train(args) -> int:
    from dspark.train.run import evaluate_drafter, run_train

    if args.evaluate:
        print(json.dumps(evaluate_drafter(args.config, args.evaluate, features=args.eval_features)))
        return 0
    folder = run_train(args.config, resume=not args.no_resume, stop_at_step=args.stop_at_step, device=args.device)
    print(f"dspark train: drafter written to {folder}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun, leave without the interpreter's teardown: after the process group is
        # destroyed, gloo's threads occasionally abort a rank at exit ("terminate called without an
        # active exception", 2 of 24 two-rank runs on a busy 2-core machine), and torchrun then
        # reports a finished run as failed. Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_calibrate(args) -> int:
    from dspark.train.run import run_calibrate

    run_calibrate(
        args.drafter, args.data, target_path=args.target, holdout_fraction=args.holdout_fraction,
        max_sequences=args.max_sequences, anchors_per_seq=args.anchors_per_seq, labels=args.labels,
        write=not args.no_write,
    )  # prints its per-position report
    return 0


def cmd_draft_vocab(args) -> int:
    from dspark.train.draft_vocab import build_draft_vocab, format_report

    report = build_draft_vocab(args.drafter, args.data, size=args.size, holdout_fraction=args.holdout_fraction,
                               write=not args.no_write)
    print(format_report(report))
    return 0


def cmd_eval(args) -> int:
    if args.report == "offline":
        from dspark.eval.offline import run_offline

        _, page = run_offline(
            args.drafter, args.bench, limit=12 if args.limit is None else args.limit, temperature=args.temperature,
            top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed, heldout=not args.no_heldout,
            target=args.target, home=args.home, device=args.device, answers_root=args.answers,
            results_dir=args.results or "runs/offline", against=args.against, exclude=args.exclude,
        )
        print(page.read_text())
        print(f"written: {page} (and .json, .png)")
        return 0
    if args.report is not None:
        if args.report != "report":
            raise UserError(f"unknown eval action {args.report!r}: use 'dspark eval report' or 'dspark eval offline'")
        from dspark.eval.report import run_report

        run_report(args.results or "docs/eval-runs", "docs/RESULTS.md", "docs/figures")
        return 0
    from dspark.eval.harness import run_eval
    from dspark.eval.tables import format_eval

    run = run_eval(
        args.drafter, args.bench, limit=args.limit, temperature=args.temperature, block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, seed=args.seed, target=args.target, home=args.home,
        dtype=args.dtype, cpu_kernels=args.cpu_kernels, device=args.device, baseline=not args.no_baseline,
        results_dir=args.results or "runs/eval",
    )
    print(json.dumps(run.brief()) if args.json else format_eval(run))
    return 0


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flag} takes comma-separated whole numbers, got {text!r}") from None


def cmd_bench(args) -> int:
    if args.bench == "decode":
        from dspark.bench.decode_cli import run

        run(args)
    elif args.bench == "draft":
        from dspark.bench.draft import run_draft_bench
        from dspark.models import load_target

        loaded = load_target(args.target, home=args.home, dtype=_dtype(args.dtype), cpu_kernels=args.cpu_kernels,
                             device=args.device)
        run_draft_bench(loaded.model, repeats=args.repeats)
    elif args.bench == "serve":
        _bench_serve(args)
    elif args.bench == "train-step":
        from dspark.bench.train_step import run_train_step_bench

        precisions = None if args.precisions is None else [p.strip() for p in args.precisions.split(",")]
        anchors = None if args.anchors is None else list(_ints(args.anchors, "--anchors"))
        run_train_step_bench(args.config, list(_ints(args.sizes, "--sizes")), repeats=args.repeats,
                             warmup=args.warmup, out=args.out, precisions=precisions, anchors=anchors)
    elif args.bench == "bigram-fit":
        from dspark.bench.bigram_fit import BigramFitSettings, run_bigram_fit

        try:
            shrinks = tuple(float(x) for x in args.shrinks.split(",") if x.strip())
        except ValueError:
            shrinks = ()
        if not shrinks or not all(x > 0 for x in shrinks):
            raise UserError(f"--shrinks takes comma-separated positive numbers, got {args.shrinks!r}")
        run_bigram_fit(BigramFitSettings(args.train, args.heldout, args.last, args.holdout_fraction, args.max_len,
                                         args.size, args.rank, shrinks, json=args.json))
    elif args.bench == "soak":
        from dspark.bench.soak import SoakSettings, run_soak

        settings = SoakSettings(clients=args.clients, requests=args.requests, max_seconds=args.max_seconds)
        return 0 if run_soak(args.url, settings).passed else 1
    return 0


def _bench_serve(args) -> None:
    from dataclasses import replace

    from dspark.bench.arms import paper_arms, parse_arm
    from dspark.bench.clients import SamplingSpec
    from dspark.bench.load import LoadSettings, run_load_bench

    arms = [parse_arm(a) for a in args.arm]
    if args.dspark or args.mtp or not arms:
        arms += paper_arms(args.dspark, args.mtp)
    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise UserError(f"--rates takes comma-separated numbers (requests/s), got {args.rates!r}") from None
    if not 0.0 <= args.temperature <= 2.0:
        raise UserError(f"--temperature must be in [0, 2], got {args.temperature}")
    sampling = replace(SamplingSpec(), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=0 if args.temperature > 0 else None)
    settings = LoadSettings(
        concurrency=_ints(args.concurrency, "--concurrency"), rates=rates, max_seconds=args.max_seconds,
        repeats=args.repeats, requests_per_client=args.requests_per_client, level_seconds=args.level_seconds,
        bench=args.prompt_sets, sampling=sampling, warmup_pass=args.warmup_pass, think_s=args.think_seconds,
        interleave=args.interleave,
    )
    run_load_bench(arms, settings, target=args.target, home=args.home, dtype=args.dtype, cpu_kernels=args.cpu_kernels,
                   device=args.device, out_dir=args.out, name=args.name,
                   command="dspark " + " ".join(sys.argv[1:]))


COMMANDS = {
    "generate": cmd_generate,
    "serve": cmd_serve,
    "profile": cmd_profile,
    "prepare": cmd_prepare,
    "train": cmd_train,
    "train-equal": cmd_train_equal,
    "calibrate": cmd_calibrate,
    "draft-vocab": cmd_draft_vocab,
    "eval": cmd_eval,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

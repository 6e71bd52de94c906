"""/metrics: valid Prometheus text (checked by a strict parser written here),
every documented family present, and the counters agree with what the
requests reported (usage, rounds) on a fresh server."""

from __future__ import annotations

import math
import re

import httpx
import pytest

from dspark.engine.metrics import Histogram, format_value
from tests.server_harness import make_engine, running_server, single_torch_thread

MODEL = "tiny-test"
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^({_NAME})(\{{{_LABEL}(?:,{_LABEL})*\}})? (\S+)$")


def parse_prometheus(text: str) -> dict[str, dict]:
    """family name -> {"type", "help", "samples": {(sample name, labels): value}}; raises on any bad line."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name) and name not in families, line
            families[name] = {"help": help_text, "type": None, "samples": {}}
            current = name
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert name == current and kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            families[name]["type"] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"bad sample line: {line!r}"
            name, labels, value = match.groups()
            fam = families[current]
            allowed = {current} | ({current + s for s in ("_bucket", "_sum", "_count")}
                                   if fam["type"] == "histogram" else set())
            assert name in allowed, f"{name} outside its family {current}"
            key = (name, labels or "")
            assert key not in fam["samples"], f"duplicate sample {key}"
            fam["samples"][key] = float(value)  # accepts NaN, +Inf
    return families


def _value(families: dict, name: str, labels: str = "", suffix: str = "") -> float:
    return families[name]["samples"][(name + suffix, labels)]


def _check_histogram(families: dict, name: str) -> None:
    samples = families[name]["samples"]
    buckets = [(k[1], v) for k, v in samples.items() if k[0] == name + "_bucket"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert buckets[-1][0] == '{le="+Inf"}'
    assert counts[-1] == samples[(name + "_count", "")]


EXPECTED = [
    "dspark_requests_running", "dspark_requests_waiting", "dspark_queue_depth", "dspark_requests_finished_total",
    "dspark_requests_aborted_total", "dspark_requests_failed_total", "dspark_prompt_tokens_total",
    "dspark_generation_tokens_total", "dspark_kv_tokens_in_use", "dspark_kv_free_slots", "dspark_step_seconds",
    "dspark_step_errors_total", "dspark_time_to_first_token_seconds", "dspark_time_per_output_token_seconds",
    "dspark_request_latency_seconds", "dspark_spec_rounds_total", "dspark_spec_verified_draft_tokens_total",
    "dspark_spec_accepted_tokens_total", "dspark_spec_committed_tokens_total", "dspark_spec_acceptance_length",
    "dspark_spec_mean_verify_length", "dspark_spec_position_reached_total", "dspark_spec_position_accepted_total",
    "dspark_spec_position_acceptance_rate", "dspark_spec_predicted_accepted_total",
    "dspark_spec_calibrated_accepted_total", "dspark_spec_calibrated_rounds_total", "dspark_spec_calibration_error",
    "dspark_decode_steps_total", "dspark_engine_steps_total", "dspark_engine_step_seconds_total",
    "dspark_engine_step_positions_total", "dspark_engine_step_forward_seconds_total",
    "dspark_engine_idle_seconds_total",
]


def test_metrics_parse_and_match_the_requests():
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    with single_torch_thread(), running_server(make_engine(seed=7), MODEL) as server:
        client = server.client()
        empty = parse_prometheus(httpx.get(server.base_url + "/metrics", timeout=10).text)
        assert math.isnan(_value(empty, "dspark_spec_acceptance_length"))
        outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=20 + 5 * i, temperature=0,
                                          extra_body={"ignore_eos": True}) for i, p in enumerate(prompts)]
        server.wait_idle()
        resp = httpx.get(server.base_url + "/metrics", timeout=10)
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = parse_prometheus(resp.text)
    assert set(EXPECTED) <= set(fams)
    assert _value(fams, "dspark_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert _value(fams, "dspark_generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert _value(fams, "dspark_requests_finished_total", '{reason="length"}') == len(prompts)
    assert _value(fams, "dspark_requests_aborted_total") == 0
    rounds = sum(o.dspark["rounds"] for o in outs)
    assert _value(fams, "dspark_spec_rounds_total") == rounds
    # a single cost curve: the scheduler has no draft gate, every decode step drafts everyone; the
    # requests ran one after another, so each decode step was one request's round
    steps = {k: _value(fams, "dspark_decode_steps_total", f'{{drafted="{k}"}}') for k in ("all", "some", "none")}
    assert steps == {"all": rounds, "some": 0, "none": 0}
    committed = _value(fams, "dspark_spec_committed_tokens_total")
    assert _value(fams, "dspark_spec_acceptance_length") == pytest.approx(committed / rounds)
    verified = _value(fams, "dspark_spec_verified_draft_tokens_total")
    assert _value(fams, "dspark_spec_mean_verify_length") == pytest.approx(verified / rounds)
    assert _value(fams, "dspark_spec_accepted_tokens_total") <= verified
    reached = _value(fams, "dspark_spec_position_reached_total", '{position="1"}')
    accepted = _value(fams, "dspark_spec_position_accepted_total", '{position="1"}')
    rate = _value(fams, "dspark_spec_position_acceptance_rate", '{position="1"}')
    assert reached > 0 and rate == pytest.approx(accepted / reached)
    calibrated = _value(fams, "dspark_spec_calibrated_rounds_total")
    predicted = _value(fams, "dspark_spec_predicted_accepted_total")
    realised = _value(fams, "dspark_spec_calibrated_accepted_total")
    # the bigram drafter reports confidences every round it drafts: all but a request's last round
    # when that round had a single token left to generate (nothing drafted, nothing predicted)
    assert rounds - len(prompts) <= calibrated <= rounds
    assert _value(fams, "dspark_spec_calibration_error") == pytest.approx((predicted - realised) / calibrated)
    assert _value(fams, "dspark_kv_tokens_in_use") == 0 and _value(fams, "dspark_requests_running") == 0
    assert _value(fams, "dspark_time_to_first_token_seconds", suffix="_count") == len(prompts)
    for hist in ("dspark_step_seconds", "dspark_time_to_first_token_seconds", "dspark_request_latency_seconds"):
        _check_histogram(fams, hist)
    assert _value(fams, "dspark_step_seconds", suffix="_count") >= rounds / 4  # 4 slots: at most 4 rounds per step
    # where the time went, by step kind: one request at a time, so every decode step drafted and
    # held no prompt chunk; the prompt chunks forwarded every prompt token, the decode steps one
    # position per round plus the verified draft tokens
    kinds = {k: [_value(fams, f"dspark_engine_{what}_total", f'{{kind="{k}"}}')
                 for what in ("steps", "step_seconds", "step_positions")] for k in ("prefill", "plain", "drafted")}
    assert kinds["drafted"][0] == rounds and kinds["plain"] == [0, 0, 0]
    assert kinds["drafted"][2] == rounds + verified
    assert len(prompts) <= kinds["prefill"][0] and kinds["prefill"][2] == _value(fams, "dspark_prompt_tokens_total")
    # the target forward is part of every step that ran one, never all of a drafted step's time
    forward = {k: _value(fams, "dspark_engine_step_forward_seconds_total", f'{{kind="{k}"}}')
               for k in ("prefill", "plain", "drafted")}
    assert forward["plain"] == 0 and 0 < forward["prefill"] <= kinds["prefill"][1]
    assert 0 < forward["drafted"] < kinds["drafted"][1]
    assert sum(k[0] for k in kinds.values()) == _value(fams, "dspark_step_seconds", suffix="_count")
    assert sum(k[1] for k in kinds.values()) == pytest.approx(_value(fams, "dspark_step_seconds", suffix="_sum"))
    assert _value(fams, "dspark_engine_idle_seconds_total") > 0  # it waited between the requests


def test_histogram_and_value_format():
    hist = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 3.0):
        hist.observe(v)
    assert hist.cumulative() == [("0.1", 2), ("1", 3), ("+Inf", 4)]  # le is inclusive
    assert [format_value(v) for v in (3, 2.0, 0.25, math.nan, math.inf)] == ["3", "2", "0.25", "NaN", "+Inf"]

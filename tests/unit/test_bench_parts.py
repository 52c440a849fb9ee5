"""The pure parts of bench: replay lines, the block schedule, the round arithmetic, the roofline."""

from __future__ import annotations

import dataclasses
import gzip
import math

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specproxy.analyze.bench import Round, geometric_mean_ci, round_aggregate, summarize_bench
from specproxy.analyze.roofline import roofline
from specproxy.analyze.summary import mean_ci
from specproxy.app.bench import schedule
from specproxy.app.fake_upstream import make_record
from specproxy.app.replay import CHAT, COMPLETIONS, MESSAGES, RESPONSES, parse_line, read_replay_file, replay_line
from specproxy.app.restarts import RestartError, restart_command, run_restart
from specproxy.errors import ConfigError
from specproxy.store.captures import Captured


def captured(body: bytes, path: str = CHAT, encoding: str = "") -> Captured:
    return Captured("t1", 0.0, "POST", path, encoding, body)


@given(st.binary(max_size=300), st.sampled_from([CHAT, COMPLETIONS, "/chat/completions"]))
def test_an_exported_line_gives_back_the_captured_bytes(body, path):
    """Whatever the bytes (UTF-8 or not): export's line parses back to the same path and body. A body
    that is not a JSON object cannot be sent as a request, and says so; the bytes never change."""
    line = replay_line(captured(body, path))
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        req = parse_line(line[:-1], "f:1")
        assert (req.path, req.body, req.content_encoding) == (path, body, "")
    else:
        with pytest.raises(ConfigError, match="f:1: the body is not"):
            parse_line(line[:-1], "f:1")


def test_a_compressed_body_comes_back_with_its_encoding():
    body = gzip.compress(b'{"messages": []}')
    req = parse_line(replay_line(captured(body, encoding="gzip"))[:-1], "f:1")
    assert (req.body, req.content_encoding) == (body, "gzip")


def test_a_bare_body_is_sent_as_its_own_bytes_and_its_path_inferred():
    chat = b'{ "messages" : [{"role": "user", "content": "hi"}],  "stream": true }'
    assert (parse_line(chat, "f:1").path, parse_line(chat, "f:1").body) == (CHAT, chat)
    assert parse_line(b'{"prompt": "x"}', "f:1").path == COMPLETIONS
    wrapped = parse_line(b'{"body": {"prompt": "x", "n": 1}}', "f:1")
    assert (wrapped.path, orjson.loads(wrapped.body)) == (COMPLETIONS, {"prompt": "x", "n": 1})


@pytest.mark.parametrize(("body", "path"), [
    # the shape both chat completions and Anthropic Messages accept: chat completions, as documented
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, CHAT),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     CHAT),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, CHAT),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, CHAT),
    ({"model": "m", "max_tokens": 8, "system": "s", "messages": [{"role": "user", "content": "hi"}]}, MESSAGES),
    ({"anthropic_version": "vertex-2023-10-16", "max_tokens": 8, "messages": []}, MESSAGES),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     MESSAGES),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]}]}, MESSAGES),
    ({"max_tokens": 8, "tools": [{"name": "t", "input_schema": {}}], "messages": []}, MESSAGES),
    ({"model": "m", "input": "hi"}, RESPONSES),
    ({"input": [{"role": "user", "content": "hi"}], "instructions": "s"}, RESPONSES),
    ({"prompt": "x", "max_tokens": 3}, COMPLETIONS),
])
def test_a_bare_body_goes_to_the_api_only_it_fits(body, path):
    raw = orjson.dumps(body)
    assert (parse_line(raw, "f:1").path, parse_line(raw, "f:1").body) == (path, raw)
    assert parse_line(orjson.dumps({"body": raw.decode()}), "f:1").path == path


@pytest.mark.parametrize("body", [
    {"system": "s", "messages": [{"role": "tool", "content": "x"}]},
    {"tools": [{"type": "function", "function": {}}], "messages": [{"role": "user", "content": [{"type": "thinking"}]}]},
    {"messages": [], "prompt": "x"},
    {"input": "x", "prompt": "y"},
])
def test_a_body_that_fits_two_apis_must_name_its_path(body):
    with pytest.raises(ConfigError) as err:
        parse_line(orjson.dumps(body), "f:7")
    message = str(err.value)
    assert message.startswith("f:7: the body has ") and '{"path": "/v1/messages", "body": ...}' in message
    assert "\n" not in message
    # naming the path settles it
    assert parse_line(orjson.dumps({"path": RESPONSES, "body": body}), "f:7").path == RESPONSES


@pytest.mark.parametrize(("line", "message"), [
    (b"nope", "f:3: not JSON"),
    (b"3", "f:3: not a request"),
    (b'{"model": "m"}', "f:3: not a request"),
    (b'{"body": 5}', "f:3: \"body\" must be a string"),
    (b'{"body_b64": "***"}', "f:3: \"body_b64\" is not base64"),
    (b'{"body": "[1]"}', "f:3: the body is not a JSON object"),
    (b'{"body": "{}"}', "f:3: no \"path\""),
    (b'{"path": "/v1/models", "body": "{}"}', "f:3: path '/v1/models' is not one specproxy measures"),
])
def test_a_bad_line_is_one_clear_error(line, message):
    with pytest.raises(ConfigError) as err:
        parse_line(line, "f:3")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_file_that_is_missing_or_empty_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_replay_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no requests in the file"):
        read_replay_file(tmp_path / "empty.jsonl")
    (tmp_path / "crlf.jsonl").write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [r.body for r in read_replay_file(tmp_path / "crlf.jsonl")] == [b'{"prompt": "a"}', b'{"prompt": "b"}']


def test_blocks_interleave_arms_so_none_always_goes_first():
    assert schedule(("A", "B"), 3) == [("A", 1), ("B", 1), ("B", 2), ("A", 2), ("A", 3), ("B", 3)]
    assert schedule(("only",), 2) == [("only", 1), ("only", 2)]


def test_the_restart_command_gets_the_arm_quoted_and_the_instance():
    assert restart_command("./serve.sh {arm} --n {instance}", "spec on", 2) == "./serve.sh 'spec on' --n 2"


def test_the_restart_command_runs_in_the_users_environment_plus_the_arm(monkeypatch):
    """The command sees this process's environment (its PATH, the user's variables) and the block's
    SPECPROXY_ARM and SPECPROXY_INSTANCE: a check in the command's own shell decides its exit status."""
    monkeypatch.setenv("SPECPROXY_TEST_MARK", "from-the-user")
    check = '[ "$SPECPROXY_TEST_MARK" = from-the-user ] && [ "$SPECPROXY_ARM" = "on" ] && [ "$SPECPROXY_INSTANCE" = 2 ]'
    run_restart(check, "on", 2, timeout_s=10)
    with pytest.raises(RestartError, match="exited with status 1"):
        run_restart(check, "off", 2, timeout_s=10)
    monkeypatch.delenv("SPECPROXY_TEST_MARK")
    with pytest.raises(RestartError, match="exited with status 1"):
        run_restart(check, "on", 2, timeout_s=10)


def test_mean_ci_is_students_t():
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0])
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) * sd 1 / sqrt(3)
    assert (mean, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    assert mean_ci([5.0]) == (5.0, None, None) and mean_ci([]) == (None, None, None)


def turn(start: float, end: float, tokens: int | None, outcome: str = "ok", **kw):
    record = make_record(t_request=start, outcome=outcome, streamed=True, **kw)
    return dataclasses.replace(record, t_done=end, completion_tokens=tokens)


def test_a_rounds_aggregate_is_its_delivered_tokens_over_its_span():
    rnd = Round("a", 1, 2, 1, records=[turn(10.0, 12.0, 30), turn(10.5, 14.0, 50), turn(11.0, 11.5, None, "upstream_error")])
    assert round_aggregate(rnd) == pytest.approx(80 / 4.0)  # failed turns add span, never tokens


def test_the_aggregate_interval_is_over_instances_when_there_are_several():
    rounds = []
    for instance, rate in ((1, 20.0), (2, 24.0), (3, 28.0)):
        for repeat in (1, 2):  # each instance's rounds deliver `rate` tokens a second
            rounds.append(Round("a", instance, 1, repeat, records=[turn(0.0, 1.0, int(rate), decode_tps=rate)], sent=1))
    level = summarize_bench(rounds)["arms"][0]["levels"][0]
    agg = level["aggregate_tps"]
    assert (agg["unit"], agg["n"]) == ("instances", 3)
    assert (agg["mean"], agg["ci_low"], agg["ci_high"]) == pytest.approx(geometric_mean_ci([20.0, 24.0, 28.0]))
    one = summarize_bench([r for r in rounds if r.instance == 1])["arms"][0]["levels"][0]["aggregate_tps"]
    assert (one["unit"], one["n"]) == ("rounds", 2)
    assert level["turns"] == level["sent"] == 6 and level["decode_tps"]["median"] == 24.0
    spread = [Round("a", i, 1, 1, records=[turn(0.0, 1.0, rate)], sent=1) for i, rate in ((1, 1), (2, 50))]
    agg = summarize_bench(spread)["arms"][0]["levels"][0]["aggregate_tps"]
    assert 0.0 < agg["ci_low"] < agg["mean"] < agg["ci_high"]  # never 0 (it was clipped there), never below


def test_the_aggregate_interval_is_t_on_the_logs_and_cannot_cross_zero():
    """Issue #31: "112.0 [0.0, 243.8]", a t interval on three spread rounds clipped at zero. On the logs
    the interval is a factor either side of the geometric mean: positive, and symmetric in ratio."""
    values = [40.0, 112.0, 184.0]
    center, lo, hi = geometric_mean_ci(values)
    logs = [math.log(v) for v in values]
    _, llo, lhi = mean_ci(logs)
    assert center == pytest.approx(math.exp(sum(logs) / 3)) and (lo, hi) == pytest.approx((math.exp(llo), math.exp(lhi)))
    assert lo > 0 and center / lo == pytest.approx(hi / center)
    assert mean_ci(values)[1] < 0  # where the old interval went
    assert geometric_mean_ci([5.0]) == (5.0, None, None) and geometric_mean_ci([]) == (None, None, None)
    assert geometric_mean_ci([0.0, 3.0])[1:] == (None, None)  # no logarithm of 0: no interval


def test_the_aggregate_interval_is_calibrated():
    """95% of intervals over 3 rounds cover the rounds' true center, lognormal rounds (exact) and normal ones
    (CV 15%), 4000 seeded draws each: within 93-97%, the promise compare's rows keep (docs/statistics.md)."""
    import numpy as np

    rng = np.random.default_rng(31)
    for draw in (lambda: 100 * np.exp(rng.normal(0, 0.4, 3)), lambda: rng.normal(100, 15, 3)):
        covered = 0
        for _ in range(4000):
            _, lo, hi = geometric_mean_ci(list(draw()))
            covered += lo <= 100 <= hi
        assert 0.93 <= covered / 4000 <= 0.97, covered


def test_the_roofline_arithmetic():
    r = roofline(8e9, 4, 273, mal=2.0, measured_fps=27.3)
    assert r["bytes_per_pass"] == 4e9
    assert r["ceiling_passes_per_s"] == pytest.approx(68.25)
    assert r["ceiling_tokens_per_s"] == pytest.approx(136.5)
    assert r["share"] == pytest.approx(0.4)
    for bad in ((0, 4, 273), (8e9, -1, 273), (8e9, 4, 0)):
        with pytest.raises(ConfigError, match="must be a positive number"):
            roofline(*bad)

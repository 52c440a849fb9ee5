"""The command line of the active side: ``bench``, ``roofline`` and ``export --format replay``.

Why apart from ``cli.py``: these commands have many options of their own, and ``cli.py`` stays the
passive proxy's. ``cli.py`` adds them to its group (``register``); what both need (one-line errors,
``--db``, reading a report) is ``cli_common.py``'s, so this module never imports ``cli``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Any

import click
import orjson

from specproxy.app.cli_common import db_option, echo, friendly, report_of, slo_option, sqlite_only
from specproxy.errors import ConfigError, SpecproxyError

__all__ = ["NO_TOKENIZER", "export_mooncake", "export_replay", "register"]

NO_TOKENIZER = ("no --tokenizer: tokens are not counted, so per-stream and aggregate tok/s show '-'; TTFT, times "
                "and errors are still measured (give --tokenizer hf:DIR, the server's tokenizer directory, or "
                "tiktoken:o200k_base)")


def export_replay(conn, db_path: str, output: str, *, label: str | None, since: float | None,
                  until: float | None) -> int:
    """Write every captured request body (selected by its turn's label, or its time) as a replay file."""
    try:
        n = _write_replay(conn, output, label=label, since=since, until=until)
    except OSError as exc:  # no such directory, a read-only file system, a full disk: one line
        raise SpecproxyError(f"cannot write {output}: {exc.strerror or exc}") from None
    if not n:
        raise ConfigError(f"{db_path}: no captured request bodies{' selected' if label or since or until else ''} "
                          "(run `specproxy serve --capture` to store them)")
    return n


def _write_replay(conn, output: str, *, label: str | None, since: float | None, until: float | None) -> int:
    from specproxy.app.replay import replay_line
    from specproxy.store.captures import captured_requests

    def lines():
        first = None
        for captured in captured_requests(conn, label=label, since=since, until=until):
            first = captured.t_wall if first is None else first
            yield replay_line(captured, first)

    return _write_lines(output, lines())


def _write_lines(output: str, lines) -> int:
    """Write ``lines`` (bytes, each with its line end) to ``output`` ("-": stdout); how many there were."""
    # to a file: written beside it and renamed into place once complete, so an error (nothing selected, a
    # failed read) leaves no file behind, nor a half-written one over a good file of that name
    out = sys.stdout.buffer if output == "-" else tempfile.NamedTemporaryFile(
        "wb", dir=os.path.dirname(os.path.abspath(output)), prefix=os.path.basename(output) + ".", delete=False)
    n = 0
    try:
        for line in lines:
            out.write(line)
            n += 1
    except BaseException:
        n = 0
        raise
    finally:
        if output == "-":
            out.flush()
        else:
            out.close()
            if n:
                os.replace(out.name, output)
            else:
                os.unlink(out.name)
    return n


def export_mooncake(conn, db_path: str, output: str, *, block_size: int, label: str | None, since: float | None,
                    until: float | None) -> tuple[int, int]:
    """Write the selected measured turns as a Mooncake trace (``app/mooncake.py``): (lines written, turns
    left out for want of block digests or an output count)."""
    from specproxy.app.mooncake import TRACE_FIELDS, check_block_size, trace_lines
    from specproxy.store.dataset import where_clause
    from specproxy.store.queries import turn_rows

    check_block_size(block_size)
    where, params = where_clause(label=label, since=since, until=until)
    skipped = [0]
    try:
        n = _write_lines(output, trace_lines(turn_rows(conn, TRACE_FIELDS, where, params), block_size, skipped))
    except OSError as exc:
        raise SpecproxyError(f"cannot write {output}: {exc.strerror or exc}") from None
    if not n:
        raise ConfigError(f"{db_path}: no turns{' selected' if label or since or until else ''} with prompt block "
                          f"digests ({skipped[0]} without: they are recorded when a tokenizer counts the prompt)")
    return n, skipped[0]


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{what} must be whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{what} must be whole numbers of at least 1, got {text!r}")
    return values


def _arms(text: str) -> tuple[str, ...]:
    from specproxy.config import check_label

    arms = tuple(a.strip() for a in text.split(","))
    if not all(arms) or len(set(arms)) != len(arms):
        raise ConfigError(f"--label {text!r}: one label per arm, separated by commas, each once")
    for arm in arms:
        check_label(arm)
    return arms


def _workloads(source: str | None, phase: str | None, db: str, *, prompt_lengths: str, max_tokens: int,
               model: str | None, seed: int, tokenizer: str | None = None,
               block_size: int = 512) -> tuple[list[tuple[int | None, list]], list | None]:
    """The workloads, and the warm-up requests when the workload's first must not be one (a trace's)."""
    from specproxy.app import probes
    from specproxy.app.replay import read_replay_file, requests_from_captures

    if source is None:
        if phase == "prefill":
            return probes.prefill_probe(list(_ints(prompt_lengths, "--prompt-lengths")), model, seed), None
        if phase == "decode":
            return [(None, probes.decode_probe(max_tokens, model))], None
        raise ConfigError("bench needs --from captured, --from FILE (a replay file) or --phase prefill|decode")
    warmup = None
    if source == "captured" or source.startswith("captured:"):
        from specproxy.store.captures import captured_requests
        from specproxy.store.db import open_existing

        label = source.partition(":")[2] or None
        with open_existing(db) as conn:
            requests = requests_from_captures(captured_requests(conn, label=label))
        if not requests:
            raise ConfigError(f"{db}: no captured request bodies{f' labelled {label}' if label else ''} "
                              "(run `specproxy serve --capture` first, or give --from FILE)")
    else:
        from specproxy.app.mooncake import file_is_trace, read_trace, trace_requests

        if file_is_trace(source):
            if tokenizer in (None, "", "none"):
                raise ConfigError(f"{source} is a Mooncake trace: synthesising its prompts needs the model's "
                                  "tokenizer (--tokenizer hf:DIR, or tiktoken:ENCODING)")
            from specproxy.measure.tokens import load_tokenizer

            trace = read_trace(source)
            requests, warm = trace_requests(trace, load_tokenizer(tokenizer), block_size, model, seed)
            warmup = [warm]
        else:
            requests = read_replay_file(source)
    if phase is not None:
        requests = [probes.for_phase(r, phase, max_tokens) for r in requests]
    return [(None, requests)], warmup


def _recorded(requests: list) -> None:
    """``--timing recorded`` needs every request's offset: one without is named."""
    missing = next((r for r in requests if r.offset_s is None), None)
    if missing is not None:
        raise ConfigError(f"--timing recorded: {missing.where} has no \"timestamp\" (milliseconds from the file's "
                          "first request; `export --format replay` and `--format mooncake` write it)")


def _lateness(rounds: list) -> dict[str, Any]:
    """How late ``--timing recorded`` sent its requests after their offsets (/ ``--speed``), over every round:
    a replay whose requests went late did not reproduce the recorded arrivals."""
    import statistics

    late = [x for rnd in rounds for x in rnd.late_s]
    return {"requests": len(late), "late_s_median": statistics.median(late) if late else None,
            "late_s_max": max(late) if late else None}


def _is_trace(source: str) -> bool:
    from specproxy.app.mooncake import file_is_trace

    return file_is_trace(source)


async def _first_model(base: str) -> str | None:
    """The first model the server lists, for probes without --model; None when it lists none."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except Exception:  # any failure: the probes go without a model field, which local servers accept
        return None


def register(group: click.Group) -> None:
    """Add ``bench`` and ``roofline`` to ``group`` (``cli.main``)."""

    @group.command()
    @click.option("--upstream", help="Base URL of the inference server [required unless set in --config or "
                                     "SPECPROXY_UPSTREAM]")
    @click.option("--from", "source", default=None,
                  help="captured (the bodies `serve --capture` stored in --db; captured:LABEL for one label's), or "
                       "a replay file (JSONL of request bodies; `export --format replay` writes one)")
    @db_option
    @click.option("--tokenizer", default=None, help="hf:DIR, tiktoken:ENCODING or none (token counts need one)")
    @click.option("--concurrency", "levels", default=None,
                  help="Streams in flight, one round per value: e.g. 1,4,8,32; with --rate or --timing recorded, the "
                       "most in flight [default: 1; with --timing recorded, no limit]")
    @click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
                  help="Rounds at each concurrency on each server instance")
    @click.option("--duration", "duration_s", type=click.FloatRange(min=0, min_open=True), default=None,
                  help="Seconds per round, cycling through the workload [default: the workload once per round]")
    @click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
                  help="Open loop: start requests at this many per second (exponential gaps), at most --concurrency "
                       "in flight [default: closed loop]")
    @click.option("--timing", type=click.Choice(["loop", "recorded"]), default="loop", show_default=True,
                  help="recorded: send each request at its recorded offset (a trace's timestamp, a replay file's "
                       "\"timestamp\", a capture's time), open loop")
    @click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                  help="With --timing recorded: divide the recorded offsets by this (2: twice as fast)")
    @click.option("--block-size", type=click.IntRange(min=1), default=512, show_default=True,
                  help="Prompt tokens per hash id of a Mooncake trace given to --from")
    @click.option("--label", "labels", default=None,
                  help="Label of the turns; with --restart-cmd, one per arm separated by commas (off,on) "
                       "[default: bench, or bench-prefill / bench-decode for a phase probe]")
    @click.option("--restart-cmd", default=None,
                  help="Shell command that restarts the server (in the background) and returns; {arm} and "
                       "{instance} are replaced, SPECPROXY_ARM and SPECPROXY_INSTANCE set")
    @click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Server instances per arm (restarts), interleaved A B B A ...; needs --restart-cmd")
    @click.option("--ready-timeout", "ready_timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
                  show_default=True, help="Seconds to wait for the restart command and for the server to be ready")
    @click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
                  help="Requests sent straight to the server after each (re)start, not recorded")
    @click.option("--phase", type=click.Choice(["prefill", "decode"]), default=None,
                  help="A phase probe: prefill (max_tokens 1, long prompts) or decode (short prompt, long output)")
    @click.option("--prompt-lengths", default="256,1024,4096", show_default=True,
                  help="The prefill probe's prompt lengths in words")
    @click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
                  help="The decode probe's output length")
    @click.option("--model", default=None, help="Model name in the probes' requests [default: the server's first]")
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON")
    @click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                  help="TOML config file (as serve's; its upstream, db, tokenizer and slo are used)")
    @slo_option
    @click.option("--slo-target", type=float, default=None,
                  help="With --slo and --concurrency: print the highest concurrency whose share of turns that met "
                       "the SLO stays at or above this (e.g. 0.9)")
    @friendly
    def bench(upstream: str | None, source: str | None, db: str | None, tokenizer: str | None, levels: str | None,
              repeats: int, duration_s: float | None, rate: float | None, timing: str, speed: float,
              block_size: int, labels: str | None,
              restart_cmd: str | None,
              instances: int, ready_timeout_s: float, warmup: int, phase: str | None, prompt_lengths: str,
              max_tokens: int, model: str | None, seed: int, as_json: bool, config_path: str | None,
              slo: str | None, slo_target: float | None) -> None:
        """Send requests at each concurrency through the measuring proxy; per-stream and aggregate figures.

        Every turn goes through the same proxy and measuring as `serve`'s, into the same database, labelled;
        `report` and `compare` read them. With --restart-cmd, each arm runs on --instances server
        instances, so `compare` can give a verdict on a restart A/B. docs/bench.md says more.
        """
        import asyncio

        from specproxy.analyze.bench import render_bench, summarize_bench
        from specproxy.app.bench import BenchError, BenchPlan, BenchRun, run_bench
        from specproxy.app.progress import make_progress
        from specproxy.config import load_config, parse_slo
        from specproxy.serve.service import install_uvloop

        # the proxy bench runs: on loopback, an ephemeral port; turns labelled by the arm (a header), never text
        # restarts make the proxy's start-up check and the scraper warn by design; bench says what matters
        logging.getLogger("specproxy").setLevel(logging.ERROR)
        cfg = load_config(config_path, overrides={
            "upstream": upstream, "db": db, "tokenizer": tokenizer, "host": "127.0.0.1", "port": 0, "capture": False,
            "store_text": False, "scrape_interval_s": 1.0, "cadence_poll": "off"})
        base = str(cfg.upstream_url).rstrip("/")  # ConfigError without an upstream
        sqlite_only(cfg.db, "bench writes the turns it measures to an SQLite file")
        objective = parse_slo(slo) if slo is not None else parse_slo(cfg.slo, "slo")
        if slo_target is not None and objective is None:
            raise ConfigError("--slo-target needs an SLO to judge turns by: give --slo (e.g. ttft=2s,tpot=50ms)")
        if slo_target is not None and not 0 < slo_target <= 1:
            raise ConfigError(f"--slo-target is a share of turns between 0 and 1 (e.g. 0.9), got {slo_target:g}")
        if objective is not None and phase == "prefill":
            raise ConfigError("--slo is not judged on a prefill probe (one output token each: no tpot, no decode)")
        # a probe's turns carry their phase in their label, so report, compare and roofline never mix the phases
        arms = _arms(labels if labels is not None else "bench" + (f"-{phase}" if phase else ""))
        if len(arms) > 1 and restart_cmd is None:
            raise ConfigError("several arms (--label A,B) need --restart-cmd: each arm is a server setting")
        if instances > 1 and restart_cmd is None:
            raise ConfigError("--instances needs --restart-cmd (an instance is a server process)")
        if timing == "recorded" and (rate is not None or duration_s is not None or source is None):
            raise ConfigError("--timing recorded sends a file's requests at their recorded offsets: give --from, and "
                              "neither --rate nor --duration")
        if speed != 1.0 and timing != "recorded":
            raise ConfigError("--speed compresses recorded offsets: it needs --timing recorded")
        trace = source is not None and not source.startswith("captured") and _is_trace(source)
        if (phase is not None or source is None or trace) and model is None:
            model = asyncio.run(_first_model(base)) if source is None or trace else None
        workloads, warmup_requests = _workloads(source, phase, cfg.db, prompt_lengths=prompt_lengths,
                                                max_tokens=max_tokens, model=model, seed=seed, tokenizer=cfg.tokenizer,
                                                block_size=block_size)
        if timing == "recorded":
            _recorded(workloads[0][1])
        plan = BenchPlan(
            workloads=workloads,
            levels=_ints(levels, "--concurrency") if levels is not None else
            ((len(workloads[0][1]),) if timing == "recorded" else (1,)),
            repeats=repeats, duration_s=duration_s, rate=rate, arms=arms,
            instances=instances, restart_cmd=restart_cmd, ready_timeout_s=ready_timeout_s, warmup=warmup, seed=seed,
            timing=timing, speed=speed, warmup_requests=warmup_requests)
        counted = cfg.tokenizer not in (None, "", "none")
        if not cfg.tokenizer:  # said before the run, not after it: the run would otherwise end in a table of "-"
            click.echo(f"specproxy bench: {NO_TOKENIZER}", err=True)  # (not to one who asked for none)
        run = BenchRun()
        install_uvloop()
        error: SpecproxyError | None = None
        try:
            asyncio.run(run_bench(cfg, plan, run, progress=make_progress()))
        except SpecproxyError as exc:  # what was measured is stored; summarise it, then say why it stopped
            if isinstance(exc, BenchError) or run.rounds:
                error = exc
            else:
                raise
        except KeyboardInterrupt:  # the proxy stopped and its writer drained: summarise what was measured
            turns = sum(len(r.records) for r in run.rounds)
            error = SpecproxyError(f"interrupted (Ctrl-C): what was measured is stored in {cfg.db}"
                                   + (f", and its {turns} turns summarised above" if run.rounds else ""))
        summary = summarize_bench(run.rounds, phase=phase, warmup=warmup, restarts=restart_cmd is not None,
                                  slo=objective, slo_target=slo_target)
        summary.update(database=cfg.db, labels=list(arms), instance_ids={f"{a}#{k}": v for (a, k), v in
                                                                         run.instance_ids.items()},
                       tokenizer=counted, timing=timing, speed=speed if timing == "recorded" else None,
                       restarts_unverified=[f"{a}#{k}" for (a, k), v in run.verified.items()
                                                               if v is None])
        if timing == "recorded":
            summary["schedule"] = _lateness(run.rounds)
        for warning in summary.get("warnings", ()):
            click.echo(f"specproxy: warning: {warning}", err=True)
        if as_json:
            click.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
        elif run.rounds:
            click.echo(render_bench(summary), nl=False)
            if timing == "recorded" and summary["schedule"]["requests"]:
                sched = summary["schedule"]
                click.echo(f"recorded timing at --speed {speed:g}: {sched['requests']} requests sent a median "
                           f"{sched['late_s_median']:.4f} s, at most {sched['late_s_max']:.4f} s after their offsets")
            hint = f"specproxy compare {arms[0]} {arms[1]} --db {cfg.db}" if len(arms) > 1 else \
                f"specproxy report --label {arms[0]} --db {cfg.db}"
            click.echo(f"the turns are in {cfg.db}, labelled {', '.join(arms)}: try `{hint}`")
        if error is not None:
            raise error


    @group.command()
    @click.option("--active-params", type=float, required=True, help="Parameters read per forward pass (e.g. 8e9)")
    @click.option("--bits", type=float, required=True, help="Bits per weight (e.g. 4 for a 4-bit quantisation)")
    @click.option("--bandwidth-gbs", type=float, required=True, help="Memory bandwidth in GB/s (e.g. 273)")
    @click.option("--mal", type=float, default=None,
                  help="Mean acceptance length (tokens per forward pass) [default: from --db's counters, else 1]")
    @click.option("--db", default=None, help="Put the measured forward passes/s beside the ceiling (an SQLite file "
                                             "or a fleet's postgresql://USER@HOST/DB) [default: none, the ceiling "
                                             "alone]")
    @click.option("--label", default=None, help="Only turns with this label (with --db)")
    @click.option("--json", "as_json", is_flag=True, help="Print as JSON")
    @friendly
    def roofline(active_params: float, bits: float, bandwidth_gbs: float, mal: float | None, db: str | None,
                 label: str | None, as_json: bool) -> None:
        """The bandwidth ceiling of decoding: bytes per forward pass, passes/s and tokens/s at most."""
        from specproxy.analyze.roofline import no_decode_speed, render_roofline
        from specproxy.analyze.roofline import roofline as ceiling

        if label is not None and db is None:  # roofline reads a database only when told which
            raise ConfigError("--label selects the measured turns of --db: give --db too (without it, roofline "
                              "gives the ceiling alone)")
        measured_fps = measured_tps = used = mal_source = None
        levels: list[dict[str, Any]] = []
        if mal is not None:
            mal_source = "--mal"
        if db is not None:
            report: dict[str, Any] = report_of(db, label)
            if label is None and len(report["labels"]) > 1:  # arms and phases: a median over them is none of them
                raise ConfigError(f"{db}: its turns carry several labels ({', '.join(report['labels'])}): give "
                                  "--label to measure one of them")
            measured_tps = report["user"]["decode_tps"]["median"]
            if measured_tps is None:
                raise ConfigError(no_decode_speed(report, db, label))
            if mal is None:
                window = (report.get("server") or {}).get("window") or {}
                mal = window.get("mal")
                gauge = window.get("mal_source") == "gauge"
                mal_source = (f"from the server's {'acceptance-length gauge' if gauge else 'counters'}"
                              if mal is not None else None)
            measured_fps = measured_tps / (mal or 1.0)
            used = {"database": db, "label": label or (report["labels"] or [None])[0],
                    "turns": report["user"]["decode_tps"]["n"]}
            levels = [{"concurrency": row["concurrency"], "turns": row["per_stream_tps"]["n"],
                       "decode_tps": row["per_stream_tps"]["median"]} for row in report["by_concurrency"]
                      if row["per_stream_tps"]["n"]]
        echo(ceiling(active_params, bits, bandwidth_gbs, mal=mal, measured_fps=measured_fps,
                             measured_tps=measured_tps, used=used, mal_source=mal_source, by_concurrency=levels),
                     render_roofline, as_json)

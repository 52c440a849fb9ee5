"""The memory-bandwidth ceiling of decoding, beside what was measured (``specproxy roofline``).

Why: decoding one step of a dense model reads every active weight once, so a server can take at
most bandwidth / (bytes of the active weights) forward passes a second, whatever its batch; each
pass delivers MAL tokens to a stream (1 without speculative decoding). Put beside the measured
forward passes per second (per-stream decode speed / MAL, as the report computes it), the ratio says
how much of the hardware a configuration uses, and so how much any software change could still
gain. The ceiling ignores the KV cache and activations (they add bytes per pass), so it is an upper
bound: the real ceiling is lower, and the share measured against it is a lower bound.

The measured figure is over one population: the turns of one label (an arm, a phase probe), as the
caller picks them, said in the output with how many turns and at which concurrencies; beside it, the
same per concurrency level when the turns ran at several (a stream's speed falls as streams share
the server's passes, so a median over levels would describe none of them).
"""

from __future__ import annotations

from typing import Any

from specproxy.errors import ConfigError
from specproxy.analyze.wording import plural

__all__ = ["no_decode_speed", "render_roofline", "roofline"]


def no_decode_speed(report: dict[str, Any], db: str, label: str | None) -> str:
    """Why ``report`` (a ``specproxy report`` of the selected turns) has no per-stream decode speed to put
    beside the ceiling, in one line: the first thing missing, of turns, completed streamed ones, their
    token counts (a tokenizer) and a decode time (more than one token)."""
    which = f" labelled {label}" if label else ""
    if not report["turns"]:
        held = (report.get("database_turns") or {}).get("n")
        return (f"{db}: no turns{which}" + (f" (it holds {plural(held, 'turn')} in all)" if label and held else "")
                + ": nothing measured to put beside the ceiling (bench or serve records turns there)")
    streamed = report["completed_turns"]["streamed"]
    if not streamed:
        return (f"{db}: {plural(report['turns'], 'turn')}{which}, none a completed streamed one: a decode speed needs a "
                "streamed answer")
    if not report["user"]["completion_tokens"]["n"]:
        return (f"{db}: {streamed} streamed turns{which}, none with a token count: they were measured without a "
                "tokenizer (give bench or serve --tokenizer)")
    return (f"{db}: {streamed} streamed turns{which}, none with a decode speed: each delivered its answer in one "
            "read (one token, as a prefill probe's, has no decode time)")


def roofline(active_params: float, bits: float, bandwidth_gbs: float, *, mal: float | None = None,
             measured_fps: float | None = None, measured_tps: float | None = None,
             used: dict[str, Any] | None = None, mal_source: str | None = None,
             by_concurrency: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Bytes read per forward pass, the ceiling in passes/s and tokens/s (times ``mal``), and the measured
    forward passes/s as a share of the ceiling when given. ``used``: which turns the measured figure is
    the median of (``turns``, ``label``, ``database``); ``mal_source``: where the MAL came from;
    ``by_concurrency``: rows of ``concurrency`` (a level or a range), ``turns`` and ``decode_tps``."""
    for name, value in (("--active-params", active_params), ("--bits", bits), ("--bandwidth-gbs", bandwidth_gbs)):
        if not value > 0:
            raise ConfigError(f"{name} must be a positive number, got {value:g}")
    if mal is not None and not mal >= 1:
        raise ConfigError(f"MAL must be at least 1, got {mal:g}")
    bytes_per_pass = active_params * bits / 8.0
    ceiling_fps = bandwidth_gbs * 1e9 / bytes_per_pass
    levels = []
    for row in by_concurrency or ():
        fps = row["decode_tps"] / (mal or 1.0) if row.get("decode_tps") is not None else None
        levels.append({**row, "passes_per_s": fps, "share": fps / ceiling_fps if fps is not None else None})
    out: dict[str, Any] = {
        "active_params": active_params, "bits": bits, "bandwidth_gbs": bandwidth_gbs,
        "bytes_per_pass": bytes_per_pass, "ceiling_passes_per_s": ceiling_fps,
        "mal": mal, "mal_source": mal_source, "ceiling_tokens_per_s": ceiling_fps * (mal or 1.0),
        "measured_passes_per_s": measured_fps, "measured_tokens_per_s": measured_tps,
        "share": measured_fps / ceiling_fps if measured_fps is not None else None,
        "measured_over": used, "by_concurrency": levels,
    }
    return out


def render_roofline(r: dict[str, Any]) -> str:
    gb = r["bytes_per_pass"] / 1e9
    lines = [
        f"roofline: {r['active_params']:.3g} active parameters at {r['bits']:g} bits = {gb:.2f} GB read per "
        f"forward pass; at {r['bandwidth_gbs']:g} GB/s at most {r['ceiling_passes_per_s']:.1f} forward passes/s",
    ]
    source = f" ({r['mal_source']})" if r.get("mal_source") else ""
    if r["mal"] is not None:
        lines.append(f"  ceiling per stream: {r['ceiling_passes_per_s']:.1f} passes/s x MAL {r['mal']:.2f}{source} = "
                     f"{r['ceiling_tokens_per_s']:.1f} tok/s")
    else:
        lines.append(f"  ceiling per stream: {r['ceiling_tokens_per_s']:.1f} tok/s (one token per pass: no MAL known)")
    if r["measured_passes_per_s"] is not None:
        lines.append(f"  measured: {r['measured_passes_per_s']:.1f} forward passes/s = {r['share']:.0%} of the ceiling"
                     + (f" (per-stream decode {r['measured_tokens_per_s']:.1f} tok/s / MAL {r['mal'] or 1:.2f})"
                        if r["measured_tokens_per_s"] is not None else ""))
        used = r.get("measured_over")
        if used:
            label = f"labelled {used['label']}" if used.get("label") else "(every turn: the database has no labels)"
            levels = ", ".join(str(row["concurrency"]) for row in r["by_concurrency"]) or "unknown"
            lines.append(f"  over: the median of {used['turns']} streamed turns {label} in {used['database']}, "
                         f"at concurrency {levels}")
        if len(r.get("by_concurrency") or ()) > 1:
            for row in r["by_concurrency"]:
                if row["passes_per_s"] is not None:
                    lines.append(f"    at concurrency {row['concurrency']}: {row['passes_per_s']:.1f} forward passes/s "
                                 f"= {row['share']:.0%} of the ceiling ({plural(row['turns'], 'turn')})")
    lines.append("  (weights only: the KV cache and activations add bytes per pass, so the true ceiling is lower)")
    return "\n".join(lines) + "\n"

"""``specproxy serve``: its option table (one flag per Config key, or a reason in ``CONFIG_ONLY``) and the
command that starts the proxy and says where it listens.

Why apart from the other commands (``app/cli.py``): the serve flags are the settings' table, checked
against ``Config``'s keys by the test suite, and they grow with every setting; the commands that read a
database share none of it. ``cli.main`` adds this command to the group.
"""

from __future__ import annotations

from typing import Any

import click

from specproxy import __version__
from specproxy.app.cli_common import db_option, friendly, setting, sqlite_only
from specproxy.config import CADENCE_POLL_MODES, RELAY_MODES, UPSTREAM_REUSE_MODES, Config, load_config, parse_slo
from specproxy.errors import SpecproxyError

__all__ = ["CONFIG_ONLY", "pages_line", "serve"]


# Config keys with no serve flag, each with the reason; the test suite checks that every other key has one.
CONFIG_ONLY: dict[str, str] = {
    "admin_token": "a secret: a flag would show it in the process list; set it in the --config file or "
                   "SPECPROXY_ADMIN_TOKEN",
    "tenant_secret": "a secret: a flag would show it in the process list; give --tenant-secret-file FILE, or set "
                     "SPECPROXY_TENANT_SECRET (or tenant_secret in the --config file)",
    "prices": "a table per model: set it in the --config file ([prices.\"MODEL\"]) or SPECPROXY_PRICES; report "
              "and audit read it with --prices FILE",
}


_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def _client_url(host: str, port: int) -> tuple[str, str]:
    """A URL a client on this machine can use, and what the listening address means when it is not one:
    a wildcard (``0.0.0.0``, ``::``) is where the proxy listens, not an address to connect to."""
    wildcard = host in _WILDCARDS
    address = _WILDCARDS.get(host, host)
    url = f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
    return url, (f" (listening on all interfaces, {host or '0.0.0.0'}:{port}: from another machine, use this "
                 "machine's address)" if wildcard else "")


def pages_line(cfg: Config, url: str) -> str:
    """Where the live page and specproxy's own metrics are, and what opening them takes."""
    from specproxy.serve.admin import is_loopback

    pages = f"live page {url}/_specproxy/, Prometheus {url}/_specproxy/metrics"
    if cfg.admin_token is not None:
        return f"{pages} (admin_token needed)"
    if not is_loopback(cfg.host):
        return "live page and Prometheus metrics closed (listening beyond loopback: set admin_token to open them)"
    return pages


@click.command()
@click.option("--upstream", "upstream",
              help="Base URL of the inference server, e.g. http://127.0.0.1:8000 "
                   "[required unless set in the --config file or SPECPROXY_UPSTREAM]")
@setting("--host", "host", "Address to listen on")
@setting("--port", "port", "Port to listen on", type=int)
@db_option
@setting("--tokenizer", "tokenizer", "hf:DIR, tiktoken:ENCODING or none")
@setting("--label", "label", "Label every turn (an A/B arm); X-Specproxy-Label overrides")
@setting("--proxy-name", "proxy_name", "This proxy's name in a fleet, stamped on every turn (unset: the host name)")
@setting("--sink", "sink",
          "Also ship turns to postgresql://USER@HOST[:PORT]/DB (commas between several); the password from "
          "PGPASSWORD or .pgpass, never the URL")
@setting("--otlp-endpoint", "otlp_endpoint",
          "Also push the per-turn figures over OTLP/HTTP protobuf to this URL, e.g. "
          "http://collector:4318/v1/metrics (GenAI semantic-convention names; pip install 'specproxy[otlp]')")
@setting("--otlp-interval", "otlp_interval_s", "Seconds between OTLP exports", type=float)
@setting("--store-text/--no-store-text", "store_text", "Store prompt and response text (opt-in)")
@setting("--client-header", "client_header",
          "The request header naming the client for audit (its value is stored: a header that may carry a "
          "credential, such as authorization, cookie or *key*, *token*, *auth*, *secret*, is refused)")
@setting("--tenant-header", "tenant_header",
          "The request header naming the turn's tenant (a team, a customer), e.g. X-Team; stored, so a header "
          "that may carry a credential is refused")
@setting("--tenant-from-key/--no-tenant-from-key", "tenant_from_key",
          "Name the tenant by a keyed hash (HMAC-SHA256, under a secret kept in the database, or the "
          "--tenant-secret-file one) of the API key; the key is never stored")
@setting("--tenant-secret-file", "tenant_secret_file",
          "A file holding a secret shared by a fleet's proxies, to key --tenant-from-key's hash with instead of "
          "the database's own: every proxy then names a key alike (never stored; or SPECPROXY_TENANT_SECRET)")
@setting("--capture/--no-capture", "capture",
          "Store request bodies as sent, for `export --format replay` and `bench --from captured` (opt-in)")
@setting("--max-concurrent", "max_concurrent", "Requests in flight before 503", type=int)
@setting("--max-body-bytes", "max_body_bytes", "Largest request body; a larger one gets 413", type=int)
@setting("--connect-timeout", "connect_timeout_s", "Seconds to connect to the upstream before 504", type=float)
@setting("--idle-timeout", "idle_timeout_s",
          "Seconds without upstream bytes before giving up; no total deadline", type=float)
@setting("--send-timeout", "send_timeout_s",
          "Seconds a client may take no more of a response before the exchange ends (client_stalled)",
          type=float)
@setting("--header-timeout", "header_timeout_s",
          "Seconds a client may take to send its request headers, and the longest pause inside a request "
          "body (408); also how long an idle kept-alive connection stays open", type=float)
@setting("--body-timeout", "body_timeout_s",
          "Seconds a client may take to send a whole request body, from the end of its headers (408)", type=float)
@setting("--max-measured-bytes", "max_measured_bytes",
          "Response bytes of one measured turn kept for measuring; past it relayed, not kept, and the "
          "record says so", type=int)
@setting("--memory-budget-bytes", "memory_budget_bytes",
          "Bytes the process may hold for request bodies, kept response bytes and turns waiting to be "
          "measured; past it new bodies get 503 and turns are measured less (0: automatic)", type=int)
@setting("--max-counted-bytes", "max_counted_bytes",
          "Bytes of one prompt, and of one completion's text, the tokenizer counts; past it not counted",
          type=int)
@setting("--queue-size", "queue_size",
          "Records waiting for the database writer; beyond it one is dropped and counted, never traffic",
          type=int)
@setting("--metrics-path", "metrics_path", "The upstream's Prometheus endpoint")
@setting("--scrape-interval", "scrape_interval_s", "Seconds between polls of the upstream's metrics; 0 = off",
          type=float)
@setting("--scrape-retention-days", "scrape_retention_days",
          "Days of polled metrics kept in the database (turns are kept); 0 = all", type=float)
@setting("--cadence-poll", "cadence_poll",
          "With few streams, poll for each next token on the server's decode clock instead of sleeping until "
          "it comes; auto: only while a core is idle", type=click.Choice(CADENCE_POLL_MODES))
@setting("--drain-timeout", "drain_timeout_s",
          "Seconds requests in flight get to finish at SIGTERM or Ctrl-C before they are cut (outcome "
          "shutdown); a second Ctrl-C cuts them at once", type=float)
@setting("--upstream-reuse", "upstream_reuse",
          "Keep an upstream connection for the same client connection's next request, or never reuse one "
          "(off: for a front proxy whose connections carry many users)", type=click.Choice(UPSTREAM_REUSE_MODES))
@setting("--relay", "relay",
          "Who relays a chunked response body: the native relay thread, or Python on the event loop (more CPU)",
          type=click.Choice(RELAY_MODES))
@setting("--relay-slice-us", "relay_slice_us",
          "The relay thread's scheduler slice in microseconds (Linux >= 6.12); 0 = the kernel's default", type=int)
@setting("--relay-nice", "relay_nice",
          "The relay thread's nice value, -20 to 0, where the process may lower it (CAP_SYS_NICE, RLIMIT_NICE); "
          "0 = the process's", type=int)
@setting("--lane/--no-lane", "lane",
          "Read plainly well-formed requests with the proxy's own reader; --no-lane: aiohttp's server for all")
@setting("--slo", "slo",
          "Judge turns by a service-level objective, e.g. ttft=2s,tpot=50ms,e2e=30s (ms or s): on the live page "
          "the share that met it and goodput per concurrency; on /_specproxy/metrics specproxy_slo_turns_total")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config file (see config.example.toml); flags override it, SPECPROXY_* in between")
@friendly
def serve(config_path: str | None, **flags: Any) -> None:
    """Run the measuring proxy in front of an inference server."""
    from specproxy.serve.service import FEW_FILES, Service, install_uvloop, raise_open_files_limit
    from specproxy.view.live import LivePages

    cfg = load_config(config_path, overrides=flags)
    sqlite_only(cfg.db, "serve writes its turns to an SQLite file of its own first (--sink ships them on)")
    files = raise_open_files_limit()
    if files is not None and files < FEW_FILES:
        click.echo(f"warning: at most {files} open files (the hard limit, RLIMIT_NOFILE): each client and "
                   f"upstream connection takes one, so connections past about {files // 2} are refused; "
                   f"raise it (ulimit -Hn, or LimitNOFILE= under systemd)", err=True)
    service = Service.from_config(cfg)
    # the live page at /_specproxy/, drawn from the database it writes, with its writer's counts
    service.pages = LivePages(cfg.db, writer=service.writer, shippers=service.shippers, slo=parse_slo(cfg.slo, "slo"))
    install_uvloop()

    def ready(svc: Service) -> None:
        from specproxy.wire import cadence_poll
        from specproxy.measure import fast_texts
        from specproxy.measure import tokens
        from specproxy.wire.relay_thread import THREAD_BUILT

        thread = cfg.relay == "thread" and THREAD_BUILT
        relay = "the relay thread (C)" if thread else (
            "Python on the event loop (relay = python: more CPU)" if THREAD_BUILT else
            "Python on the event loop (specproxy.wire._relayc not built: more CPU)")
        scans = "C" if fast_texts.C_BUILT else "pure Python (specproxy.frames._scanc not built: more CPU)"
        front = "the lane, aiohttp's server for the rest" if cfg.lane else (
            "aiohttp's server (lane off: more CPU)")
        counting = tokens.describe(svc.tokenizer)
        quota = svc.cadence.quota if svc.cadence is not None else None
        poll = cadence_poll.describe(cfg.cadence_poll, thread, quota)
        url, listening = _client_url(cfg.host, svc.port)
        click.echo(
            f"specproxy {__version__}: forwarding {url} -> {cfg.upstream} (client /v1/chat/completions -> "
            f"{cfg.forwards_to('/v1/chat/completions')}; /chat/completions -> {cfg.forwards_to('/chat/completions')}); "
            f"tokenizer {cfg.tokenizer or 'none (token counts will be missing)'}"
            f"{f' ({counting})' if counting else ''}; database {cfg.db}; "
            f"requests read by {front}; relay {relay}; "
            f"cadence poll {poll}; measuring scans {scans}\n"
            f"point your client's base URL at {url}/v1{listening}; {pages_line(cfg, url)}; Ctrl-C to stop",
            err=True,
        )

    import asyncio  # here: the commands that read the database never start an event loop

    try:
        asyncio.run(service.run_forever(ready))
    except OSError as exc:
        raise SpecproxyError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None

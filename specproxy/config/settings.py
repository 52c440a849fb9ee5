"""The settings themselves: the frozen ``Config``, each field's docstring its definition.

Why frozen and in one place: the proxy reads its settings on every request; a value that cannot change
under it cannot surprise it. ``config.example.toml`` and ``serve --help`` are made from these docstrings
(``scripts/gen_docs.py``), so the docs cannot drift from the code. Where a value comes from (file,
environment, flags) is ``config/load.py``'s; what makes one valid, ``config/checks.py``'s.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass, field

from yarl import URL

from specproxy.errors import ConfigError
from specproxy.prices import Price

__all__ = ["CADENCE_POLL_MODES", "RELAY_MODES", "UPSTREAM_REUSE_MODES", "Config", "server_root"]

CADENCE_POLL_MODES = ("auto", "on", "off")
RELAY_MODES = ("thread", "python")
UPSTREAM_REUSE_MODES = ("client", "off")


@dataclass(frozen=True, slots=True)
class Config:
    upstream: str | None = None
    """Base URL of the inference server, e.g. ``http://127.0.0.1:8000``; every request goes there, its path
    appended as the client sent it. A trailing ``/v1`` is accepted and dropped (``http://127.0.0.1:8000/v1``
    is the same upstream, not ``/v1/v1/...``); any other base path is kept as a prefix."""
    host: str = "127.0.0.1"
    """Address to listen on. Loopback by default: exposing the proxy is a choice you make."""
    port: int = 8080
    """Port to listen on."""
    db: str = "specproxy.db"
    """SQLite database file for the turns."""
    tokenizer: str | None = None
    """``hf:DIR``, ``tiktoken:ENCODING`` or ``none``: counts tokens with the model's own tokenizer."""
    label: str | None = None
    """Label stamped on every turn (an A/B arm); a request's ``X-Specproxy-Label`` header overrides it."""
    store_text: bool = False
    """Store prompt and response text in the database (opt-in; off by default for privacy)."""
    client_header: str = "user-agent"
    """The request header whose value names the client (``client`` per turn, grouped by ``specproxy
    audit``): a coding agent's ``User-Agent`` by default, or a header of your own (``x-client-name``)
    where several clients share one. At most 200 characters of it are stored. A header that may carry a
    credential is refused at start-up: by name (``authorization``, ``cookie``, ``x-api-key``...) or by
    shape (a name with ``auth``, ``token``, ``secret``, ``key``, ``passw``, ``session``... in it)."""
    capture: bool = False
    """Store each measured request's body, exactly as the client sent it, so that ``specproxy export
    --format replay`` and ``specproxy bench --from captured`` can send the same requests again (opt-in;
    off by default for privacy). Headers are never stored, so neither are API keys."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body accepted; a larger one gets 413 and never reaches the upstream."""
    max_concurrent: int = 1024
    """Requests in flight at once; one more gets an immediate 503. An exchange whose response waits on a
    client that is not reading does not count (``send_timeout_s`` ends it), up to twice this in all."""
    connect_timeout_s: float = 10.0
    """Seconds to connect to the upstream before answering 504 (a refused connection is a 502 at once)."""
    idle_timeout_s: float = 600.0
    """Seconds without a byte from the upstream before giving up (504 before its response headers,
    a truncated stream after them). There is no total deadline: a slow first token is not an error."""
    send_timeout_s: float = 60.0
    """Seconds a client may take no more of a response (its TCP acknowledges no byte) before the
    exchange ends: the client's connection is cut, the upstream's closed, and the turn recorded as
    ``client_stalled``. It runs only while the client is what holds the body back (the proxy has stopped
    reading the upstream for it); a slow reader that keeps taking bytes is never cut. Bounds how long
    clients that never read hold an exchange (past ``max_concurrent``, which does not count them)."""
    header_timeout_s: float = 30.0
    """Seconds a client may take to send its request headers (counted from connecting, or from the end
    of the previous response on a kept-alive connection, which is also how long an idle kept-alive
    connection stays open), and the longest pause allowed between bytes of a request body (408). Stops
    slow-header and slow-body clients from holding connections; never applies to a response."""
    body_timeout_s: float = 120.0
    """Seconds a client may take to send a whole request body, counted from the end of its headers (408
    past it), however steadily it trickles. A request counts toward ``max_concurrent`` only once its body
    is complete, so slow bodies never lock other clients out; this bounds how long they hold a connection."""
    max_measured_bytes: int = 16 * 1024 * 1024
    """Response bytes of one measured turn kept in memory for measuring. Past it the rest of the body is
    relayed as ever but not kept, and the turn's record says so (``measure_capped``); an unmeasured
    response is never kept at all."""
    memory_budget_bytes: int = 0
    """Bytes the whole process may hold for its clients: request bodies (counted from their head, as they
    arrive), response bytes kept for measuring, and turns waiting to be measured. Past it a new request body
    gets 503 before it is read, and turns are measured less (response bytes relayed but not kept, a prompt
    not counted), each record saying why (``measure_capped_reason``); forwarding never waits for it. 0:
    a quarter of the machine's memory (or of the cgroup's limit), at most 2 GiB, at least twice
    ``max_body_bytes`` (the least it may be set to). RSS stays within it plus a constant
    (docs/operations.md, "Memory")."""
    max_counted_bytes: int = 4 * 1024 * 1024
    """Bytes of one turn's prompt (its request body) and of its completion text that the tokenizer counts:
    a larger prompt's ``prompt_tokens`` is null (the server's own ``usage_prompt_tokens`` stays), a longer
    completion's token counts are null, and the record says why. Bounds the measuring work of one turn
    (about 1 s of tokenizer CPU per 4 MiB), so that one huge prompt cannot hold up the others' records."""
    queue_size: int = 10000
    """Records waiting for the database writer; when full, a record is dropped and counted, never traffic."""
    metrics_path: str = "/metrics"
    """The upstream's Prometheus endpoint, polled for its own counters."""
    scrape_interval_s: float = 5.0
    """Seconds between polls of ``metrics_path``; 0 turns scraping off."""
    scrape_retention_days: float = 30.0
    """Days of scrapes kept (the ``scrapes`` table: one row per poll of ``metrics_path``, holding the
    whole page); older ones are deleted at start-up and hourly; 0 keeps them all. Turns are never deleted
    by this (``specproxy prune --turns`` does that). At the default 5 s interval one llama.cpp server's
    scrapes take about 15 MB a day, so the default keeps about 450 MB; a vLLM page carries histograms and
    is many times larger (see yours: ``SELECT avg(length(raw)) FROM scrapes`` is bytes per row)."""
    cadence_poll: str = "auto"
    """``auto``, ``on`` or ``off``: with at most 4 streams in flight, the relay thread learns the server's
    decode clock and polls for each next token instead of sleeping until it comes, which saves the token a
    CPU wake-up (tens of µs on a VM), at the cost of at most a tenth of one core. ``auto`` polls only while
    the machine has a core idle, so that it never takes CPU from a server on the same machine, and never
    under a CPU quota (a container's limit)."""
    drain_timeout_s: float = 30.0
    """Seconds that requests in flight get to finish when ``serve`` is told to stop (SIGTERM, Ctrl-C): then
    they are cut, and their turns recorded with the outcome ``shutdown``. A second signal cuts them at once."""
    upstream_reuse: str = "client"
    """``client`` or ``off``: whether an upstream connection that carried an exchange is kept alive for the
    same client connection's next request (``client``: never another client's), or never reused at all
    (``off``: each request gets a new upstream connection, closed after its response). Use ``off`` where one
    client connection carries many users (a front proxy or gateway that pools its connections): bytes a
    misframing upstream sends past a response's end can then never reach the next request."""
    admin_token: str | None = None
    """Secret for the reserved ``/_specproxy/`` paths (live page, events, ``/_specproxy/metrics``), sent as
    ``Authorization: Bearer TOKEN`` (or ``?token=TOKEN`` for a browser). Unset, those paths answer only
    clients on loopback while the proxy listens on loopback; listening on any other address, every request
    there needs it (401 without, and always 401 when it is unset). Never logged, never stored."""
    relay: str = "thread"
    """``thread`` or ``python``: who relays a chunked response body passed through to the client. ``thread``
    hands it to one native thread that reads, sends and stamps it without the interpreter lock (the fast
    path); bodies it cannot take (a TLS upstream, bytes still queued for the client), and every body with
    ``python``, are relayed by the event loop in Python, the reference the thread is tested against.
    Without the C extension (no compiler at install) every body is relayed in Python."""
    relay_slice_us: int = 100
    """The relay thread's scheduler slice in microseconds (Linux >= 6.12 honours it; older kernels ignore
    it): a short one lets a token's read preempt Python at once instead of waiting out its slice. 0 keeps
    the kernel's default. Applied when the thread starts (the first relayed body of the process)."""
    relay_nice: int = -10
    """The relay thread's nice value, -20 to 0, where the process may lower one (``CAP_SYS_NICE``, as root
    has, or an ``RLIMIT_NICE`` that allows it: systemd's ``LimitNICE=``); elsewhere it keeps the process's.
    A lower one lets the relay win its core from Python's threads when a decode step's tokens and the
    turns it ended come at once, instead of waiting for them; it stays an ordinary task, sharing the core
    with everything else by weight. 0 leaves the process's value. Applied when the thread starts."""
    lane: bool = True
    """Read plainly well-formed requests with the proxy's own lean request reader, handing every other to
    aiohttp's server; off sends every connection to aiohttp's server (more CPU per request; for
    comparisons, and a way around a bug in the lane)."""
    tenant_header: str | None = None
    """The request header whose value names the turn's tenant (``tenant``: a team, a customer), e.g.
    ``x-team``; at most 200 characters of it are stored, and ``report --by tenant`` and ``audit --by
    tenant`` group by it. A header that may carry a credential is refused, as for ``client_header``: to
    tell tenants apart by their API keys, use ``tenant_from_key``. Unset: no tenant from a header."""
    tenant_from_key: bool = False
    """Name each turn's tenant by its API key, without keeping the key: ``tenant`` is ``key:`` and 16 hex
    digits of HMAC-SHA256 of the key (``Authorization: Bearer``, ``x-api-key`` or ``api-key``) under a
    secret drawn at random for this database and kept in it (the ``store_meta`` table), so the same key
    is the same tenant in this database and nowhere else, and a key cannot be read back from its name.
    The key itself is never stored nor logged. Not with ``tenant_header``. In a fleet, where every proxy
    has a database (and so a secret) of its own, give them one shared secret (``tenant_secret_file`` or
    ``tenant_secret``) so that a key is the same tenant on every proxy."""
    tenant_secret_file: str | None = None
    """A file holding the secret ``tenant_from_key``'s fingerprints are keyed with (at least 16
    characters; surrounding whitespace and the final newline are dropped), instead of the database's own:
    give every proxy of a fleet the same one, and ``report --by tenant`` over the fleet's database names
    each key once, not once per proxy. Read once at start-up; the secret is never stored (not in the
    database either) nor logged. Generate one with ``openssl rand -hex 32`` and keep the file readable by
    the proxy's user only. Not with ``tenant_secret``."""
    tenant_secret: str | None = field(default=None, repr=False)
    """The same shared secret given as is, for where a file is awkward (a container's secret
    environment): ``SPECPROXY_TENANT_SECRET``. Never a flag (it would show in the process list); not
    with ``tenant_secret_file``, which is read into it."""

    proxy_name: str | None = None
    """This proxy's name in a fleet, stamped on every turn (``proxy_name``): unset, the machine's host
    name. Turns shipped to one database are told apart by it, so each proxy needs its own: a sink refuses
    to ship under a name another proxy's database already ships under (docs/operations.md, "Fleet")."""
    slo: str | None = None
    """A service-level objective every measured turn is judged by on the live page and on
    ``/_specproxy/metrics`` (``specproxy_slo_turns_total``), e.g.
    ``ttft=2s,tpot=50ms,e2e=30s`` (any of the three; ``ms`` or ``s``): TTFT, time per output token
    after the first chunk (``1 / decode_tps``) and whole turn at most that. Labels may have their own
    after a ``;`` (``ttft=2s,tpot=50ms; batch: e2e=60s``): their turns are judged by it instead. The page then shows the
    share of turns that met it, with its interval, and goodput (tokens of those turns per second) at
    each concurrency; ``report``, ``compare`` and ``bench`` take ``--slo`` (docs/metrics.md, "Goodput
    under an SLO")."""
    sink: str | None = None
    """Where a fleet's turns go besides the local database: one or more ``postgresql://USER@HOST[:PORT]/DB``
    URLs, separated by commas. The local database stays the record and the outbox: a shipper thread per
    sink sends its turns and scrapes in batches and remembers in it how far it got, so a sink that is
    down or slow never holds traffic up. A password never goes in the URL (refused): libpq reads it from
    ``PGPASSWORD`` or a ``.pgpass`` file."""
    otlp_endpoint: str | None = None
    """Also push the per-turn figures (and the shippers') over OTLP/HTTP protobuf to this URL, e.g.
    ``http://collector:4318/v1/metrics``, under the OpenTelemetry GenAI semantic-convention names
    (docs/operations.md, "Fleet"). Needs ``pip install 'specproxy[otlp]'``. Sent from a thread of its own
    every ``otlp_interval_s``; an endpoint that does not take them is said in one line and
    counted, never waited on."""
    otlp_interval_s: float = 15.0
    """Seconds between OTLP exports (with ``otlp_endpoint``): each sends the running totals."""

    prices: tuple[tuple[str, Price], ...] | None = None
    """The price table: per model (as the request's ``model`` names it), ``input``, ``cached_input``,
    ``cache_write``, ``output`` and ``reasoning`` in USD per million tokens (only ``input`` and ``output``
    are needed; the others default to them). In the file, ``[prices."MODEL"]`` tables or an inline table;
    ``SPECPROXY_PRICES`` takes the inline table. None by default: specproxy makes up no prices, and a
    turn of a model without one has no cost. ``report`` and ``audit`` read it with ``--prices FILE``."""

    @property
    def price_table(self) -> dict[str, Price]:
        """``prices`` as a dict by model name."""
        return dict(self.prices or ())

    @property
    def tenant_key_secret(self) -> bytes | None:
        """The shared secret of ``tenant_from_key``'s fingerprints (``tenant_secret``, or the file's, which
        loading read into it), as bytes; None: the database's own."""
        return self.tenant_secret.encode() if self.tenant_secret is not None else None

    @property
    def name_of_proxy(self) -> str:
        """``proxy_name``, or the host name when it is unset."""
        return self.proxy_name or _host_name()

    @property
    def sinks(self) -> tuple[str, ...]:
        """The ``sink`` URLs, in order."""
        return tuple(u.strip() for u in (self.sink or "").split(",") if u.strip())

    @property
    def upstream_url(self) -> URL:
        """The upstream server's root: what every client path is appended to, and what ``metrics_path``
        and the identity look-ups (``/v1/models``...) are read under. See ``server_root``."""
        if not self.upstream:
            raise ConfigError("no upstream: pass --upstream URL (e.g. http://127.0.0.1:8000), or set upstream in "
                              "the --config file or SPECPROXY_UPSTREAM")
        return server_root(URL(self.upstream))

    def forwards_to(self, client_path: str) -> str:
        """The upstream URL a client's request for ``client_path`` goes to (for the start-up line; the
        proxy builds its request line from the same ``upstream_url``)."""
        url = self.upstream_url
        return f"{url.origin()}{url.raw_path.rstrip('/')}{client_path}"


def server_root(url: URL) -> URL:
    """``url`` without a trailing ``/v1`` segment (``/v1/`` too); any other base path is kept.

    Why here, once: clients send ``/v1/...`` themselves, and most servers' docs give their base URL as
    ``http://host:8000/v1``, so a user copying it would otherwise get ``/v1/v1/...`` on every request;
    and the server's ``/metrics``, ``/props`` and ``/version`` live at its root, not under ``/v1``. A
    reverse-proxied server under ``/llm`` keeps that prefix (``http://host/llm/v1`` -> ``/llm``)."""
    path = url.raw_path.rstrip("/")
    if not path.endswith("/v1"):
        return url
    return url.with_path(path[: -len("/v1")], encoded=True)


@functools.cache
def _host_name() -> str:
    """The machine's name, asked once (every request's record reads ``name_of_proxy`` on the event loop)."""
    return socket.gethostname()


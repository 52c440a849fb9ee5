"""A frozen ``Config``, from a TOML file, then ``SPECPROXY_*`` environment variables, then CLI flags.

Why frozen and in one place: the proxy reads its settings on every request; a value that cannot change
under it cannot surprise it. ``config.example.toml`` documents every key and is checked against
``KEYS`` by the test suite, so the docs cannot drift from the code.
"""

from __future__ import annotations

import functools
import os
import socket
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from yarl import URL

from specproxy.errors import ConfigError
from specproxy.prices import Price, parse_prices

__all__ = ["CADENCE_POLL_MODES", "RELAY_MODES", "UPSTREAM_REUSE_MODES", "Config", "Slo", "check_label",
           "check_otlp_endpoint", "check_sink_url", "child_environment", "load_config", "parse_slo", "server_root"]

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
    The key itself is never stored nor logged. Not with ``tenant_header``."""

    proxy_name: str | None = None
    """This proxy's name in a fleet, stamped on every turn (``proxy_name``): unset, the machine's host
    name. Turns shipped to one database are told apart by it, so each proxy needs its own: a sink refuses
    to ship under a name another proxy's database already ships under (docs/operations.md, "Fleet")."""
    slo: str | None = None
    """A service-level objective every measured turn is judged by on the live page, e.g.
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


KEYS: dict[str, type] = {}
for _f in fields(Config):
    _t = str(_f.type)
    KEYS[_f.name] = bool if "bool" in _t else int if _t == "int" else float if _t == "float" else str
# settings that are gone, and what to do where a file or the environment still names one
REMOVED = {"scan": "the measuring reads streams with its C scans wherever they are built (the reference "
                   "where not); delete it"}


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = KEYS[key]
    if value is None:
        return None
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be {kind.__name__}, got {value!r}") from None


# headers that carry credentials: never a client's name (they would be stored). By name (these, and any
# name with one of the words below in it: x-goog-api-key, x-auth-token, x-session-id, apikey...) or by
# shape (a name whose hyphen- or underscore-separated parts include one of SECRET_PARTS: x-sid, x-pwd)
SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key", "cookie",
                  "set-cookie")
SECRET_WORDS = ("auth", "token", "secret", "key", "passw", "session", "cookie", "credential", "signature",
                "bearer", "jwt", "csrf", "xsrf", "nonce", "private", "cert")
SECRET_PARTS = frozenset(("sid", "pwd", "pw", "pass", "otp", "pin", "sig", "hmac", "sso", "saml", "oauth"))


def carries_credentials(header: str) -> bool:
    """Whether a header named ``header`` may carry a credential, by its name or its shape (see above)."""
    name = header.strip().lower()
    return (name in SECRET_HEADERS or any(w in name for w in SECRET_WORDS)
            or any(part in SECRET_PARTS for part in name.replace("_", "-").split("-")))


def _prices_value(table: dict[str, Price]) -> tuple[tuple[str, Price], ...]:
    return tuple(sorted(table.items()))


def check_label(label: str, what: str = "--label") -> None:
    """A label ``compare`` can name as an arm: one that begins with ``@`` would be read as a time window."""
    if label.startswith("@"):
        raise ConfigError(f"{what} {label!r} begins with '@', which compare reads as a time window "
                          "(@START..END): choose a label that does not")


@functools.cache
def _host_name() -> str:
    """The machine's name, asked once (every request's record reads ``name_of_proxy`` on the event loop)."""
    return socket.gethostname()


SINK_SCHEMES = ("postgresql", "postgres")


def check_otlp_endpoint(url: str) -> None:
    """An OTLP/HTTP metrics URL (``http(s)://HOST[:PORT]/PATH``): one line saying what is wrong, else nothing."""
    try:
        parsed = URL(url)
    except ValueError:
        raise ConfigError(f"otlp_endpoint {url!r} is not a URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"otlp_endpoint {url!r} is not an http(s) URL with a host (OTLP/HTTP, e.g. "
                          "http://collector:4318/v1/metrics)")
    if parsed.password is not None:
        raise ConfigError("otlp_endpoint holds a password: it would show in the process list and the logs")


def check_sink_url(url: str) -> None:
    """A sink URL specproxy can ship to, without a password in it (it would show in the process list
    and the logs): one line saying what is wrong, else nothing."""
    try:
        parsed = URL(url)
    except ValueError:
        raise ConfigError(f"sink {url!r} is not a URL") from None
    if parsed.password is not None or "password" in parsed.query:
        raise ConfigError("sink URL holds a password: take it out of the URL and give it to libpq in "
                          "PGPASSWORD or a ~/.pgpass file (a URL shows in the process list and the logs)")
    if parsed.scheme not in SINK_SCHEMES:
        raise ConfigError(f"sink {url!r}: unknown kind {parsed.scheme!r} (a sink is "
                          "postgresql://USER@HOST[:PORT]/DB)")
    if not parsed.host or not parsed.path.strip("/"):
        raise ConfigError(f"sink {url!r} needs a host and a database: postgresql://USER@HOST[:PORT]/DB")


@dataclass(frozen=True, slots=True)
class Slo:
    """A service-level objective: upper bounds in seconds on a turn's TTFT, its time per output token
    after the first chunk (``tpot``) and its whole time (``e2e``); None where the objective sets none.
    ``labels``: the objectives of labels that have their own (``chat: ttft=1s``), which their turns are
    judged by instead. ``text`` is how the user wrote it, said back in every report."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    labels: tuple[tuple[str, Slo], ...] = ()

    @property
    def bounded(self) -> bool:
        """Whether this objective sets any bound (one given per label only sets none for the rest)."""
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def for_label(self, label: str | None) -> Slo | None:
        """The objective a turn with ``label`` is judged by: its label's own, else this one's bounds;
        None when neither sets any (the turn is not judged)."""
        for name, own in self.labels:
            if name == label:
                return own
        return self if self.bounded else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "text": self.text}
        if self.labels:
            out["by_label"] = {name: own.as_dict() for name, own in self.labels}
        return out


SLO_FIGURES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
_SLO_UNITS = (("ms", 1e-3), ("s", 1.0))  # "ms" first: "50ms" also ends in "s"


def _slo_bounds(group: str, text: str, what: str) -> Slo:
    """One objective, ``ttft=2s,tpot=50ms,e2e=30s`` (any subset, each once, a unit on every value)."""
    bounds: dict[str, float] = {}
    for part in group.split(","):
        name, eq, value = (p.strip() for p in part.partition("="))
        if not eq or name not in SLO_FIGURES:
            raise ConfigError(f"{what} {text!r}: {part.strip()!r} is not NAME=VALUE with NAME one of "
                              f"{', '.join(SLO_FIGURES)} (e.g. ttft=2s,tpot=50ms,e2e=30s)")
        if SLO_FIGURES[name] in bounds:
            raise ConfigError(f"{what} {text!r}: {name} is given twice")
        unit = next(((u, k) for u, k in _SLO_UNITS if value.endswith(u)), None)
        try:
            number = float(value[: -len(unit[0])]) if unit else None
        except ValueError:
            number = None
        if unit is None or number is None or not number > 0 or number == float("inf"):
            raise ConfigError(f"{what} {text!r}: {name}={value!r} is not a positive time with a unit "
                              "(ms or s, e.g. 50ms or 2s)")
        bounds[SLO_FIGURES[name]] = number * unit[1]
    return Slo(**bounds, text=",".join(p.strip() for p in group.split(",")))


def parse_slo(text: str | None, what: str = "--slo") -> Slo | None:
    """``ttft=2s,tpot=50ms,e2e=30s`` (any subset) as an ``Slo``, for every turn; with objectives of
    their own for labels after it, separated by ``;``: ``ttft=2s,tpot=50ms; batch: e2e=60s`` (turns
    labelled ``batch`` are judged by ``e2e=60s`` alone). Without a group for every turn, only the named
    labels' turns are judged. None for None or an empty text; anything else is a ConfigError of one
    line saying what is wrong."""
    if text is None or not text.strip():
        return None
    default: Slo | None = None
    labels: dict[str, Slo] = {}
    for group in (g.strip() for g in text.split(";")):
        head, colon, rest = group.partition(":")
        if not group:
            raise ConfigError(f"{what} {text!r}: an empty objective between ';' (e.g. ttft=2s; batch: e2e=60s)")
        if colon and "=" not in head:
            label = head.strip()
            if not label or not rest.strip():
                raise ConfigError(f"{what} {text!r}: {group!r} is not LABEL: NAME=VALUE,... (e.g. batch: e2e=60s)")
            if label in labels:
                raise ConfigError(f"{what} {text!r}: label {label!r} is given twice")
            labels[label] = _slo_bounds(rest.strip(), text, what)
        elif default is not None:
            raise ConfigError(f"{what} {text!r}: two objectives for every turn; name a label for the "
                              "second (LABEL: NAME=VALUE,...)")
        else:
            default = _slo_bounds(group, text, what)
    groups = ([default.text] if default else []) + [f"{name}: {own.text}" for name, own in labels.items()]
    base = default or Slo()
    return Slo(base.ttft_s, base.tpot_s, base.e2e_s, text="; ".join(groups), labels=tuple(labels.items()))


def _validate(cfg: Config) -> Config:
    if cfg.upstream is not None:
        url = URL(cfg.upstream)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"upstream {cfg.upstream!r} is not an http(s) URL with a host")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port {cfg.port} is out of range")
    name = cfg.client_header.strip().lower()
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(f"client_header {cfg.client_header!r} is not a header name")
    if carries_credentials(name):
        raise ConfigError(f"client_header {cfg.client_header!r} may carry credentials (its value would be stored): "
                          f"name the client with a header of your own, such as x-client-name")
    if cfg.tenant_header is not None:
        tenant = cfg.tenant_header.strip().lower()
        if not tenant or not all(c.isalnum() or c in "-_" for c in tenant):
            raise ConfigError(f"tenant_header {cfg.tenant_header!r} is not a header name")
        if carries_credentials(tenant):
            raise ConfigError(f"tenant_header {cfg.tenant_header!r} may carry credentials (its value would be "
                              "stored): use tenant_from_key to name tenants by a keyed hash of their API key")
        if cfg.tenant_from_key:
            raise ConfigError("tenant_header and tenant_from_key both name the tenant: choose one")
    for key in ("max_body_bytes", "max_concurrent", "queue_size", "max_measured_bytes", "max_counted_bytes"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be positive")
    if cfg.memory_budget_bytes < 0 or 0 < cfg.memory_budget_bytes < 2 * cfg.max_body_bytes:
        # (a large body may fill three quarters of the budget: a smaller one could refuse every largest body)
        raise ConfigError("memory_budget_bytes must be 0 (automatic) or at least twice max_body_bytes")
    for key in ("connect_timeout_s", "idle_timeout_s", "send_timeout_s", "header_timeout_s", "body_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be positive")
    if cfg.drain_timeout_s < 0:
        raise ConfigError("drain_timeout_s must be >= 0 (0 cuts in-flight requests at once)")
    if cfg.scrape_interval_s < 0:
        raise ConfigError("scrape_interval_s must be >= 0")
    if cfg.label is not None:
        check_label(cfg.label, "label")
    if cfg.scrape_retention_days < 0:
        raise ConfigError("scrape_retention_days must be >= 0 (0 keeps every scrape)")
    if cfg.admin_token is not None and len(cfg.admin_token) < 16:
        raise ConfigError("admin_token must be at least 16 characters (e.g. the output of `openssl rand -hex 16`)")
    if cfg.relay_slice_us < 0:
        raise ConfigError("relay_slice_us must be >= 0 (0 keeps the kernel's default)")
    if cfg.proxy_name is not None and not (0 < len(cfg.proxy_name) <= 100 and cfg.proxy_name.isprintable()):
        raise ConfigError(f"proxy_name {cfg.proxy_name!r} must be 1 to 100 printable characters")
    for url in cfg.sinks:
        check_sink_url(url)
    if cfg.otlp_endpoint is not None:
        check_otlp_endpoint(cfg.otlp_endpoint)
    if not cfg.otlp_interval_s > 0:
        raise ConfigError("otlp_interval_s must be positive")
    parse_slo(cfg.slo, "slo")
    for key, modes in (("upstream_reuse", UPSTREAM_REUSE_MODES), ("relay", RELAY_MODES),
                       ("cadence_poll", CADENCE_POLL_MODES)):
        if getattr(cfg, key) not in modes:
            raise ConfigError(f"{key} must be one of {', '.join(modes)}, not {getattr(cfg, key)!r}")
    return cfg


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment for a command specproxy runs for the user (``bench --restart-cmd``): this process's
    own, so the command finds what the user's shell would give it, plus ``extra``. Here because this module
    is the one place that reads the environment."""
    return {**os.environ, **extra}


def load_config(
    path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """File, then environment (``SPECPROXY_PORT=9000``...), then flags (``None`` means not given)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        for key, value in data.items():
            if key in REMOVED:
                raise ConfigError(f"config file {p}: {key!r} was removed: {REMOVED[key]}")
            if key not in KEYS:
                raise ConfigError(f"config file {p}: unknown key {key!r} (see config.example.toml)")
            if key == "prices":
                values[key] = _prices_value(parse_prices(value, str(p)))
                continue
            values[key] = _coerce(key, value, str(p))
    env = os.environ if env is None else env
    for key, why in REMOVED.items():
        if f"SPECPROXY_{key.upper()}" in env:
            raise ConfigError(f"SPECPROXY_{key.upper()} was removed: {why}")
    for key in KEYS:
        name = f"SPECPROXY_{key.upper()}"
        if name in env and key == "prices":
            try:
                inline = tomllib.loads(f"prices = {env[name]}")["prices"]
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{name} is not a TOML inline table of prices: {exc}") from None
            values[key] = _prices_value(parse_prices(inline, name))
        elif name in env:
            values[key] = _coerce(key, env[name], name)
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in KEYS:
                raise ConfigError(f"unknown setting {key!r}")
            if key == "prices":
                values[key] = _prices_value(value if isinstance(value, dict) else dict(value))
                continue
            values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    return _validate(replace(Config(), **values))

"""What makes a setting valid: one line saying what is wrong, at start-up, never a surprise later.

Why apart from the dataclass and the loading: the rules (credential-carrying headers, a sink URL without
a password, an SLO that parses) are asked by other commands too (``report --slo``, ``prune`` of a
sink's database), and each is written once here.
"""

from __future__ import annotations

from yarl import URL

from specproxy.config.settings import CADENCE_POLL_MODES, RELAY_MODES, UPSTREAM_REUSE_MODES, Config
from specproxy.config.slo import parse_slo
from specproxy.errors import ConfigError

__all__ = ["MIN_TENANT_SECRET", "carries_credentials", "check_label", "check_otlp_endpoint", "check_sink_url", "is_pg_url",
           "validate"]

# the shortest shared tenant secret taken: a short one could be guessed, and with it every key tested
MIN_TENANT_SECRET = 16

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


def check_label(label: str, what: str = "--label") -> None:
    """A label ``compare`` can name as an arm: one that begins with ``@`` would be read as a time window."""
    if label.startswith("@"):
        raise ConfigError(f"{what} {label!r} begins with '@', which compare reads as a time window "
                          "(@START..END): choose a label that does not")


SINK_SCHEMES = ("postgresql", "postgres")


def is_pg_url(db: str | None) -> bool:
    """Whether a ``--db`` names a fleet's PostgreSQL database rather than an SQLite file (decided here, not
    in ``store/pg_source.py``, so that a command on an SQLite file never imports the PostgreSQL driver)."""
    return db is not None and str(db).startswith(tuple(f"{scheme}://" for scheme in SINK_SCHEMES))


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


def validate(cfg: Config) -> Config:
    """``cfg`` when every setting is valid; else a ConfigError of one line saying which is not and why."""
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
    if cfg.tenant_secret is not None:
        if not cfg.tenant_from_key:
            raise ConfigError("a shared tenant secret (tenant_secret_file or SPECPROXY_TENANT_SECRET) is given "
                              "without tenant_from_key, whose fingerprints it keys: add --tenant-from-key")
        if len(cfg.tenant_secret) < MIN_TENANT_SECRET:
            raise ConfigError(f"the shared tenant secret (tenant_secret_file or SPECPROXY_TENANT_SECRET) must be "
                              f"at least {MIN_TENANT_SECRET} characters (e.g. the output of `openssl rand -hex 32`)")
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
    if not -20 <= cfg.relay_nice <= 0:
        raise ConfigError("relay_nice must be -20 to 0 (0 keeps the process's nice value)")
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

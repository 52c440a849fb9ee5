"""The settings: a frozen ``Config``, from a TOML file, then ``SPECPROXY_*`` environment variables, then CLI flags.

The package by job: ``settings`` (the dataclass, each field's docstring its definition), ``slo`` (the
objective's text parsed), ``checks`` (what makes a value valid), ``load`` (file, environment, flags; the
one place that reads the environment). Callers import from here, but for measuring, which takes ``Slo``
from ``config.slo`` itself (``settings`` imports ``socket``, which measuring may not).
"""

from specproxy.config.checks import check_label, check_otlp_endpoint, check_sink_url, is_pg_url
from specproxy.config.load import KEYS, child_environment, load_config
from specproxy.config.settings import CADENCE_POLL_MODES, RELAY_MODES, UPSTREAM_REUSE_MODES, Config, server_root
from specproxy.config.slo import Slo, parse_slo

__all__ = ["CADENCE_POLL_MODES", "KEYS", "RELAY_MODES", "UPSTREAM_REUSE_MODES", "Config", "Slo", "check_label", "is_pg_url",
           "check_otlp_endpoint", "check_sink_url", "child_environment", "load_config", "parse_slo", "server_root"]

"""Tenants (measure/tenant.py, Config tenant_header / tenant_from_key) and the price table in the config."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from specproxy.config import load_config
from specproxy.errors import ConfigError
from specproxy.measure.tenant import TenantRule, key_fingerprint
from specproxy.store.db import connect, migrate
from specproxy.store.queries import tenant_key_secret

KEY = b"sk-test-0123456789abcdef"
SECRET = b"s" * 32


def test_the_tenant_header_names_the_tenant():
    rule = TenantRule(header="X-Team")
    assert rule.of([(b"User-Agent", b"a"), (b"x-team", b"search")]) == "search"
    assert rule.of([(b"User-Agent", b"a")]) is None


@pytest.mark.parametrize("headers", [
    [(b"Authorization", b"Bearer " + KEY)],  # the OpenAI SDKs
    [(b"x-api-key", KEY)],  # the Anthropic SDK
    [(b"api-key", KEY)],  # Azure's
])
def test_the_key_names_the_tenant_by_a_keyed_hash_never_the_key(headers):
    tenant = TenantRule(secret=SECRET).of(headers)
    assert tenant == "key:" + hmac.new(SECRET, KEY, hashlib.sha256).hexdigest()[:16]
    assert KEY.decode() not in tenant and hashlib.sha256(KEY).hexdigest()[:16] not in tenant
    # another database's secret names the same key otherwise
    assert TenantRule(secret=b"t" * 32).of(headers) != tenant


def test_a_request_without_a_key_has_no_tenant():
    assert TenantRule(secret=SECRET).of([(b"user-agent", b"x")]) is None
    assert key_fingerprint(SECRET, KEY) != key_fingerprint(SECRET, KEY + b"x")


def test_each_database_draws_its_own_secret(tmp_path):
    secrets = []
    for name in ("a.db", "b.db"):
        conn = connect(tmp_path / name)
        migrate(conn)
        secrets.append(tenant_key_secret(conn))
        assert tenant_key_secret(conn) == secrets[-1]  # kept, not drawn again
        conn.close()
    assert len(secrets[0]) == 32 and secrets[0] != secrets[1]


@pytest.mark.parametrize("header", ["authorization", "x-api-key", "x-auth-token", "cookie"])
def test_a_tenant_header_that_may_carry_a_credential_is_refused(header):
    with pytest.raises(ConfigError, match="tenant_from_key") as err:
        load_config(env={}, overrides={"tenant_header": header})
    assert "\n" not in str(err.value)


def test_tenant_header_and_tenant_from_key_exclude_each_other():
    with pytest.raises(ConfigError, match="choose one"):
        load_config(env={}, overrides={"tenant_header": "x-team", "tenant_from_key": True})
    assert load_config(env={}, overrides={"tenant_header": "X-Team"}).tenant_header == "X-Team"


def test_prices_come_from_the_config_file_and_the_environment(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('port = 9000\n[prices."qwen"]\ninput = 0.5\ncached_input = 0.05\noutput = 2\n')
    p = load_config(f, env={}).price_table["qwen"]
    assert (p.input, p.cached_input, p.output, p.reasoning) == (0.5, 0.05, 2.0, 2.0)
    cfg = load_config(env={"SPECPROXY_PRICES": '{ "m" = { input = 1, output = 3 } }'})
    assert cfg.price_table["m"].output == 3.0
    assert load_config(env={}).price_table == {}  # none by default
    with pytest.raises(ConfigError, match="SPECPROXY_PRICES"):
        load_config(env={"SPECPROXY_PRICES": "{ m = "})
    f.write_text('[prices."qwen"]\ninput = 0.5\n')
    with pytest.raises(ConfigError, match="needs output"):
        load_config(f, env={})


SHARED = "fleet-shared-secret-0123456789"


def test_a_shared_secret_comes_from_a_file_or_the_environment_alike_and_is_never_shown(tmp_path):
    f = tmp_path / "secret"
    f.write_text(f"  {SHARED}\n")
    by_file = load_config(env={}, overrides={"tenant_from_key": True, "tenant_secret_file": str(f)})
    by_env = load_config(env={"SPECPROXY_TENANT_SECRET": SHARED + "\n", "SPECPROXY_TENANT_FROM_KEY": "1"})
    assert by_file.tenant_key_secret == by_env.tenant_key_secret == SHARED.encode()
    assert SHARED not in repr(by_file) and SHARED not in repr(by_env)
    assert load_config(env={}, overrides={"tenant_from_key": True}).tenant_key_secret is None  # the database's


@pytest.mark.parametrize("env, overrides, said", [
    ({"SPECPROXY_TENANT_SECRET": SHARED}, {}, "without tenant_from_key"),
    ({"SPECPROXY_TENANT_SECRET": SHARED[:15]}, {"tenant_from_key": True}, "at least 16 characters"),
    ({"SPECPROXY_TENANT_SECRET": SHARED}, {"tenant_from_key": True, "tenant_secret_file": "FILE"}, "choose one"),
])
def test_a_shared_secret_that_cannot_be_used_is_one_line_that_never_quotes_it(tmp_path, env, overrides, said):
    f = tmp_path / "secret"
    f.write_text(SHARED)
    overrides = {k: str(f) if v == "FILE" else v for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=said) as err:
        load_config(env=env, overrides=overrides)
    assert "\n" not in str(err.value) and SHARED[:15] not in str(err.value)

"""Which server process said it: an inference server's identity, read from what it serves.

Why: restarts change results (docs/metrics.md: "Restarts count"), so every scrape carries the
``instance_id`` of the process that produced it. ``identify_instance`` asks the server what it is
(its ``/props`` or ``/v1/models``, the start time its ``/metrics`` headers carry) and hashes what
names the process; ``Scraper`` (``specproxy.observe.scrape``) calls it and notices when it changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import aiohttp

from specproxy.observe.server_metrics import ScrapeError, ServerKind, Snapshot, parse_exposition

__all__ = ["START_HEADER", "Instance", "float_or_none", "identify_instance", "identity_changed"]

START_HEADER = "Process-Start-Time-Unix"  # llama.cpp sets it on /metrics (server-context.cpp)


@dataclass(frozen=True)
class Instance:
    """One server process, as far as the server lets us tell.

    ``instance_id`` is a hash of the upstream URL, the start time, the model list and the build,
    so it changes exactly when docs/metrics.md says an instance changes (start time, build or model
    list) and is the same for every specproxy that looks at the same process. Every part is
    optional: a part the server does not expose is ``None`` and simply not in the hash; a part
    whose look-up failed is ``None`` too, and the failure is listed in ``errors``.

    When a server exposes no start time (llama.cpp builds before the header, SGLang's
    multiprocess registry) a restart with the same models and build would hash the same; the
    ``Scraper`` then sets ``restart_epoch`` to the wall time it noticed the restart (a counter
    went down), which makes the id differ. Such an id is not reproducible by another observer;
    exposing a start time is the cure.
    """

    instance_id: str
    base_url: str
    server_kind: ServerKind = "unknown"
    start_time: float | None = None
    start_time_source: str | None = None
    #: Model ids from ``GET /v1/models``, sorted; ``None`` when that failed.
    models: tuple[str, ...] | None = None
    #: vLLM ``/version`` "version", llama.cpp ``/props`` "build_info", SGLang
    #: ``/get_server_info`` "version".
    build: str | None = None
    model_path: str | None = None
    total_slots: int | None = None
    restart_epoch: float | None = None
    errors: tuple[str, ...] = ()
    #: Small extras worth keeping (e.g. vLLM ``max_model_len``), JSON-able.
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def identity(self) -> dict[str, Any]:
        """The parts the id is a hash of, as a JSON-able dict (store it next to the id)."""
        return {
            "base_url": self.base_url,
            "start_time": None if self.start_time is None else round(self.start_time, 3),
            "models": list(self.models) if self.models is not None else None,
            "build": self.build,
            "restart_epoch": self.restart_epoch,
        }

    def rehashed(self, **changes: Any) -> Instance:
        """A copy with ``changes`` applied and the id recomputed from the new parts."""
        new = dataclasses.replace(self, **changes)
        return dataclasses.replace(new, instance_id=_hash_identity(new.identity()))


def _hash_identity(parts: Mapping[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return "inst-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


async def _get(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[int, bytes, Mapping[str, str]]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        body = await resp.read()
        return resp.status, body, resp.headers


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    status, body, _ = await _get(session, url, timeout_s)
    if status != 200:
        raise ScrapeError(f"HTTP {status}")
    try:
        return json.loads(body)
    except ValueError as e:
        raise ScrapeError(f"not JSON ({e})") from e


def float_or_none(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


async def identify_instance(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    snapshot: Snapshot | None = None,
    metrics_path: str = "/metrics",
    timeout_s: float = 2.0,
) -> Instance:
    """Ask the server who it is; never raises.

    Reads, each optional and each failure tolerated (listed in ``Instance.errors``):
    ``/metrics`` for the server kind and start time (skipped when the caller passes the
    ``snapshot`` it just scraped; the ``Process-Start-Time-Unix`` header should then already be
    on it), ``GET /v1/models`` for the model ids, then per kind: llama.cpp ``/props``
    (build_info, model_path, total_slots), vLLM ``/version``, SGLang ``/get_server_info``
    (version). For an unknown server it tries ``/version`` and ``/props``.
    """
    base = base_url.rstrip("/")
    errors: list[str] = []
    if snapshot is None:
        try:
            status, body, headers = await _get(session, base + metrics_path, timeout_s)
            if status != 200:
                raise ScrapeError(f"HTTP {status}")
            snapshot = parse_exposition(body.decode("utf-8", errors="replace"))
            header = float_or_none(headers.get(START_HEADER))
            if header is not None:
                snapshot = dataclasses.replace(snapshot, start_time_header=header)
        except Exception as e:  # identity is best effort by design
            errors.append(f"{metrics_path}: {type(e).__name__}: {e}")
    kind: ServerKind = snapshot.server_kind if snapshot is not None else "unknown"
    start, start_source = snapshot.start_time if snapshot is not None else (None, None)

    models: tuple[str, ...] | None = None
    extra: dict[str, Any] = {}
    try:
        data = await _get_json(session, base + "/v1/models", timeout_s)
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ScrapeError("no 'data' list")
        models = tuple(sorted(str(m["id"]) for m in entries if isinstance(m, dict) and "id" in m))
        lens = {str(m["id"]): m["max_model_len"] for m in entries if isinstance(m, dict) and "max_model_len" in m}
        if lens:
            extra["max_model_len"] = lens
    except Exception as e:  # best effort: recorded in errors
        errors.append(f"/v1/models: {type(e).__name__}: {e}")

    build: str | None = None
    model_path: str | None = None
    total_slots: int | None = None
    paths = {"llamacpp": ["/props"], "vllm": ["/version"], "sglang": ["/get_server_info"]}.get(
        kind, ["/version", "/props"]
    )
    for path in paths:
        try:
            data = await _get_json(session, base + path, timeout_s)
            if not isinstance(data, dict):
                raise ScrapeError("not a JSON object")
        except Exception as e:  # best effort: recorded in errors
            errors.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if path == "/props":
            build = build or _str_or_none(data.get("build_info"))
            model_path = _str_or_none(data.get("model_path"))
            slots = data.get("total_slots")
            total_slots = slots if isinstance(slots, int) else None
        else:
            build = build or _str_or_none(data.get("version"))
            model_path = model_path or _str_or_none(data.get("model_path"))

    inst = Instance(
        instance_id="",
        base_url=base,
        server_kind=kind,
        start_time=start,
        start_time_source=start_source,
        models=models,
        build=build,
        model_path=model_path,
        total_slots=total_slots,
        errors=tuple(errors),
        extra=MappingProxyType(extra),
    )
    return inst.rehashed()


def _str_or_none(value: Any) -> str | None:
    return str(value) if value is not None and value != "" else None


def identity_changed(old: Instance, new: Instance) -> str | None:
    """A difference in a part both identifications know (an unknown part proves nothing)."""
    if old.models is not None and new.models is not None and old.models != new.models:
        return f"models changed ({list(old.models)} -> {list(new.models)})"
    if old.build is not None and new.build is not None and old.build != new.build:
        return f"build changed ({old.build} -> {new.build})"
    if (
        old.start_time is not None
        and new.start_time is not None
        and old.start_time_source == new.start_time_source
        and abs(old.start_time - new.start_time) > 0.5
    ):
        return "start time changed"
    return None

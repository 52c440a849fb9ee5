"""A real Prometheus server for the fleet's tests: Debian's ``prometheus`` binary, run by the test in a
temporary directory on 127.0.0.1 with a generated configuration that scrapes the given specproxy
targets every second (the packaged service is never used). Without the binary the tests skip, except
where ``SPECPROXY_REQUIRE_PROMETHEUS=1`` (``.ci/run``) makes that a failure. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from faultkit import wait_until
from pgcluster import PORT_TRIES, free_port, port_taken

SCRAPE_S = 1


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("SPECPROXY_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("Prometheus is not installed (apt-get install prometheus) and SPECPROXY_REQUIRE_PROMETHEUS=1")
        pytest.skip("Prometheus is not installed (apt-get install prometheus): the fleet's scrape test needs it")
    return found


class Prometheus:
    """``prometheus`` scraping ``targets`` (host:port) at ``/_specproxy/metrics``; ``close`` kills it."""

    def __init__(self, targets: list[str]) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="specproxy-prom-"))
        config = self.root / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n"
            "scrape_configs:\n  - job_name: specproxy\n    metrics_path: /_specproxy/metrics\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n")
        self.proc: subprocess.Popen | None = None
        for attempt in range(PORT_TRIES):  # another port when the one picked was taken meanwhile
            self.port = free_port()
            self.log = open(self.root / "prometheus.log", "wb")
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root)
            try:
                wait_until(self._ready, 60, 0.1, "Prometheus to be ready")
                return
            except AssertionError as exc:
                self._end_process()
                if attempt == PORT_TRIES - 1 or not port_taken(str(exc)):
                    self.close()
                    raise
            except BaseException:
                self.close()
                raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}: "
                                 f"{(self.root / 'prometheus.log').read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        """An instant query's result vector (now)."""
        qs = urllib.parse.urlencode({"query": promql, "time": f"{time.time():.3f}"})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The one value of a query that gives at most one series (None when it gives none)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def targets_up(self) -> int:
        with urllib.request.urlopen(self.url + "/api/v1/targets", timeout=10) as resp:
            active = json.loads(resp.read())["data"]["activeTargets"]
        return sum(t["health"] == "up" for t in active)

    def _end_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def close(self) -> None:
        self._end_process()
        shutil.rmtree(self.root, ignore_errors=True)

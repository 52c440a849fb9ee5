"""``bench_overhead.py --watch``: someone looking at specproxy while it relays, in threads of the
orchestrator (the load side's CPUs), so that the cost of being watched is in specproxy's figures."""

from __future__ import annotations

import time

from overhead_peers import now_ns


class Watcher:
    """``--watch``: someone looking at specproxy while it relays: the live page's event stream read
    throughout (``/_specproxy/events``) and ``/_specproxy/metrics`` scraped once a second, as a browser
    tab and a Prometheus server would. Counts what it got (pictures: the events' ``data:`` messages, not
    the bytes, since a stream of keep-alive comments is bytes too; scrapes that answered Prometheus
    text), so a window where it got nothing is visible."""

    def __init__(self, port: int, until_ns: int) -> None:
        import threading

        self.port, self.until_ns = port, until_ns
        self.events_bytes = 0
        self.pictures = 0
        self.scrapes = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._events, self._metrics)]
        for t in self._threads:
            t.start()

    def _events(self) -> None:
        import http.client

        try:
            # the page may wait several seconds between pictures under load (serve/admin.py RENDER_SHARE)
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("GET", "/_specproxy/events")
            resp = conn.getresponse()
            tail = b""  # a message's start may be cut between two reads
            while now_ns() < self.until_ns:
                data = resp.read1(65536)
                if not data:
                    break
                self.events_bytes += len(data)
                seen = tail + data
                self.pictures += seen.count(b"\ndata: ")  # the stream opens with a comment: each follows a LF
                tail = seen[-6:]  # shorter than the marker: no message is counted twice
            conn.close()
        except OSError as exc:
            self.errors.append(f"events: {type(exc).__name__}: {exc}")

    def _metrics(self) -> None:
        import http.client

        while now_ns() < self.until_ns:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/_specproxy/metrics")
                resp = conn.getresponse()
                if resp.status == 200 and b"# TYPE specproxy_turns_total counter" in resp.read():
                    self.scrapes += 1
                else:
                    self.errors.append(f"metrics: HTTP {resp.status}")
                conn.close()
            except OSError as exc:
                self.errors.append(f"metrics: {type(exc).__name__}: {exc}")
            time.sleep(1.0)  # a scrape interval, not a wait for an event

    def join(self) -> dict:
        for t in self._threads:
            t.join(timeout=10)
        return {"events_bytes": self.events_bytes, "pictures": self.pictures, "scrapes": self.scrapes,
                "errors": self.errors[:5]}

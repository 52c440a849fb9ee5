"""The running proxy: the fronts, the forwarding of each turn, measuring scheduled in the relay's gaps,
and the server watch, wired together by the service."""

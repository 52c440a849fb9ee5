"""The inference server's own account: /metrics scraped, parsed, and turned into counter deltas and instances."""

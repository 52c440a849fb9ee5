"""The forwarding path: upstream connections, response heads, and the relay that moves body bytes.

Nothing here understands what the bytes mean; it stamps each read with the monotonic clock and keeps it."""

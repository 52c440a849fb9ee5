"""Framing parsers shared by the wire and measuring: HTTP/1.1 chunked framing and server-sent events.

Sans-I/O and below both users, so that the relay and the measuring read a body by the same rules."""

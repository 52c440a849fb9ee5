"""Turning a finished turn's stamped reads into a Record: texts, tokens, prompt parts, content class.

Pure computation, no I/O (the import contracts hold it): it runs off the event loop, after forwarding."""

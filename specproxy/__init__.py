"""specproxy: a transparent OpenAI-compatible proxy that measures what users of an inference server get."""

__version__ = "0.1.0"

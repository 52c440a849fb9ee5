"""Session fixtures for the ``real`` llama.cpp test tier.

Load them from ``tests/conftest.py`` (pyproject sets ``pythonpath = ["tests"]``)::

    pytest_plugins = ["real.fixtures"]      # preferred: registers the summary hook too
    # or
    from real.fixtures import *             # noqa: F401,F403  (also imports the hook)

Fixtures:

* ``llama_server_bin``  — path to a cached (built on first use) ``llama-server``.
  When building is impossible here (no cmake/compiler, no PyPI) the fixture
  *skips*, loudly: the reason is written to the terminal immediately and again
  in the final summary.  ``SPECPROXY_REQUIRE_LLAMA=1`` turns the skip into a
  failure, so CI cannot go green by silently skipping the whole tier.
* ``tiny_model`` / ``tiny_model_path`` — a model that recites ``TINY_SENTENCE``
  and ends its turn (``tiny_model.token_ids`` includes the ``<|eot_id|>``).
* ``looping_model_path`` — same, but repeats the sentence until ``max_tokens``.
* ``draft_model_path`` — a looping draft (different random weights, same
  predictions) for ``--spec-type draft-simple -md PATH``.  NB: ``-md`` alone
  does not enable drafting in this llama.cpp.
* ``hf_tokenizer_dir`` — a transformers tokenizer directory equal to the models'.
* ``llama_server`` — one running server on ``tiny_model_path`` for the session
  (counters in ``/metrics`` accumulate across tests: compare deltas).
* ``tool_model`` / ``tool_server`` — a model built the same way that recites ``TOOL_SENTENCE``, a
  Llama-3.1 JSON tool call, and a one-thread server on it: llama-server's own tool-call parser turns it
  into a real ``tool_calls`` answer when the request has tools.
* ``counter`` — specproxy's own tokenizer adapter on the models' tokenizer (``--tokenizer hf:DIR``).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from .server import LlamaServer
from .tiny_model import DEFAULT_SENTENCE, make_hf_tokenizer_dir, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TINY_SENTENCE = DEFAULT_SENTENCE
# The tool model writes this; llama-server parses it into tool_calls=[get_weather({"city": "Paris"})]
# (a bigram model needs distinct tokens: the spacing of that JSON is one whose tokens are all different).
TOOL_SENTENCE = '{"name":"get_weather","parameters":{"city": "Paris"}}'
# What the client receives as the call's arguments: llama-server re-serialises the parsed object.
TOOL_ARGS = '{"city": "Paris"}'
REQUIRE_ENV = "SPECPROXY_REQUIRE_LLAMA"
VOCAB_NAME = "ggml-vocab-llama-bpe.gguf"

_loud_messages: list[str] = []


def _build_module():
    """Import scripts/build_llama_server.py by path (scripts/ is not a package)."""
    name = "specproxy_build_llama_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "build_llama_server.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _capture_disabled(config: pytest.Config):
    capman = config.pluginmanager.get_plugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()


def _say_loudly(config: pytest.Config, msg: str) -> None:
    """Print past pytest's output capture right now, and remember for the summary."""
    _loud_messages.append(msg)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        with _capture_disabled(config):
            tr.write_line("")
            tr.write_line(f"!!! {msg}", red=True, bold=True)
    else:  # e.g. -p no:terminal: fall back to a visible warning
        warnings.warn(msg, pytest.PytestWarning, stacklevel=2)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """Repeat the skip reason at the end, where nobody can scroll past it."""
    if _loud_messages:
        terminalreporter.section("llama.cpp real tier NOT RUN", red=True, bold=True)
        for msg in dict.fromkeys(_loud_messages):
            terminalreporter.write_line(msg, red=True)
        terminalreporter.write_line(f"(set {REQUIRE_ENV}=1 to make this a failure)")


@pytest.fixture(scope="session")
def llama_server_bin(request: pytest.FixtureRequest) -> Path:
    """The cached ``llama-server`` binary, built on first use (minutes, once).

    Only ``BuildError`` (the machine cannot build it) becomes a skip; any other
    exception is a bug in the infrastructure and propagates as an error.
    pytest caches a session fixture's skip/failure, so the build is attempted
    at most once per session.
    """
    mod = _build_module()
    if (exe := mod.cached_binary()) is not None:
        return exe
    try:
        # A cold build takes minutes: let its progress lines reach the terminal
        # instead of sitting in pytest's capture until the test ends.
        with _capture_disabled(request.config):
            return mod.ensure_llama_server()
    except mod.BuildError as e:
        reason = str(e)
    # Outside the except block so the report is not cluttered with a chained traceback.
    msg = f"llama-server could not be built on this machine, skipping real llama.cpp tests: {reason}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{msg} ({REQUIRE_ENV}=1 forbids skipping)", pytrace=False)
    _say_loudly(request.config, msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def llama_assets_dir(llama_server_bin: Path) -> Path:
    """``<cache>/llama-server-<v>/models``: the vocab GGUF and chat templates."""
    return llama_server_bin.parent.parent / "models"


@dataclass(frozen=True)
class TinyModel:
    path: Path
    sentence: str
    token_ids: list[int]  # what the model emits, including <|eot_id|> when it ends its turn
    ends_turn: bool


def _cached_model(assets: Path, *, sentence: str, end_with_eot: bool, seed: int) -> TinyModel:
    """Generate once per (generator code, parameters); reuse across sessions.

    The key hashes tiny_model.py itself, so changing the generator invalidates
    old models automatically.
    """
    src = (Path(__file__).parent / "tiny_model.py").read_bytes()
    vocab = assets / VOCAB_NAME
    key = hashlib.sha256(src + repr((sentence, end_with_eot, seed, vocab.stat().st_size)).encode()).hexdigest()[:16]
    out = assets.parent / "tiny-models" / f"tiny-{key}.gguf"
    meta = out.with_suffix(".json")
    if not (out.is_file() and meta.is_file()):
        _drop_stale_models(out.parent)
        # written aside and renamed: test workers in parallel may make the same model at once
        part = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        ids = make_tiny_model(vocab, part, sentence, end_with_eot=end_with_eot, seed=seed)
        part.replace(out)
        tmp = meta.with_name(f".{meta.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"token_ids": ids, "sentence": sentence}))
        tmp.replace(meta)  # written after the model: its presence marks completeness
    ids = json.loads(meta.read_text())["token_ids"]
    os.utime(meta)  # "last used": lets _drop_stale_models spare models in use
    return TinyModel(path=out, sentence=sentence, token_ids=ids, ends_turn=end_with_eot)


def _drop_stale_models(d: Path, max_idle_s: float = 7 * 86400) -> None:
    """Delete models unused for a week (old generator versions pile up at ~40 MB each)."""
    now = time.time()
    for meta in d.glob("tiny-*.json"):
        with contextlib.suppress(OSError):
            if now - meta.stat().st_mtime > max_idle_s:
                meta.unlink()
                meta.with_suffix(".gguf").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model(llama_assets_dir: Path) -> TinyModel:
    return _cached_model(llama_assets_dir, sentence=TINY_SENTENCE, end_with_eot=True, seed=0)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model: TinyModel) -> Path:
    return tiny_model.path


@pytest.fixture(scope="session")
def looping_model_path(llama_assets_dir: Path) -> Path:
    return _cached_model(llama_assets_dir, sentence=TINY_SENTENCE, end_with_eot=False, seed=0).path


@pytest.fixture(scope="session")
def draft_model_path(llama_assets_dir: Path) -> Path:
    return _cached_model(llama_assets_dir, sentence=TINY_SENTENCE, end_with_eot=False, seed=1).path


@pytest.fixture(scope="session")
def hf_tokenizer_dir(llama_assets_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for ``AutoTokenizer.from_pretrained`` matching the tiny models.

    Loading a local directory never contacts a hub; HF_HUB_OFFLINE=1 is set
    anyway (if unset) so a stray repo-id lookup fails fast instead of waiting
    on network timeouts.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return make_hf_tokenizer_dir(llama_assets_dir / VOCAB_NAME, tmp_path_factory.mktemp("hf-tokenizer"))


@pytest.fixture(scope="session")
def llama_server(llama_server_bin: Path, tiny_model_path: Path):
    """A shared server on the tiny model (no speculative decoding)."""
    with LlamaServer(llama_server_bin, tiny_model_path) as srv:
        yield srv


@pytest.fixture(scope="session")
def tool_model(llama_assets_dir: Path) -> TinyModel:
    return _cached_model(llama_assets_dir, sentence=TOOL_SENTENCE, end_with_eot=True, seed=0)


@pytest.fixture(scope="session")
def tool_server(llama_server_bin: Path, tool_model: TinyModel):
    with LlamaServer(llama_server_bin, tool_model.path, threads=1) as srv:
        yield srv


@pytest.fixture(scope="session")
def counter(hf_tokenizer_dir: Path):
    """specproxy's own tokenizer adapter on the models' tokenizer (``--tokenizer hf:DIR``)."""
    from specproxy.measure.tokens import load_tokenizer

    return load_tokenizer(f"hf:{hf_tokenizer_dir}")

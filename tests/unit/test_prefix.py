"""``PrefixTracker``: the first token where a turn's prompt stops being its session's previous turn's.

The reference is the plain computation: tokenize both whole prompts and compare the ids. With a chat
template the whole prompt is the template's render (``prompt_text``); the tracker tokenizes it by
pieces between added tokens and reuses the previous turn's ids, and must land on the same token."""

from __future__ import annotations

from specproxy.measure.openai import split_prompt
from specproxy.measure.prefix import PrefixTracker


def _body(system: str, turns: int) -> dict:
    messages = [{"role": "system", "content": system}]
    for k in range(turns):
        messages.append({"role": "user", "content": f"Question {k}: what does module {k} do?"})
        messages.append({"role": "assistant", "content": f"Module {k} parses the configuration."})
    messages.append({"role": "user", "content": "And the next one?"})
    return {"model": "m", "messages": messages,
            "tools": [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_with_a_chat_template_the_break_is_where_the_whole_renders_part(hf_tok):
    assert hf_tok.rendered.by_pieces  # the piece path is the one under test
    tracker = PrefixTracker()
    bodies = [_body("You are terse.", 1), _body("You are terse.", 2), _body("You are very terse.", 3),
              _body("You are very terse.", 4)]
    renders = []
    for k, body in enumerate(bodies):
        parts = split_prompt(body)
        renders.append(hf_tok.encode(hf_tok.prompt_text(parts)))
        got = tracker.observe("s", hf_tok, parts)
        if k == 0:
            assert got.reused is None and got.diff is None
            continue
        assert got.reused == _common(renders[k - 1], renders[k])
        assert got.part is None  # a render does not keep the parts in order
    # back to the first body: its two leading messages stay, the 7 after them differ, its last is new
    assert tracker.observe("s", hf_tok, split_prompt(bodies[0])).diff == {
        "messages_added": 1, "messages_removed": 7, "system_changed": True, "tools_changed": False}


def test_plain_counts_name_the_part_and_forgotten_sessions_start_over(tiktoken_tok):
    tracker = PrefixTracker(max_sessions=1)
    body = _body("Be brief.", 1)
    grown = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "The lexer."},
                                  {"role": "user", "content": "Thanks."}]}
    first, second = split_prompt(body), split_prompt(grown)
    assert tracker.observe("a", tiktoken_tok, first).reused is None
    assert tracker.observe("a", tiktoken_tok, second).reused == tiktoken_tok.count_prompt(first).total
    edited = split_prompt({**grown, "tools": [{"type": "function", "function": {"name": "find"}}]})
    got = tracker.observe("a", tiktoken_tok, edited)
    assert got.part == "tools" and got.diff["tools_changed"] and not got.diff["system_changed"]
    assert got.reused == tiktoken_tok.count("Be brief.") + _common(
        tiktoken_tok.encode('[{"type":"function","function":{"name":"grep","parameters":{"type":"object"}}}]'),
        tiktoken_tok.encode('[{"type":"function","function":{"name":"find"}}]'))
    tracker.observe("b", tiktoken_tok, first)  # one session remembered: "a" is forgotten
    assert tracker.observe("a", tiktoken_tok, second).reused is None


def test_segments_shared_across_sessions_are_tokenized_once(tiktoken_tok):
    """Every session of one agent opens with the same system prompt and tools: tokenized once, and the
    shared ids give the same breaks as tokenizing afresh."""
    shared, fresh = PrefixTracker(), PrefixTracker(max_shared_tokens=0)
    for i in range(3):
        body = _body("Be brief.", 0)
        body["messages"][-1] = {"role": "user", "content": f"Session {i}'s own question"}
        first = split_prompt(body)
        grown = split_prompt({**body, "messages": [*body["messages"], {"role": "assistant", "content": "Yes."},
                                                   {"role": "user", "content": f"More on {i}"}]})
        for parts in (first, grown):
            assert shared.observe(f"s{i}", tiktoken_tok, parts) == fresh.observe(f"s{i}", tiktoken_tok, parts)
    # per session: system, tools, its question; then its two new messages ("Yes." is shared after the first)
    assert fresh.encoded == 3 * (3 + 2)
    assert shared.encoded == (3 + 2) + 2 * (1 + 1)


def test_a_prompt_cut_back_to_an_earlier_one_reuses_all_of_it_and_breaks_in_the_part_after(tiktoken_tok):
    """The other way round from growing: the next turn's prompt is the previous one's first messages (a
    client retried an earlier turn). All of it is the previous prompt's prefix; the break is in the part
    the previous turn had next (both directions are one comparison of the two prompts' token ids)."""
    tracker = PrefixTracker()
    long = split_prompt(_body("Be brief.", 2))
    short = split_prompt({**_body("Be brief.", 2), "messages": _body("Be brief.", 2)["messages"][:3]})
    tracker.observe("s", tiktoken_tok, long)
    got = tracker.observe("s", tiktoken_tok, short)
    assert got.reused == tiktoken_tok.count_prompt(short).total
    assert got.part == "history"
    assert got.diff == {"messages_added": 0, "messages_removed": 3, "system_changed": False, "tools_changed": False}

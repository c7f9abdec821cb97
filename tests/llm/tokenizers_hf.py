"""Cross-check of accel::llm::Tokenizer against Hugging Face tokenizers (and transformers' AutoTokenizer for
tokenizer_config.json): trains byte-level and SentencePiece-style BPE tokenizers on a >= 1 MB local corpus, writes
them with the JSON structure of the real Qwen2, Llama 3 and Llama 2 files, encodes and decodes every text with
the Python peers, then runs the C++ checker (tokenizer_check), which must agree id for id and text for text.

usage: tokenizers_hf.py CHECKER [--keep DIR]     exit 0 when everything matches, 77 when a package is missing
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_corpus import build_texts  # noqa: E402

try:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
except ImportError as e:  # pragma: no cover
    print(f"SKIP: tokenizers is not importable ({e})")
    sys.exit(77)

# The pre-tokenizer patterns of the real files (Qwen2 / Qwen2.5 tokenizer.json, Llama 3 tokenizer.json).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level_bpe(texts, pattern, specials, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts[: len(texts) // 2], trainer)
    return json.loads(tok.to_str())


def qwen2_json(texts, vocab_size=6000):
    j = byte_level_bpe(texts, QWEN2_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], vocab_size)
    j["normalizer"] = {"type": "NFC"}
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    j["decoder"], j["post_processor"] = dict(bl), dict(bl)
    m = j["model"]
    m.update(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
             byte_fallback=False, ignore_merges=False)
    m["merges"] = [" ".join(p) for p in m["merges"]]  # the real Qwen2 file's "a b" strings
    n = max(m["vocab"].values()) + 1
    for tok in j["added_tokens"]:
        tok.update(special=True, normalized=False)
    # Added tokens as Qwen2.5 has them (special false) and with the other matching options.
    for content, extra in [("<tool_call>", {}), ("<mask>", {"lstrip": True, "rstrip": True}),
                           ("ZZword", {"single_word": True, "normalized": True})]:
        tok = {"id": n, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": False}
        tok.update(extra)
        j["added_tokens"].append(tok)
        n += 1
    return j


def llama3_json(texts, vocab_size=7000):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    j = byte_level_bpe(texts, LLAMA3_PATTERN, specials, vocab_size)
    j["normalizer"] = None
    j["pre_tokenizer"]["pretokenizers"][1].update(trim_offsets=True)
    m = j["model"]
    m.update(dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None, fuse_unk=False,
             byte_fallback=False, ignore_merges=True)
    # Whole words the merges cannot build: ignore_merges makes them one id.
    n = max(m["vocab"].values()) + 1
    for word in ["ĠQuokka", "ĠZyxwv", "Ġquokkas", "Ġtokenizer"]:
        if word not in m["vocab"]:
            m["vocab"][word] = n
            n += 1
    for tok in j["added_tokens"]:
        tok.update(special=True, normalized=False)
    bos = j["added_tokens"][0]
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos["content"], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}}]}
    j["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return j


def sentencepiece_bpe(texts, vocab_size=5000):
    """A Llama-2-like model: <unk> <s> </s>, the 256 <0xXX> byte tokens, then trained pieces (limited alphabet,
    so rare characters fall back to bytes)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                         limit_alphabet=150)
    tok.train_from_iterator(texts[: len(texts) // 2], trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [" ".join(p) for p in trained["merges"]]
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    bos_template = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    return model, added, bos_template


def llama2_variants(texts, vocab_size=5000):
    model, added, bos_template = sentencepiece_bpe(texts, vocab_size)
    base = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "model": model,
            "post_processor": bos_template}
    sp_decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    # Llama-2-7b-hf's tokenizer.json as published: the normalizer does the SentencePiece space handling.
    legacy = dict(base, normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        pre_tokenizer=None, decoder=sp_decoder)
    # The same model as transformers converts it today: Metaspace with prepend_scheme "first".
    metaspace = dict(base, normalizer=None, pre_tokenizer={
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        decoder={"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {
            "type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}, {"type": "Fuse"}]})
    # Without byte fallback (unk, fused), digits split one by one, Metaspace splitting words, a regex Replace.
    unk_model = dict(model, byte_fallback=False)
    unk = dict(base, model=unk_model, normalizer={"type": "Replace", "pattern": {"Regex": "\\s*\\t"}, "content": "\t"},
               pre_tokenizer={"type": "Sequence", "pretokenizers": [
                   {"type": "Digits", "individual_digits": True},
                   {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}]},
               decoder={"type": "Sequence", "decoders": [{"type": "Metaspace", "replacement": "▁",
                                                          "prepend_scheme": "always", "split": True}]})
    return {"llama2_legacy": legacy, "llama2_metaspace": metaspace, "llama2_unk_digits": unk}


def split_behaviors_json(qwen):
    """Qwen2's model behind other Split behaviors and inverted patterns (each one a separate rule of
    NormalizedString::split)."""
    j = json.loads(json.dumps(qwen))
    j["normalizer"] = {"type": "NFKC"}
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithPrevious", "invert": False},
        {"type": "Split", "pattern": {"String": "."}, "behavior": "MergedWithNext", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Contiguous", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[,;]"}, "behavior": "Removed", "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\p{N}+|\\s+"}, "behavior": "Isolated", "invert": True},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}]}
    return j


def gpt2_json(qwen):
    """GPT-2's layout: ByteLevel with its built-in regex (add_prefix_space false), no normalizer."""
    j = json.loads(json.dumps(qwen))
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    j["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return j


# Unicode general categories, Oniguruma's \\d and \\w, and categories inside [...], as tokenizers' Oniguruma has
# them (Unicode 16; Debian's PCRE2 10.42 has Unicode 14: regex.cpp adds the difference, unicode_classes.inc).
# Each Replace turns one class's code points into a control character that no later class matches, so the ids
# of the texts (every assigned code point) are equal only when each class holds the same code points.
CLASS_CHAINS = {
    "unicode_categories": [r"\p{%s}" % c for c in ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No",
                                                     "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So"]],
    "unicode_aggregates": [r"\d", r"\w", r"\p{N}", r"\p{P}", r"\p{S}", r"\p{L}", r"\p{M}"],
    "unicode_in_classes": [r"[\p{L}\p{M}]", r"[\p{N}\d]", r"[^\s\p{L}\p{N}\p{M}\x00-\x1f]"],
}


def unicode_class_cases(qwen, assigned):
    """(name, tokenizer.json, texts) per CLASS_CHAINS entry: Qwen2's byte-level model behind the chain's Replace
    normalizers and GPT-2's pre-tokenizer regex, on every code point tokenizers has assigned (not private use),
    1,000 a text."""
    texts = [assigned[i:i + 1000] for i in range(0, len(assigned), 1000)]
    markers = [chr(c) for c in range(1, 32) if not 9 <= c <= 13]
    cases = []
    for name, chain in CLASS_CHAINS.items():
        j = json.loads(json.dumps(qwen))
        j["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"Regex": pattern}, "content": marker}
            for pattern, marker in zip(chain, markers)]}
        j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        # Qwen2's added tokens stay: "ZZword" (normalized) is matched as the chain normalizes it ("\x02" x 6 in
        # the aggregates chain) and decodes, as tokenizers decodes it, to that normalized content.
        cases.append((name, j, texts))
    return cases


# Unicode normalization forms as tokenizers has them (its unicode-normalization-alignments tables are older than
# utf8proc's Unicode 15: normalizers.cpp maps the difference, unicode_norm.inc). Each form runs alone before
# GPT-2's byte-level pre-tokenizer, so the ids are equal only when the normalized texts are.
NORMALIZATION_FORMS = ["NFC", "NFD", "NFKC", "NFKD"]


def assigned_code_points():
    """Every code point tokenizers' regex engine has assigned (Unicode 16), private use left out."""
    points = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    unassigned = pre_tokenizers.Split(Regex(r"[\p{Cn}\p{Co}]"), behavior="removed")
    return "".join(piece for piece, _ in unassigned.pre_tokenize_str(points))


def normalization_texts(assigned):
    """Every assigned code point (1,000 a text, in code point order), then every mark (\\p{M}, Unicode 16) in
    sequences whose order and composition depend on its combining class (after an acute, before a class-1
    overlay, between e and an acute: they compose only when it does not block), then the canonical
    decompositions of Python's unicodedata (Unicode 14) to compose, 100 a text, space-separated."""
    import unicodedata
    texts = [assigned[i:i + 1000] for i in range(0, len(assigned), 1000)]
    kept = "".join(piece for piece, _ in pre_tokenizers.Split(Regex(r"\p{M}"), behavior="removed")
                   .pre_tokenize_str(assigned))
    marks = sorted(set(assigned) - set(kept))
    seqs = ["a\u0301%s a%s\u0334 e%s\u0301" % (m, m, m) for m in marks]
    pairs = []
    for c in range(0x110000):
        d = unicodedata.decomposition(chr(c)) if not 0xD800 <= c <= 0xDFFF else ""
        if d and not d.startswith("<"):
            pairs.append("".join(chr(int(h, 16)) for h in d.split()))
    for items in (seqs, pairs):
        texts += [" ".join(items[i:i + 100]) for i in range(0, len(items), 100)]
    return texts


def digits_texts():
    """For the Digits pre-tokenizer (Rust's char::is_numeric, whose tables are newer than Oniguruma's: Unicode 17
    in tokenizers 0.23), every code point of planes 0 and 1 (where all numbers are) that Oniguruma has in \\p{N}
    or unassigned (\\p{Cn}), 1,000 a text: Metaspace's "always" prefix after it shows each isolated digit."""
    points = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, 0x20000)))
    chosen = "".join(piece for piece, _ in pre_tokenizers.Split(Regex(r"[^\p{N}\p{Cn}]+"), behavior="removed")
                     .pre_tokenize_str(points))
    return [chosen[i:i + 1000] for i in range(0, len(chosen), 1000)]


def normalization_cases(qwen, assigned):
    texts = normalization_texts(assigned)
    cases = []
    for form in NORMALIZATION_FORMS:
        j = json.loads(json.dumps(qwen))
        j["normalizer"] = {"type": form}
        j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        cases.append(("unicode_" + form.lower(), j, texts))
    return cases


def expected_for(tok, texts, rng, transformers_tok=None):
    """Every text encoded with special tokens; every 4th also without them and decoded (the checker compares
    what is there)."""
    some = texts[::4]
    if transformers_tok is None:
        with_special = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=True)]
        plain = [e.ids for e in tok.encode_batch_fast(some, add_special_tokens=False)]
    else:
        with_special = [transformers_tok(t)["input_ids"] for t in texts]
        plain = [transformers_tok(t, add_special_tokens=False)["input_ids"] for t in some]
    size = tok.get_vocab_size(with_added_tokens=True) if transformers_tok is None else len(transformers_tok)
    random_ids = [[rng.randrange(size) for _ in range(rng.randint(1, 40))] for _ in range(400)]
    dec = transformers_tok.decode if transformers_tok is not None else tok.decode
    return {"texts": texts, "ids": with_special, "ids_plain": plain, "size": size,
            "decoded": [dec(ids, skip_special_tokens=False) for ids in with_special[::4]],
            "decoded_skip": [dec(ids, skip_special_tokens=True) for ids in with_special[::4]],
            "random_ids": random_ids,
            "random_decoded": [dec(ids, skip_special_tokens=False) for ids in random_ids],
            "random_decoded_skip": [dec(ids, skip_special_tokens=True) for ids in random_ids]}


def write_case(root, name, tokenizer_json, texts, rng, config=None, special_tokens_map=None):
    d = os.path.join(root, name)
    os.makedirs(d)
    path = os.path.join(d, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer_json, ensure_ascii=False))  # dumps: C encoder (dump's is pure Python)
    tok = Tokenizer.from_file(path)
    transformers_tok = None
    if config is not None:
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        if special_tokens_map is not None:
            with open(os.path.join(d, "special_tokens_map.json"), "w", encoding="utf-8") as f:
                json.dump(special_tokens_map, f)
        from transformers import AutoTokenizer
        transformers_tok = AutoTokenizer.from_pretrained(d)
    with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(expected_for(tok, texts, rng, transformers_tok), ensure_ascii=False))
    return d


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    checker = sys.argv[1]
    keep = sys.argv[sys.argv.index("--keep") + 1] if "--keep" in sys.argv else None
    t0 = time.time()
    texts = build_texts()
    nbytes = sum(len(t.encode()) for t in texts)
    print(f"corpus: {len(texts)} texts, {nbytes} bytes")
    if keep:
        os.makedirs(keep, exist_ok=True)
        return run(checker, texts, keep, t0)
    with tempfile.TemporaryDirectory(prefix="accel_tok_") as root:
        return run(checker, texts, root, t0)


def run(checker, texts, root, t0):
    rng = random.Random(7)
    qwen = qwen2_json(texts)
    cases = [("qwen2", qwen), ("llama3", llama3_json(texts)), ("split_behaviors", split_behaviors_json(qwen)),
             ("gpt2", gpt2_json(qwen))]
    cases += sorted(llama2_variants(texts).items())
    by_name = dict(cases)
    dirs = [write_case(root, name, j, texts, rng) for name, j in cases]
    assigned = assigned_code_points()
    unicode_cases = unicode_class_cases(qwen, assigned) + normalization_cases(qwen, assigned)
    dirs += [write_case(root, name, j, unicode_texts, rng) for name, j, unicode_texts in unicode_cases]
    dirs.append(write_case(root, "digits_unicode17", by_name["llama2_unk_digits"], digits_texts(), rng))
    print(f"python: trained and encoded {len(cases)} tokenizers in {time.time() - t0:.1f} s")
    # transformers' AutoTokenizer with tokenizer_config.json (a few hundred texts: its per-call cost is high).
    sample = texts[:300]
    try:
        import transformers  # noqa: F401
        configs = [
            ("tf_llama2_bos_eos", by_name["llama2_metaspace"], {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
                                                "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>",
                                                "unk_token": "<unk>", "clean_up_tokenization_spaces": False}),
            ("tf_qwen2_chat", qwen, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                                     "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "sep_token": "<sep>",
                                     "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<extra_tok>"],
                                     "clean_up_tokenization_spaces": False}),
            ("tf_llama3_default", by_name["llama3"], {"tokenizer_class": "PreTrainedTokenizerFast",
                                                "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                                "clean_up_tokenization_spaces": False}),
            # The classes transformers 5 rebuilds the pipeline for: LlamaTokenizer on Llama-2-7b-hf's legacy
            # layout (Metaspace "first", or "always" with legacy true), Qwen2Tokenizer with add_prefix_space.
            ("tf_llama2_class", by_name["llama2_legacy"], {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                              "legacy": False, "clean_up_tokenization_spaces": False}),
            ("tf_llama2_class_legacy", by_name["llama2_legacy"], {"tokenizer_class": "LlamaTokenizerFast", "legacy": True,
                                                     "bos_token": "<s>", "eos_token": "</s>",
                                                     "clean_up_tokenization_spaces": False}),
            ("tf_qwen2_class", by_name["split_behaviors"], {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True,
                                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                             "unk_token": None, "bos_token": None,
                                             "clean_up_tokenization_spaces": False}),
        ]
        for name, j, config in configs:
            dirs.append(write_case(root, name, j, sample, rng, config))
        # An older checkpoint: no added_tokens_decoder, so special_tokens_map.json is read over the config.
        dirs.append(write_case(root, "tf_special_tokens_map", by_name["llama3"], sample, rng,
                               {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>",
                                "clean_up_tokenization_spaces": False},
                               {"eos_token": {"content": "<extra_tok>", "lstrip": False, "rstrip": False,
                                              "normalized": False, "single_word": False},
                                "pad_token": "<sep>", "bos_token": "<|begin_of_text|>",
                                "additional_special_tokens": ["<mask>"]}))
    except ImportError:
        print("transformers is not importable: the tokenizer_config.json cases are skipped")
    print(f"python: {time.time() - t0:.1f} s in all")
    proc = subprocess.run([checker] + dirs)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

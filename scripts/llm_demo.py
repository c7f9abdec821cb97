#!/usr/bin/env python3
"""Helpers of scripts/llm_demo.sh (the LLM demo): data, tokenizer and model making, scoring, the loss plot.

  llm_demo.py make WORKDIR [--size demo|test]   tokenizer + Qwen2 model (random weights) + pretrain.jsonl,
                                                chat.jsonl, heldout.jsonl (held-out questions and answers),
                                                prompts.jsonl, prose_prompts.jsonl (generate's prompts)
  llm_demo.py prompt WORKDIR QUESTION           the chat-formatted prompt (Qwen2.5's template) of a question
  llm_demo.py prompts MODEL HELDOUT.jsonl CHAT.jsonl [PROSE.jsonl]   generate's prompts files
  llm_demo.py score HELDOUT.jsonl ANSWERS.jsonl [--prose]   accuracy of generated answers (same order)
  llm_demo.py plot TRAINER_STATE.json OUT.svg [TITLE]   the loss curve: ASCII in the terminal, SVG file

Everything is made offline from text that ships with the system (Debian's /usr/share/common-licenses, the
Python standard library's LICENSE.txt) and generated arithmetic: no download. Only `tokenizers`,
`transformers` and the standard library are used (all in scripts/setup.sh's venv).
"""
import glob
import json
import os
import random
import re
import sys

# Qwen2 / Qwen2.5's pre-tokenizer pattern (tokenizer.json of the real files): digits one by one (\p{N}).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "..", "tests", "fixtures", "llm", "qwen2_5.jinja")

# Sizes: "demo" is what the README command runs, "test" the ctest entry's shortened run.
SIZES = {
    # demo: every pair's fact `fact_repeats` times in the pretraining text, one a line (the numbers at the same
    # places in every line), with `chatml_lines` generic ChatML turns (licence prose); the chat data: every pair
    # but the held-out ones.
    "demo": dict(a_range=(10, 49), b_range=(0, 9), heldout=40, vocab=1024, hidden=128, layers=2, heads=4, kv_heads=2,
                 intermediate=384, fact_repeats=20, chatml_lines=1000),
    "test": dict(a_range=(10, 29), b_range=(0, 9), heldout=20, vocab=512, hidden=64, layers=2, heads=4, kv_heads=2,
                 intermediate=192, fact_repeats=4, chatml_lines=100),
}
# Qwen2.5's default system prompt (tests/fixtures/llm/qwen2_5.jinja), in every ChatML turn of the pretraining text.
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def license_texts():
    """Plain English text that ships with Debian (base-files) and with Python itself."""
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")))
    texts = []
    for f in files:
        if os.path.isfile(f):
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
    if not texts:
        sys.exit("llm_demo.py: no licence text found (/usr/share/common-licenses, Python's LICENSE.txt)")
    return texts


def license_chunks(texts, n, rng, length=240):
    """n pieces of licence prose of about `length` characters, whitespace collapsed."""
    words = " ".join(re.sub(r"\s+", " ", t) for t in texts).split(" ")
    out = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(words) - 60))
        piece, i = [], start
        while len(" ".join(piece)) < length and i < len(words):
            piece.append(words[i])
            i += 1
        out.append(" ".join(piece))
    return out


def split_pairs(a_range, b_range, heldout, seed=0):
    """All (a, b) with a in a_range (two digits) and b in b_range (one digit), as "12 plus 7"; `heldout` of
    them are kept out of the chat data (the fine-tuning set): their facts are only in the pretraining text."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(a_range[0], a_range[1] + 1) for b in range(b_range[0], b_range[1] + 1)]
    rng.shuffle(pairs)
    held = sorted(pairs[:heldout])
    return sorted(pairs[heldout:]), held


# A sum as a base model meets it in plain text: a question answered in prose ("What is 12 plus 7? 12 plus 7 is
# 19."), the chat reply's wording, but never in a chat turn.
FACT_FORM = "What is {a} plus {b}? {a} plus {b} is {c}."


def question(a, b):
    return f"What is {a} plus {b}?"


def answer(a, b):
    return f"{a} plus {b} is {a + b}."


def chatml(user, assistant):
    """One conversation as Qwen2.5's template renders it (default system prompt)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{assistant}<|im_end|>\n")


def pretrain_rows(pairs, size, texts, rng):
    """{"text"} lines, shuffled: every pair's fact (FACT_FORM) `fact_repeats` times, held-out pairs included (the
    base reads every sum), and `chatml_lines` generic ChatML conversations whose turns are licence prose (the
    ChatML tokens and the system prompt's words are trained; no arithmetic in a chat turn)."""
    rows = [{"text": FACT_FORM.format(a=a, b=b, c=a + b)} for a, b in pairs for _ in range(size["fact_repeats"])]
    users = license_chunks(texts, size["chatml_lines"], rng, length=40)
    replies = license_chunks(texts, size["chatml_lines"], rng, length=100)
    rows += [{"text": chatml(u, r)} for u, r in zip(users, replies)]
    rng.shuffle(rows)
    return rows


def chat_rows(train, rng):
    """Conversational prompt-completion lines (TRL's form for chat SFT with the loss on the reply only):
    {"prompt": [user "What is a plus b?"], "completion": [assistant "a plus b is c."]}, training pairs only."""
    pairs = rng.sample(train, len(train))
    return [{"prompt": [{"role": "user", "content": question(a, b)}],
             "completion": [{"role": "assistant", "content": answer(a, b)}]} for a, b in pairs]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def make_tokenizer(corpus, vocab_size, out_dir):
    """Byte-level BPE in Qwen2's tokenizer.json layout (NFC, Split with Qwen2's pattern + ByteLevel, ChatML
    special tokens) and Qwen2.5's tokenizer_config.json (its chat template, eos / pad <|endoftext|> as the
    Qwen2.5 base models have them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    j = json.loads(tok.to_str())
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    j["decoder"], j["post_processor"] = dict(bl), dict(bl)
    m = j["model"]
    m.update(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
             byte_fallback=False, ignore_merges=False)
    for t in j["added_tokens"]:
        t.update(special=True, normalized=False)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    with open(TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    decoder = {str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for t in j["added_tokens"]}
    config = {"add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
              "chat_template": template, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
              "errors": "replace", "model_max_length": 512, "pad_token": "<|endoftext|>",
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    return {t["content"]: t["id"] for t in j["added_tokens"]}, len(m["vocab"])


def make_model(size, vocab, ids, out_dir):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def cmd_make(workdir, size_name):
    size = SIZES[size_name]
    rng = random.Random(1)
    base = os.path.join(workdir, "base")
    os.makedirs(base, exist_ok=True)
    train, held = split_pairs(size["a_range"], size["b_range"], size["heldout"])
    texts = license_texts()
    pre = pretrain_rows(sorted(train + held), size, texts, rng)
    chat = chat_rows(train, rng)
    write_jsonl(os.path.join(workdir, "pretrain.jsonl"), pre)
    write_jsonl(os.path.join(workdir, "chat.jsonl"), chat)
    write_jsonl(os.path.join(workdir, "heldout.jsonl"),
                [{"question": question(a, b), "answer": answer(a, b), "sum": a + b} for a, b in held])
    plain = [re.sub(r"<\|[a-z_]+\|>", " ", r["text"]) for r in pre]
    ids, vocab = make_tokenizer(texts + plain + [answer(a, b) for a, b in train], size["vocab"], base)
    params = make_model(size, vocab, ids, base)
    cmd_prompts(base, os.path.join(workdir, "heldout.jsonl"), os.path.join(workdir, "prompts.jsonl"),
                os.path.join(workdir, "prose_prompts.jsonl"))
    print(f"made {base}: Qwen2, {params / 1e6:.2f} M parameters (hidden {size['hidden']}, {size['layers']} layers, "
          f"vocab {vocab}); tokenizer: byte-level BPE trained on {len(texts)} licence files + the demo's text")
    n_pairs = len(train) + len(held)
    print(f"data: pretrain.jsonl {len(pre)} lines: the {n_pairs} sums a + b (a in {size['a_range']}, b in "
          f"{size['b_range']}) as prose, each {size['fact_repeats']} times, and {size['chatml_lines']} ChatML "
          f"conversations of licence prose; chat.jsonl {len(chat)} conversations 'What is a plus b?' -> 'a plus b "
          f"is c.' (prompt-completion); heldout.jsonl {len(held)} questions whose pairs are not in chat.jsonl "
          f"(their sums only in the pretraining prose)")


def chat_prompt(model_dir, text):
    """The prompt as transformers renders it: apply_chat_template with add_generation_prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


def cmd_prompts(model_dir, heldout, out, prose_out=None):
    """One JSON string per line: the chat prompt of each held-out question (for generate --prompts_file); with
    prose_out, also the question alone as plain text (how the pretraining text asks it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(heldout, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    with open(out, "w", encoding="utf-8") as o:
        for q in questions:
            o.write(json.dumps(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True)) + "\n")
    if prose_out:
        with open(prose_out, "w", encoding="utf-8") as o:
            for q in questions:
                o.write(json.dumps(q) + "\n")


def score(heldout, answers):
    """(exact, right number, well formed, shaped, n): exact = the whole reply is "a plus b is c."; right number =
    the first number after "is" (or, without "is", the last number of the reply) is the sum; well formed = the
    reply is "a plus b is N." with the question's a and b and some number N; shaped = "X plus Y is N." with
    any numbers (the reply's form, learned before the model repeats the question's numbers)."""
    exact = number = formed = shaped = 0
    for h, a in zip(heldout, answers):
        a = a.strip()
        exact += a == h["answer"]
        m = re.search(r"\bis\s+(-?\d+)", a) or re.search(r"(-?\d+)\D*$", a)
        number += bool(m) and int(m.group(1)) == h["sum"]
        formed += re.fullmatch(re.escape(h["answer"].rsplit(" is ", 1)[0]) + r" is \d+\.", a) is not None
        shaped += re.fullmatch(r"\d+ plus \d+ is \d+\.", a) is not None
    return exact, number, formed, shaped, len(heldout)


def cmd_score(heldout_path, answers_path, prose=False):
    with open(heldout_path, encoding="utf-8") as f:
        held = [json.loads(l) for l in f if l.strip()]
    with open(answers_path, encoding="utf-8") as f:
        answers = [json.loads(l) for l in f if l.strip()]
    if len(answers) != len(held):
        sys.exit(f"llm_demo.py score: {len(answers)} answers for {len(held)} questions in {answers_path}")
    exact, number, formed, _, n = score(held, answers)
    if prose:
        return print(f"held-out sums in prose: {number}/{n} right ({100 * number / n:.0f}%)")
    print(f"held-out accuracy: {number}/{n} right sums ({100 * number / n:.0f}%); {exact}/{n} exact replies, "
          f"{formed}/{n} in the reply form 'a plus b is N.'")


def losses(state_path):
    with open(state_path, encoding="utf-8") as f:
        state = json.load(f)
    pts = [(e["step"], e["loss"]) for e in state.get("log_history", []) if "loss" in e and "step" in e]
    if not pts:
        sys.exit(f"llm_demo.py plot: no 'loss' entries in log_history of {state_path}")
    return pts


def ascii_plot(pts, width=60, height=12):
    steps = [s for s, _ in pts]
    vals = [v for _, v in pts]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    smin, smax = min(steps), max(steps)
    grid = [[" "] * width for _ in range(height)]
    for s, v in pts:
        x = 0 if smax == smin else round((s - smin) / (smax - smin) * (width - 1))
        y = round((hi - v) / span * (height - 1))
        grid[y][x] = "*"
    lines = []
    for i, row in enumerate(grid):
        label = f"{hi - span * i / (height - 1):7.3f}" if i in (0, height // 2, height - 1) else " " * 7
        lines.append(f"{label} |{''.join(row)}")
    lines.append(" " * 8 + "+" + "-" * width)
    lines.append(" " * 8 + f"step {smin}".ljust(width - 8) + f"step {smax}")
    return "\n".join(lines)


def svg_plot(pts, title):
    w, h, ml, mr, mt, mb = 640, 360, 60, 20, 40, 45
    steps = [s for s, _ in pts]
    vals = [v for _, v in pts]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    smin, smax = min(steps), max(steps)
    sx = lambda s: ml + (0 if smax == smin else (s - smin) / (smax - smin) * (w - ml - mr))
    sy = lambda v: mt + (hi - v) / span * (h - mt - mb)
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(s):.1f},{sy(v):.1f}" for i, (s, v) in enumerate(pts))
    ticks = []
    for i in range(5):
        v = hi - span * i / 4
        ticks.append(f'<line x1="{ml}" y1="{sy(v):.1f}" x2="{w - mr}" y2="{sy(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{ml - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
    for i in range(5):
        s = smin + (smax - smin) * i / 4
        ticks.append(f'<text x="{sx(s):.1f}" y="{h - mb + 18}" text-anchor="middle">{s:.0f}</text>')
    esc = title.replace("&", "&amp;").replace("<", "&lt;")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
            f'font-size="12"><rect width="100%" height="100%" fill="white"/>{"".join(ticks)}'
            f'<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>'
            f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">{esc}</text>'
            f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">step</text>'
            f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">loss</text></svg>\n')


def cmd_plot(state_path, out, title):
    pts = losses(state_path)
    print(f"{title}: loss {pts[0][1]:.3f} at step {pts[0][0]} -> {pts[-1][1]:.3f} at step {pts[-1][0]}")
    print(ascii_plot(pts))
    with open(out, "w", encoding="utf-8") as f:
        f.write(svg_plot(pts, title))
    print(f"plot: {out}")


def main(argv):
    if len(argv) >= 2 and argv[0] == "make":
        size = "demo"
        if len(argv) == 4 and argv[2] == "--size" and argv[3] in SIZES:
            size = argv[3]
        elif len(argv) != 2:
            sys.exit("usage: llm_demo.py make WORKDIR [--size demo|test]")
        return cmd_make(argv[1], size)
    if len(argv) == 3 and argv[0] == "prompt":
        return print(chat_prompt(argv[1], argv[2]), end="")
    if len(argv) in (4, 5) and argv[0] == "prompts":
        return cmd_prompts(*argv[1:])
    if len(argv) in (3, 4) and argv[0] == "score" and argv[3:] in ([], ["--prose"]):
        return cmd_score(argv[1], argv[2], argv[3:] == ["--prose"])
    if len(argv) in (3, 4) and argv[0] == "plot":
        return cmd_plot(argv[1], argv[2], argv[3] if len(argv) == 4 else "training loss")
    sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

"""A varied text corpus (>= 1 MB) built from text present on any Debian machine plus generated scripts, for the
tokenizer cross-check (tokenizers_hf.py) and its benchmark (bench/llm/tokenizer_bench.py).

Licence texts, Debian copyright files and Python's standard library sources give English prose, code,
whitespace runs and tabs; the generated part adds CJK, Hangul, kana, emoji (ZWJ sequences, skin tones, flags),
Arabic, Hindi, Cyrillic, Greek, decomposed accents (which NFC changes), unusual white space (U+0085, U+00A0,
U+2028, U+3000), long numbers, contractions in any case, and special tokens inside text."""

import glob
import os
import random
import sysconfig

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|begin_of_text|>",
            "<|eot_id|>", "<tool_call>", "<mask>", "ZZword", "<extra_tok>", "<sep>"]


def _read(path, limit):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _local_documents(budget):
    paths = sorted(glob.glob("/usr/share/common-licenses/*"))
    paths += sorted(glob.glob("/usr/share/doc/*/copyright"))[:400]
    stdlib = sysconfig.get_paths()["stdlib"]
    paths += [os.path.join(stdlib, m) for m in ("textwrap.py", "string.py", "difflib.py", "argparse.py",
                                                "json/decoder.py", "email/message.py", "tarfile.py", "ast.py")]
    docs, total = [], 0
    for p in paths:
        if total >= budget:
            break
        text = _read(p, 60000)
        if text:
            docs.append(text)
            total += len(text.encode())
    return docs


def _rand_chars(rng, lo, hi, n):
    return "".join(chr(rng.randint(lo, hi)) for _ in range(n))


def _generated_documents(rng, count):
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "❤️", "🧑🏿‍💻", "👩‍❤️‍💋‍👨", "🤷‍♀️", "✨", "🎉", "1️⃣"]
    words = {
        "ar": ["مرحبا", "بالعالم", "اللغة", "العربية", "كتاب", "مدرسة"],
        "hi": ["नमस्ते", "दुनिया", "भाषा", "हिन्दी", "किताब", "विद्यालय"],
        "ru": ["Привет", "мир", "язык", "русский", "книга", "школа", "ЁЛКА"],
        "el": ["Γειά", "σου", "κόσμε", "γλώσσα", "ΒΙΒΛΊΟ"],
    }
    oddspace = ["\u0085", "\u00a0", "\u2028", "\u3000", "\u2009", "\t", "\r\n", "\n\n\n", "   ", "\t\t  \t", "\u200b"]
    contractions = ["'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'ll", "'LL", "'d", "'m", "'M"]
    docs = []
    for i in range(count):
        parts = []
        for _ in range(rng.randint(10, 40)):
            k = rng.randint(0, 13)
            if k == 0:
                parts.append(_rand_chars(rng, 0x4E00, 0x9FFF, rng.randint(1, 30)))
            elif k == 1:
                parts.append(_rand_chars(rng, 0x3041, 0x30FA, rng.randint(1, 12)))
            elif k == 2:
                parts.append(_rand_chars(rng, 0xAC00, 0xD7A3, rng.randint(1, 8)))
            elif k == 3:
                parts.append("".join(rng.choice(emoji) for _ in range(rng.randint(1, 5))))
            elif k == 4:
                lang = rng.choice(sorted(words))
                parts.append(" ".join(rng.choice(words[lang]) for _ in range(rng.randint(1, 8))))
            elif k == 5:
                parts.append(rng.choice(oddspace) * rng.randint(1, 3))
            elif k == 6:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 40))) + rng.choice(["", ".5", ",000", "%"]))
            elif k == 7:
                parts.append(rng.choice(SPECIALS))
            elif k == 8:
                parts.append("cafe\u0301 re\u0301sume\u0301 n\u0303 A\u030a \u1100\u1161\u11a8 Å ﬁ ①")
            elif k == 9:
                parts.append("word" + rng.choice(contractions) + " they" + rng.choice(contractions))
            elif k == 10:
                parts.append(" " + rng.choice(SPECIALS) + " ")
            elif k == 11:
                parts.append("Quokka Zyxwv quokkas zyxwvs")
            elif k == 12:
                parts.append(rng.choice(["<0x41>", "▁", "▁▁x", "ſ", "ǅ", "\u0301start", "x\u0000y", "\x7f"]))
            else:
                parts.append(rng.choice(["Hello", "world", "The", "quick", "brown", "fox", "tokenizer"]))
            parts.append(rng.choice(["", " ", " ", "  ", "\n", "\t"]))
        docs.append("".join(parts))
    return docs


def build_texts(min_bytes=1_100_000, seed=1234):
    """Texts (documents cut into paragraphs and single lines), at least min_bytes of UTF-8 in all."""
    rng = random.Random(seed)
    docs = _local_documents(int(min_bytes * 0.75)) + _generated_documents(rng, 1200)
    texts, total = [], 0
    while total < min_bytes:
        for doc in docs:
            # Paragraphs of a few lines (keeping their line ends and indentation), sometimes whole lines.
            lines = doc.splitlines(keepends=True) if rng.random() < 0.7 else doc.split("\n\n")
            i = 0
            while i < len(lines):
                n = rng.randint(1, 12)
                chunk = "".join(lines[i:i + n])
                i += n
                if chunk:
                    texts.append(chunk)
                    total += len(chunk.encode())
            if total >= min_bytes:
                break
        rng.shuffle(docs)
    rng.shuffle(texts)
    texts += ["", " ", "  leading", "trailing  ", "\n", "<|im_start|>", "<s>", "a<s>b", "<mask>x", " <mask> ",
              "ZZword", "xZZword", "ZZword!", "\u0085\u0085", "1234567890123456789"]
    return texts

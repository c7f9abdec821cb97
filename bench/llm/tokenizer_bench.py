"""Tokenizer encoding throughput, one thread: accel::llm::Tokenizer (bench_tokenizer) against Hugging Face
tokenizers (Rust) on the same texts and the same tokenizer.json, interleaved.

  TOKENIZERS_PARALLELISM=false .venv/bin/python bench/llm/tokenizer_bench.py build/bench/llm/bench_tokenizer

Trains three tokenizers with the JSON layouts of the real files (Qwen2: NFC + its regex + byte-level BPE;
Llama 3: its regex, ignore_merges; Llama 2: SentencePiece-style BPE with byte fallback) on the cross-check's
corpus (tests/llm/tokenizer_corpus.py), then per round times Hugging Face's three ways to encode a list
(encode_batch_fast, encode_batch, a loop of encode: all on one thread with TOKENIZERS_PARALLELISM=false and
RAYON_NUM_THREADS=1, checked by the process CPU time) and one pass of bench_tokenizer. Reports the median of
the rounds and the ratio of our tokens/s to the fastest Hugging Face way. Token counts must agree.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "llm"))
from tokenizer_corpus import build_texts  # noqa: E402
import tokenizers_hf as layouts  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def hf_ways(tok, texts):
    return {
        "encode_batch_fast": lambda: sum(len(e.ids) for e in tok.encode_batch_fast(texts)),
        "encode_batch": lambda: sum(len(e.ids) for e in tok.encode_batch(texts)),
        "encode loop": lambda: sum(len(tok.encode(t).ids) for t in texts),
    }


def ours(binary, path, texts_path):
    out = subprocess.run([binary, "--tokenizer", path, "--texts", texts_path, "--repeat", "1"], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"(\d+) tokens, ([0-9.]+) s", out)
    return int(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=float, default=2.0, help="corpus size in MB")
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    texts = build_texts(min_bytes=int(args.mb * 1e6))
    nbytes = sum(len(t.encode()) for t in texts)
    with tempfile.TemporaryDirectory(prefix="accel_tok_bench_") as root:
        return bench(args, texts, nbytes, root)


def bench(args, texts, nbytes, root):
    texts_path = os.path.join(root, "texts.json")
    with open(texts_path, "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    flavors = {"qwen2": layouts.qwen2_json(texts, args.vocab), "llama3": layouts.llama3_json(texts, args.vocab),
               "llama2": layouts.llama2_variants(texts, args.vocab)["llama2_legacy"]}
    print(f"corpus: {len(texts)} texts, {nbytes / 1e6:.2f} MB; trained vocabularies of {args.vocab}; "
          f"{args.rounds} interleaved rounds, one thread")
    print("| tokenizer | tokens | HF encode_batch_fast | HF encode_batch | HF encode loop | accel-cpp | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, j in flavors.items():
        path = os.path.join(root, name + ".json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        ways = hf_ways(tok, texts)
        times = {k: [] for k in list(ways) + ["accel-cpp"]}
        counts = set()
        for _ in range(args.rounds):
            for k, fn in ways.items():
                wall, cpu = time.perf_counter(), time.process_time()
                counts.add(fn())
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if cpu > 1.3 * wall:
                    sys.exit(f"{name} {k}: {cpu:.2f} s of CPU in {wall:.2f} s: Hugging Face used more than one thread")
                times[k].append(wall)
            n, s = ours(args.binary, path, texts_path)
            counts.add(n)
            times["accel-cpp"].append(s)
        if len(counts) != 1:
            sys.exit(f"{name}: token counts differ between the runs: {sorted(counts)}")
        n = counts.pop()
        rate = {k: n / statistics.median(v) for k, v in times.items()}
        best_hf = max(v for k, v in rate.items() if k != "accel-cpp")
        cells = " | ".join(f"{rate[k] / 1e6:.2f} M/s" for k in times)
        print(f"| {name} | {n} | {cells} | {rate['accel-cpp'] / best_hf:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SFT data preparation time: accel::llm::prepare_sft_examples (through tests/llm/llm_data_tool, with
accel::llm::Tokenizer) against TRL's SFTTrainer dataset preparation, on the same JSONL conversations, tokenizer
and Qwen2.5 chat template (the tiny byte-level BPE of tests/llm/data_crosscheck.py). Both single-process. Also
checks that both produce the same number of rows and tokens.

usage: data_bench.py LLM_DATA_TOOL FIXTURES_DIR [CONVERSATIONS]      (from a build: tests/llm/llm_data_tool)
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "llm"))
import data_crosscheck as dc  # noqa: E402


def conversations(n):
    rows = []
    for i in range(n):
        a, b = i % 97, i % 13
        rows.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a} plus {b}? Explain the quick brown fox answer."},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}. " * 3},
            {"role": "user", "content": "And again, please, with the lazy dog?"},
            {"role": "assistant", "content": f"Again: {a} plus {b} is {a + b}."}]})
    return rows


def trl_seconds(tok, rows, packing, workdir):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    args = SFTConfig(output_dir=os.path.join(workdir, "out"), report_to="none", use_cpu=True, max_length=256,
                     packing=packing, dataset_num_proc=None)
    ds = Dataset.from_list(rows)
    start = time.time()
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    seconds = time.time() - start
    return seconds, len(trainer.train_dataset), sum(len(x) for x in trainer.train_dataset["input_ids"])


def main():
    dc.TOOL, dc.FIXTURES = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
    with tempfile.TemporaryDirectory() as workdir:
        template = open(os.path.join(dc.FIXTURES, "qwen2_5.jinja"), encoding="utf-8").read()
        d, tok = dc.tokenizer_dir(workdir, "tok", dc.make_tokenizer(workdir), template, dc.QWEN_SPECIAL)
        rows = conversations(n)
        path = os.path.join(workdir, "data.jsonl")
        dc.write_jsonl(path, rows)
        _, _, base = trl_seconds(tok, rows[:10], False, workdir)  # warm up imports and caches
        for packing in (False, True):
            request = {"dataset": path, "template_dir": d, "tokenizer_dir": d, "time_only": True,
                       "options": {"max_length": 256, "packing": packing}, "collator": {"pad_token_id": 0}}
            req_path = os.path.join(workdir, "request.json")
            json.dump(request, open(req_path, "w"))
            start = time.time()
            out = json.loads(subprocess.run([dc.TOOL, "prepare", req_path], capture_output=True, text=True,
                                            check=True).stdout)
            wall = time.time() - start
            trl_s, trl_rows, trl_tokens = trl_seconds(tok, rows, packing, workdir)
            same = trl_rows == out["rows"] and trl_tokens == out["tokens"]
            print(f"packing={packing}: {n} conversations, {out['tokens']} tokens -> {out['rows']} rows; "
                  f"accel {out['seconds']:.2f} s (process {wall:.2f} s with reading the JSONL); "
                  f"TRL SFTTrainer construction {trl_s:.2f} s; speedup {trl_s / out['seconds']:.1f}x; "
                  f"same rows and tokens: {same}")


if __name__ == "__main__":
    main()

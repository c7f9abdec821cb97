#!/usr/bin/env python3
"""Fine-tuning throughput and memory of a Qwen2-0.5B-shaped model (random weights, fp32) on 2 CPU ranks x 1
thread: our recipe against transformers' Trainer + PEFT, side by side in one run (issue 51, "Performance and
memory").

  ours:   build/launcher/accel-launch launch --config_file config_templates/trainer/TYPE.accelerate.yaml
              build/examples/llm/finetune --model_name_or_path M --dataset D ... (DDP, 2 ranks)
  theirs: torchrun --standalone --nproc_per_node 2 (Gloo) this file --hf-worker ...: transformers' Trainer
              (+ PEFT for LoRA) on the same model directory, the same token ids, the same batch

Both sides: per_device_train_batch_size 1 (2 rows of SEQ tokens per step), AdamW (adamw_torch), constant
learning rate, max_grad_norm 1.0, logging every step, OMP_NUM_THREADS=1 per rank, no saving inside training;
LoRA r 8, alpha 16, dropout 0 on q_proj and v_proj; gradient checkpointing off or on on both sides
(transformers with use_reentrant False; ours has one mechanism, which computes the same gradients).

Data (--data, a comma list run interleaved: text, completion or both; default text):
- text: {"text"} rows of SEQ - 1 random digits; both pipelines append the end-of-text token, so each row is
  SEQ tokens (the tokenizer, a byte-level BPE in Qwen2's layout made here, splits digits one by one, as
  Qwen2's does), all of them labels: SEQ - 1 counted labels per row (the last token predicts nothing).
- completion: {"prompt", "completion"} rows, TRL's prompt-completion form: a prompt of P = round(--prompt-frac
  x SEQ) random digits (default 0.5) and a completion of SEQ - P - 1 digits, to which both pipelines append
  the end-of-text token: SEQ tokens, the prompt's P labels -100 (completion-only loss, as TRL's SFTTrainer
  prepares such rows: labels = input_ids with -100 where the completion mask is 0), so SEQ - P counted labels
  per row. Ours runs with --completion_only_loss true (also the recipe's default for this form, as TRL's);
  its fused linear + cross-entropy computes the lm_head only at the positions whose next label counts,
  transformers computes every position's logits. Theirs: the Trainer on rows of input_ids + labels built by
  TRL's rule (prompt ids = tokenizer(prompt), ids = tokenizer(prompt + completion + eos), the prompt's
  labels -100 up to their common prefix).
Before the runs the script checks, per SEQ and mode, that the rows the Python worker builds are exactly those
of TRL 1.16's SFTTrainer (its dataset preparation with completion_only_loss, on the same tokenizer) and those
of our pipeline (accel::llm::prepare_sft_examples, through build/tests/llm/llm_data_tool with the model
directory's tokenizer; skipped with a note if that tool is not built): the same input ids and labels, row
for row; it prints the counted labels per step (labels[1:] != -100 summed over the ranks' rows: what
transformers' num_items_in_batch and our sft_label_count count). During the runs it checks our log's
num_input_tokens_seen (SEQ tokens per row), and prints each run's first logged loss, a further check by eye:
in the runs of 2026-11-29 the two sides agreed to 4e-5 (12.30340 / 12.30342 on text rows, 12.29660 / 12.29664
on completion rows: the two modes differ more than the sides). Tokens/s and CPU s per 1000 tokens count every input token
(prompt + completion) in both modes, and the model FLOPs count the lm_head at every position (what
transformers computes), so ours' roofline figure in completion mode includes head work it skips.

Measured per run (each side in its own processes, the sides alternating: ours, theirs, ours, ...):
- step times from the wall-clock time at which each step's log line reaches this script (ours: the Trainer's
  log line, theirs: a TrainerCallback's on_step_end line), the first max(1, --warmup) steps dropped (the
  first step has no start mark); tokens/s =
  tokens per step / median step time (the spread across steps is printed as min-max);
- CPU time per rank: each rank process's user + system time (/proc/PID/stat, all its threads) read when each
  step's line arrives; the step's CPU seconds per rank, and CPU seconds per 1000 tokens per rank (the
  median over the measured steps and both ranks). On a machine loaded by others this is the comparable
  figure: wall time depends on the share of the cores each side gets. (Under the kernel's autogroup
  scheduling the share is per session: torchrun starts each worker in its own session, and so does
  accel-launch since issue 51's fix; before it, our two ranks shared the launcher's session's one share.)
- peak RSS per rank: each rank process's VmHWM (/proc/PID/status) read when the last step's line arrives (so
  the model load is included, the final save of our recipe is not), and its largest RssAnon polled every
  0.2 s (anonymous memory, without the pages of the memory-mapped checkpoint); the table gives the largest
  rank's, --json also the sum over the ranks;
- the GEMM-roofline ratio as bench/llm/models_bench.py has it: model FLOPs per step / step time / the fp32
  GEMM rate build/bench/llm/bench_models measures on 2 threads (512 x hidden x intermediate), measured
  before each pair, the highest used (others' load depresses it). Model
  FLOPs per token: forward 2 x (matmul parameters, lm_head included) + 4 x layers x seq x hidden (attention);
  a full fine-tuning step counts 3 forwards, a LoRA step 2 (the frozen weights get no weight gradient); the
  recomputation of gradient checkpointing is not counted (MFU's convention).

Memory guard: before each run its need is estimated (weights, gradients and AdamW state of each rank plus
activations per token as measured for transformers, the larger side) and compared with the smaller of
--max-gib and MemAvailable - --reserve-gib; a run that would not fit is SKIPPED with its estimate printed
(never silently). Pass --force to run anyway.

  .venv/bin/python bench/llm/finetune_bench.py                   # every case, 3 measured steps
  .venv/bin/python bench/llm/finetune_bench.py --types lora --seqs 512 --gc off --steps 2 --warmup 1
  .venv/bin/python bench/llm/finetune_bench.py --layers 4 --types full   # 0.5B width, 4 of 24 layers
  # masked prompts against all-label rows, interleaved (text, completion per checkpointing setting):
  .venv/bin/python bench/llm/finetune_bench.py --types lora --seqs 512 --gc off,on --data text,completion \
      --warmup 1 --steps 2

Options pick the cases (--types, --seqs, --gc, --data, --prompt-frac, --sides), the steps (--warmup,
--steps), the rounds (--rounds: each case's pair repeated, the medians of all measured steps taken), the depth
(--layers) and the output (--json FILE: every step time and peak); --ours-extra passes more arguments to our
recipe (e.g. '--fused_linear_cross_entropy false'). It is a program, not a test: CI never runs it.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
                 tie_word_embeddings=True, hidden_act="silu", rope_theta=1000000.0)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
RANKS = 2
GIB = 1024 ** 3


# ---- the model, tokenizer and data (made once per run of this script) -------------------------------------
def make_tokenizer(out_dir):
    """Byte-level BPE in Qwen2's tokenizer.json layout; digits are single pre-tokens (Qwen2's pattern)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    corpus = ["the quick brown fox jumps over the lazy dog 0123456789"] * 20
    tok.train_from_iterator(corpus, BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def make_model(out_dir, layers):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = make_tokenizer(out_dir)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    shape = dict(QWEN2_05B, num_hidden_layers=layers)
    config = Qwen2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    del model
    return shape


def prompt_tokens(seq, prompt_frac):
    """P, the prompt's tokens in completion mode: at least 1, leaving at least one digit of completion."""
    return min(max(1, round(prompt_frac * seq)), seq - 2)


def write_data(path, seq, rows, mode="text", prompt_frac=0.5, seed=0):
    rng = random.Random(seed)
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))  # noqa: E731
    p = prompt_tokens(seq, prompt_frac)
    with open(path, "w") as f:
        for _ in range(rows):
            row = ({"text": digits(seq - 1)} if mode == "text" else
                   {"prompt": digits(p), "completion": digits(seq - p - 1)})
            f.write(json.dumps(row) + "\n")


def common_prefix_length(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def build_rows(tok, path, seq):
    """The Python side's rows {input_ids, labels, attention_mask}: text rows all labels; prompt-completion rows
    by TRL's rule (eos appended to the completion, the prompt's labels -100 up to the common prefix)."""
    eos_token = "<|endoftext|>"
    eos = tok.convert_tokens_to_ids(eos_token)
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "text" in r:
                ids = tok(r["text"], add_special_tokens=False)["input_ids"] + [eos]
                labels = list(ids)
            else:
                prompt_ids = tok(r["prompt"])["input_ids"]
                ids = tok(r["prompt"] + r["completion"] + eos_token)["input_ids"]
                n = common_prefix_length(prompt_ids, ids)
                labels = [-100] * n + ids[n:]
            assert len(ids) == seq, f"row of {len(ids)} tokens, expected {seq}"
            rows.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)})
    return rows


def counted_labels(rows):
    """Labels that count in a causal LM's loss, labels[1:] != -100 (transformers' num_items_in_batch)."""
    return sum(sum(1 for x in r["labels"][1:] if x != -100) for r in rows)


def trl_rows(model_dir, path, seq, work):
    """TRL 1.16's SFTTrainer preparation of the same JSONL (completion_only_loss on) with the same tokenizer."""
    import warnings

    import datasets
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    tiny = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with open(path) as f:
        data = [json.loads(line) for line in f]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SFTConfig's gradient_checkpointing default is deprecated in transformers 5
        args = SFTConfig(output_dir=os.path.join(work, "trl_check"), report_to="none", use_cpu=True,
                         per_device_train_batch_size=1, max_length=seq, completion_only_loss=True,
                         dataset_num_proc=None)
        ds = SFTTrainer(model=tiny, args=args, train_dataset=datasets.Dataset.from_list(data),
                        processing_class=tok).train_dataset
    return [{"input_ids": list(ds[i]["input_ids"]), "labels": list(ds[i]["labels"])} for i in range(len(ds))]


def our_rows(a, model_dir, path, seq, work):
    """accel::llm::prepare_sft_examples on the same JSONL with the model directory's tokenizer, as the recipe
    prepares it (through llm_data_tool); None when that test tool is not built."""
    tool = os.path.join(a.build, "tests", "llm", "llm_data_tool")
    if not os.path.exists(tool):
        return None
    request = {"dataset": path, "tokenizer_dir": model_dir,
               "options": {"max_length": seq, "completion_only_loss": True, "eos_token": "<|endoftext|>"},
               "collator": {"pad_token_id": 0, "padding_free": False, "batch_size": 1}}
    req = os.path.join(work, "llm_data_tool_request.json")
    with open(req, "w") as f:
        json.dump(request, f)
    out = json.loads(subprocess.run([tool, "prepare", req], check=True, capture_output=True, text=True).stdout)
    if "examples" not in out:
        raise RuntimeError(f"llm_data_tool prepare {req}: {out}")
    return [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in out["examples"]]


def check_rows(a, model_dir, path, seq, mode, work):
    """The worker's rows == TRL's == ours (ids and labels); returns the counted labels per row."""
    from transformers import AutoTokenizer
    mine = [{"input_ids": r["input_ids"], "labels": r["labels"]}
            for r in build_rows(AutoTokenizer.from_pretrained(model_dir), path, seq)]
    checked = []
    for name, rows in (("TRL SFTTrainer", trl_rows(model_dir, path, seq, work)),
                       ("ours (llm_data_tool)", our_rows(a, model_dir, path, seq, work))):
        if rows is None:
            print(f"# {mode} data: NOT checked against our pipeline ({a.build}/tests/llm/llm_data_tool is not "
                  f"built)", flush=True)
            continue
        if rows != mine:
            bad = next((i for i, (x, y) in enumerate(zip(rows, mine)) if x != y), min(len(rows), len(mine)))
            raise RuntimeError(f"{mode} data {path}: {name}'s rows differ from the worker's "
                               f"({len(rows)} against {len(mine)} rows, first difference in row {bad})")
        checked.append(name)
    per_row = {counted_labels([r]) for r in mine}
    assert len(per_row) == 1, f"rows with different counted labels: {per_row}"
    labels = per_row.pop()
    masked = sum(1 for x in mine[0]["labels"] if x == -100)
    print(f"# {mode} data, seq {seq}: {len(mine)} rows of {seq} tokens, {masked} labels -100 per row, {labels} "
          f"counted labels per row ({RANKS * labels} per step of {RANKS * seq} tokens); ids and labels equal to "
          f"{' and '.join(checked)}'s, row for row", flush=True)
    return labels


# ---- transformers' side (run under torchrun) --------------------------------------------------------------
def hf_worker(a):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    rows = build_rows(AutoTokenizer.from_pretrained(a.model), a.data, a.seq)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if a.type == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.is_world_process_zero:
                print(f"bench-step {state.global_step}", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"bench-loss {state.global_step} {logs['loss']}", flush=True)

    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=1, max_steps=a.max_steps, learning_rate=1e-4,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
        gradient_checkpointing=a.gc == "on", gradient_checkpointing_kwargs={"use_reentrant": False}, seed=0)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepClock()]).train()


# ---- running one side, timing its steps and polling its ranks' memory -------------------------------------
def proc_cpu_s(pid):
    """utime + stime of a process (all its threads), seconds; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def proc_status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class RankWatcher(threading.Thread):
    """Polls the launcher's process tree: the rank processes' VmHWM (peak RSS) and RssAnon."""

    def __init__(self, root_pid, is_rank, interval=0.2):
        super().__init__(daemon=True)
        self.root, self.is_rank, self.interval = root_pid, is_rank, interval
        self.ranks = {}  # pid -> {"hwm": bytes, "anon": max RssAnon}
        self.series = []  # (seconds since start, pid, RssAnon)
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def poll(self):
        import psutil
        try:
            kids = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return
        for k in kids:
            try:
                if not self.is_rank(k.cmdline()):
                    continue
            except psutil.Error:
                continue
            s = proc_status(k.pid)
            if not s:
                continue
            with self.lock:
                self.series.append((time.perf_counter() - self.t0, k.pid, s.get("RssAnon", 0)))
                r = self.ranks.setdefault(k.pid, {"hwm": 0, "anon": 0})
                r["hwm"] = max(r["hwm"], s.get("VmHWM", 0))
                r["anon"] = max(r["anon"], s.get("RssAnon", 0))

    def snapshot(self):
        self.poll()
        with self.lock:
            return {pid: dict(v) for pid, v in self.ranks.items()}

    def cpu(self):
        """{rank pid: CPU seconds so far} of the rank processes seen (found now if not yet polled)."""
        self.poll()
        with self.lock:
            pids = list(self.ranks)
        return {pid: proc_cpu_s(pid) for pid in pids}

    def run(self):
        while not self.stop.wait(self.interval):
            self.poll()


def run_side(cmd, env, is_rank, step_re, total_steps, log_path):
    """Runs cmd, timestamps the step lines; returns step end times and the ranks' peaks at the last step."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        watcher = RankWatcher(p.pid, is_rank)
        watcher.start()
        times, tokens, peaks, cpu, losses = [], [], None, [], []
        for line in p.stdout:
            t = time.perf_counter()
            log.write(line)
            loss = re.search(r"'loss': ([0-9.e+-]+)|^bench-loss \d+ ([0-9.e+-]+)", line)
            if loss:
                losses.append(float(loss.group(1) or loss.group(2)))
            m = step_re.search(line)
            if m:
                times.append(t)
                cpu.append(watcher.cpu())
                tok = re.search(r"'num_input_tokens_seen': ([0-9.e+]+)", line)
                if tok:
                    tokens.append(float(tok.group(1)))
                if len(times) == total_steps:
                    peaks = watcher.snapshot()
        rc = p.wait()
        watcher.stop.set()
    if rc != 0 or peaks is None:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}, {len(times)} steps seen):\n{tail}")
    return {"times": [t - start for t in times], "tokens": tokens, "peaks": peaks, "cpu": cpu, "losses": losses,
            "wall_s": time.perf_counter() - start, "series": watcher.series}


def our_cmd(a, kind, seq, gc, steps, work, model_dir, data, mode):
    model_cfg = os.path.join(work, f"{kind}.model.yaml")
    with open(model_cfg, "w") as f:
        if kind == "lora":
            f.write("use_peft: true\nlora_r: 8\nlora_alpha: 16\nlora_dropout: 0.0\n"
                    "lora_target_modules: [q_proj, v_proj]\nlora_modules_to_save: null\n")
        else:
            f.write("use_peft: false\n")
    return [os.path.join(a.build, "launcher", "accel-launch"), "launch", "--config_file",
            os.path.join(ROOT, "config_templates", "trainer", f"{kind}.accelerate.yaml"),
            os.path.join(a.build, "examples", "llm", "finetune"), "--model_name_or_path", model_dir,
            "--dataset", data, "--max_length", str(seq), "--model_config", model_cfg,
            "--output_dir", os.path.join(work, "ours_out"), "--per_device_train_batch_size", "1",
            "--max_steps", str(steps), "--learning_rate", "1e-4", "--lr_scheduler_type", "constant",
            "--warmup_steps", "0", "--weight_decay", "0", "--max_grad_norm", "1.0", "--optim", "adamw_torch",
            "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
            "--load_best_model_at_end", "false", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "0", "--gradient_checkpointing", "true" if gc == "on" else "false",
            *(["--completion_only_loss", "true"] if mode == "completion" else []), *a.ours_extra.split()]


def their_cmd(a, kind, seq, gc, steps, work, model_dir, data, mode):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
            os.path.abspath(__file__), "--hf-worker", "--type", kind, "--seq", str(seq), "--gc", gc,
            "--max_steps", str(steps), "--model", model_dir, "--data", data, "--out", os.path.join(work, "hf_out")]


def step_cpu(r, warmup):
    """CPU seconds (user + system) of each measured step, per rank: [[rank a, rank b], ...]."""
    out = []
    for i in range(max(warmup, 1), len(r["cpu"])):
        before, after = r["cpu"][i - 1], r["cpu"][i]
        pids = [p for p in after if after[p] is not None and before.get(p) is not None]
        out.append([after[p] - before[p] for p in sorted(pids)])
    return out


# ---- arithmetic: FLOPs, memory guess -----------------------------------------------------------------------
def matmul_params(c):
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return L * (h * (2 * h + 2 * kv) + 3 * h * i) + h * v


def flops_per_step(c, seq, kind):
    forward = 2 * seq * matmul_params(c) + 4 * c["num_hidden_layers"] * seq * seq * c["hidden_size"]
    return RANKS * forward * (3 if kind == "full" else 2)


def total_params(c):
    h, L = c["hidden_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = h * (2 * h + 2 * kv) + 3 * h * c["intermediate_size"] + (h + 2 * kv) + 2 * h
    return L * per_layer + h * c["vocab_size"] + h


def need_gib(c, seq, kind, gc):
    """A rough upper estimate of both ranks' memory: state + activations (transformers' measured order:
    ~4.5 MB per token at Qwen2-0.5B without checkpointing, of which the logits ~1.8 MB) + 0.6 GB runtime."""
    n = total_params(c)
    state = n * 4 + (n * 12 + n * 4 if kind == "full" else 0)  # weights, grads + AdamW + DDP buckets
    layer_bytes_per_token = 112e3 * c["hidden_size"] / 896
    logits = 12 * c["vocab_size"]
    act = seq * (logits + (layer_bytes_per_token if gc == "on" else layer_bytes_per_token * c["num_hidden_layers"])
                 + 4 * c["hidden_size"] * c["num_hidden_layers"])
    return RANKS * (state + act + 0.6e9) / GIB


def mem_available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0


def gemm_rate(a, config_path, seq, tries=3):
    """The GEMM probe's GFLOP/s; None (said so) when it cannot run, e.g. while a build relinks bench_models."""
    for attempt in range(tries):
        try:
            out = subprocess.run([os.path.join(a.build, "bench", "llm", "bench_models"), "--config", config_path,
                                  "--mode", "gemm", "--seq", str(seq), "--threads", "2"], check=True,
                                 capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2")).stdout
            return float(re.search(r"gflops=([0-9.e+]+)", out).group(1))
        except (OSError, subprocess.CalledProcessError, AttributeError) as e:
            print(f"# GEMM probe failed ({type(e).__name__}: {e}){'; retrying in 20 s' if attempt + 1 < tries else ''}",
                  flush=True)
            if attempt + 1 < tries:
                time.sleep(20)
    return None


# ---- the benchmark ------------------------------------------------------------------------------------------
def summarize(runs, warmup, tokens_per_step, flops, gemm):
    steps, cpu = [], []
    for r in runs:
        t = r["times"]
        steps += [t[i] - t[i - 1] for i in range(max(warmup, 1), len(t))]
        cpu += [x for per_rank in step_cpu(r, warmup) for x in per_rank]
    med = statistics.median(steps)
    cpu_med = statistics.median(cpu) if cpu else float("nan")
    per_rank = [max(v["hwm"] for v in r["peaks"].values()) for r in runs]
    anon = [max(v["anon"] for v in r["peaks"].values()) for r in runs]
    sums = [sum(v["hwm"] for v in r["peaks"].values()) for r in runs]
    return {"step_s": med, "step_min": min(steps), "step_max": max(steps), "n": len(steps), "steps": steps,
            "tokens_per_s": tokens_per_step / med, "roofline": flops / med / 1e9 / gemm,
            "cpu_rank_step_s": cpu_med, "cpu_s_per_1k_tokens_rank": cpu_med / (tokens_per_step / RANKS) * 1000,
            "cpu_rank_steps": cpu,
            "peak_rank_gb": max(per_rank) / 1e9, "peak_anon_gb": max(anon) / 1e9, "peak_sum_gb": max(sums) / 1e9,
            "ranks_seen": [len(r["peaks"]) for r in runs],
            "raw": [{"times": r["times"], "peaks": list(r["peaks"].values()), "cpu": step_cpu(r, warmup)}
                    for r in runs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--types", default="lora,full")
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--gc", default="on,off", help="gradient checkpointing settings, in the order run")
    ap.add_argument("--data", default="text", help="text (every token a label), completion (prompt-completion "
                    "rows, the prompt's labels -100), or both as a comma list (run interleaved, in that order)")
    ap.add_argument("--prompt-frac", type=float, default=0.5,
                    help="completion data: the prompt's share of the SEQ tokens")
    ap.add_argument("--sides", default="ours,theirs")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped from the timing")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24: Qwen2-0.5B)")
    ap.add_argument("--max-gib", type=float, default=16.0, help="the most a run may need (both ranks)")
    ap.add_argument("--reserve-gib", type=float, default=3.0, help="MemAvailable kept free for others")
    ap.add_argument("--force", action="store_true", help="run cases the memory guard would skip")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--ours-extra", default="", help="more arguments for our recipe, one string (e.g. "
                    "'--fused_linear_cross_entropy false')")
    ap.add_argument("--keep", help="keep logs and the model in this directory")
    a = ap.parse_args()
    modes = a.data.split(",")
    if not modes or any(m not in ("text", "completion") for m in modes):
        ap.error(f"--data takes text, completion or text,completion, got '{a.data}'")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    sides = a.sides.split(",")
    work = a.keep or tempfile.mkdtemp(prefix="finetune_bench_")
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "model")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {' '.join(sys.argv)}", flush=True)
    fin = os.path.join(a.build, "examples", "llm", "finetune")
    head = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()[:80]
    print(f"# git {head}; {fin} built {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(os.path.getmtime(fin)))}; "
          f"MemAvailable {mem_available_gib():.1f} GiB; load average {os.getloadavg()[0]:.1f}", flush=True)
    start_mtime = os.path.getmtime(fin)
    shape = make_model(model_dir, a.layers)
    print(f"# model: Qwen2-0.5B shape, {a.layers} layers, {total_params(shape) / 1e6:.1f} M parameters, fp32, "
          f"random weights ({model_dir}); {RANKS} ranks x 1 thread, batch 1 row per rank", flush=True)
    results, skipped = [], []
    gemm_seen = []  # GEMM rates measured so far (GFLOP/s)
    total = a.warmup + a.steps
    try:
        for seq in map(int, a.seqs.split(",")):
            datas, labels = {}, {}
            for mode in modes:
                datas[mode] = os.path.join(work, f"data_{mode}_{seq}.jsonl")
                write_data(datas[mode], seq, RANKS * total + 2, mode, a.prompt_frac)
                labels[mode] = check_rows(a, model_dir, datas[mode], seq, mode, work)
            for kind, gc, mode in ((k, g, m) for k in a.types.split(",") for g in a.gc.split(",") for m in modes):
                data = datas[mode]
                need = need_gib(shape, seq, kind, gc)
                avail = mem_available_gib()
                limit = min(a.max_gib, avail - a.reserve_gib)
                case = f"{kind} seq {seq} checkpointing {gc} data {mode}"
                if need > limit and not a.force:
                    msg = (f"SKIPPED {case}: needs ~{need:.1f} GiB for {RANKS} ranks, limit {limit:.1f} GiB "
                           f"(--max-gib {a.max_gib}, MemAvailable {avail:.1f} - --reserve-gib {a.reserve_gib})")
                    print(msg, flush=True)
                    skipped.append(msg)
                    continue
                runs = {s: [] for s in sides}
                for rnd in range(a.rounds):
                    # The GEMM rate before each pair (others' load varies): the roofline uses the highest.
                    gemm_seen.append(gemm_rate(a, os.path.join(model_dir, "config.json"), 512))
                    for side in sides:
                        make = our_cmd if side == "ours" else their_cmd
                        cmd = make(a, kind, seq, gc, total, work, model_dir, data, mode)
                        is_rank = ((lambda c: bool(c) and c[0].endswith("/finetune")) if side == "ours" else
                                   (lambda c: "--hf-worker" in c))
                        step_re = (re.compile(r"'step': (\d+)") if side == "ours" else
                                   re.compile(r"^bench-step (\d+)"))
                        log = os.path.join(work, f"{side}_{kind}_{seq}_{gc}_{mode}_{rnd}.log")
                        r = run_side(cmd, env, is_rank, step_re, total, log)
                        if side == "ours" and r["tokens"] and r["tokens"][-1] != RANKS * seq * total:
                            raise RuntimeError(f"ours saw {r['tokens'][-1]} tokens, expected "
                                               f"{RANKS * seq * total} ({log})")
                        runs[side].append(r)
                        st = [r["times"][i] - r["times"][i - 1] for i in range(max(a.warmup, 1), len(r["times"]))]
                        peaks = " ".join(f"{v['hwm'] / 1e9:.2f}" for v in r["peaks"].values())
                        anon = " ".join(f"{v['anon'] / 1e9:.2f}" for v in r["peaks"].values())
                        cpu = " ".join("/".join(f"{x:.1f}" for x in s) for s in step_cpu(r, a.warmup))
                        print(f"  {case} round {rnd} {side:6s}: steps "
                              f"{' '.join(f'{x:.1f}' for x in st)} s (CPU s per rank {cpu}; load average "
                              f"{os.getloadavg()[0]:.1f}), peak RSS per rank {peaks} GB "
                              f"(anonymous {anon} GB), "
                              f"run {r['wall_s']:.0f} s, first step's loss "
                              f"{r['losses'][0] if r['losses'] else float('nan'):.5f}", flush=True)
                flops = flops_per_step(shape, seq, kind)
                gemm = max([g for g in gemm_seen if g] or [float("nan")])
                summary = {s: summarize(runs[s], a.warmup, RANKS * seq, flops, gemm) for s in sides}
                results.append({"type": kind, "seq": seq, "gc": gc, "data": mode,
                                "counted_labels_per_step": RANKS * labels[mode], "flops_per_step": flops,
                                "gemm_gflops": gemm, **summary})
    except BaseException:
        if results:
            print("\nINTERRUPTED: the cases completed so far:", flush=True)
            print_table(results, skipped, sides, a)
        raise
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    built = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(os.path.getmtime(fin)))
    print(f"# {fin} built {built} at the end" + (" (REBUILT DURING THE RUN: the rows may mix two builds)"
                                                 if os.path.getmtime(fin) > start_mtime else ""))
    print_table(results, skipped, sides, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "layers": a.layers, "results": results, "skipped": skipped}, f, indent=1)


def print_table(results, skipped, sides, a):
    if not results:
        print("no case ran")
    gemm = max([r["gemm_gflops"] for r in results] or [0])
    print(f"\nfp32 GEMM rate (2 threads, bench_models --mode gemm, 512 x 896 x 4864, measured before each pair; "
          f"the highest, {gemm:.1f} GFLOP/s, is the roofline's); {a.warmup} warm-up step(s) dropped, "
          f"{a.steps} measured x {a.rounds} round(s); step time: median (min-max)\n")
    if sides != ["ours", "theirs"]:
        for r in results:
            print(json.dumps(r))
        return
    print("| type | seq | checkpointing | data | counted labels/step | ours tokens/s | theirs tokens/s | ratio | "
          "ours s/step | theirs s/step | "
          "ours CPU s/1k tokens/rank | theirs | ratio (theirs/ours) | "
          "roofline ours | roofline theirs | peak RSS/rank ours | theirs | ratio | peak anonymous/rank ours | "
          "theirs | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        o, t = r["ours"], r["theirs"]
        print(f"| {r['type']} | {r['seq']} | {r['gc']} | {r['data']} | {r['counted_labels_per_step']} of "
              f"{RANKS * r['seq']} | {o['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | "
              f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x | {o['step_s']:.1f} ({o['step_min']:.1f}-"
              f"{o['step_max']:.1f}) | {t['step_s']:.1f} ({t['step_min']:.1f}-{t['step_max']:.1f}) | "
              f"{o['cpu_s_per_1k_tokens_rank']:.2f} | {t['cpu_s_per_1k_tokens_rank']:.2f} | "
              f"{t['cpu_s_per_1k_tokens_rank'] / o['cpu_s_per_1k_tokens_rank']:.2f}x | "
              f"{o['roofline']:.0%} | {t['roofline']:.0%} | {o['peak_rank_gb']:.2f} GB | "
              f"{t['peak_rank_gb']:.2f} GB | {o['peak_rank_gb'] / t['peak_rank_gb']:.2f}x | "
              f"{o['peak_anon_gb']:.2f} GB | {t['peak_anon_gb']:.2f} GB | {o['peak_anon_gb'] / t['peak_anon_gb']:.2f}x |")
    for s in skipped:
        print(s)


if __name__ == "__main__":
    if "--hf-worker" in sys.argv:
        wp = argparse.ArgumentParser()
        wp.add_argument("--hf-worker", action="store_true")
        for k in ("--type", "--gc", "--model", "--data", "--out"):
            wp.add_argument(k)
        wp.add_argument("--seq", type=int)
        wp.add_argument("--max_steps", type=int)
        hf_worker(wp.parse_args())
    else:
        main()

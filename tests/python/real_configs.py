#!/usr/bin/env python3
"""The real-config corpus (tests/data/real_configs): users' own Accelerate YAML and DeepSpeed JSON files, run
through accel-launch as a user migrating from Python would, each outcome compared with expected.tsv.

  real_configs.py ACCEL_LAUNCH CORPUS_DIR [--test N|all] [--update]

- `accel-launch env --config_file F` on every file: the file loads ("ok") or is refused with an error whose
  first line holds the reason expected.tsv names. A DeepSpeed JSON runs as Accelerate runs it, through a YAML
  `distributed_type: DEEPSPEED` with `deepspeed_config_file:` on 2 processes; an Accelerate YAML that names a
  JSON of the corpus (same repository, same file name) gets it at the path it names.
- Every refusal must say "not supported" or name the limit behind it (a GPU, a TPU, another launcher, batch
  sizes that fit another number of GPUs, a file missing from the corpus): never a bare parse error.
- `accel-launch test --cpu --num_processes 2` on the files expected.tsv marks `sample` (or the first N files
  that load, or all of them): each must pass, or fail as expected.tsv says. A file for several machines runs
  as those machines on localhost (one launcher per machine_rank, one rank per machine).
- --update rewrites expected.tsv from this run (review the diff: it is the corpus's contract).
"""
import csv
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

# What a refusal must mention: "not supported", or the limit it names (a GPU, another launcher, batch sizes
# written for another number of GPUs, a JSON file outside the corpus), or an unknown key (Accelerate refuses
# those too: accelerate's own tests/test_configs/invalid_keys.yaml).
ACCEPTED_REASONS = re.compile(
    r"not supported|needs? (a |an )?(GPU|TPU|CUDA)|no GPU|launcher|train_batch_size|"
    r"cannot open the DeepSpeed config|unknown key", re.IGNORECASE)


def first_line(text):
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line
    return ""


def deepspeed_file_of(yaml_text):
    m = re.search(r"^\s*deepspeed_config_file:\s*['\"]?([^'\"\n#]+?)['\"]?\s*(#.*)?$", yaml_text, re.MULTILINE)
    return m.group(1).strip() if m else None


def stage(corpus, sources, name, work):
    """Copies corpus file `name` into `work` as accel-launch should see it; returns the config path."""
    src = os.path.join(corpus, name)
    if name.startswith("deepspeed/"):
        json_path = os.path.join(work, os.path.basename(name))
        shutil.copyfile(src, json_path)
        config = os.path.join(work, "accelerate.yaml")
        with open(config, "w") as f:
            f.write("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                    f"  deepspeed_config_file: {json_path}\n")
        return config
    config = os.path.join(work, os.path.basename(name))
    shutil.copyfile(src, config)
    with open(src, encoding="utf-8", errors="replace") as f:
        wanted = deepspeed_file_of(f.read())
    if wanted and not os.path.isabs(wanted):
        repo = sources[name][0]
        for other, (other_repo, other_path) in sources.items():
            if other.startswith("deepspeed/") and other_repo == repo and \
                    os.path.basename(other_path) == os.path.basename(wanted):
                target = os.path.join(work, wanted)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(os.path.join(corpus, other), target)
                break
    return config


def run(cmd, cwd, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ACCEL_CONFIG_FILE", None)
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no answer within {timeout} s"
    return ("ok" if p.returncode == 0 else "refused"), (p.stderr + p.stdout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_test(launch, config, work, timeout=300):
    """`accel-launch test` on 2 CPU ranks. A file for several machines is tested as `accelerate test` tests it,
    once per machine, here with every machine on localhost: one launcher per machine_rank, one rank per
    machine (at least 2 ranks in all), machine 0 at 127.0.0.1 on a free port."""
    with open(config, encoding="utf-8", errors="replace") as f:
        m = re.search(r"^num_machines:\s*(\d+)\s*(#.*)?$", f.read(), re.MULTILINE)
    machines = int(m.group(1)) if m else 1
    base = [launch, "test", "--config_file", config, "--cpu"]
    if machines <= 1:
        return run(base + ["--num_processes", "2", "--main_process_port", "0"], work, timeout)
    ranks = machines * max(1, -(-2 // machines))
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ACCEL_CONFIG_FILE", None)
    procs = [subprocess.Popen(base + ["--num_processes", str(ranks), "--num_machines", str(machines),
                                      "--machine_rank", str(i), "--main_process_ip", "127.0.0.1",
                                      "--main_process_port", port],
                              cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(machines)]
    outputs, outcome = [], "ok"
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return "timeout", f"machine {i}: no answer within {timeout} s"
        outputs.append(f"[machine {i}]\n{out}")
        if p.returncode != 0:
            outcome = "refused"
    return outcome, "\n".join(outputs)


def error_line(output, work):
    """The decisive line of a refusal (an error or a failed check, not a notice), without the temporary
    directory."""
    lines = [line.replace(work + "/", "").strip() for line in output.splitlines() if line.strip()]
    for marker in ("error:", "FAILED:", "error"):
        for line in lines:
            if marker in line and "note:" not in line:
                return line
    return lines[0] if lines else ""


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    update = "--update" in sys.argv
    test_count = None
    if "--test" in sys.argv:
        test_count = sys.argv[sys.argv.index("--test") + 1]
        args = [a for a in args if a != test_count]
    launch, corpus = args[0], args[1]
    sources = {}
    with open(os.path.join(corpus, "SOURCES.tsv")) as f:
        for row in csv.DictReader(f, delimiter="\t"):
            sources[row["file"]] = (row["repo"], row["path"])
    expected_path = os.path.join(corpus, "expected.tsv")
    expected = {}
    if os.path.exists(expected_path):
        with open(expected_path) as f:
            for row in csv.DictReader(f, delimiter="\t"):
                expected[row["file"]] = row
    files = sorted(sources)
    missing = [n for n in files if not os.path.exists(os.path.join(corpus, n))]
    if missing:
        print("FAILED: SOURCES.tsv lists files that are not there:", missing)
        return 1

    failures, results = [], {}
    loads = {"accelerate": [0, 0], "deepspeed": [0, 0]}
    for name in files:
        with tempfile.TemporaryDirectory() as work:
            config = stage(corpus, sources, name, work)
            outcome, output = run([launch, "env", "--config_file", config], work, 60)
            line = "" if outcome == "ok" else error_line(output, work)
        results[name] = {"env": outcome, "reason": line}
        kind = name.split("/")[0]
        loads[kind][0] += outcome == "ok"
        loads[kind][1] += 1
        if outcome == "timeout":
            failures.append(f"{name}: accel-launch env did not answer within 60 s")
        if outcome == "refused" and not ACCEPTED_REASONS.search(line):
            failures.append(f"{name}: refused without saying 'not supported' or the limit: {line}")
        want = expected.get(name)
        if not update:
            if want is None:
                failures.append(f"{name}: not in expected.tsv (run with --update and review)")
            elif want["env"] != outcome or (outcome != "ok" and want["reason"] not in line):
                failures.append(f"{name}: env {outcome} ({line!r}); expected {want['env']} ({want['reason']!r})")
        print(f"env  {outcome:8} {name}{'  ' + line if line else ''}")

    # accel-launch test on 2 CPU ranks: the sample expected.tsv marks, or the first N / all files that load.
    if test_count is None:
        to_test = [n for n in files if expected.get(n, {}).get("sample") == "yes"]
    else:
        loading = [n for n in files if results[n]["env"] == "ok"]
        to_test = loading if test_count == "all" else loading[:int(test_count)]
    passed = 0
    for name in to_test:
        with tempfile.TemporaryDirectory() as work:
            config = stage(corpus, sources, name, work)
            outcome, output = run_test(launch, config, work)
            line = "" if outcome == "ok" else error_line(output, work)
        results[name]["test"] = outcome
        results[name]["test_reason"] = line
        passed += outcome == "ok"
        want = expected.get(name, {})
        if not update and test_count is None:
            if want.get("test", "ok") != outcome or (outcome != "ok" and want.get("test_reason", "") not in line):
                failures.append(f"{name}: test {outcome} ({line!r}); expected {want.get('test', 'ok')}")
        print(f"test {outcome:8} {name}{'  ' + line if line else ''}")

    for kind, (ok, total) in loads.items():
        print(f"{kind}: {ok} of {total} load ({100.0 * ok / max(total, 1):.0f}%)")
    if to_test:
        print(f"accel-launch test on 2 CPU ranks: {passed} of {len(to_test)} passed")
    if update:
        with open(expected_path, "w", newline="") as f:
            w = csv.writer(f, delimiter="\t", lineterminator="\n")
            w.writerow(["file", "env", "reason", "sample", "test", "test_reason"])
            for name in files:
                old = expected.get(name, {})
                r = results[name]
                sample = old.get("sample", "no")
                w.writerow([name, r["env"], r["reason"][:160], sample, r.get("test", old.get("test", "")),
                            r.get("test_reason", old.get("test_reason", ""))[:160]])
        print(f"wrote {expected_path}")
    for f in failures:
        print("FAILED:", f)
    print(f"real configs: {len(files)} files, {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

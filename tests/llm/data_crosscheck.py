"""Cross-check of accel::llm's data room against transformers and TRL (the Python peers in the project venv).

1. Chat templates: the Qwen2.5, Qwen3, Llama 3.1 and Llama 3.2 templates (tests/fixtures/llm/, the files the
   model repos ship) are rendered by transformers' tokenizer.apply_chat_template(tokenize=False) and by
   llm_data_tool render over conversations with and without system prompts, multi-turn, generation prompts,
   reasoning, tools and unusual characters: the texts must be equal (and the {% generation %} spans of the
   training templates equal transformers' generation indices). Then every template TRL ships is rendered the
   same way over a few conversations: each must render equal, or raise in both, or be refused by accel as
   unsupported (a refusal names the construct); a different text fails.
2. SFT data: JSONL files of every form are prepared by TRL's SFTTrainer (a tiny Qwen2 model and a byte-level BPE
   tokenizer with ChatML tokens this script trains) and by llm_data_tool prepare: input_ids, labels, the
   collator's attention_mask / position_ids / cu_seq_lens must be equal, with truncation, completion-only and
   assistant-only loss, and bfd / wrapped packing. The C++ side tokenizes through a table of texts this script
   encodes with the same tokenizer (the tool lists the texts it needs).
3. assistant_only_loss with a template without {% generation %} markers: SFTTrainer swaps in TRL's training
   variant (get_training_chat_template) or raises; so must accel (llm::training_chat_template, TRL's files
   compiled in). On TRL's own qwen2_5 / qwen3 / qwen3_instruct_2507 / llama3 templates (read from the installed
   TRL, with system prompts and multi-turn): the variant chosen, ids, labels, attention masks and
   is_chat_template_stop_token_trained equal TRL's; Llama 3.1's template and an inexact Qwen2.5 one are refused
   by both; and for every template TRL ships, the decision equals TRL's (variants of architectures accel::llm
   does not load are refused), the shipped copies equal TRL's files byte for byte.

usage: data_crosscheck.py LLM_DATA_TOOL FIXTURES_DIR      exit 0 when all equal, 77 when TRL is missing
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
except ImportError as e:  # pragma: no cover
    print(f"SKIP: transformers / tokenizers not importable ({e})")
    sys.exit(77)

TOOL, FIXTURES = None, None  # set by main() from the command line
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<s>", "</s>"]
UNICODE = "Grüße, 世界 🌍! \"double\" 'single' \\ back\\slash\n\ttab  {{ not jinja }} {% raw %} <tag> &amp;"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "The city"},
                                               "days": {"type": "integer"}}, "required": ["city"]}}}]


# Small templates for the corners of jinja2's semantics (whitespace control, scoping, Python values, every
# filter, test and method of the subset, errors), rendered by transformers' environment and by accel.
SNIPPETS = [
    "a\n  {% if true %}\n  b\n  {% endif %}\nc",
    "a  {%- if true -%}  b  {%- endif %}  c",
    "a\n  {%+ if true %}x{% endif %}",
    "  {{- ' v ' -}}  \n{{ 'w' }}\n",
    "{# c1 #}\n  {#- c2 -#}  x\n{#+ c3 #}\ny",
    "{% raw %}{{ not rendered }} {% if %}{% endraw %}\n!",
    "{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]",
    "{% set a, b = [1, 2] %}{{ b }}{{ a }}",
    "{% macro m(a, b='B', c=none) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }}|{{ m(1, 2, 3) }}|{{ m(a=5, c=7) }}",
    "{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for x in [1, 2, 3, 4] if x is odd %}{{ loop.index }}/{{ loop.length }}:{{ x }} {% else %}none{% endfor %}",
    "{% for x in [] %}x{% else %}empty{% endfor %}",
    "{% for x in range(5) %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in 'héy' %}[{{ x }}]{% endfor %}{% for k in {'z': 1, 'y': 2} %}{{ k }}{% endfor %}",
    "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ loop.index0 }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}{{ loop.revindex }}{% endfor %}",
    "{{ [1, 2.5, 'x', none, true, false, [], {}, (1,), (1, 2)] }}",
    "{{ 3 / 2 }} {{ 4 / 2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }} {{ 1e16 }} {{ 1.5e-7 }} {{ 100.0 }} {{ 123456789.123 }}",
    "{{ 'abc'[1:] }} {{ 'abc'[:-1] }} {{ 'abcdef'[::2] }} {{ [1, 2, 3, 4][::-1] }} {{ [1, 2, 3][5:] }} {{ 'héllo'[1] }} {{ [1,2,3][-1] }}",
    "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b  c'.split() }}|{{ 'a-b-c'.split('-', 1) }}|{{ ' x '.lstrip() }}|{{ ' x '.rstrip() }}",
    "{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'a.b.c'.replace('.', '/') }} {{ 'a.b.c'.replace('.', '/', 1) }} {{ 'abc'.upper() }} {{ 'ABC'.lower() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }}",
    "{{ '-'.join(['a', 'b']) }} {{ 'abcabc'.find('c') }} {{ 'abcabc'.count('bc') }} {{ 'x' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }}",
    "{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b') }} {{ {'a': 1}.get('b', 'd') }} {{ {'a': 1}.keys() | list }} {{ {'a': 1}.values() | list }}",
    "{{ 'a' in 'cat' }} {{ 1 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 2 in {'a': 2} }}",
    "{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ none == none }} {{ 1 != 2 }} {{ 2 >= 2 }}",
    "{{ 'a' if false }}|{{ 'a' if true else 'b' }}|{{ none or 'x' }}|{{ 0 and 1 }}|{{ 'y' and 'z' }}|{{ not none }}",
    "{{ x is defined }} {{ x is undefined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is sequence }} {{ 'a' is iterable }} {{ 1 is number }} {{ 1 is integer }} {{ 1.0 is float }} {{ true is boolean }} {{ false is false }} {{ true is true }} {{ 3 is divisibleby 3 }} {{ 4 is even }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ none is sameas none }} {{ 1 is eq 1 }} {{ 2 is gt 1 }} {{ 1 is in [1] }}",
    "{{ ' x '|trim }}|{{ 'xyx'|trim('x') }}|{{ [1, 2]|length }}|{{ 'héllo'|count }}|{{ none|string }}|{{ 5|string }}|{{ 'ab'|upper }}|{{ 'AB'|lower }}|{{ 'ab cd'|title }}|{{ 'ab'|capitalize }}",
    "{{ x|default('d') }}|{{ none|default('d') }}|{{ ''|default('d', true) }}|{{ ''|d('e', boolean=true) }}|{{ 0|default(1) }}",
    "{{ [1, 2, 3]|join('-') }}|{{ [{'a': 1}, {'a': 2}]|join(',', attribute='a') }}|{{ {'b': 2, 'a': 1}|items|list }}|{{ {'b': 2, 'A': 1, 'a': 3}|dictsort }}|{{ {'b': 2, 'a': 1}|dictsort(by='value', reverse=true) }}",
    "{{ [3, 1, 2]|sort }}|{{ ['b', 'A', 'c']|sort }}|{{ ['b', 'A', 'c']|sort(case_sensitive=true) }}|{{ [3, 1]|sort(reverse=true) }}|{{ [1, 2, 1, 'a', 'A']|unique|list }}|{{ [1, 2]|first }}|{{ [1, 2]|last }}|{{ 'abc'|reverse }}|{{ [1, 2]|reverse|list }}",
    "{{ [1, 2, 3, 4]|select('odd')|list }}|{{ [1, 2, 3, 4]|reject('odd')|list }}|{{ [0, 1, '', 'a']|select|list }}|{{ ['a', 'b', 'code_interpreter']|reject('equalto', 'code_interpreter')|join(', ') }}",
    "{{ [{'r': 'u', 'c': 1}, {'r': 'a', 'c': 2}]|selectattr('r', 'equalto', 'a')|list }}|{{ [{'r': 'u'}, {'x': 1}]|selectattr('r', 'defined')|list }}|{{ [{'r': 1}, {'r': 0}]|rejectattr('r')|list }}",
    "{{ [{'a': {'b': 1}}, {'a': {'b': 2}}]|map(attribute='a.b')|list }}|{{ ['a', 'b']|map('upper')|list }}|{{ [{'a': 1}, {}]|map(attribute='a', default=0)|list }}|{{ [1, 2, 3]|sum }}|{{ [3, 1]|min }}|{{ [3, 1]|max }}",
    "{{ '3'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ '1.5'|float }} {{ 3|float }} {{ -3|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} {{ 'a&<b>\"'|e }} {{ 'a'|safe }}",
    "{{ 'a\nb\n\nc'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(2, blank=true) }}",
    "{{ {'a': [1, {'b': none}], 'c': 'é\"\\\\'}|tojson }}|{{ {'a': 1, 'b': [1, 2]}|tojson(indent=4) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ 'x'|tojson }}|{{ 1.0|tojson }}|{{ [[], {}]|tojson(indent=2) }}",
    "{% set ns = namespace(a=1, b=[]) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ ns.b }}{% set ns2 = namespace({'x': 5}) %}{{ ns2.x }}",
    "{{ dict(a=1, b=2) }} {{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ messages|length }} {{ add_generation_prompt }} {{ eos_token }} {{ bos_token }} {{ tools }}",
    "{{ messages[0].role }} {{ messages[0]['content'] }} {{ messages[0].missing is defined }} {{ messages[5] is defined }} {{ messages[-1].content }} {{ messages.0.role }}",
    "{{ 'a' ~ 1 ~ none ~ 2.0 ~ true ~ [1] }}",
    "{%- for m in messages -%}\n  {%- if m.role == 'user' %}\n    U: {{ m.content }}\n  {%- else %}\n    A: {{ m.content }}\n  {%- endif %}\n{%- endfor %}\n",
    "{{ 'a' \"b\" 'c' }} {{ '\\u00e9\\x41\\t|\\101|\\q' }} {{ \"it's\" }} {{ 'say \"hi\"' }}",
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{{ loop_messages|length }}",
    "{{ 10 - 2 - 3 }} {{ 2 * 3 + 4 }} {{ -2 ** 2 }} {{ (1 + 2) * 3 }} {{ 1 - -1 }} {{ not 1 == 2 }} {{ 7 % 4 }} {{ 1.5 + 1 }}",
    "{{ [1, 2]|first is number }} {{ x|length }} {% for y in x %}never{% endfor %}{{ x|list }}",
    "{{ raise_exception('boom: ' ~ messages|length) }}",
    "{{ undefined_thing.attr }}",
    "{{ messages[0].content + 1 }}",
]


def check_snippets(workdir):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}]
    special = {"eos_token": "</s>", "bos_token": "<s>"}
    equal, failures = 0, []
    for i, snippet in enumerate(SNIPPETS):
        try:
            (text,), _ = render_jinja_template(conversations=[msgs], chat_template=snippet,
                                               add_generation_prompt=True, **special)
            want = {"text": text, "spans": []}
        except Exception as e:  # noqa: BLE001 - an error is a verdict
            want = {"error": f"{type(e).__name__}: {e}"}
        d = os.path.join(workdir, f"snippet{i}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(snippet)
        json.dump(special, open(os.path.join(d, "tokenizer_config.json"), "w"))
        got = cpp_render(d, [{"messages": msgs, "add_generation_prompt": True}], workdir)[0]
        if want == got or ("error" in want and "error" in got):
            equal += 1
        else:
            failures.append((f"snippet {i}: {snippet!r}", want, got))
    return equal, failures


def corpus():
    words = ("the quick brown fox jumps over lazy dog what is plus minus times equals answer question "
             "hello world assistant user system think tool call weather city paris london berlin").split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(12)) + f" {i} {i * 13 % 97}.")
    lines += [UNICODE] * 5
    return lines


def make_tokenizer(workdir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    path = os.path.join(workdir, "tokenizer.json")
    tok.save(path)
    return path


def tokenizer_dir(workdir, name, tokenizer_json, template, special, in_config=False):
    """A tokenizer directory as transformers 5 saves it (chat_template.jinja), or with the template inside
    tokenizer_config.json (in_config)."""
    d = os.path.join(workdir, name)
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, **special)
    tok.chat_template = template
    tok.save_pretrained(d)
    if in_config:
        cfg_path = os.path.join(d, "tokenizer_config.json")
        cfg = json.load(open(cfg_path))
        cfg["chat_template"] = template if isinstance(template, str) else [
            {"name": k, "template": v} for k, v in template.items()]  # the legacy list of named templates
        json.dump(cfg, open(cfg_path, "w"), ensure_ascii=False, indent=2)
        os.remove(os.path.join(d, "chat_template.jinja"))
        shutil.rmtree(os.path.join(d, "additional_chat_templates"), ignore_errors=True)
    return d, transformers.AutoTokenizer.from_pretrained(d)


QWEN_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def conversations():
    sys_user_asst = [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "What is 12 plus 7?"},
                     {"role": "assistant", "content": "12 plus 7 is 19."}]
    multi = sys_user_asst + [{"role": "user", "content": "And times 2?"},
                             {"role": "assistant", "content": " 38, with spaces around. "}]
    cases = [
        {"messages": sys_user_asst},
        {"messages": sys_user_asst[1:]},
        {"messages": multi},
        {"messages": sys_user_asst[:2]},
        {"messages": [{"role": "user", "content": UNICODE}, {"role": "assistant", "content": UNICODE[::-1]}]},
        {"messages": [{"role": "user", "content": "Think first."},
                      {"role": "assistant", "content": "Answer.", "reasoning_content": "Some thoughts.\n"}]},
        {"messages": [{"role": "user", "content": "Q1"},
                      {"role": "assistant", "content": "<think>\ninline thought\n</think>\n\nA1"},
                      {"role": "user", "content": "Q2"}]},
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "get_weather",
                                                            "arguments": {"city": "Paris", "days": 2}}}]},
                      {"role": "tool", "content": "{\"temp\": 21.5}"},
                      {"role": "assistant", "content": "It is 21.5 degrees."}], "tools": TOOLS},
        {"messages": sys_user_asst[1:2], "tools": TOOLS},
        {"messages": sys_user_asst[1:], "kwargs": {"enable_thinking": False}},
        {"messages": sys_user_asst, "kwargs": {"date_string": "01 Jan 2025"}},
    ]
    out = []
    for c in cases:
        for agp in (False, True):
            x = copy.deepcopy(c)
            x["add_generation_prompt"] = agp
            out.append(x)
    return out


def python_render(tok, case, template=None):
    """transformers' text and generation spans (as UTF-8 byte offsets), or ("error", message)."""
    kwargs = dict(case.get("kwargs", {}))
    try:
        text = tok.apply_chat_template(copy.deepcopy(case["messages"]), tools=case.get("tools"),
                                       add_generation_prompt=case["add_generation_prompt"], tokenize=False,
                                       chat_template=template, **kwargs)
        tpl = template or tok.get_chat_template()
        if "generation" not in tpl:
            return {"text": text, "spans": []}
        _, indices = render_jinja_template(
            conversations=[_normalize_chat_messages(copy.deepcopy(case["messages"]))], tools=case.get("tools"),
            chat_template=tpl, return_assistant_tokens_mask=True,
            add_generation_prompt=case["add_generation_prompt"], **{**tok.special_tokens_map, **kwargs})
    except Exception as e:  # noqa: BLE001 - any template error is a verdict
        return {"error": f"{type(e).__name__}: {e}"}
    spans = [[len(text[:b].encode()), len(text[:e].encode())] for b, e in indices[0]]
    return {"text": text, "spans": spans}


def cpp_render(template_dir, cases, workdir):
    path = os.path.join(workdir, "cases.jsonl")
    with open(path, "w") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    out = subprocess.run([TOOL, "render", template_dir, path], capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def check_fixtures(workdir, tokenizer_json):
    """Every case on the four model templates (and the two training variants): equal texts and spans."""
    failures, equal = [], 0
    fixtures = [("qwen2_5.jinja", QWEN_SPECIAL, False), ("qwen3.jinja", QWEN_SPECIAL, True),
                ("llama3_1.jinja", LLAMA_SPECIAL, False), ("llama3_2.jinja", LLAMA_SPECIAL, True),
                ("qwen2_5_training.jinja", QWEN_SPECIAL, False), ("qwen3_training.jinja", QWEN_SPECIAL, False)]
    # Named templates ("tool_use" is rendered when tools are passed): as files, and as tokenizer_config's list.
    fixtures += [("qwen2_5.jinja+tool_use=llama3_1.jinja", LLAMA_SPECIAL, False),
                 ("qwen2_5.jinja+tool_use=llama3_1.jinja", LLAMA_SPECIAL, True)]
    cases = conversations()
    for name, special, in_config in fixtures:
        parts = name.split("+tool_use=")
        template = open(os.path.join(FIXTURES, parts[0]), encoding="utf-8").read()
        if len(parts) == 2:
            template = {"default": template,
                        "tool_use": open(os.path.join(FIXTURES, parts[1]), encoding="utf-8").read()}
        d, tok = tokenizer_dir(workdir, name.replace(".jinja", "").replace("+", "_") + str(in_config), tokenizer_json,
                               template, special, in_config)
        got = cpp_render(d, cases, workdir)
        for case, g in zip(cases, got):
            want = python_render(tok, case)
            if "error" in want and "error" in g:
                equal += 1
                continue
            if want != g:
                failures.append((name, case, want, g))
            else:
                equal += 1
    return equal, failures


def check_trl_templates(workdir, tokenizer_json):
    """Every template TRL ships: equal, raised by both, or refused by accel as unsupported."""
    import trl
    tdir = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    names = sorted(n for n in os.listdir(tdir) if n.endswith(".jinja"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}
    _, tok = tokenizer_dir(workdir, "generic", tokenizer_json, "{{ 'x' }}", special)
    cases = conversations()[::2] + conversations()[3::4]  # every conversation, generation prompt on and off
    stats = {"equal": 0, "both_raise": 0, "refused": 0}
    refused, failures = set(), []
    for name in names:
        template = open(os.path.join(tdir, name), encoding="utf-8").read()
        d = os.path.join(workdir, "trl_" + name)
        os.makedirs(d, exist_ok=True)
        json.dump({**special, "chat_template": template}, open(os.path.join(d, "tokenizer_config.json"), "w"))
        got = cpp_render(d, cases, workdir)
        for case, g in zip(cases, got):
            want = python_render(tok, case, template)
            if "error" in g and "not supported by accel" in g["error"]:
                stats["refused"] += 1
                refused.add(name + ": " + g["error"].split(": ", 1)[-1][:90])
            elif "error" in g and "error" in want:
                stats["both_raise"] += 1
            elif want == g:
                stats["equal"] += 1
            else:
                failures.append((name, case, want, g))
    return stats, sorted(refused), failures


# ---- SFT data against TRL ------------------------------------------------------------------------------------

def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def sft_data(workdir):
    qa = [("What is %d plus %d?" % (a, b), "%d plus %d is %d." % (a, b, a + b)) for a, b in
          [(12, 7), (3, 4), (100, 23), (5, 5), (41, 1), (8, 13), (0, 0), (77, 22)]]
    messages = []
    for i, (q, a) in enumerate(qa):
        m = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if i % 3 == 0:
            m = [{"role": "system", "content": "You add numbers."}] + m
        if i % 4 == 1:
            m += [{"role": "user", "content": "Again, longer: " + q * 3}, {"role": "assistant", "content": a * 2}]
        messages.append({"messages": m})
    messages.append({"messages": [{"role": "user", "content": UNICODE}, {"role": "assistant", "content": "ok"}]})
    messages.append({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21.5}"},
        {"role": "assistant", "content": "It is 21.5 degrees."}], "tools": TOOLS})
    files = {}
    files["messages"] = os.path.join(workdir, "messages.jsonl")
    write_jsonl(files["messages"], messages)
    files["text"] = os.path.join(workdir, "text.jsonl")
    write_jsonl(files["text"], [{"text": q + " " + a * (1 + i % 3)} for i, (q, a) in enumerate(qa)] +
                [{"text": "ends with eos already<|im_end|>"}])
    files["prompt_completion"] = os.path.join(workdir, "pc.jsonl")
    write_jsonl(files["prompt_completion"], [{"prompt": q, "completion": " " + a} for q, a in qa])
    files["conv_pc"] = os.path.join(workdir, "conv_pc.jsonl")
    write_jsonl(files["conv_pc"], [{"prompt": [{"role": "user", "content": q}],
                                    "completion": [{"role": "assistant", "content": a}]} for q, a in qa])
    alpaca = [{"instruction": q, "input": "" if i % 2 else "Show the sum.", "output": a} for i, (q, a) in
              enumerate(qa)]
    alpaca[2]["system"] = "Be exact."
    alpaca[3]["history"] = [["What is 1 plus 1?", "1 plus 1 is 2."]]
    files["alpaca"] = os.path.join(workdir, "alpaca.jsonl")
    write_jsonl(files["alpaca"], alpaca)
    # LLaMA-Factory's AlpacaDatasetConverter, written out as TRL's conversational prompt-completion.
    conv = []
    for r in alpaca:
        prompt = [{"role": "system", "content": r["system"]}] if r.get("system") else []
        for u, a in r.get("history", []):
            prompt += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        query = "\n".join(x for x in (r.get("instruction"), r.get("input")) if x)
        prompt.append({"role": "user", "content": query})
        conv.append({"prompt": prompt, "completion": [{"role": "assistant", "content": r["output"]}]})
    files["alpaca_as_trl"] = conv
    # A directory of JSONL files read in name order.
    d = os.path.join(workdir, "msgdir")
    os.makedirs(d, exist_ok=True)
    write_jsonl(os.path.join(d, "b.jsonl"), messages[4:])
    write_jsonl(os.path.join(d, "a.jsonl"), messages[:4])
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("not data\n")
    files["messages_dir"] = d
    # A JSON array file (.json, indented over many lines), as LLaMA-Factory ships its data and datasets' JSON
    # loader reads it (TRL's scripts load any .json / .jsonl file through it).
    files["messages_json"] = os.path.join(workdir, "messages.json")
    with open(files["messages_json"], "w") as f:
        json.dump(messages, f, ensure_ascii=False, indent=2)
    return files


def load_rows(path_or_rows):
    if isinstance(path_or_rows, list):
        return path_or_rows
    paths = [path_or_rows] if os.path.isfile(path_or_rows) else sorted(
        os.path.join(path_or_rows, n) for n in os.listdir(path_or_rows) if n.endswith(".jsonl"))
    rows = []
    for p in paths:
        if p.endswith(".json"):  # a JSON array, as datasets' JSON loader reads it
            rows += json.load(open(p))
            continue
        rows += [json.loads(line) for line in open(p) if line.strip()]
    # Every column in every row, as datasets' JSON loader makes them (Dataset.from_list keeps the first row's).
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


def trl_prepare(tok, model, rows, cfg, batch_size, workdir):
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    args = SFTConfig(output_dir=os.path.join(workdir, "out"), report_to="none", use_cpu=True,
                     per_device_train_batch_size=batch_size, max_length=cfg.get("max_length", 1024),
                     packing=cfg.get("packing", False), packing_strategy=cfg.get("packing_strategy", "bfd"),
                     assistant_only_loss=cfg.get("assistant_only_loss", False),
                     completion_only_loss=cfg.get("completion_only_loss"), dataset_num_proc=None,
                     pad_to_multiple_of=cfg.get("pad_to_multiple_of"))
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trl_prepare.chat_template = trainer.chat_template  # TRL's training template swapped in, or None
    ds = trainer.train_dataset
    examples = [{"input_ids": list(ds[i]["input_ids"]), "labels": list(ds[i]["labels"]),
                 "seq_lengths": list(ds[i].get("seq_lengths") or [])} for i in range(len(ds))]
    batches = []
    for at in range(0, len(ds), batch_size):
        feats = [{k: v for k, v in ds[i].items() if k in ("input_ids", "labels", "seq_lengths")}
                 for i in range(at, min(at + batch_size, len(ds)))]
        b = trainer.data_collator(feats)
        out = {"rows": int(b["input_ids"].shape[0]), "cols": int(b["input_ids"].shape[1])}
        for k in ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q", "seq_idx"):
            if k in b:
                out["cu_seq_lens" if k == "cu_seq_lens_q" else k] = b[k].reshape(-1).tolist()
        if "max_length_q" in b:
            out["max_length"] = int(b["max_length_q"])
        batches.append(out)
    pad_id = trainer.data_collator.pad_token_id
    padding_free = trainer.data_collator.padding_free
    del torch
    return examples, batches, pad_id, padding_free


def cpp_prepare(tok, request, workdir):
    table = {}
    for _ in range(100):  # an example that fails on ids not yet encoded hides the texts after it
        request["table"] = table
        path = os.path.join(workdir, "request.json")
        json.dump(request, open(path, "w"), ensure_ascii=False)
        out = json.loads(subprocess.run([TOOL, "prepare", path], capture_output=True, text=True,
                                        check=True).stdout)
        if "missing" not in out:
            return out
        for text, special in out["missing"]:
            table[("1" if special else "0") + text] = tok(text, add_special_tokens=special)["input_ids"]
    raise RuntimeError(f"llm_data_tool kept asking for texts: {out['missing'][:3]}")


def check_sft(workdir, tokenizer_json):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    files = sft_data(workdir)
    fixtures = {n: open(os.path.join(FIXTURES, n + ".jinja"), encoding="utf-8").read()
                for n in ("qwen2_5", "qwen2_5_training", "qwen3")}
    dirs = {n: tokenizer_dir(workdir, "sft_" + n, tokenizer_json, t, QWEN_SPECIAL) for n, t in fixtures.items()}
    dirs.update(trl_template_dirs(workdir, tokenizer_json))
    vocab = len(dirs["qwen2_5"][1])
    configs = [
        ("messages, Qwen2.5 template, max_length 48", "messages", "qwen2_5", {"max_length": 48}, 3),
        ("messages, assistant_only_loss (Qwen2.5 training template)", "messages", "qwen2_5_training",
         {"assistant_only_loss": True}, 4),
        ("messages, Qwen3 template", "messages", "qwen3", {}, 2),
        ("directory of JSONL files", "messages_dir", "qwen2_5", {}, 4),
        ("a JSON array file (.json), as datasets loads it", "messages_json", "qwen2_5", {}, 4),
        ("text, eos appended", "text", "qwen2_5", {}, 3),
        ("prompt-completion, completion_only_loss default", "prompt_completion", "qwen2_5", {"max_length": 20}, 3),
        ("prompt-completion, completion_only_loss false", "prompt_completion", "qwen2_5",
         {"completion_only_loss": False}, 3),
        ("conversational prompt-completion, pad_to_multiple_of 8", "conv_pc", "qwen2_5",
         {"pad_to_multiple_of": 8}, 3),
        ("Alpaca (LLaMA-Factory converter)", "alpaca", "qwen2_5_training", {"assistant_only_loss": True}, 3),
        ("text, bfd packing 32, padding-free collator", "text", "qwen2_5", {"packing": True, "max_length": 32}, 2),
        ("text, bfd packing 32, padding-free, pad_to_multiple_of 16", "text", "qwen2_5",
         {"packing": True, "max_length": 32, "pad_to_multiple_of": 16}, 3),
        ("messages, bfd packing 64 + assistant_only_loss", "messages", "qwen2_5_training",
         {"packing": True, "max_length": 64, "assistant_only_loss": True}, 3),
        ("text, wrapped packing 16", "text", "qwen2_5",
         {"packing": True, "max_length": 16, "packing_strategy": "wrapped"}, 4),
        ("messages, bfd_split packing 24", "messages", "qwen2_5",
         {"packing": True, "max_length": 24, "packing_strategy": "bfd_split"}, 3),
    ]
    # assistant_only_loss on templates without {% generation %} markers, TRL's own files read here from the
    # installed TRL: SFTTrainer swaps in its training variant (get_training_chat_template), and so must accel;
    # the variant's name, the ids, labels and masks, and the stop-token check must equal TRL's.
    configs += [
        ("messages, assistant_only_loss on TRL's qwen2_5.jinja (no markers)", "messages", "trl:qwen2_5",
         {"assistant_only_loss": True}, 4),
        ("messages, assistant_only_loss on TRL's qwen3.jinja (no markers)", "messages", "trl:qwen3",
         {"assistant_only_loss": True}, 3),
        ("messages, assistant_only_loss on TRL's llama3.jinja (no markers)", "messages", "trl:llama3",
         {"assistant_only_loss": True, "max_length": 40}, 3),
        ("messages, assistant_only_loss, qwen2_5.jinja as the \"default\" of tokenizer_config's named templates",
         "messages", "trl:qwen2_5+tool_use", {"assistant_only_loss": True}, 3),
        ("conversational prompt-completion, assistant_only_loss on TRL's qwen3_instruct_2507.jinja",
         "conv_pc", "trl:qwen3_instruct_2507", {"assistant_only_loss": True}, 3),
        ("messages, assistant_only_loss, markers leaving <|im_end|> out (kept; TRL's stop-token check false)",
         "messages", "trl:eot_outside", {"assistant_only_loss": True}, 3),
    ]
    # Refused as SFTTrainer refuses them: TRL ships no training variant of Llama 3.1's template, and matches
    # the text exactly (qwen2_5.jinja plus a trailing newline is not qwen2_5.jinja).
    configs += [
        ("messages, assistant_only_loss on TRL's llama3_1.jinja: refused (TRL has no training variant)",
         "messages", "trl:llama3_1", {"assistant_only_loss": True}, 3),
        ("messages, assistant_only_loss on qwen2_5.jinja + a newline: refused (TRL matches exactly)",
         "messages", "trl:qwen2_5+newline", {"assistant_only_loss": True}, 3),
    ]
    equal, equal_tok, failures, tokens, refused, swapped = 0, 0, [], 0, 0, []
    for title, data, tpl_name, cfg, batch_size in configs:
        d, tok = dirs[tpl_name]
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        rows = load_rows(files["alpaca_as_trl"] if data == "alpaca" else files[data])
        try:
            want_ex, want_b, pad_id, padding_free = trl_prepare(tok, model, rows, cfg, batch_size, workdir)
        except ValueError as e:  # SFTTrainer refuses (a template without a training variant)
            want_ex, want_b, pad_id, padding_free = {"error": str(e)}, None, 0, False
        request = {"dataset": files[data] if data != "alpaca" else files["alpaca"], "template_dir": d,
                   "options": {"max_length": cfg.get("max_length", 1024),
                               "completion_only_loss": cfg.get("completion_only_loss"),
                               "assistant_only_loss": cfg.get("assistant_only_loss", False),
                               "packing": cfg.get("packing", False),
                               "packing_strategy": cfg.get("packing_strategy", "bfd")},
                   "collator": {"pad_token_id": pad_id, "padding_free": padding_free, "batch_size": batch_size,
                                "pad_to_multiple_of": cfg.get("pad_to_multiple_of")}}
        got = cpp_prepare(tok, request, workdir)
        # End to end: the same with accel::llm::Tokenizer reading the tokenizer directory.
        request.pop("table")
        request["tokenizer_dir"] = d
        request["stop_token_check"] = tpl_name.startswith("trl:")
        path = os.path.join(workdir, "request.json")
        json.dump(request, open(path, "w"), ensure_ascii=False)
        got_tok = json.loads(subprocess.run([TOOL, "prepare", path], capture_output=True, text=True,
                                            check=True).stdout)
        if "error" in want_ex:
            if "error" in got_tok and "not one TRL 1.16 ships a training variant for" in got_tok["error"] \
                    and d in got_tok["error"] and "patching is not supported" in want_ex["error"]:
                equal, equal_tok, refused = equal + 1, equal_tok + 1, refused + 1
            else:
                failures.append((title + " (a refusal, as SFTTrainer's)", want_ex["error"], "", got_tok))
            continue
        if tpl_name.startswith("trl:"):
            from trl.chat_template_utils import is_chat_template_stop_token_trained
            want_name = trl_template_name(trl_prepare.chat_template)
            want_stop = is_chat_template_stop_token_trained(tok, chat_template=trl_prepare.chat_template)
            if got.get("training_template") != want_name or got_tok.get("training_template") != want_name:
                failures.append((title + " (the training template swapped in)", want_name, "",
                                 {"table": got.get("training_template"), "tokenizer": got_tok.get("training_template")}))
            if got_tok.get("stop_token_trained") != want_stop:
                failures.append((title + " (is_chat_template_stop_token_trained)", want_stop, "", got_tok))
            if tpl_name == "trl:eot_outside" and want_stop is not False:  # the case must exercise a False
                failures.append((title + " (TRL's stop-token check should be False here)", False, "", want_stop))
            if want_name is not None:
                swapped.append(want_name)
        if got.get("examples") == want_ex and got.get("batches") == want_b:
            equal += 1
            tokens += sum(len(e["input_ids"]) for e in want_ex)
        else:
            failures.append((title + " (ids from the table)", want_ex, want_b, got))
        if got_tok.get("examples") == want_ex and got_tok.get("batches") == want_b:
            equal_tok += 1
        else:
            failures.append((title + " (accel::llm::Tokenizer)", want_ex, want_b, got_tok))
    print(f"training templates: SFTTrainer and accel swapped in {', '.join(swapped)}; {refused} templates "
          f"refused by both")
    return equal, equal_tok, len(configs), tokens, failures


EOT_OUTSIDE = ("{%- for message in messages %}{%- if message.role == 'assistant' %}"
               "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message.content }}{%- endgeneration %}"
               "{{- '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
               "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def trl_template_dirs(workdir, tokenizer_json):
    """Tokenizer directories with TRL's own model templates (no {% generation %} markers)."""
    import trl
    tdir = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    text = {n: open(os.path.join(tdir, n + ".jinja"), encoding="utf-8").read()
            for n in ("qwen2_5", "qwen3", "qwen3_instruct_2507", "llama3", "llama3_1")}
    dirs = {"trl:" + n: tokenizer_dir(workdir, "trl_sft_" + n, tokenizer_json, t,
                                      LLAMA_SPECIAL if n.startswith("llama") else QWEN_SPECIAL)
            for n, t in text.items()}
    dirs["trl:qwen2_5+tool_use"] = tokenizer_dir(workdir, "trl_sft_named", tokenizer_json,
                                                 {"default": text["qwen2_5"], "tool_use": text["llama3_1"]},
                                                 QWEN_SPECIAL, in_config=True)
    dirs["trl:qwen2_5+newline"] = tokenizer_dir(workdir, "trl_sft_newline", tokenizer_json, text["qwen2_5"] + "\n",
                                                QWEN_SPECIAL)
    # Markers that leave the assistant's <|im_end|> outside: kept as they are (no swap), and TRL's stop-token check
    # is False (SFTTrainer warns), which accel must find too.
    dirs["trl:eot_outside"] = tokenizer_dir(workdir, "trl_sft_eot_outside", tokenizer_json, EOT_OUTSIDE, QWEN_SPECIAL)
    return dirs


def trl_template_name(template):
    """The file of the installed TRL's chat_templates/ whose text `template` is (None: None)."""
    if template is None:
        return None
    import trl
    tdir = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    for n in sorted(os.listdir(tdir)):
        if open(os.path.join(tdir, n), encoding="utf-8").read() == template:
            return n
    return "a template that is not one of TRL's files"


def check_training_swap(workdir, tokenizer_json):
    """The template SFTTrainer renders with under assistant_only_loss, for every template TRL ships: the model's
    own when it has {% generation %} markers, else get_training_chat_template's variant, else a refusal. accel's
    llm::training_chat_template must decide the same, except that it refuses the variants of architectures
    accel::llm does not load (those not in the shipped folder); the shipped files must be TRL's, byte for byte."""
    import trl
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    tdir = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    shipped_dir = os.path.join(FIXTURES, "..", "..", "..", "accelerate_cpp", "src", "llm", "data", "trl_chat_templates")
    shipped = sorted(n for n in os.listdir(shipped_dir) if n.endswith(".jinja"))
    failures = [("shipped " + n, "TRL's file", "", "differs or is missing in TRL") for n in shipped
                if not os.path.exists(os.path.join(tdir, n))
                or open(os.path.join(tdir, n), "rb").read() != open(os.path.join(shipped_dir, n), "rb").read()]
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>"}
    _, tok = tokenizer_dir(workdir, "swap_generic", tokenizer_json, "{{ 'x' }}", special)
    names = sorted(n for n in os.listdir(tdir) if n.endswith(".jinja"))
    dirs, want = [], []
    for name in names:
        template = open(os.path.join(tdir, name), encoding="utf-8").read()
        d = os.path.join(workdir, "swap_" + name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
        json.dump(special, open(os.path.join(d, "tokenizer_config.json"), "w"))
        dirs.append(d)
        if has_generation_markers(template):
            want.append(None)
            continue
        tok.chat_template = template
        try:
            want.append(trl_template_name(get_training_chat_template(tok)))
        except Exception as e:  # noqa: BLE001 - TRL's refusal is a verdict
            want.append({"error": f"{type(e).__name__}: {e}"})
    out = subprocess.run([TOOL, "training"] + dirs, capture_output=True, text=True, check=True).stdout
    counts = {"own": 0, "swapped": 0, "refused": 0, "not_loaded": 0}
    for name, w, line in zip(names, want, out.splitlines()):
        g = json.loads(line)
        if w is None and g.get("training", 0) is None:
            counts["own"] += 1
        elif isinstance(w, str) and g.get("training") == w:
            counts["swapped"] += 1
        elif isinstance(w, dict) and "error" in g and "not one TRL 1.16 ships a training variant for" in g["error"]:
            counts["refused"] += 1
        elif isinstance(w, str) and "error" in g and name not in shipped:
            counts["not_loaded"] += 1
        else:
            failures.append(("training template for " + name, w, "", g))
    return counts, len(shipped), failures


def show(failures, limit=3):
    for f in failures[:limit]:
        print("MISMATCH", f[0])
        if len(f) == 4 and isinstance(f[1], list) and "examples" in f[3]:  # SFT: the first differing example
            want, got = f[1], f[3]["examples"]
            for i, (w, g) in enumerate(zip(want, got)):
                if w != g:
                    print(f"    example {i}: TRL {json.dumps(w)[:700]}\n    accel {json.dumps(g)[:700]}")
                    break
            else:
                print(f"    {len(want)} examples from TRL, {len(got)} from accel; batches differ")
            continue
        for part in f[1:]:
            print("   ", json.dumps(part, ensure_ascii=False)[:1500])


def main():
    global TOOL, FIXTURES
    TOOL, FIXTURES = sys.argv[1], sys.argv[2]
    start = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer_json = make_tokenizer(workdir)
        snippets_equal, snippet_failures = check_snippets(workdir)
        eq, fixture_failures = check_fixtures(workdir, tokenizer_json)
        stats, refused, trl_failures = check_trl_templates(workdir, tokenizer_json)
        differ = len(fixture_failures) + len(trl_failures) + len(snippet_failures)
        print(f"snippets: {snippets_equal} of {len(SNIPPETS)} corner-case templates equal jinja2 under transformers "
              f"(or raise in both)")
        print(f"fixtures: {eq} renders of the Qwen2.5 / Qwen3 / Llama 3.1 / Llama 3.2 templates (and Qwen "
              f"training variants) equal transformers, {len(fixture_failures)} differ")
        print(f"TRL's templates: {stats['equal']} renders equal, {stats['both_raise']} raise in both, "
              f"{stats['refused']} refused as unsupported")
        for r in refused:
            print("  refused:", r)
        show(snippet_failures)
        show(fixture_failures)
        show(trl_failures)
        print(f"templates: {eq + stats['equal'] + snippets_equal} renders equal, {differ} differ ({time.time() - start:.1f} s)")
        try:
            import trl  # noqa: F401
        except ImportError as e:
            print(f"SKIP: trl is not importable ({e})")
            return 77
        swap, shipped, swap_failures = check_training_swap(workdir, tokenizer_json)
        show(swap_failures)
        print(f"assistant_only_loss templates: of TRL's {sum(swap.values())} files, {swap['own']} with markers kept, "
              f"{swap['swapped']} swapped for the variant SFTTrainer takes, {swap['refused']} refused by both; "
              f"{swap['not_loaded']} that TRL swaps are refused (architectures accel::llm does not load); "
              f"{shipped} shipped files compared with TRL's; {len(swap_failures)} differ")
        sft_equal, sft_equal_tok, sft_total, tokens, sft_failures = check_sft(workdir, tokenizer_json)
        show(sft_failures, 2)
        # ctest passes on the printed line (PASS_REGULAR_EXPRESSION), not the exit code: a training-template
        # decision that differs from TRL's withholds it too.
        ok = sft_equal == sft_total and sft_equal_tok == sft_total and not swap_failures
        if ok:
            print(f"sft: {sft_equal} configurations equal TRL ({tokens} tokens: input_ids, labels, "
                  f"attention masks, packed position ids), also through accel::llm::Tokenizer")
        else:
            print(f"sft: {sft_total - sft_equal} of {sft_total} configurations differ from TRL with table ids, "
                  f"{sft_total - sft_equal_tok} through accel::llm::Tokenizer; {len(swap_failures)} training-template "
                  f"decisions differ")
        print(f"time {time.time() - start:.1f} s")
        return 0 if differ == 0 and ok else 1


if __name__ == "__main__":
    sys.exit(main())

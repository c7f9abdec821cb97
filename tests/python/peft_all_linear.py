"""PEFT's choice for target_modules="all-linear" (peft/tuners/tuners_utils.py, _maybe_include_all_linear_layers)
on tiny transformers models, which tests/nn/lora_targets_test.cpp ([.peft_all_linear]) compares with
accel::peft::get_peft_model's on C++ module trees of the same names.

  peft_all_linear.py DIR   writes DIR/all_linear_causal.txt (Qwen2ForCausalLM, task CAUSAL_LM: lm_head left out)
                           and DIR/all_linear_seq_cls.txt (Qwen2ForSequenceClassification, task SEQ_CLS: score
                           left out), one adapted module path a line, sorted; exit 77 when peft is missing.
"""
import pathlib
import sys

try:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification
except ImportError as e:  # pragma: no cover
    print(f"peft_all_linear: skipped ({e})")
    sys.exit(77)


def adapted(model, task_type):
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type=task_type))
    prefix = "base_model.model."
    names = sorted(n[len(prefix):] for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and n.startswith(prefix))
    return names


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, num_labels=3,
                      pad_token_id=0)
    causal = adapted(Qwen2ForCausalLM(cfg), "CAUSAL_LM")
    seq_cls = adapted(Qwen2ForSequenceClassification(cfg), "SEQ_CLS")
    assert "lm_head" not in causal and "score" not in seq_cls, (causal, seq_cls)
    (out / "all_linear_causal.txt").write_text("\n".join(causal) + "\n")
    (out / "all_linear_seq_cls.txt").write_text("\n".join(seq_cls) + "\n")
    print(f"peft_all_linear: PEFT adapts {len(causal)} modules of the causal LM, {len(seq_cls)} of the classifier")


if __name__ == "__main__":
    main()

// Generates a completion of a prompt with any Llama / Qwen2 / Qwen3 checkpoint directory (config.json,
// model.safetensors or its sharded index, tokenizer.json):
//
//   build/examples/llm/generate --model_name_or_path DIR --prompt "Once upon a time" --max_new_tokens 32
//       [--do_sample --temperature 0.7 --top_k 50 --top_p 0.9 --seed 0] [--dtype float32|bfloat16|float16]
//       [--print_ids]
//
// Greedy unless --do_sample. With --print_ids it also prints `prompt_ids: ...` (the prompt as the tokenizer
// encodes it) and `completion_ids: ...` (the generated ids), to hold against transformers' generate. The
// generation ends at max_new_tokens or at an eos id (config.json's eos_token_id and the tokenizer's).
#include <accel/errors.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/generation.hpp>
#include <accel/llm/tokenizers/tokenizer.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string model, prompt, dtype = "float32";
  accel::llm::GenerationConfig gen;
  bool print_ids = false;
};

const char* kUsage =
    "usage: generate --model_name_or_path DIR --prompt TEXT [--max_new_tokens N] [--do_sample] "
    "[--temperature T] [--top_k K] [--top_p P] [--seed S] [--dtype float32|bfloat16|float16] [--print_ids]";

Args parse(int argc, char** argv) {
  Args a;
  a.gen.max_new_tokens = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--do_sample") {
      a.gen.do_sample = true;
      continue;
    }
    if (k == "--print_ids") {
      a.print_ids = true;
      continue;
    }
    if (k == "--help" || k == "-h") throw std::invalid_argument(kUsage);
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value; " + kUsage);
    const std::string v = argv[++i];
    if (k == "--model_name_or_path") {
      a.model = v;
    } else if (k == "--prompt") {
      a.prompt = v;
    } else if (k == "--max_new_tokens") {
      a.gen.max_new_tokens = std::stoll(v);
    } else if (k == "--temperature") {
      a.gen.temperature = std::stod(v);
    } else if (k == "--top_k") {
      a.gen.top_k = std::stoll(v);
    } else if (k == "--top_p") {
      a.gen.top_p = std::stod(v);
    } else if (k == "--seed") {
      a.gen.seed = std::stoull(v);
    } else if (k == "--dtype") {
      a.dtype = v;
    } else {
      throw std::invalid_argument("unknown argument " + k + "; " + kUsage);
    }
  }
  if (a.model.empty())
    throw std::invalid_argument(std::string("--model_name_or_path is required; ") + kUsage);
  return a;
}

torch::ScalarType dtype_of(const std::string& name) {
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw std::invalid_argument("--dtype takes float32, bfloat16 or float16, not " + name);
}

std::string join(const std::vector<std::int64_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i)
    out += (i ? " " : "") + std::to_string(ids[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  Args args = parse(argc, argv);
  const auto tokenizer = accel::llm::Tokenizer::from_pretrained(args.model);
  auto model = accel::llm::from_pretrained(args.model, accel::llm::LoadOptions().dtype(dtype_of(args.dtype)));
  const auto prompt_ids = tokenizer.encode(args.prompt);
  if (prompt_ids.empty())
    throw std::invalid_argument("the prompt encodes to no token; give a non-empty --prompt");
  auto eos = model->config().eos_token_ids;
  if (const auto id = tokenizer.eos_token_id(); id && std::find(eos.begin(), eos.end(), *id) == eos.end())
    eos.push_back(*id);
  args.gen.eos_token_ids = eos;
  if (const auto pad = tokenizer.pad_token_id()) args.gen.pad_token_id = *pad;
  const auto completion = accel::llm::generate(model, {prompt_ids}, args.gen)[0];
  if (args.print_ids) {
    std::cout << "prompt_ids: " << join(prompt_ids) << "\n";
    std::cout << "completion_ids: " << join(completion) << "\n";
  }
  std::cout << tokenizer.decode(completion, /*skip_special_tokens=*/true) << std::endl;
  return 0;
} catch (const std::invalid_argument& e) {
  std::cerr << "generate: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "generate: " << e.what() << "\n";
  return 1;
}

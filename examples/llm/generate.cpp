// Generates a completion of a prompt with any Llama / Qwen2 / Qwen3 checkpoint directory (config.json,
// model.safetensors or its sharded index, tokenizer.json):
//
//   build/examples/llm/generate --model_name_or_path DIR --prompt "Once upon a time" --max_new_tokens 32
//       [--do_sample --temperature 0.7 --top_k 50 --top_p 0.9 --seed 0] [--dtype
//       auto|float32|bfloat16|float16]
//       [--print_ids] [--adapter ADAPTER_DIR] [--prompts_file FILE.jsonl]
//
// Greedy unless --do_sample. --adapter loads a PEFT LoRA adapter directory (adapter_config.json +
// adapter_model.safetensors, as the finetune recipe or Python's PEFT writes it) onto the model: the adapters
// are put on with the file's r, lora_alpha, target_modules, modules_to_save, use_rslora and
// ensure_weight_tying (accel::peft::get_peft_model), their weights read (LoraModel::load_adapter) and merged
// into the base (merge_and_unload: the same outputs, no adapter term to add at each step). --prompts_file
// generates for every line of a file (each a JSON string, or an object with a "prompt" string) as one
// left-padded batch and prints each completion as one JSON string per line, in the file's order. With
// --print_ids it also prints `prompt_ids: ...` (the prompt as the tokenizer encodes it) and `completion_ids:
// ...` (the generated ids), to hold against transformers' generate. The generation ends at max_new_tokens or
// at an eos id (config.json's eos_token_id and the tokenizer's).
#include <accel/errors.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/generation.hpp>
#include <accel/llm/tokenizers/tokenizer.hpp>
#include <accel/nn/lora.hpp>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string model, prompt, dtype = "auto", adapter, prompts_file;
  accel::llm::GenerationConfig gen;
  bool print_ids = false;
};

const char* kUsage =
    "usage: generate --model_name_or_path DIR --prompt TEXT [--max_new_tokens N] [--do_sample] "
    "[--temperature T] [--top_k K] [--top_p P] [--seed S] [--dtype auto|float32|bfloat16|float16] "
    "[--print_ids] "
    "[--adapter PEFT_ADAPTER_DIR] [--prompts_file FILE.jsonl]";

// A flag's number, the whole text of it ("3x" is refused, not read as 3).
std::int64_t whole_number(const std::string& key, const std::string& v) {
  std::size_t used = 0;
  std::int64_t n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size())
    throw std::invalid_argument(key + " takes a whole number, got '" + v + "'");
  return n;
}

double real_number(const std::string& key, const std::string& v) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size()) throw std::invalid_argument(key + " takes a number, got '" + v + "'");
  return x;
}

// Flags over the checkpoint's generation_config.json (its eos ids, pad id and sampling settings), greedy
// unless --do_sample, 32 new tokens unless --max_new_tokens.
Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--model_name_or_path")
      a.gen = accel::llm::generation_config_from_pretrained(argv[i + 1]);
  a.gen.do_sample = false;
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
      a.gen.max_new_tokens = whole_number(k, v);
    } else if (k == "--temperature") {
      a.gen.temperature = real_number(k, v);
    } else if (k == "--top_k") {
      a.gen.top_k = whole_number(k, v);
    } else if (k == "--top_p") {
      a.gen.top_p = real_number(k, v);
    } else if (k == "--seed") {
      a.gen.seed = static_cast<std::uint64_t>(whole_number(k, v));
    } else if (k == "--dtype") {
      a.dtype = v;
    } else if (k == "--adapter") {
      a.adapter = v;
    } else if (k == "--prompts_file") {
      a.prompts_file = v;
    } else {
      throw std::invalid_argument("unknown argument " + k + "; " + kUsage);
    }
  }
  if (a.model.empty())
    throw std::invalid_argument(std::string("--model_name_or_path is required; ") + kUsage);
  return a;
}

// `auto` (the default, as transformers 5's from_pretrained): the checkpoint config's dtype.
std::optional<torch::ScalarType> dtype_of(const std::string& name) {
  if (name == "auto") return std::nullopt;
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw std::invalid_argument("--dtype takes auto, float32, bfloat16 or float16, not " + name);
}

std::string join(const std::vector<std::int64_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i)
    out += (i ? " " : "") + std::to_string(ids[i]);
  return out;
}

using Json = nlohmann::json;

Json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open '" + path + "'");
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    throw std::runtime_error("'" + path + "' is not valid JSON: " + e.what());
  }
}

// A PEFT LoRA adapter directory onto `model`, merged into its weights.
void load_adapter(accel::llm::CausalLM& model, const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  const Json c = read_json(path);
  if (c.value("peft_type", std::string()) != "LORA")
    throw std::runtime_error("'" + path + "' is not a LoRA adapter (peft_type is not \"LORA\")");
  accel::peft::LoraConfig lora;
  lora.r = c.at("r").get<int>();
  lora.lora_alpha = c.at("lora_alpha").get<double>();
  lora.use_rslora = c.value("use_rslora", false);
  lora.bias = c.value("bias", std::string("none"));
  const Json& targets = c.at("target_modules");
  if (targets.is_string())
    lora.target_modules_regex = targets.get<std::string>();
  else
    lora.target_modules = targets.get<std::vector<std::string>>();
  if (c.contains("modules_to_save") && c.at("modules_to_save").is_array())
    lora.modules_to_save = c.at("modules_to_save").get<std::vector<std::string>>();
  // A tied embedding among them: its head untied and frozen (PEFT's default) or tied to it, as trained.
  if (c.contains("ensure_weight_tying") && c.at("ensure_weight_tying").is_boolean())
    lora.ensure_weight_tying = c.at("ensure_weight_tying").get<bool>();
  const auto peft = accel::peft::get_peft_model(model, lora);
  peft->load_adapter(dir);
  peft->merge_and_unload();
}

// The prompts of a --prompts_file: one JSON string, or {"prompt": string}, per non-empty line.
std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open --prompts_file '" + path + "'");
  std::vector<std::string> prompts;
  std::string line;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_string()) {
      prompts.push_back(j.get<std::string>());
    } else if (j.is_object() && j.contains("prompt") && j.at("prompt").is_string()) {
      prompts.push_back(j.at("prompt").get<std::string>());
    } else {
      throw std::runtime_error("--prompts_file '" + path + "' line " + std::to_string(n) +
                               ": not a JSON string or an object with a \"prompt\" string");
    }
  }
  if (prompts.empty()) throw std::runtime_error("--prompts_file '" + path + "' holds no prompt");
  return prompts;
}

}  // namespace

int main(int argc, char** argv) try {
  Args args = parse(argc, argv);
  const auto tokenizer = accel::llm::Tokenizer::from_pretrained(args.model);
  accel::llm::LoadOptions load;
  if (const auto dtype = dtype_of(args.dtype)) load.dtype(*dtype);
  auto model = accel::llm::from_pretrained(args.model, load);
  const auto loaded = model->model->embed_tokens->weight.scalar_type();
  if (!dtype_of(args.dtype) && loaded != torch::kFloat32)
    std::cerr << "generate: " << args.model << " runs in " << c10::toString(loaded)
              << " (its config.json's dtype, as transformers' from_pretrained loads it; --dtype float32 to "
                 "compute in float32)\n";
  if (!args.adapter.empty()) load_adapter(model, args.adapter);
  auto eos = args.gen.eos_token_ids.empty() ? model->config().eos_token_ids : args.gen.eos_token_ids;
  if (const auto id = tokenizer.eos_token_id(); id && std::find(eos.begin(), eos.end(), *id) == eos.end())
    eos.push_back(*id);
  args.gen.eos_token_ids = eos;
  if (const auto pad = tokenizer.pad_token_id(); pad && !args.gen.pad_token_id) args.gen.pad_token_id = *pad;
  const std::vector<std::string> texts =
      args.prompts_file.empty() ? std::vector<std::string>{args.prompt} : read_prompts(args.prompts_file);
  std::vector<std::vector<std::int64_t>> prompts;
  for (const auto& text : texts) {
    prompts.push_back(tokenizer.encode(text));
    if (prompts.back().empty())
      throw std::invalid_argument("a prompt encodes to no token; give a non-empty --prompt");
  }
  const auto completions = accel::llm::generate(model, prompts, args.gen);
  for (std::size_t i = 0; i < completions.size(); ++i) {
    if (args.print_ids) {
      std::cout << "prompt_ids: " << join(prompts[i]) << "\n";
      std::cout << "completion_ids: " << join(completions[i]) << "\n";
    }
    const std::string text = tokenizer.decode(completions[i], /*skip_special_tokens=*/true);
    if (args.prompts_file.empty())
      std::cout << text << std::endl;
    else
      std::cout << Json(text).dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
  }
  std::cout.flush();
  return 0;
} catch (const std::invalid_argument& e) {
  std::cerr << "generate: " << e.what() << "\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "generate: " << e.what() << "\n";
  return 1;
}

// accel::ModelArguments: TRL's ModelConfig keys and defaults (trl/trainer/model_config.py, TRL 1.16), the
// training types' TYPE.model.yaml files, command-line overrides, and errors naming the file, line and key.
#include <accel/errors.hpp>
#include <accel/trainer/model_arguments.hpp>
#include "build_paths.hpp"

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

using accel::ConfigError;
using accel::ModelArguments;
using Catch::Matchers::Contains;

TEST_CASE("ModelArguments: TRL's defaults and keys") {
  ModelArguments m;
  m.validate();
  CHECK_FALSE(m.model_name_or_path);
  CHECK(m.dtype == "float32");
  CHECK_FALSE(m.use_peft);
  CHECK(m.lora_r == 16);
  CHECK(m.lora_alpha == 32);
  CHECK(m.lora_dropout == 0.05);
  CHECK(m.lora_task_type == "CAUSAL_LM");
  CHECK(m.bnb_4bit_quant_type == "nf4");
  CHECK_FALSE(m.use_bnb_nested_quant);
  std::vector<std::string> names;
  for (const auto& k : ModelArguments::keys())
    names.push_back(k.name);
  // Every field of TRL 1.16's ModelConfig dataclass, in its order (trl/trainer/model_config.py).
  const std::vector<std::string> trl = {"model_name_or_path",
                                        "model_revision",
                                        "dtype",
                                        "attn_implementation",
                                        "use_peft",
                                        "lora_r",
                                        "lora_alpha",
                                        "lora_dropout",
                                        "lora_target_modules",
                                        "lora_target_parameters",
                                        "lora_modules_to_save",
                                        "lora_task_type",
                                        "use_rslora",
                                        "use_dora",
                                        "load_in_8bit",
                                        "load_in_4bit",
                                        "bnb_4bit_quant_type",
                                        "use_bnb_nested_quant",
                                        "bnb_4bit_quant_storage"};
  CHECK(names == trl);
}

TEST_CASE("ModelArguments: a file, TRL's list-of-one rule, and refusals that name file, line and key") {
  auto m = ModelArguments::load_string(
      "model_name_or_path: models/qwen\ntorch_dtype: bfloat16\nuse_peft: true\nlora_r: 8\n"
      "lora_target_modules: [q_proj, v_proj]\nuse_rslora: true\nload_in_4bit: true\n"
      "use_bnb_nested_quant: true\n",
      "qlora.model.yaml");
  m.validate();
  CHECK(m.model_name_or_path == "models/qwen");
  CHECK(m.dtype == "bfloat16");  // torch_dtype, TRL's older name
  CHECK(m.lora_target_modules == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK_FALSE(m.lora_target_modules_string);
  CHECK(m.use_rslora);
  CHECK(m.load_in_4bit);
  // TRL's __post_init__: a list of one is that string (all-linear, or PEFT's regular expression).
  auto one = ModelArguments::load_string("use_peft: true\nlora_target_modules: [all-linear]\n", "m.yaml");
  CHECK(one.lora_target_modules_string == "all-linear");
  CHECK(one.lora_target_modules.empty());
  try {
    ModelArguments::load_string("use_peft: true\nlora_aplha: 8\n", "lora.model.yaml");
    FAIL("an unknown key was accepted");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(),
               Contains("lora.model.yaml:2") && Contains("'lora_aplha'") && Contains("'lora_alpha'"));
    CHECK(e.line() == 2);
  }
  auto dora = ModelArguments::load_string("use_peft: true\nuse_dora: true\nlora_target_modules: all-linear\n",
                                          "d.yaml");
  CHECK_THROWS_WITH(dora.validate(), Contains("use_dora") && Contains("not available"));
  auto eight = ModelArguments::load_string(
      "use_peft: true\nload_in_8bit: true\nlora_target_modules: [a, b]\n", "e.yaml");
  CHECK_THROWS_WITH(eight.validate(), Contains("load_in_8bit") && Contains("load_in_4bit"));
  auto both = ModelArguments::load_string("load_in_8bit: true\nload_in_4bit: true\n", "b.yaml");
  CHECK_THROWS_WITH(both.validate(), Contains("8 bit and 4 bit"));
  auto base = ModelArguments::load_string("load_in_4bit: true\n", "q.yaml");
  CHECK_THROWS_WITH(base.validate(), Contains("use_peft: true"));
  CHECK_THROWS_WITH(ModelArguments::load_string("bnb_4bit_compute_dtype: bfloat16\n", "q.yaml"),
                    Contains("q.yaml:1") && Contains("set dtype"));
  CHECK_THROWS_WITH(ModelArguments::load_string("bnb_4bit_quant_type: int4\n", "q.yaml"),
                    Contains("nf4, fp4"));
  CHECK_THROWS_WITH(ModelArguments::load_string("lora_r: many\n", "q.yaml"), Contains("'many'"));
  auto flash = ModelArguments::load_string("attn_implementation: flash_attention_2\n", "f.yaml");
  REQUIRE(flash.notices.size() == 1);
  CHECK_THAT(flash.notices[0], Contains("scaled_dot_product_attention"));
}

TEST_CASE("ModelArguments: --model_config FILE then overrides; the rest is the program's") {
  namespace fs = std::filesystem;
  const auto file = fs::temp_directory_path() / "accel_model_arguments_test.model.yaml";
  {
    std::FILE* f = std::fopen(file.string().c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs("use_peft: true\nlora_r: 16\nlora_target_modules: [q_proj, v_proj]\n", f);
    std::fclose(f);
  }
  std::vector<std::string> args = {"--dataset",   "chat.jsonl",           "--model_config",
                                   file.string(), "--model_name_or_path", "qwen",
                                   "--lora_r=4",  "--use_rslora"};
  std::vector<std::string> rest;
  auto m = ModelArguments::from_command_line(args, &rest);
  CHECK(m.model_name_or_path == "qwen");
  CHECK(m.lora_r == 4);
  CHECK(m.use_rslora);
  CHECK(m.lora_target_modules == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK(rest == std::vector<std::string>{"--dataset", "chat.jsonl"});
  std::vector<std::string> list = {"--use_peft", "--lora_target_modules", "q_proj,k_proj"};
  CHECK(ModelArguments::from_command_line(list).lora_target_modules ==
        std::vector<std::string>{"q_proj", "k_proj"});
  // TRL's command line (TrlParser / HfArgumentParser, nargs "+"): the values after a list key up to the next
  // option. TRL 1.16 parses {--lora_target_modules q_proj v_proj --lora_modules_to_save embed_tokens lm_head}
  // to ['q_proj', 'v_proj'] and ['embed_tokens', 'lm_head'] (run in the venv), one value to that string.
  std::vector<std::string> nargs = {"--lora_target_modules", "q_proj",  "v_proj",    "--lora_modules_to_save",
                                    "embed_tokens",          "lm_head", "--dataset", "d.jsonl"};
  rest.clear();
  const auto n = ModelArguments::from_command_line(nargs, &rest);
  CHECK(n.lora_target_modules == std::vector<std::string>{"q_proj", "v_proj"});
  CHECK(n.lora_modules_to_save == std::vector<std::string>{"embed_tokens", "lm_head"});
  CHECK(rest == std::vector<std::string>{"--dataset", "d.jsonl"});
  std::vector<std::string> one = {"--lora_target_modules", "all-linear"};
  CHECK(ModelArguments::from_command_line(one).lora_target_modules_string == "all-linear");
  std::vector<std::string> typo = {"--lora_alpah", "16"};
  CHECK_THROWS_WITH(ModelArguments::from_command_line(typo, &rest), Contains("--lora_alpha"));
  fs::remove(file);
}

TEST_CASE("ModelArguments: every TYPE.model.yaml of config_templates/trainer loads and validates") {
  namespace fs = std::filesystem;
  int files = 0;
  for (const auto& e : fs::directory_iterator(fs::path(accel::test::config_template_dir()) / "trainer")) {
    const std::string name = e.path().filename().string();
    if (name.size() < 11 || name.compare(name.size() - 11, 11, ".model.yaml") != 0) continue;
    INFO(name);
    auto m = ModelArguments::load_file(e.path().string());
    CHECK_NOTHROW(m.validate());
    ++files;
  }
  CHECK(files >= 3);  // lora, qlora, minimal
}

// The C++ side of tests/llm/data_crosscheck.py: renders chat templates and prepares SFT datasets with
// accel::llm's data room, and prints the results as JSON lines for the script to compare with transformers /
// TRL.
//
//   llm_data_tool render TEMPLATE_DIR CASES.jsonl        one {"text", "spans"} or {"error"} line per case
//   llm_data_tool prepare REQUEST.json                   {"examples": [...], "batches": [...]} or {"error"}
//   llm_data_tool training TEMPLATE_DIR...               one {"training": NAME or null} or {"error"} line
//   each

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"
#include "accel/llm/data/chat_template.hpp"
#include "llm_data_tool_prepare.hpp"

namespace {

using json = nlohmann::ordered_json;

int render(const std::string& dir, const std::string& cases_path) {
  std::ifstream cases(cases_path);
  std::string line;
  std::optional<accel::llm::ChatTemplate> tpl;
  std::string load_error;
  try {
    tpl = accel::llm::ChatTemplate::from_pretrained(dir);
  } catch (const accel::Error& e) {
    load_error = e.what();
  }
  while (std::getline(cases, line)) {
    if (line.empty()) continue;
    const json c = json::parse(line);
    json out = json::object();
    if (!tpl) {
      out["error"] = load_error;
      std::cout << out.dump() << "\n";
      continue;
    }
    accel::llm::ChatRenderOptions options;
    options.add_generation_prompt = c.value("add_generation_prompt", false);
    if (c.contains("tools") && !c["tools"].is_null()) options.tools_json = c["tools"].dump();
    if (c.contains("kwargs")) options.template_kwargs_json = c["kwargs"].dump();
    try {
      const auto r = tpl->render(c["messages"].dump(), options);
      out["text"] = r.text;
      json spans = json::array();
      for (const auto& [b, e] : r.generation_spans)
        spans.push_back(json::array({b, e}));
      out["spans"] = spans;
    } catch (const accel::Error& e) {
      out["error"] = e.what();
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}

// One {"training": "X_training.jinja"} (TRL's variant swapped in), {"training": null} (the template has
// {% generation %} markers) or {"error"} line per template directory, as training_chat_template decides.
int training(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    json out = json::object();
    try {
      const auto swapped =
          accel::llm::training_chat_template(accel::llm::ChatTemplate::from_pretrained(argv[i]));
      out["training"] = swapped ? json(swapped->training) : json(nullptr);
    } catch (const accel::Error& e) {
      out["error"] = e.what();
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "render" && argc == 4) return render(argv[2], argv[3]);
  if (cmd == "prepare" && argc == 3) return accel::test::prepare_command(argv[2]);
  if (cmd == "training" && argc >= 3) return training(argc, argv);
  std::cerr << "usage: llm_data_tool render TEMPLATE_DIR CASES.jsonl | prepare REQUEST.json | training "
               "TEMPLATE_DIR...\n";
  return 2;
}

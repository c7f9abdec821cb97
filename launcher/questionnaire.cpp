/// \file questionnaire.cpp
/// The question engine (Prompter) and the questions of `accel-launch config`.

#include "questionnaire.hpp"

#include <accel/errors.hpp>
#include <accel/parallel/pipeline_schedule.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <utility>

namespace accel::launcher {
namespace {

std::string trim(const std::string& text) {
  const auto is_space = [](unsigned char c) { return std::isspace(c) != 0; };
  auto begin = std::find_if_not(text.begin(), text.end(), is_space);
  auto end = std::find_if_not(text.rbegin(), std::string::const_reverse_iterator(begin), is_space).base();
  return std::string(begin, end);
}

// Case-insensitive, with '-', '_' and ' ' alike, so that "multi-machine", "Multi machine" and
// "MULTI_MACHINE" all name the same choice.
std::string normalize(const std::string& name) {
  std::string out;
  for (unsigned char c : trim(name)) {
    out += (c == '-' || c == ' ') ? '_' : static_cast<char>(std::tolower(c));
  }
  return out;
}

template <typename Int>
bool parse_int(const std::string& answer, Int min, Int max, Int& value, std::string& error) {
  const char* first = answer.data();
  const char* last = answer.data() + answer.size();
  if (first != last && *first == '+') ++first;
  Int parsed = 0;
  const auto [end, ec] = std::from_chars(first, last, parsed);
  if (ec == std::errc::result_out_of_range && end == last) {
    error = "'" + answer + "' is too large";
    return false;
  }
  if (ec != std::errc() || end != last || first == last) {
    error = "'" + answer + "' is not a whole number";
    return false;
  }
  if (parsed < min || parsed > max) {
    error = max == std::numeric_limits<Int>::max()
                ? answer + " is too small: enter a number of at least " + std::to_string(min)
                : answer + " is out of range: enter a number from " + std::to_string(min) + " to " +
                      std::to_string(max);
    return false;
  }
  value = parsed;
  return true;
}

std::string quoted(const std::string& text) {
  return "'" + text + "'";
}

// Why a pipeline cannot run with this backend's settings, as the Accelerator refuses it at prepare_pipeline
// (refuse_sharding_with_pipeline): sharded gradients or parameters would be reduced once per micro-batch.
std::optional<std::string> pipeline_refusal(const Config& c) {
  const auto whole = [](const BackendCapabilities& s) { return !s.shards_gradients && !s.shards_parameters; };
  if (whole(sharding_of(c))) return std::nullopt;
  return "backend " + describe_layout(c) +
         " shards gradients or parameters, which a pipeline refuses (as DeepSpeed: they would be "
         "communicated once per micro-batch); answer no, or run accel-launch config again with " +
         layouts_where(whole);
}

// What is wrong with a partition answer, if anything. The model is not known here, so layer boundaries are
// checked for their count, first value and order only; prepare_pipeline checks the last against the model's
// layer count.
std::optional<std::string> partition_answer_problem(const std::string& answer, int stages) {
  if (normalize(answer) == "balanced") return std::nullopt;
  pipeline::PartitionMethod method;
  try {
    method = pipeline::parse_partition(answer);
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
  if (method.kind != pipeline::PartitionMethod::Kind::Explicit) return std::nullopt;
  const auto& b = method.boundaries;
  std::string given;
  for (std::size_t i = 0; i < b.size(); ++i)
    given += (i == 0 ? "" : ",") + std::to_string(b[i]);
  if (b.size() != static_cast<std::size_t>(stages) + 1) {
    return "pipeline: partition " + given + " has " + std::to_string(b.size()) + " boundaries; " +
           std::to_string(stages) + " stages need " + std::to_string(stages + 1) +
           ": 0, then where each stage ends (the last is the model's layer count)";
  }
  if (b.front() != 0) return "pipeline: partition " + given + " must start at 0, the first layer";
  for (std::size_t s = 0; s + 1 < b.size(); ++s) {
    if (b[s + 1] <= b[s]) {
      return "pipeline: partition " + given + " leaves stage " + std::to_string(s) +
             " without layers; boundaries must increase strictly";
    }
  }
  return std::nullopt;
}

// The pipeline_config: questions (asked when a distributed backend runs several processes).
void ask_pipeline(Prompter& prompter, Config& config) {
  constexpr int kIntMax = std::numeric_limits<int>::max();
  const size_t use = prompter.ask_choice(
      "Do you want to use pipeline parallelism (a torch::nn::Sequential cut into stages, "
      "accelerator.prepare_pipeline)?",
      {{"no", "", {"n", "false"}}, {"yes", "", {"y", "true"}}}, 0,
      [&config](size_t index) { return index == 1 ? pipeline_refusal(config) : std::nullopt; });
  if (use == 0) return;
  const int processes = config.num_processes;
  config.pipeline.stages = prompter.ask_int(
      "How many pipeline stages (num_processes must be a multiple: num_processes / stages data-parallel "
      "replicas of each stage)?",
      processes, 2, processes, [processes](int stages) -> std::optional<std::string> {
        if (processes % stages != 0) {
          return std::to_string(processes) + " processes do not split into " + std::to_string(stages) +
                 " stages: the number of stages must divide num_processes (" + std::to_string(processes) +
                 ")";
        }
        return std::nullopt;
      });
  // Default 4 x stages: with M micro-batches each stage idles (stages - 1) / (M + stages - 1) of a step, so
  // 1 micro-batch (0 with no accumulation) would run the stages one after the other. Micro-batches split each
  // batch and average back, so the count changes the bubble and the memory, never the gradients.
  const int stages = config.pipeline.stages;
  config.pipeline.micro_batches = prompter.ask_int(
      "How many micro-batches is each batch cut into (the batch's row count must be a multiple; with M "
      "micro-batches each stage idles (stages - 1) / (M + stages - 1) of a step; 0: "
      "gradient_accumulation_steps, here " +
          std::to_string(config.gradient_accumulation_steps) + ")?",
      4 * stages, 0, kIntMax);
  config.pipeline.schedule =
      prompter.ask_choice(
          "Which pipeline schedule?",
          {{"1f1b", "one forward one backward: stage s holds at most stages - s micro-batches"},
           {"gpipe", "all forwards, then all backwards: every stage holds all micro-batches"}},
          0) == 0
          ? pipeline::Schedule::OneFOneB
          : pipeline::Schedule::GPipe;
  std::string partition = prompter.ask_text(
      "How should the layers be split into stages: parameters (balanced by parameter count), uniform, "
      "type:<regex> (balances the layers whose type matches), or layer boundaries such as 0,3,6?",
      std::string("parameters"),
      [stages](const std::string& answer) { return partition_answer_problem(answer, stages); });
  if (normalize(partition) == "balanced") partition = "parameters";
  config.pipeline.partition = partition;
}

}  // namespace

// -----------------------------------------------------------------------------------------------------------
// Prompter

Prompter::Prompter(std::istream& in, std::ostream& out, QuestionnaireOptions options)
    : in_(in), out_(out), options_(options) {}

std::string Prompter::ask(const std::string& question, const std::string& prompt,
                          const std::optional<std::string>& default_text,
                          const std::function<bool(const std::string&, std::string&)>& accept) {
  std::string error;
  for (int attempt = 1;; ++attempt) {
    out_ << prompt << std::flush;
    std::string line;
    if (!ended_ && !std::getline(in_, line)) ended_ = true;
    if (ended_) {
      if (options_.interactive) out_ << "\n";
      if (!default_text) {
        out_ << "(end of input)\n" << std::flush;
        throw UsageError("stdin ended before question '" + question +
                         "' was answered; give one answer per line (an empty line takes the default)");
      }
      out_ << *default_text << " (default: end of input)\n" << std::flush;
      if (!accept(*default_text, error)) throw std::logic_error("invalid default for '" + question + "'");
      return *default_text;
    }
    const std::string answer = trim(line);
    if (answer.empty() && default_text) {
      if (!options_.interactive) out_ << *default_text << " (default)\n";
      if (!accept(*default_text, error)) throw std::logic_error("invalid default for '" + question + "'");
      return *default_text;
    }
    if (!options_.interactive) out_ << answer << "\n";
    if (answer.empty()) {
      error = "this question has no default: type an answer";
    } else if (accept(answer, error)) {
      return answer;
    }
    out_ << "Error: " << error << "\n";
    if (options_.max_attempts > 0 && attempt >= options_.max_attempts) {
      throw ConfigError("no valid answer for '" + question + "' after " + std::to_string(attempt) +
                        " attempts; the last one was rejected because " + error);
    }
  }
}

size_t Prompter::ask_choice(const std::string& question, const std::vector<Choice>& choices,
                            size_t default_index, const AnswerCheck<size_t>& check) {
  if (choices.empty() || default_index >= choices.size()) {
    throw std::logic_error("ask_choice: bad choices for '" + question + "'");
  }
  size_t width = 0;
  for (const Choice& choice : choices)
    width = std::max(width, choice.name.size());
  out_ << question << "\n";
  std::vector<std::string> names;
  for (size_t i = 0; i < choices.size(); ++i) {
    out_ << "  " << i << ") " << choices[i].name;
    if (!choices[i].description.empty()) {
      out_ << std::string(width - choices[i].name.size() + 2, ' ') << choices[i].description;
    }
    out_ << "\n";
    names.push_back(choices[i].name);
  }
  std::string names_list;
  for (size_t i = 0; i < names.size(); ++i)
    names_list += (i == 0 ? "" : ", ") + names[i];
  const std::string prompt =
      "Enter 0-" + std::to_string(choices.size() - 1) + " or a name [" + choices[default_index].name + "]: ";

  size_t chosen = default_index;
  auto accept = [&](const std::string& answer, std::string& error) {
    std::optional<size_t> index;
    if (std::all_of(answer.begin(), answer.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) {
      size_t number = 0;
      const auto [end, ec] = std::from_chars(answer.data(), answer.data() + answer.size(), number);
      if (ec == std::errc() && end == answer.data() + answer.size() && number < choices.size()) {
        index = number;
      }
    }
    for (size_t i = 0; i < choices.size() && !index; ++i) {
      if (normalize(choices[i].name) == normalize(answer)) index = i;
      for (const std::string& alias : choices[i].aliases) {
        if (normalize(alias) == normalize(answer)) index = i;
      }
    }
    if (!index) {
      error = quoted(answer) + " is not one of the choices: enter a number from 0 to " +
              std::to_string(choices.size() - 1) + " or one of " + names_list;
      return false;
    }
    if (check) {
      if (auto reason = check(*index)) {
        error = *reason;
        return false;
      }
    }
    chosen = *index;
    return true;
  };
  ask(question, prompt, choices[default_index].name, accept);
  return chosen;
}

int Prompter::ask_int(const std::string& question, int default_value, int min, int max,
                      const AnswerCheck<int>& check) {
  int value = default_value;
  auto accept = [&](const std::string& answer, std::string& error) {
    int parsed = 0;
    if (!parse_int(answer, min, max, parsed, error)) return false;
    if (check) {
      if (auto reason = check(parsed)) {
        error = *reason;
        return false;
      }
    }
    value = parsed;
    return true;
  };
  const std::string text = std::to_string(default_value);
  ask(question, question + " [" + text + "]: ", text, accept);
  return value;
}

int64_t Prompter::ask_int64(const std::string& question, int64_t default_value, int64_t min, int64_t max) {
  int64_t value = default_value;
  auto accept = [&](const std::string& answer, std::string& error) {
    return parse_int(answer, min, max, value, error);
  };
  const std::string text = std::to_string(default_value);
  ask(question, question + " [" + text + "]: ", text, accept);
  return value;
}

bool Prompter::ask_bool(const std::string& question, bool default_value) {
  bool value = default_value;
  auto accept = [&](const std::string& answer, std::string& error) {
    const std::string word = normalize(answer);
    if (word == "yes" || word == "y" || word == "true" || word == "1") {
      value = true;
    } else if (word == "no" || word == "n" || word == "false" || word == "0") {
      value = false;
    } else {
      error = quoted(answer) + " is not yes or no";
      return false;
    }
    return true;
  };
  const std::string text = default_value ? "yes" : "no";
  ask(question, question + " (yes/no) [" + text + "]: ", text, accept);
  return value;
}

std::string Prompter::ask_text(const std::string& question, const std::optional<std::string>& default_value,
                               const AnswerCheck<std::string>& check) {
  std::string value;
  auto accept = [&](const std::string& answer, std::string& error) {
    if (check) {
      if (auto reason = check(answer)) {
        error = *reason;
        return false;
      }
    }
    value = answer;
    return true;
  };
  const std::string prompt = question + (default_value ? " [" + *default_value + "]: " : ": ");
  ask(question, prompt, default_value, accept);
  return value;
}

// -----------------------------------------------------------------------------------------------------------
// The questions

namespace {

constexpr int kIntMax = std::numeric_limits<int>::max();

// The compute environment, and for several machines: how many, this one's rank, and the main process's
// address and port.
void ask_machines(Prompter& prompter, Config& config) {
  const size_t environment =
      prompter.ask_choice("In which compute environment are you running?",
                          {{"This machine", "one machine, any number of processes"},
                           {"Multi-machine", "several machines (multi-node training)"}},
                          0);
  if (environment != 1) return;
  config.num_machines = prompter.ask_int("How many machines will you use?", 2, 2, kIntMax);
  config.machine_rank = prompter.ask_int("What is the rank of this machine (0 for the main machine)?", 0, 0,
                                         config.num_machines - 1);
  config.main_process_ip = prompter.ask_text(
      "What is the IP address or host name of the machine that will host the main process?", std::nullopt,
      [](const std::string& answer) -> std::optional<std::string> {
        if (std::any_of(answer.begin(), answer.end(), [](unsigned char c) { return std::isspace(c); })) {
          return quoted(answer) + " contains spaces: enter one IP address or host name";
        }
        return std::nullopt;
      });
  config.main_process_port = prompter.ask_int(
      "What is the port you will use to communicate with the main process (0 picks a free port)?",
      config.main_process_port, 0, 65535);
}

// Why `refused` cannot train on `machines` machines: it runs a single process.
std::string single_process_refusal(const std::vector<BackendInfo>& backends, const BackendInfo& refused,
                                   int machines) {
  std::vector<std::string> others;
  for (const BackendInfo& info : backends) {
    if (info.max_processes != 1) others.push_back(info.name);
  }
  std::string list;
  for (size_t i = 0; i < others.size(); ++i)
    list += (i == 0 ? "" : i + 1 == others.size() ? " or " : ", ") + others[i];
  return refused.name + " runs a single process; training on " + std::to_string(machines) +
         " machines needs " + list;
}

const BackendInfo& ask_backend(Prompter& prompter, int machines) {
  // The backends and their own questions come from the backend folders (BackendInfo), so this list is never
  // written here.
  const std::vector<BackendInfo>& backends = config_backends();
  std::vector<Choice> backend_choices;
  size_t default_backend = 0;
  for (const BackendInfo& info : backends) {
    Choice choice{info.name, info.summary, info.aliases};
    for (const std::string& type : info.distributed_types)
      choice.aliases.push_back(type);
    backend_choices.push_back(std::move(choice));
  }
  for (size_t i = 0; i < backends.size() && machines > 1; ++i) {
    if (backends[i].max_processes != 1) {
      default_backend = i;
      break;
    }
  }
  const size_t backend =
      prompter.ask_choice("Which type of distributed training do you want?", backend_choices, default_backend,
                          [&backends, machines](size_t index) -> std::optional<std::string> {
                            if (backends[index].max_processes == 1 && machines > 1)
                              return single_process_refusal(backends, backends[index], machines);
                            return std::nullopt;
                          });
  return backends[backend];
}

int ask_num_processes(Prompter& prompter, int machines) {
  return prompter.ask_int(machines > 1 ? "How many processes will you use in total (across all machines)?"
                                       : "How many processes will you use?",
                          2 * machines, 1, kIntMax, [machines](int n) -> std::optional<std::string> {
                            if (n % machines != 0) {
                              return std::to_string(n) + " is not a multiple of the number of machines (" +
                                     std::to_string(machines) +
                                     "): every machine runs the same number of processes";
                            }
                            return std::nullopt;
                          });
}

MixedPrecision ask_mixed_precision(Prompter& prompter) {
  return std::vector<MixedPrecision>{MixedPrecision::No, MixedPrecision::Fp16,
                                     MixedPrecision::Bf16}[prompter.ask_choice(
      "Do you wish to use mixed precision?",
      {{"no", "full precision (fp32)"}, {"fp16", "float16 with dynamic loss scaling"}, {"bf16", "bfloat16"}},
      0)];
}

}  // namespace

Config run_questionnaire(std::istream& in, std::ostream& out, const QuestionnaireOptions& options) {
  Prompter prompter(in, out, options);
  Config config;
  ask_machines(prompter, config);

  const int machines = config.num_machines;
  const BackendInfo& chosen = ask_backend(prompter, machines);
  config.backend = chosen.name;
  const bool distributed = chosen.max_processes != 1;

  config.use_cpu =
      prompter.ask_bool("Do you want to run your training on CPU only (even if a GPU is available)?", false);

  // A single-process backend runs exactly one process, so there is nothing to ask.
  if (distributed) config.num_processes = ask_num_processes(prompter, machines);
  if (chosen.ask_settings) chosen.ask_settings(prompter, config);

  config.gradient_accumulation_steps =
      prompter.ask_int("How many gradient accumulation steps do you want?", 1, 1, kIntMax);
  config.mixed_precision = ask_mixed_precision(prompter);
  if (distributed) {
    config.debug = prompter.ask_bool(
        "Should every collective first check that all ranks pass matching shapes (turns hangs into errors, "
        "but is slower)?",
        false);
    if (config.num_processes > 1) ask_pipeline(prompter, config);
  }
  config.validate();
  return config;
}

Config default_config(int num_processes, MixedPrecision mixed_precision) {
  Config config;
  config.num_processes = num_processes;
  config.backend = backend_for_processes("local", num_processes);
  config.mixed_precision = mixed_precision;
  config.validate();
  return config;
}

}  // namespace accel::launcher

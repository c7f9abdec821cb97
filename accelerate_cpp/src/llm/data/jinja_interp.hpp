#pragma once
// The chat-template interpreter (private): evaluates a parsed template as jinja2's
// ImmutableSandboxedEnvironment does under transformers (Undefined for missing keys, Python semantics for
// values, no mutation of lists/dicts).

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "llm/data/jinja_ast.hpp"

namespace accel::llm::detail::jinja {

using Spans = std::vector<std::pair<std::size_t, std::size_t>>;

class Interpreter {
 public:
  /// `context`: the variables of the render call (messages, add_generation_prompt, special tokens ...).
  Interpreter(const Template& tpl, std::shared_ptr<Dict> context);

  /// Renders the template; `spans` (optional) receives the byte ranges of `{% generation %}` blocks.
  std::string render(Spans* spans);

  /// An error jinja2 would raise while rendering (undefined value used, type error, raise_exception):
  /// accel::ConfigError naming the template and line.
  [[noreturn]] void fail(int line, const std::string& what) const;
  /// A construct jinja2 supports and this interpreter does not: accel::ConfigError saying so.
  [[noreturn]] void unsupported(int line, const std::string& what) const;

  Value call(const Value& fn, List& args, KwArgs& kwargs, int line);
  /// jinja2's getattr (obj.name): attribute first (methods), then item; missing -> Undefined.
  Value getattr(const Value& obj, const std::string& name, int line);
  /// jinja2's getitem (obj[key]): item first, then attribute; missing -> Undefined.
  Value getitem(const Value& obj, const Value& key, int line);
  /// Python iteration over a value (dict -> keys, str -> characters, Undefined -> nothing).
  List iterate(const Value& v, int line) const;
  const std::string& origin() const { return tpl_.origin; }
  /// A macro's call (define_macro's callables come here).
  Value call_macro(const Node& macro, List& args, KwArgs& kwargs);

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec(const Body& body, std::string& out);
  Flow exec_node(const Node& n, std::string& out);
  Flow exec_for(const Node& n, std::string& out);
  void exec_set(const Node& n, const Value& value);
  void define_macro(const Node& n);
  Value eval(const Expr& e);
  Value eval_binary(const Expr& e);
  Value eval_call(const Expr& e);
  Value eval_slice(const Expr& e);
  Value lookup(const std::string& name) const;
  void assign(const std::string& name, Value v);

  const Template& tpl_;
  std::vector<std::shared_ptr<Dict>> frames_;  // [globals+context, top-level sets, loop iterations...]
  std::string* main_out_ = nullptr;
  Spans* spans_ = nullptr;
  int depth_ = 0;
  int call_line_ = 0;  // the line of the call being evaluated (builtins report errors there)
};

/// Filters, tests, methods and globals (jinja_builtins.cpp).
Value apply_filter(Interpreter& in, const std::string& name, const Value& input, List& args, KwArgs& kwargs,
                   int line);
bool apply_test(Interpreter& in, const std::string& name, const Value& input, List& args, int line);
/// The bound method `obj.name` (str, dict and list methods chat templates call), or Undefined.
Value bound_method(Interpreter& in, const Value& obj, const std::string& name, int line);
/// namespace(), raise_exception(), strftime_now(), range(), dict(): jinja2's and transformers' globals.
void install_globals(Dict& globals);
/// Python binary arithmetic (+ - * / // % **); throws through `in.fail` on a type error.
Value arithmetic(Interpreter& in, const std::string& op, const Value& a, const Value& b, int line);
/// Python ordering (< <= > >=).
bool less_than(Interpreter& in, const Value& a, const Value& b, int line);

}  // namespace accel::llm::detail::jinja

#pragma once
// The syntax tree of a chat template (private to the data room): what jinja2's parser builds for the subset
// of Jinja that chat templates use. Parsing refuses anything outside the subset with accel::ConfigError
// naming the template's file, line and construct, so a template is either rendered as jinja2 renders it or
// not at all.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "llm/data/jinja_value.hpp"

namespace accel::llm::detail::jinja {

struct Expr;
using ExprPtr = std::shared_ptr<Expr>;

enum class ExprKind {
  kConst,    // constant
  kName,     // name
  kList,     // args: items
  kTuple,    // args: items
  kDict,     // args: key, value, key, value ...
  kGetAttr,  // args[0].name
  kGetItem,  // args[0][args[1]]
  kSlice,    // args[0][args[1]:args[2]:args[3]] (null when absent)
  kCall,     // args[0](args[1:], kwargs)
  kFilter,   // args[0] | name(args[1:], kwargs)
  kTest,     // args[0] is name(args[1:]); negated when `negate`
  kUnary,    // name: "-", "+", "not"
  kBinary,   // name: + - * / // % ** ~ == != < > <= >= in notin and or
  kCond,     // args[1] if args[0] else args[2] (args[2] null: undefined)
};

struct Expr {
  ExprKind kind = ExprKind::kConst;
  int line = 0;
  Value constant;
  std::string name;
  bool negate = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Node;
using NodePtr = std::shared_ptr<Node>;
using Body = std::vector<NodePtr>;

enum class NodeKind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kGeneration };

struct Node {
  NodeKind kind = NodeKind::kText;
  int line = 0;
  std::string text;                                     // kText; kMacro: the macro's name
  ExprPtr expr;                                         // kOutput; kFor: iterable; kSet: value
  std::vector<std::pair<ExprPtr, Body>> branches;       // kIf: (condition or null for else, body)
  std::vector<std::string> targets;                     // kFor, kSet, kSetBlock: names assigned
  std::string attr;                                     // kSet of `ns.attr`: targets[0] is ns
  ExprPtr filter;                                       // kFor: `if` condition
  Body body;                                            // kFor, kSetBlock, kMacro, kGeneration
  Body else_body;                                       // kFor
  std::vector<std::pair<std::string, ExprPtr>> params;  // kMacro: name, default (or null)
};

/// A parsed template. `origin` names it in errors (the file it came from).
struct Template {
  std::string origin;
  Body body;
  bool has_generation = false;
};

/// Parses `source` as jinja2 does with trim_blocks and lstrip_blocks (transformers' settings). Throws
/// accel::ConfigError naming `origin`, the line and the construct for syntax errors and unsupported
/// constructs.
std::shared_ptr<Template> parse_template(const std::string& source, const std::string& origin);

/// The filters and tests the interpreter implements (checked at parse time).
bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);

}  // namespace accel::llm::detail::jinja

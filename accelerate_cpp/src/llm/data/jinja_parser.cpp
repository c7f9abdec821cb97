#include <set>

#include "accel/errors.hpp"
#include "llm/data/jinja_ast.hpp"
#include "llm/data/jinja_lexer.hpp"

namespace accel::llm::detail::jinja {
namespace {

const std::set<std::string>& unsupported_statements() {
  static const std::set<std::string> s = {"call",  "filter",     "include", "import", "from",  "extends",
                                          "block", "autoescape", "with",    "do",     "trans", "pluralize"};
  return s;
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, std::string origin) : t_(std::move(tokens)), origin_(std::move(origin)) {}

  std::shared_ptr<Template> run() {
    auto tpl = std::make_shared<Template>();
    tpl->origin = origin_;
    std::string end;
    tpl->body = parse_body({}, end);
    tpl->has_generation = has_generation_;
    return tpl;
  }

 private:
  [[noreturn]] void fail(const std::string& what, int line = -1) const {
    const int l = line >= 0 ? line : cur().line;
    throw ConfigError("chat template " + origin_ + " line " + std::to_string(l) + ": " + what, origin_, l);
  }
  [[noreturn]] void unsupported(const std::string& construct, int line = -1) const {
    fail(construct +
             " is not supported by accel's chat-template interpreter (a Jinja subset); render this template "
             "with transformers, or simplify the template",
         line);
  }

  const Token& cur() const { return t_[pos_]; }
  const Token& peek(std::size_t k = 1) const { return t_[std::min(pos_ + k, t_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::kName && cur().text == name; }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool accept_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(std::string("expected '") + op + "', got '" + describe(cur()) + "'");
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail("expected a name, got '" + describe(cur()) + "'");
    return t_[pos_++].text;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd)
      fail("expected the end of the statement, got '" + describe(cur()) + "'");
    ++pos_;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kBlockEnd:
        return "%}";
      case Tok::kVarEnd:
        return "}}";
      case Tok::kEof:
        return "end of template";
      default:
        return t.text;
    }
  }

  // Statements until one of `ends` (returned in `end`, its tag name consumed, its `%}` not).
  Body parse_body(const std::set<std::string>& ends, std::string& end) {
    Body body;
    while (true) {
      const Token& tok = cur();
      if (tok.type == Tok::kEof) {
        if (!ends.empty()) fail("unexpected end of template, expected one of: " + join(ends));
        return body;
      }
      if (tok.type == Tok::kData) {
        auto n = std::make_shared<Node>();
        n->kind = NodeKind::kText;
        n->line = tok.line;
        n->text = tok.text;
        body.push_back(n);
        ++pos_;
      } else if (tok.type == Tok::kVarBegin) {
        ++pos_;
        auto n = std::make_shared<Node>();
        n->kind = NodeKind::kOutput;
        n->line = tok.line;
        n->expr = parse_tuple_expr();
        if (cur().type != Tok::kVarEnd) fail("expected '}}', got '" + describe(cur()) + "'");
        ++pos_;
        body.push_back(n);
      } else {
        ++pos_;  // {%
        const Token& name = cur();
        if (name.type == Tok::kName && ends.count(name.text)) {
          end = name.text;
          ++pos_;
          return body;
        }
        body.push_back(parse_statement());
      }
    }
  }

  static std::string join(const std::set<std::string>& s) {
    std::string out;
    for (const auto& x : s)
      out += (out.empty() ? "" : ", ") + x;
    return out;
  }

  NodePtr parse_statement() {
    const Token& tok = cur();
    if (tok.type != Tok::kName) fail("expected a statement name after '{%'");
    const std::string& kw = tok.text;
    const int line = tok.line;
    if (kw == "if") return parse_if();
    if (kw == "for") return parse_for();
    if (kw == "set") return parse_set();
    if (kw == "macro") return parse_macro();
    if (kw == "generation") return parse_generation();
    if (kw == "break" || kw == "continue") {
      ++pos_;
      auto n = std::make_shared<Node>();
      n->kind = kw == "break" ? NodeKind::kBreak : NodeKind::kContinue;
      n->line = line;
      expect_block_end();
      return n;
    }
    if (unsupported_statements().count(kw)) unsupported("the statement `{% " + kw + " %}`", line);
    fail("unknown statement `{% " + kw + " %}`", line);
  }

  NodePtr parse_if() {
    auto n = std::make_shared<Node>();
    n->kind = NodeKind::kIf;
    n->line = cur().line;
    ++pos_;
    ExprPtr cond = parse_expr();
    while (true) {
      expect_block_end();
      std::string end;
      Body body = parse_body({"elif", "else", "endif"}, end);
      n->branches.emplace_back(cond, std::move(body));
      if (end == "endif") break;
      if (end == "elif") {
        cond = parse_expr();
        continue;
      }
      expect_block_end();
      Body else_body = parse_body({"endif"}, end);
      n->branches.emplace_back(nullptr, std::move(else_body));
      break;
    }
    expect_block_end();
    return n;
  }

  NodePtr parse_for() {
    auto n = std::make_shared<Node>();
    n->kind = NodeKind::kFor;
    n->line = cur().line;
    ++pos_;
    do {
      n->targets.push_back(expect_name());
    } while (accept_op(","));
    if (!accept_name("in")) fail("expected 'in' in a for loop");
    n->expr = parse_expr(false);
    if (accept_name("if")) n->filter = parse_expr();
    if (is_name("recursive")) unsupported("a recursive for loop");
    expect_block_end();
    std::string end;
    n->body = parse_body({"else", "endfor"}, end);
    if (end == "else") {
      expect_block_end();
      n->else_body = parse_body({"endfor"}, end);
    }
    expect_block_end();
    return n;
  }

  NodePtr parse_set() {
    auto n = std::make_shared<Node>();
    n->line = cur().line;
    ++pos_;
    n->targets.push_back(expect_name());
    if (accept_op(".")) {
      n->attr = expect_name();
    } else {
      while (accept_op(","))
        n->targets.push_back(expect_name());
    }
    if (cur().type == Tok::kBlockEnd) {
      if (!n->attr.empty() || n->targets.size() != 1) fail("a block `{% set %}` assigns one plain name");
      n->kind = NodeKind::kSetBlock;
      ++pos_;
      std::string end;
      n->body = parse_body({"endset"}, end);
      expect_block_end();
      return n;
    }
    n->kind = NodeKind::kSet;
    expect_op("=");
    n->expr = parse_tuple_expr();
    expect_block_end();
    return n;
  }

  NodePtr parse_macro() {
    auto n = std::make_shared<Node>();
    n->kind = NodeKind::kMacro;
    n->line = cur().line;
    ++pos_;
    n->text = expect_name();
    expect_op("(");
    while (!accept_op(")")) {
      if (!n->params.empty()) expect_op(",");
      if (accept_op(")")) break;
      std::string name = expect_name();
      ExprPtr def;
      if (accept_op("=")) def = parse_expr();
      n->params.emplace_back(std::move(name), def);
    }
    expect_block_end();
    std::string end;
    n->body = parse_body({"endmacro"}, end);
    if (cur().type == Tok::kName) ++pos_;  // {% endmacro name %}
    expect_block_end();
    return n;
  }

  NodePtr parse_generation() {
    auto n = std::make_shared<Node>();
    n->kind = NodeKind::kGeneration;
    n->line = cur().line;
    ++pos_;
    expect_block_end();
    std::string end;
    n->body = parse_body({"endgeneration"}, end);
    expect_block_end();
    has_generation_ = true;
    return n;
  }

  // ---- expressions (jinja2's precedence) ----
  ExprPtr node(ExprKind kind, int line, std::vector<ExprPtr> args = {}, std::string name = {}) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->line = line;
    e->args = std::move(args);
    e->name = std::move(name);
    return e;
  }

  // `a, b` without brackets is a tuple (in `{{ }}` and `set`).
  ExprPtr parse_tuple_expr() {
    const int line = cur().line;
    ExprPtr first = parse_expr();
    if (!is_op(",")) return first;
    std::vector<ExprPtr> items{first};
    while (accept_op(",")) {
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd) break;
      items.push_back(parse_expr());
    }
    return node(ExprKind::kTuple, line, std::move(items));
  }

  ExprPtr parse_expr(bool with_cond = true) {
    const int line = cur().line;
    ExprPtr e = parse_or();
    while (with_cond && accept_name("if")) {
      ExprPtr cond = parse_or();
      ExprPtr other = accept_name("else") ? parse_expr() : nullptr;
      e = node(ExprKind::kCond, line, {cond, e, other});
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = cur().line;
      ++pos_;
      left = node(ExprKind::kBinary, line, {left, parse_and()}, "or");
    }
    return left;
  }
  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = cur().line;
      ++pos_;
      left = node(ExprKind::kBinary, line, {left, parse_not()}, "and");
    }
    return left;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      const int line = cur().line;
      ++pos_;
      return node(ExprKind::kUnary, line, {parse_not()}, "not");
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr left = parse_math1();
    while (true) {
      const int line = cur().line;
      std::string op;
      if (cur().type == Tok::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                     cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        ++pos_;
      } else if (is_name("in")) {
        op = "in";
        ++pos_;
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        op = "notin";
        pos_ += 2;
      } else {
        return left;
      }
      left = node(ExprKind::kBinary, line, {left, parse_math1()}, op);
    }
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& op = t_[pos_++];
      left = node(ExprKind::kBinary, op.line, {left, parse_concat()}, op.text);
    }
    return left;
  }
  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const int line = cur().line;
      ++pos_;
      left = node(ExprKind::kBinary, line, {left, parse_math2()}, "~");
    }
    return left;
  }
  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& op = t_[pos_++];
      left = node(ExprKind::kBinary, op.line, {left, parse_pow()}, op.text);
    }
    return left;
  }
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary();
    while (is_op("**")) {
      const int line = cur().line;
      ++pos_;
      left = node(ExprKind::kBinary, line, {left, parse_unary()}, "**");
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter = true) {
    const int line = cur().line;
    ExprPtr e;
    if (accept_op("-")) {
      e = node(ExprKind::kUnary, line, {parse_unary(false)}, "-");
    } else if (accept_op("+")) {
      e = node(ExprKind::kUnary, line, {parse_unary(false)}, "+");
    } else {
      e = parse_primary();
    }
    e = parse_postfix(e);
    return with_filter ? parse_filter_expr(e) : e;
  }

  ExprPtr parse_primary() {
    const Token& tok = cur();
    if (tok.type == Tok::kName) {
      ++pos_;
      auto e = node(ExprKind::kConst, tok.line);
      if (tok.text == "true" || tok.text == "True") {
        e->constant = Value::boolean(true);
      } else if (tok.text == "false" || tok.text == "False") {
        e->constant = Value::boolean(false);
      } else if (tok.text == "none" || tok.text == "None") {
        e->constant = Value::none();
      } else {
        e->kind = ExprKind::kName;
        e->name = tok.text;
      }
      return e;
    }
    if (tok.type == Tok::kString) {
      std::string s;
      const int line = tok.line;
      while (cur().type == Tok::kString)
        s += t_[pos_++].text;  // adjacent literals concatenate
      auto e = node(ExprKind::kConst, line);
      e->constant = Value::string(std::move(s));
      return e;
    }
    if (tok.type == Tok::kInt || tok.type == Tok::kFloat) {
      ++pos_;
      auto e = node(ExprKind::kConst, tok.line);
      e->constant = tok.type == Tok::kInt ? Value::integer(tok.ival) : Value::floating(tok.fval);
      return e;
    }
    if (is_op("(")) return parse_paren();
    if (is_op("[")) return parse_list();
    if (is_op("{")) return parse_dict();
    fail("unexpected '" + describe(tok) + "'");
  }

  ExprPtr parse_paren() {
    const int line = cur().line;
    ++pos_;
    if (accept_op(")")) return node(ExprKind::kTuple, line);
    ExprPtr first = parse_expr();
    if (accept_op(")")) return first;
    std::vector<ExprPtr> items{first};
    while (accept_op(",")) {
      if (is_op(")")) break;
      items.push_back(parse_expr());
    }
    expect_op(")");
    return node(ExprKind::kTuple, line, std::move(items));
  }
  ExprPtr parse_list() {
    const int line = cur().line;
    ++pos_;
    std::vector<ExprPtr> items;
    while (!accept_op("]")) {
      if (!items.empty()) expect_op(",");
      if (accept_op("]")) break;
      items.push_back(parse_expr());
    }
    return node(ExprKind::kList, line, std::move(items));
  }
  ExprPtr parse_dict() {
    const int line = cur().line;
    ++pos_;
    std::vector<ExprPtr> items;
    while (!accept_op("}")) {
      if (!items.empty()) expect_op(",");
      if (accept_op("}")) break;
      items.push_back(parse_expr());
      expect_op(":");
      items.push_back(parse_expr());
    }
    return node(ExprKind::kDict, line, std::move(items));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (accept_op(".")) {
        if (cur().type == Tok::kInt) {
          auto idx = node(ExprKind::kConst, line);
          idx->constant = Value::integer(t_[pos_++].ival);
          e = node(ExprKind::kGetItem, line, {e, idx});
        } else {
          e = node(ExprKind::kGetAttr, line, {e}, expect_name());
        }
      } else if (is_op("[")) {
        e = parse_subscript(e);
      } else if (is_op("(")) {
        e = parse_call(e);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const int line = cur().line;
    ++pos_;
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!is_op("]")) {
      if (accept_op(":")) {
        is_slice = true;
        if (++part > 2) fail("a slice takes at most three parts");
        continue;
      }
      if (parts[part]) fail("expected ':' or ']' in a subscript");
      parts[part] = parse_expr();
    }
    ++pos_;
    if (!is_slice) {
      if (!parts[0]) fail("empty subscript");
      return node(ExprKind::kGetItem, line, {obj, parts[0]});
    }
    return node(ExprKind::kSlice, line, {obj, parts[0], parts[1], parts[2]});
  }

  // `(args)`; fills e->args (after what is already there) and e->kwargs.
  void parse_args(const ExprPtr& e) {
    expect_op("(");
    bool first = true;
    while (!accept_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (accept_op(")")) break;
      if (is_op("*") || is_op("**")) unsupported("`*args` / `**kwargs` in a call");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        std::string key = t_[pos_].text;
        pos_ += 2;
        e->kwargs.emplace_back(std::move(key), parse_expr());
      } else {
        if (!e->kwargs.empty()) fail("a positional argument follows a keyword argument");
        e->args.push_back(parse_expr());
      }
    }
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = node(ExprKind::kCall, cur().line, {callee});
    parse_args(e);
    return e;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++pos_;
        const int line = cur().line;
        std::string name = expect_name();
        while (accept_op("."))
          name += "." + expect_name();
        if (!is_known_filter(name)) unsupported("the filter '" + name + "'", line);
        auto f = node(ExprKind::kFilter, line, {e}, name);
        if (is_op("(")) parse_args(f);
        e = f;
      } else if (is_name("is")) {
        e = parse_test(e);
      } else if (is_op("(")) {
        e = parse_call(e);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_test(ExprPtr e) {
    const int line = cur().line;
    ++pos_;
    const bool negate = accept_name("not");
    std::string name = expect_name();
    while (accept_op("."))
      name += "." + expect_name();
    if (!is_known_test(name)) unsupported("the test '" + name + "'", line);
    auto t = node(ExprKind::kTest, line, {e}, name);
    t->negate = negate;
    if (is_op("(")) {
      parse_args(t);
    } else if ((cur().type == Tok::kName && cur().text != "else" && cur().text != "or" &&
                cur().text != "and") ||
               cur().type == Tok::kString || cur().type == Tok::kInt || cur().type == Tok::kFloat ||
               is_op("[") || is_op("{")) {
      if (is_name("is")) fail("tests cannot be chained with `is`");
      t->args.push_back(parse_postfix(parse_primary()));
    }
    return t;
  }

  std::vector<Token> t_;
  std::string origin_;
  std::size_t pos_ = 0;
  bool has_generation_ = false;
};

}  // namespace

std::shared_ptr<Template> parse_template(const std::string& source, const std::string& origin) {
  return Parser(lex(source, origin), origin).run();
}

}  // namespace accel::llm::detail::jinja

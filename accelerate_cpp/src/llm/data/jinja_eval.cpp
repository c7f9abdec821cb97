#include <algorithm>
#include <cmath>

#include "accel/errors.hpp"
#include "llm/data/jinja_interp.hpp"

namespace accel::llm::detail::jinja {

Interpreter::Interpreter(const Template& tpl, std::shared_ptr<Dict> context) : tpl_(tpl) {
  frames_.push_back(std::move(context));
}

void Interpreter::fail(int line, const std::string& what) const {
  if (line == 0) line = call_line_;
  throw ConfigError("chat template " + tpl_.origin + " line " + std::to_string(line) + ": " + what,
                    tpl_.origin, line);
}

void Interpreter::unsupported(int line, const std::string& what) const {
  fail(line,
       what +
           " is not supported by accel's chat-template interpreter (a Jinja subset); render this template "
           "with transformers, or simplify the template");
}

std::string Interpreter::render(Spans* spans) {
  std::string out;
  main_out_ = &out;
  spans_ = spans;
  exec(tpl_.body, out);
  main_out_ = nullptr;
  return out;
}

Value Interpreter::lookup(const std::string& name) const {
  for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
    if (const Value* v = (*it)->find(name)) return *v;
  }
  return Value::undefined(name);
}

void Interpreter::assign(const std::string& name, Value v) {
  frames_.back()->set(name, std::move(v));
}

Interpreter::Flow Interpreter::exec(const Body& body, std::string& out) {
  for (const auto& n : body) {
    const Flow f = exec_node(*n, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_node(const Node& n, std::string& out) {
  switch (n.kind) {
    case NodeKind::kText:
      out += n.text;
      return Flow::kNormal;
    case NodeKind::kOutput:
      out += py_str(eval(*n.expr));
      return Flow::kNormal;
    case NodeKind::kIf:
      for (const auto& [cond, body] : n.branches) {
        if (!cond || eval(*cond).truthy()) return exec(body, out);
      }
      return Flow::kNormal;
    case NodeKind::kFor:
      return exec_for(n, out);
    case NodeKind::kSet:
      exec_set(n, eval(*n.expr));
      return Flow::kNormal;
    case NodeKind::kSetBlock: {
      std::string captured;
      exec(n.body, captured);
      assign(n.targets[0], Value::string(std::move(captured)));
      return Flow::kNormal;
    }
    case NodeKind::kMacro:
      define_macro(n);
      return Flow::kNormal;
    case NodeKind::kBreak:
      return Flow::kBreak;
    case NodeKind::kContinue:
      return Flow::kContinue;
    case NodeKind::kGeneration: {
      // transformers' AssistantTracker: a call block (its own scope) whose output span is recorded.
      const std::size_t start = out.size();
      frames_.push_back(std::make_shared<Dict>());
      exec(n.body, out);
      frames_.pop_back();
      if (spans_ != nullptr && &out == main_out_) spans_->emplace_back(start, out.size());
      return Flow::kNormal;
    }
  }
  return Flow::kNormal;
}

namespace {

void bind_targets(Interpreter& in, Dict& frame, const std::vector<std::string>& targets, const Value& item,
                  int line) {
  if (targets.size() == 1) {
    frame.set(targets[0], item);
    return;
  }
  if (!item.is_list() || item.items().size() != targets.size()) {
    in.fail(line, "cannot unpack " + item.type_name() + " into " + std::to_string(targets.size()) + " names");
  }
  for (std::size_t i = 0; i < targets.size(); ++i)
    frame.set(targets[i], item.items()[i]);
}

Value loop_object(const List& items, std::size_t i) {
  auto d = std::make_shared<Dict>();
  const auto n = static_cast<int64_t>(items.size());
  const auto k = static_cast<int64_t>(i);
  d->set("index", Value::integer(k + 1));
  d->set("index0", Value::integer(k));
  d->set("revindex", Value::integer(n - k));
  d->set("revindex0", Value::integer(n - k - 1));
  d->set("first", Value::boolean(k == 0));
  d->set("last", Value::boolean(k == n - 1));
  d->set("length", Value::integer(n));
  d->set("depth", Value::integer(1));
  d->set("depth0", Value::integer(0));
  if (k > 0) d->set("previtem", items[i - 1]);
  if (k + 1 < n) d->set("nextitem", items[i + 1]);
  auto cycle = std::make_shared<Callable>();
  cycle->name = "loop.cycle";
  cycle->call = [k](Interpreter& in, List& args, KwArgs&) {
    if (args.empty()) in.fail(0, "loop.cycle() needs at least one value");
    return args[static_cast<std::size_t>(k) % args.size()];
  };
  d->set("cycle", Value::callable(cycle));
  return Value::dict(d);
}

}  // namespace

Interpreter::Flow Interpreter::exec_for(const Node& n, std::string& out) {
  List items = iterate(eval(*n.expr), n.line);
  if (n.filter) {
    List kept;
    for (const auto& item : items) {
      frames_.push_back(std::make_shared<Dict>());
      bind_targets(*this, *frames_.back(), n.targets, item, n.line);
      const bool keep = eval(*n.filter).truthy();
      frames_.pop_back();
      if (keep) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    frames_.push_back(std::make_shared<Dict>());
    exec(n.else_body, out);
    frames_.pop_back();
    return Flow::kNormal;
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    // Each iteration has its own scope: a `set` in the body is gone in the next iteration and after the loop.
    frames_.push_back(std::make_shared<Dict>());
    bind_targets(*this, *frames_.back(), n.targets, items[i], n.line);
    frames_.back()->set("loop", loop_object(items, i));
    const Flow f = exec(n.body, out);
    frames_.pop_back();
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Interpreter::exec_set(const Node& n, const Value& value) {
  if (!n.attr.empty()) {
    const Value ns = lookup(n.targets[0]);
    if (ns.kind() != Value::Kind::kNamespace) {
      fail(n.line,
           "cannot assign attribute '" + n.attr + "' on '" + n.targets[0] + "', which is not a namespace");
    }
    if (!n.attr.empty() && n.attr[0] == '_') {
      fail(n.line, "chat templates cannot store underscore-prefixed attributes on a namespace");
    }
    ns.dict().set(n.attr, value);
    return;
  }
  if (n.targets.size() == 1) {
    assign(n.targets[0], value);
    return;
  }
  Dict tmp;
  bind_targets(*this, tmp, n.targets, value, n.line);
  for (auto& [k, v] : tmp.entries)
    assign(k, v);
}

void Interpreter::define_macro(const Node& n) {
  auto fn = std::make_shared<Callable>();
  fn->name = n.text;
  const Node* node = &n;
  fn->call = [node](Interpreter& in, List& args, KwArgs& kwargs) {
    return in.call_macro(*node, args, kwargs);
  };
  assign(n.text, Value::callable(fn));
}

Value Interpreter::call_macro(const Node& node, List& args, KwArgs& kwargs) {
  const int line = call_line_;
  if (args.size() > node.params.size()) {
    fail(line, "macro '" + node.text + "' takes not more than " + std::to_string(node.params.size()) +
                   " argument(s)");
  }
  auto frame = std::make_shared<Dict>();
  for (std::size_t i = 0; i < node.params.size(); ++i) {
    const auto& [name, def] = node.params[i];
    const auto kw =
        std::find_if(kwargs.begin(), kwargs.end(), [&](const auto& p) { return p.first == name; });
    if (i < args.size()) {
      frame->set(name, args[i]);
    } else if (kw != kwargs.end()) {
      frame->set(name, kw->second);
    } else {
      frame->set(name, def ? eval(*def) : Value::undefined(name));
    }
  }
  for (const auto& [key, value] : kwargs) {
    if (frame->find(key) == nullptr) fail(line, "macro '" + node.text + "' has no argument " + key);
  }
  if (depth_ >= 100) fail(line, "macro '" + node.text + "' recurses too deeply");
  // A macro sees the template's globals and top-level names, not the caller's loop variables.
  std::vector<std::shared_ptr<Dict>> saved = std::move(frames_);
  frames_ = {saved.front(), frame};
  ++depth_;
  std::string out;
  try {
    exec(node.body, out);
  } catch (...) {
    frames_ = std::move(saved);
    --depth_;
    throw;
  }
  frames_ = std::move(saved);
  --depth_;
  return Value::string(std::move(out));
}

Value Interpreter::eval(const Expr& e) {
  switch (e.kind) {
    case ExprKind::kConst:
      return e.constant;
    case ExprKind::kName:
      return lookup(e.name);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      List items;
      for (const auto& a : e.args)
        items.push_back(eval(*a));
      return Value::list(std::move(items), e.kind == ExprKind::kTuple);
    }
    case ExprKind::kDict: {
      auto d = std::make_shared<Dict>();
      for (std::size_t i = 0; i + 1 < e.args.size(); i += 2) {
        const Value key = eval(*e.args[i]);
        if (!key.is_string()) unsupported(e.line, "a dict literal with a non-string key");
        d->set(key.str(), eval(*e.args[i + 1]));
      }
      return Value::dict(d);
    }
    case ExprKind::kGetAttr:
      return getattr(eval(*e.args[0]), e.name, e.line);
    case ExprKind::kGetItem:
      return getitem(eval(*e.args[0]), eval(*e.args[1]), e.line);
    case ExprKind::kSlice:
      return eval_slice(e);
    case ExprKind::kCall:
      return eval_call(e);
    case ExprKind::kFilter: {
      const Value input = eval(*e.args[0]);
      List args;
      for (std::size_t i = 1; i < e.args.size(); ++i)
        args.push_back(eval(*e.args[i]));
      KwArgs kwargs;
      for (const auto& [k, v] : e.kwargs)
        kwargs.emplace_back(k, eval(*v));
      return apply_filter(*this, e.name, input, args, kwargs, e.line);
    }
    case ExprKind::kTest: {
      const Value input = eval(*e.args[0]);
      List args;
      for (std::size_t i = 1; i < e.args.size(); ++i)
        args.push_back(eval(*e.args[i]));
      return Value::boolean(apply_test(*this, e.name, input, args, e.line) != e.negate);
    }
    case ExprKind::kUnary: {
      const Value v = eval(*e.args[0]);
      if (e.name == "not") return Value::boolean(!v.truthy());
      if (!v.is_number()) fail(e.line, "bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
      if (e.name == "+") return v.kind() == Value::Kind::kBool ? Value::integer(v.as_int()) : v;
      return v.kind() == Value::Kind::kFloat ? Value::floating(-v.as_double()) : Value::integer(-v.as_int());
    }
    case ExprKind::kBinary:
      return eval_binary(e);
    case ExprKind::kCond:
      if (eval(*e.args[0]).truthy()) return eval(*e.args[1]);
      return e.args[2] ? eval(*e.args[2]) : Value::undefined();
  }
  return Value::undefined();
}

Value Interpreter::eval_binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and" || op == "or") {
    Value left = eval(*e.args[0]);
    if ((op == "and") != left.truthy()) return left;
    return eval(*e.args[1]);
  }
  const Value a = eval(*e.args[0]);
  const Value b = eval(*e.args[1]);
  if (op == "==") return Value::boolean(equal(a, b));
  if (op == "!=") return Value::boolean(!equal(a, b));
  if (op == "<") return Value::boolean(less_than(*this, a, b, e.line));
  if (op == ">") return Value::boolean(less_than(*this, b, a, e.line));
  if (op == "<=") return Value::boolean(!less_than(*this, b, a, e.line));
  if (op == ">=") return Value::boolean(!less_than(*this, a, b, e.line));
  if (op == "~") return Value::string(py_str(a) + py_str(b));
  if (op == "in" || op == "notin") {
    bool found = false;
    if (b.is_string()) {
      if (!a.is_string()) fail(e.line, "'in <string>' requires string as left operand, not " + a.type_name());
      found = b.str().find(a.str()) != std::string::npos;
    } else if (b.is_dict() || b.kind() == Value::Kind::kNamespace) {
      found = a.is_string() && b.dict().find(a.str()) != nullptr;
    } else {
      for (const auto& item : iterate(b, e.line)) {
        if (equal(a, item)) {
          found = true;
          break;
        }
      }
    }
    return Value::boolean(found == (op == "in"));
  }
  return arithmetic(*this, op, a, b, e.line);
}

Value Interpreter::eval_call(const Expr& e) {
  const Value fn = eval(*e.args[0]);
  List args;
  for (std::size_t i = 1; i < e.args.size(); ++i)
    args.push_back(eval(*e.args[i]));
  KwArgs kwargs;
  for (const auto& [k, v] : e.kwargs)
    kwargs.emplace_back(k, eval(*v));
  return call(fn, args, kwargs, e.line);
}

Value Interpreter::call(const Value& fn, List& args, KwArgs& kwargs, int line) {
  if (fn.kind() == Value::Kind::kCallable) {
    call_line_ = line;
    return fn.fn().call(*this, args, kwargs);
  }
  if (fn.is_undefined()) {
    fail(line, "'" + (fn.undefined_name().empty() ? std::string("value") : fn.undefined_name()) +
                   "' is undefined (called as a function)");
  }
  fail(line, "'" + fn.type_name() + "' object is not callable");
}

namespace {

// Python's slice.indices(): the index sequence of [start:stop:step] over n items.
std::vector<int64_t> slice_indices(Interpreter& in, const Value& start, const Value& stop, const Value& step,
                                   int64_t n, int line) {
  auto as_index = [&](const Value& v, const char* what) {
    if (!v.is_number()) in.fail(line, std::string("slice ") + what + " must be an integer or None");
    return v.as_int();
  };
  const int64_t st = step.is_none() || step.is_undefined() ? 1 : as_index(step, "step");
  if (st == 0) in.fail(line, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t def) {
    if (v.is_none() || v.is_undefined()) return def;
    int64_t i = as_index(v, "index");
    if (i < 0) i += n;
    if (st > 0) return std::min(std::max<int64_t>(i, 0), n);
    return std::min(std::max<int64_t>(i, -1), n - 1);
  };
  const int64_t lo = clamp(start, st > 0 ? 0 : n - 1);
  const int64_t hi = clamp(stop, st > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st)
    out.push_back(i);
  return out;
}

}  // namespace

Value Interpreter::eval_slice(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  const Value start = e.args[1] ? eval(*e.args[1]) : Value::none();
  const Value stop = e.args[2] ? eval(*e.args[2]) : Value::none();
  const Value step = e.args[3] ? eval(*e.args[3]) : Value::none();
  if (obj.is_undefined()) fail(e.line, "'" + obj.undefined_name() + "' is undefined (sliced)");
  if (obj.is_string()) {
    const std::u32string s = utf8_decode(obj.str());
    std::u32string out;
    for (int64_t i : slice_indices(*this, start, stop, step, static_cast<int64_t>(s.size()), e.line)) {
      out += s[static_cast<std::size_t>(i)];
    }
    return Value::string(utf8_encode(out));
  }
  if (obj.is_list()) {
    List out;
    const auto& items = obj.items();
    for (int64_t i : slice_indices(*this, start, stop, step, static_cast<int64_t>(items.size()), e.line)) {
      out.push_back(items[static_cast<std::size_t>(i)]);
    }
    return Value::list(std::move(out), obj.is_tuple());
  }
  return Value::undefined();
}

Value Interpreter::getattr(const Value& obj, const std::string& name, int line) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      fail(line, "'" + (obj.undefined_name().empty() ? std::string("value") : obj.undefined_name()) +
                     "' is undefined (reading ." + name + ")");
    case Value::Kind::kDict: {
      Value m = bound_method(*this, obj, name, line);
      if (!m.is_undefined()) return m;
      if (const Value* v = obj.dict().find(name)) return *v;
      return Value::undefined(name);
    }
    case Value::Kind::kNamespace:
      if (const Value* v = obj.dict().find(name)) return *v;
      return Value::undefined(name);
    case Value::Kind::kString:
    case Value::Kind::kList:
      return bound_method(*this, obj, name, line);
    default:
      return Value::undefined(name);
  }
}

Value Interpreter::getitem(const Value& obj, const Value& key, int line) {
  if (obj.is_undefined()) {
    fail(line, "'" + (obj.undefined_name().empty() ? std::string("value") : obj.undefined_name()) +
                   "' is undefined (indexed with [" + py_repr(key) + "])");
  }
  if ((obj.is_dict() || obj.kind() == Value::Kind::kNamespace) && key.is_string()) {
    if (const Value* v = obj.dict().find(key.str())) return *v;
  }
  if ((obj.is_list() || obj.is_string()) && key.is_number() && key.kind() != Value::Kind::kFloat) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      const auto n = static_cast<int64_t>(obj.items().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.items()[static_cast<std::size_t>(i)];
    } else {
      const std::u32string s = utf8_decode(obj.str());
      const auto n = static_cast<int64_t>(s.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return Value::string(utf8_encode(s.substr(static_cast<std::size_t>(i), 1)));
    }
    return Value::undefined();
  }
  if (key.is_string() && (obj.is_dict() || obj.is_list() || obj.is_string())) {
    return bound_method(*this, obj, key.str(), line);
  }
  return Value::undefined(key.is_string() ? key.str() : std::string());
}

List Interpreter::iterate(const Value& v, int line) const {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      return v.items();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, item] : v.dict().entries)
        keys.push_back(Value::string(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (char32_t c : utf8_decode(v.str()))
        chars.push_back(Value::string(utf8_encode(std::u32string(1, c))));
      return chars;
    }
    default:
      fail(line, "'" + v.type_name() + "' object is not iterable");
  }
}

}  // namespace accel::llm::detail::jinja

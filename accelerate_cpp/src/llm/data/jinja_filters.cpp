// jinja2's filters and tests (the subset chat templates use), transformers' tojson, and the render globals.

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include "llm/data/jinja_interp.hpp"

namespace accel::llm::detail::jinja {
namespace {

Value arg(const List& args, const KwArgs& kwargs, std::size_t index, const char* name,
          Value def = Value::undefined()) {
  if (index < args.size()) return args[index];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return v;
  }
  return def;
}

int64_t py_len(Interpreter& in, const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(utf8_decode(v.str()).size());
    case Value::Kind::kList:
      return static_cast<int64_t>(v.items().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict().entries.size());
    default:
      in.fail(line, "object of type '" + v.type_name() + "' has no len()");
  }
}

// An attribute path "a.b" looked up as jinja2's environment.getitem does (make_attrgetter).
Value attr_path(Interpreter& in, Value v, const std::string& path, int line) {
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    v = digits ? in.getitem(v, Value::integer(std::stoll(part)), line)
               : in.getitem(v, Value::string(part), line);
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value filter_tojson(Interpreter& in, const Value& v, List& a, KwArgs& k, int line) {
  // transformers' override: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  const Value ensure_ascii = arg(a, k, 0, "ensure_ascii", Value::boolean(false));
  const Value indent = arg(a, k, 1, "indent", Value::none());
  const Value separators = arg(a, k, 2, "separators", Value::none());
  const Value sort_keys = arg(a, k, 3, "sort_keys", Value::boolean(false));
  if (ensure_ascii.truthy()) in.unsupported(line, "tojson(ensure_ascii=True)");
  int ind = -1;
  if (indent.is_string()) in.unsupported(line, "tojson(indent=<string>)");
  if (indent.is_number()) ind = static_cast<int>(std::max<int64_t>(indent.as_int(), 0));
  std::string item_sep = ind >= 0 ? "," : ", ";
  std::string key_sep = ": ";
  if (separators.is_list() && separators.items().size() == 2) {
    item_sep = separators.items()[0].str();
    key_sep = separators.items()[1].str();
  }
  try {
    return Value::string(to_json(v, ind, sort_keys.truthy(), item_sep, key_sep));
  } catch (const std::runtime_error& e) {
    in.fail(line, std::string("tojson: ") + e.what());
  }
}

Value filter_default(Interpreter&, const Value& v, List& a, KwArgs& k, int) {
  const Value def = arg(a, k, 0, "default_value", Value::string(""));
  const bool boolean = arg(a, k, 1, "boolean", Value::boolean(false)).truthy();
  if (v.is_undefined() || (boolean && !v.truthy())) return def;
  return v;
}

Value filter_join(Interpreter& in, const Value& v, List& a, KwArgs& k, int line) {
  const Value sep = arg(a, k, 0, "d", Value::string(""));
  const Value attribute = arg(a, k, 1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (Value item : in.iterate(v, line)) {
    if (!attribute.is_none()) item = attr_path(in, item, py_str(attribute), line);
    out += (first ? "" : py_str(sep)) + py_str(item);
    first = false;
  }
  return Value::string(out);
}

Value filter_items(Interpreter& in, const Value& v, List&, KwArgs&, int line) {
  if (v.is_undefined()) return Value::list({});
  if (!v.is_dict()) in.fail(line, "Can only get item pairs from a mapping, not " + v.type_name());
  List out;
  for (const auto& [key, item] : v.dict().entries)
    out.push_back(Value::list({Value::string(key), item}, true));
  return Value::list(std::move(out));
}

Value filter_dictsort(Interpreter& in, const Value& v, List& a, KwArgs& k, int line) {
  const bool case_sensitive = arg(a, k, 0, "case_sensitive", Value::boolean(false)).truthy();
  const std::string by = py_str(arg(a, k, 1, "by", Value::string("key")));
  const bool reverse = arg(a, k, 2, "reverse", Value::boolean(false)).truthy();
  Value items = filter_items(in, v, a, k, line);
  List list = items.items();
  const std::size_t pos = by == "value" ? 1 : 0;
  auto key = [&](const Value& pair) {
    const Value& x = pair.items()[pos];
    if (x.is_string() && !case_sensitive) {
      std::string s = x.str();
      for (char& c : s)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return Value::string(s);
    }
    return x;
  };
  std::stable_sort(list.begin(), list.end(), [&](const Value& x, const Value& y) {
    return reverse ? less_than(in, key(y), key(x), line) : less_than(in, key(x), key(y), line);
  });
  return Value::list(std::move(list));
}

// select / reject / selectattr / rejectattr.
Value filter_select(Interpreter& in, const Value& v, List& a, KwArgs&, int line, bool attr, bool keep) {
  std::size_t next = 0;
  std::string attribute;
  if (attr) {
    if (a.empty()) in.fail(line, "selectattr/rejectattr need an attribute name");
    attribute = py_str(a[next++]);
  }
  std::string test;
  if (next < a.size()) test = py_str(a[next++]);
  List test_args(a.begin() + static_cast<std::ptrdiff_t>(std::min(next, a.size())), a.end());
  List out;
  for (const Value& item : in.iterate(v, line)) {
    const Value x = attr ? attr_path(in, item, attribute, line) : item;
    const bool pass = test.empty() ? x.truthy() : apply_test(in, test, x, test_args, line);
    if (pass == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value filter_map(Interpreter& in, const Value& v, List& a, KwArgs& k, int line) {
  List out;
  const Value attribute = arg({}, k, 0, "attribute");
  if (!attribute.is_undefined()) {
    const Value def = arg({}, k, 0, "default");
    for (const Value& item : in.iterate(v, line)) {
      Value x = attr_path(in, item, py_str(attribute), line);
      out.push_back(x.is_undefined() && !def.is_undefined() ? def : x);
    }
    return Value::list(std::move(out));
  }
  if (a.empty()) in.fail(line, "map() needs a filter name or attribute=");
  const std::string name = py_str(a[0]);
  if (!is_known_filter(name)) in.unsupported(line, "map() with the filter '" + name + "'");
  List rest(a.begin() + 1, a.end());
  for (const Value& item : in.iterate(v, line)) {
    KwArgs none;
    out.push_back(apply_filter(in, name, item, rest, none, line));
  }
  return Value::list(std::move(out));
}

Value filter_indent(Interpreter& in, const Value& v, List& a, KwArgs& k, int line) {
  const Value width = arg(a, k, 0, "width", Value::integer(4));
  const bool first = arg(a, k, 1, "first", Value::boolean(false)).truthy();
  const bool blank = arg(a, k, 2, "blank", Value::boolean(false)).truthy();
  const std::string ind =
      width.is_string() ? width.str() : std::string(static_cast<std::size_t>(width.as_int()), ' ');
  const std::string s = py_str(v) + "\n";
  for (char c : s) {
    if (c == '\r' || c == '\v' || c == '\f') in.unsupported(line, "indent() of text with \\r, \\v or \\f");
  }
  std::vector<std::string> lines;
  std::size_t start = 0;
  for (std::size_t at = s.find('\n'); at != std::string::npos; at = s.find('\n', start)) {
    lines.push_back(s.substr(start, at - start));
    start = at + 1;
  }
  std::string rv = lines.front();
  for (std::size_t i = 1; i < lines.size(); ++i) {
    rv += "\n" + ((blank || !lines[i].empty()) ? ind : std::string()) + lines[i];
  }
  return Value::string(first ? ind + rv : rv);
}

Value filter_escape(const Value& v) {
  if (v.is_undefined()) return Value::string("");
  std::string out;
  for (char c : py_str(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return Value::string(out);
}

Value filter_sort(Interpreter& in, const Value& v, List& a, KwArgs& k, int line, bool unique) {
  // sort(reverse=False, case_sensitive=False, attribute=None); unique(case_sensitive=False, attribute=None).
  const bool reverse = unique ? false : arg(a, k, 0, "reverse", Value::boolean(false)).truthy();
  const bool case_sensitive = arg(a, k, unique ? 0 : 1, "case_sensitive", Value::boolean(false)).truthy();
  const Value attribute = arg(a, k, unique ? 1 : 2, "attribute", Value::none());
  List items = in.iterate(v, line);
  auto key = [&](const Value& x) {
    Value kx = attribute.is_none() ? x : attr_path(in, x, py_str(attribute), line);
    if (!kx.is_string() || case_sensitive) return kx;
    std::string s = kx.str();
    for (char& c : s) {
      if (static_cast<unsigned char>(c) >= 0x80)
        in.unsupported(line, "case-insensitive sort/unique of non-ASCII text");
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    return Value::string(s);
  };
  if (unique) {
    List out;
    List seen;
    for (const auto& x : items) {
      const Value kx = key(x);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& y) { return equal(kx, y); })) {
        seen.push_back(kx);
        out.push_back(x);
      }
    }
    return Value::list(std::move(out));
  }
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? less_than(in, key(y), key(x), line) : less_than(in, key(x), key(y), line);
  });
  return Value::list(std::move(items));
}

Value to_number(Interpreter& in, const Value& v, const Value& def, bool integer, int line) {
  if (v.is_number()) return integer ? Value::integer(v.as_int()) : Value::floating(v.as_double());
  if (v.is_string()) {
    const std::string s = v.str();
    char* end = nullptr;
    if (integer) {
      const long long i = std::strtoll(s.c_str(), &end, 10);
      if (end != s.c_str() && *end == '\0') return Value::integer(i);
    } else {
      const double d = std::strtod(s.c_str(), &end);
      if (end != s.c_str() && *end == '\0') return Value::floating(d);
    }
  }
  return def;
}

Value filter_misc(Interpreter& in, const std::string& name, const Value& v, List& a, KwArgs& k, int line) {
  if (name == "abs") {
    if (!v.is_number()) in.fail(line, "bad operand type for abs(): '" + v.type_name() + "'");
    return v.kind() == Value::Kind::kFloat ? Value::floating(std::fabs(v.as_double()))
                                           : Value::integer(std::llabs(v.as_int()));
  }
  if (name == "int") return to_number(in, v, arg(a, k, 0, "default", Value::integer(0)), true, line);
  if (name == "float") return to_number(in, v, arg(a, k, 0, "default", Value::floating(0)), false, line);
  if (name == "round") {
    const int64_t precision = arg(a, k, 0, "precision", Value::integer(0)).as_int();
    const std::string method = py_str(arg(a, k, 1, "method", Value::string("common")));
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = v.as_double() * scale;
    const double r = method == "ceil"    ? std::ceil(x)
                     : method == "floor" ? std::floor(x)
                                         : std::nearbyint(x);  // Python's round: half to even
    return Value::floating(r / scale);
  }
  if (name == "sum") {
    const Value attribute = arg(a, k, 0, "attribute", Value::none());
    Value total = arg(a, k, 1, "start", Value::integer(0));
    for (const auto& x : in.iterate(v, line)) {
      total = arithmetic(in, "+", total, attribute.is_none() ? x : attr_path(in, x, py_str(attribute), line),
                         line);
    }
    return total;
  }
  if (name == "min" || name == "max") {
    List items = in.iterate(v, line);
    if (items.empty()) return Value::undefined();
    Value best = items[0];
    for (const auto& x : items) {
      if (name == "min" ? less_than(in, x, best, line) : less_than(in, best, x, line)) best = x;
    }
    return best;
  }
  if (name == "attr") return bound_method(in, v, py_str(arg(a, k, 0, "name")), line);
  in.unsupported(line, "the filter '" + name + "'");
}

}  // namespace

bool is_known_filter(const std::string& name) {
  static const std::set<std::string> kFilters = {
      "abs",     "attr",    "capitalize", "count",  "d",      "default",    "dictsort", "e",
      "escape",  "first",   "float",      "indent", "int",    "items",      "join",     "last",
      "length",  "list",    "lower",      "map",    "max",    "min",        "reject",   "rejectattr",
      "replace", "reverse", "round",      "safe",   "select", "selectattr", "sort",     "string",
      "sum",     "title",   "tojson",     "trim",   "unique", "upper"};
  return kFilters.count(name) > 0;
}

bool is_known_test(const std::string& name) {
  static const std::set<std::string> kTests = {
      "boolean", "callable", "defined",  "divisibleby", "eq",          "equalto",   "escaped", "even",
      "false",   "float",    "ge",       "gt",          "greaterthan", "in",        "integer", "iterable",
      "le",      "lessthan", "lower",    "lt",          "mapping",     "ne",        "none",    "number",
      "odd",     "sameas",   "sequence", "string",      "true",        "undefined", "upper",   "==",
      "!=",      "<",        "<=",       ">",           ">="};
  return kTests.count(name) > 0;
}

Value apply_filter(Interpreter& in, const std::string& name, const Value& v, List& a, KwArgs& k, int line) {
  if (name == "tojson") return filter_tojson(in, v, a, k, line);
  if (name == "default" || name == "d") return filter_default(in, v, a, k, line);
  if (name == "trim") return bound_method(in, Value::string(py_str(v)), "strip", line).fn().call(in, a, k);
  if (name == "length" || name == "count") return Value::integer(py_len(in, v, line));
  if (name == "string") return Value::string(py_str(v));
  if (name == "safe") return v.is_string() ? v : Value::string(py_str(v));
  if (name == "e" || name == "escape") return filter_escape(v);
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    List none;
    KwArgs no_kw;
    return bound_method(in, Value::string(py_str(v)), name, line).fn().call(in, none, no_kw);
  }
  if (name == "replace") {
    List args = {Value::string(py_str(arg(a, k, 0, "old"))), Value::string(py_str(arg(a, k, 1, "new"))),
                 arg(a, k, 2, "count", Value::integer(-1))};
    KwArgs none;
    if (args[2].is_none()) args[2] = Value::integer(-1);
    return bound_method(in, Value::string(py_str(v)), "replace", line).fn().call(in, args, none);
  }
  if (name == "join") return filter_join(in, v, a, k, line);
  if (name == "items") return filter_items(in, v, a, k, line);
  if (name == "dictsort") return filter_dictsort(in, v, a, k, line);
  if (name == "list") return Value::list(in.iterate(v, line));
  if (name == "first" || name == "last") {
    List items = in.iterate(v, line);
    if (items.empty()) return Value::undefined();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string s = utf8_decode(v.str());
      std::reverse(s.begin(), s.end());
      return Value::string(utf8_encode(s));
    }
    List items = in.iterate(v, line);
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (name == "select" || name == "reject") return filter_select(in, v, a, k, line, false, name == "select");
  if (name == "selectattr" || name == "rejectattr") {
    return filter_select(in, v, a, k, line, true, name == "selectattr");
  }
  if (name == "map") return filter_map(in, v, a, k, line);
  if (name == "indent") return filter_indent(in, v, a, k, line);
  if (name == "sort" || name == "unique") return filter_sort(in, v, a, k, line, name == "unique");
  return filter_misc(in, name, v, a, k, line);
}

bool apply_test(Interpreter& in, const std::string& name, const Value& v, List& a, int line) {
  using K = Value::Kind;
  const Value other = a.empty() ? Value::undefined() : a[0];
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "sequence") return v.is_string() || v.is_list() || v.is_dict();
  if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind() == K::kInt;
  if (name == "float") return v.kind() == K::kFloat;
  if (name == "boolean") return v.kind() == K::kBool;
  if (name == "true") return v.kind() == K::kBool && v.as_bool();
  if (name == "false") return v.kind() == K::kBool && !v.as_bool();
  if (name == "callable") return v.kind() == K::kCallable;
  if (name == "escaped") return false;
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, other);
  if (name == "ne" || name == "!=") return !equal(v, other);
  if (name == "lt" || name == "lessthan" || name == "<") return less_than(in, v, other, line);
  if (name == "gt" || name == "greaterthan" || name == ">") return less_than(in, other, v, line);
  if (name == "le" || name == "<=") return !less_than(in, other, v, line);
  if (name == "ge" || name == ">=") return !less_than(in, v, other, line);
  if (name == "in") {
    if (other.is_string()) return v.is_string() && other.str().find(v.str()) != std::string::npos;
    if (other.is_dict()) return v.is_string() && other.dict().find(v.str()) != nullptr;
    const List items = in.iterate(other, line);
    return std::any_of(items.begin(), items.end(), [&](const Value& x) { return equal(v, x); });
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (!v.is_number()) in.fail(line, "the test '" + name + "' needs a number, got " + v.type_name());
    const int64_t d = name == "divisibleby" ? other.as_int() : 2;
    if (d == 0) in.fail(line, "division by zero");
    const int64_t r = ((v.as_int() % d) + d) % d;
    return name == "odd" ? r == 1 : r == 0;
  }
  if (name == "lower" || name == "upper") {
    const std::string s = py_str(v);
    bool cased = false;
    for (unsigned char c : s) {
      if (c >= 0x80) in.unsupported(line, "the test '" + name + "' on non-ASCII text");
      if (std::isalpha(c)) {
        cased = true;
        if ((name == "lower") != (std::islower(c) != 0)) return false;
      }
    }
    return cased;
  }
  if (name == "sameas") {
    if (v.kind() != other.kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.kind() == K::kBool) return v.as_bool() == other.as_bool();
    if (v.is_list()) return v.list_ptr() == other.list_ptr();
    if (v.is_dict() || v.kind() == K::kNamespace) return v.dict_ptr() == other.dict_ptr();
    in.unsupported(line, "the test 'sameas' on " + v.type_name() + " values");
  }
  in.unsupported(line, "the test '" + name + "'");
}

void install_globals(Dict& globals) {
  auto add = [&](const std::string& name, std::function<Value(Interpreter&, List&, KwArgs&)> fn) {
    auto c = std::make_shared<Callable>();
    c->name = name;
    c->call = std::move(fn);
    globals.set(name, Value::callable(c));
  };
  add("namespace", [](Interpreter& in, List& a, KwArgs& k) {
    auto d = std::make_shared<Dict>();
    for (const auto& x : a) {
      if (!x.is_dict()) in.fail(0, "namespace() takes keyword arguments or a dict");
      for (const auto& [key, v] : x.dict().entries)
        d->set(key, v);
    }
    for (const auto& [key, v] : k)
      d->set(key, v);
    for (const auto& [key, v] : d->entries) {
      if (!key.empty() && key[0] == '_') {
        in.fail(0, "chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                       key + "'");
      }
    }
    return Value::namespace_(d);
  });
  add("raise_exception", [](Interpreter& in, List& a, KwArgs&) -> Value {
    in.fail(0, "the template raised an exception: " + (a.empty() ? std::string() : py_str(a[0])));
  });
  add("strftime_now", [](Interpreter& in, List& a, KwArgs&) {
    if (a.empty() || !a[0].is_string()) in.fail(0, "strftime_now() needs a format string");
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const std::size_t n = std::strftime(buf, sizeof buf, a[0].str().c_str(), &local);
    return Value::string(std::string(buf, n));
  });
  add("range", [](Interpreter& in, List& a, KwArgs&) {
    if (a.empty() || a.size() > 3) in.fail(0, "range() takes 1 to 3 arguments");
    const int64_t start = a.size() == 1 ? 0 : a[0].as_int();
    const int64_t stop = a.size() == 1 ? a[0].as_int() : a[1].as_int();
    const int64_t step = a.size() == 3 ? a[2].as_int() : 1;
    if (step == 0) in.fail(0, "range() arg 3 must not be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      out.push_back(Value::integer(i));
      if (out.size() > 100000) in.fail(0, "range() is too long for a chat template");
    }
    return Value::list(std::move(out));
  });
  add("dict", [](Interpreter& in, List& a, KwArgs& k) {
    auto d = std::make_shared<Dict>();
    for (const auto& x : a) {
      if (!x.is_dict()) in.unsupported(0, "dict() of a non-dict");
      for (const auto& [key, v] : x.dict().entries)
        d->set(key, v);
    }
    for (const auto& [key, v] : k)
      d->set(key, v);
    return Value::dict(d);
  });
}

}  // namespace accel::llm::detail::jinja

// Filters, tests, methods and globals of the chat-template interpreter: jinja2's builtins and transformers'
// additions (tojson without HTML escaping, raise_exception, strftime_now, namespace), with Python semantics.

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <set>

#include "llm/data/jinja_interp.hpp"

namespace accel::llm::detail::jinja {
namespace {

using FilterFn = Value (*)(Interpreter&, const Value&, List&, KwArgs&, int);
using TestFn = bool (*)(Interpreter&, const Value&, List&, int);

// Positional or keyword argument `index`/`name`, else `def`.
Value arg(const List& args, const KwArgs& kwargs, std::size_t index, const char* name,
          Value def = Value::undefined()) {
  if (index < args.size()) return args[index];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return v;
  }
  return def;
}

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  const std::u32string u = utf8_decode(s);
  const std::u32string set = chars.is_string() ? utf8_decode(chars.str()) : std::u32string();
  auto strip = [&](char32_t c) {
    return chars.is_string() ? set.find(c) != std::u32string::npos : py_isspace(c);
  };
  std::size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip(u[b]))
      ++b;
  }
  if (right) {
    while (e > b && strip(u[e - 1]))
      --e;
  }
  return utf8_encode(u.substr(b, e - b));
}

std::string ascii_case(std::string s, bool upper) {
  for (char& c : s) {
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  }
  return s;
}

// Case mapping beyond ASCII is refused rather than done wrong (Python maps all of Unicode).
std::string change_case(Interpreter& in, const std::string& s, bool upper, int line) {
  for (unsigned char c : s) {
    if (c >= 0x80) in.unsupported(line, "upper/lower/title/capitalize of non-ASCII text");
  }
  return ascii_case(s, upper);
}

std::string capitalize(Interpreter& in, const std::string& s, int line) {
  std::string out = change_case(in, s, false, line);
  if (!out.empty()) out[0] = ascii_case(out.substr(0, 1), true)[0];
  return out;
}

std::string title(Interpreter& in, const std::string& s, int line) {
  std::string out = change_case(in, s, false, line);
  bool start = true;
  for (char& c : out) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
    if (alpha && start) c = ascii_case(std::string(1, c), true)[0];
    start = !alpha;
  }
  return out;
}

List split(Interpreter& in, const std::string& s, const Value& sep, int64_t maxsplit, int line) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    const std::u32string u = utf8_decode(s);
    std::size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && py_isspace(u[i]))
        ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        std::size_t e = u.size();
        while (e > i && py_isspace(u[e - 1]))
          --e;
        out.push_back(Value::string(utf8_encode(u.substr(i, e - i))));
        break;
      }
      std::size_t j = i;
      while (j < u.size() && !py_isspace(u[j]))
        ++j;
      out.push_back(Value::string(utf8_encode(u.substr(i, j - i))));
      i = j;
    }
    return out;
  }
  if (!sep.is_string()) in.fail(line, "split() separator must be a string");
  if (sep.str().empty()) in.fail(line, "empty separator");
  std::size_t start = 0;
  while (true) {
    const std::size_t at = s.find(sep.str(), start);
    if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) break;
    out.push_back(Value::string(s.substr(start, at - start)));
    start = at + sep.str().size();
  }
  out.push_back(Value::string(s.substr(start)));
  return out;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) {
    std::string out;
    int64_t n = 0;
    for (char32_t c : utf8_decode(s)) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      out += utf8_encode(std::u32string(1, c));
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  std::string out;
  std::size_t start = 0;
  int64_t n = 0;
  for (std::size_t at = s.find(from); at != std::string::npos && (count < 0 || n < count);
       at = s.find(from, start), ++n) {
    out += s.substr(start, at - start) + to;
    start = at + from.size();
  }
  return out + s.substr(start);
}

bool affix(const std::string& s, const Value& what, bool prefix) {
  auto one = [&](const std::string& a) {
    if (a.size() > s.size()) return false;
    return prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0;
  };
  if (what.is_list()) {
    return std::any_of(what.items().begin(), what.items().end(),
                       [&](const Value& v) { return one(v.str()); });
  }
  return one(what.str());
}

Value make_method(const std::string& name, std::function<Value(Interpreter&, List&, KwArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = name;
  c->call = std::move(fn);
  return Value::callable(c);
}

Value string_method(Interpreter& in, const std::string& s, const std::string& name, int line) {
  using F = std::function<Value(Interpreter&, List&, KwArgs&)>;
  static const std::set<std::string> kStrip = {"strip", "lstrip", "rstrip"};
  F f;
  if (kStrip.count(name)) {
    f = [s, name](Interpreter&, List& a, KwArgs& k) {
      return Value::string(strip_chars(s, arg(a, k, 0, "chars"), name != "rstrip", name != "lstrip"));
    };
  } else if (name == "startswith" || name == "endswith") {
    f = [s, name](Interpreter& i, List& a, KwArgs& k) {
      const Value w = arg(a, k, 0, "prefix");
      if (!w.is_string() && !w.is_list()) i.fail(0, name + "() argument must be str or a tuple of str");
      return Value::boolean(affix(s, w, name == "startswith"));
    };
  } else if (name == "split" || name == "rsplit") {
    if (name == "rsplit") in.unsupported(line, "str.rsplit()");
    f = [s, line](Interpreter& i, List& a, KwArgs& k) {
      const Value m = arg(a, k, 1, "maxsplit", Value::integer(-1));
      return Value::list(split(i, s, arg(a, k, 0, "sep", Value::none()), m.as_int(), line));
    };
  } else if (name == "replace") {
    f = [s](Interpreter& i, List& a, KwArgs& k) {
      const Value from = arg(a, k, 0, "old"), to = arg(a, k, 1, "new");
      if (!from.is_string() || !to.is_string()) i.fail(0, "replace() arguments must be strings");
      return Value::string(
          replace(s, from.str(), to.str(), arg(a, k, 2, "count", Value::integer(-1)).as_int()));
    };
  } else if (name == "upper" || name == "lower") {
    f = [s, name, line](Interpreter& i, List&, KwArgs&) {
      return Value::string(change_case(i, s, name == "upper", line));
    };
  } else if (name == "title" || name == "capitalize") {
    f = [s, name, line](Interpreter& i, List&, KwArgs&) {
      return Value::string(name == "title" ? title(i, s, line) : capitalize(i, s, line));
    };
  } else if (name == "join") {
    f = [s](Interpreter& i, List& a, KwArgs&) {
      std::string out;
      bool first = true;
      for (const auto& v : i.iterate(a.empty() ? Value() : a[0], 0)) {
        if (!v.is_string()) i.fail(0, "str.join() expects strings, got " + v.type_name());
        out += (first ? "" : s) + v.str();
        first = false;
      }
      return Value::string(out);
    };
  } else if (name == "find" || name == "count") {
    f = [s, name](Interpreter& i, List& a, KwArgs&) {
      if (a.size() != 1 || !a[0].is_string()) i.unsupported(0, "str." + name + "() with start/end arguments");
      if (name == "count") return Value::integer(static_cast<int64_t>(split(i, s, a[0], -1, 0).size()) - 1);
      const std::size_t at = s.find(a[0].str());
      return Value::integer(
          at == std::string::npos ? -1 : static_cast<int64_t>(utf8_decode(s.substr(0, at)).size()));
    };
  } else {
    static const std::set<std::string> kPython = {
        "casefold",   "center",       "encode",       "expandtabs", "format",    "format_map",
        "index",      "isalnum",      "isalpha",      "isascii",    "isdecimal", "isdigit",
        "islower",    "isnumeric",    "isspace",      "istitle",    "isupper",   "ljust",
        "partition",  "removeprefix", "removesuffix", "rfind",      "rindex",    "rjust",
        "rpartition", "splitlines",   "swapcase",     "translate",  "zfill"};
    if (kPython.count(name)) in.unsupported(line, "str." + name + "()");
    return Value::undefined(name);
  }
  return make_method("str." + name, std::move(f));
}

Value dict_method(Interpreter& in, const Value& obj, const std::string& name, int line) {
  if (name == "items" || name == "keys" || name == "values") {
    return make_method("dict." + name, [obj, name](Interpreter&, List&, KwArgs&) {
      List out;
      for (const auto& [k, v] : obj.dict().entries) {
        if (name == "items") out.push_back(Value::list({Value::string(k), v}, true));
        if (name == "keys") out.push_back(Value::string(k));
        if (name == "values") out.push_back(v);
      }
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return make_method("dict.get", [obj](Interpreter&, List& a, KwArgs& k) {
      const Value key = arg(a, k, 0, "key");
      const Value* v = key.is_string() ? obj.dict().find(key.str()) : nullptr;
      return v != nullptr ? *v : arg(a, k, 1, "default", Value::none());
    });
  }
  static const std::set<std::string> kMutating = {"clear", "pop", "popitem", "setdefault", "update"};
  if (kMutating.count(name))
    in.fail(line, "dict." + name + "() is not allowed: chat templates are sandboxed");
  if (name == "copy" || name == "fromkeys") in.unsupported(line, "dict." + name + "()");
  return Value::undefined(name);
}

}  // namespace

Value bound_method(Interpreter& in, const Value& obj, const std::string& name, int line) {
  if (obj.is_string()) return string_method(in, obj.str(), name, line);
  if (obj.is_dict()) return dict_method(in, obj, name, line);
  if (obj.is_list()) {
    static const std::set<std::string> kMutating = {"append", "clear",  "extend",  "insert",
                                                    "pop",    "remove", "reverse", "sort"};
    if (kMutating.count(name))
      in.fail(line, "list." + name + "() is not allowed: chat templates are sandboxed");
    if (name == "count" || name == "index" || name == "copy") in.unsupported(line, "list." + name + "()");
  }
  return Value::undefined(name);
}

// ---- arithmetic and ordering ----

Value arithmetic(Interpreter& in, const std::string& op, const Value& a, const Value& b, int line) {
  auto type_error = [&]() -> Value {
    in.fail(line, "unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
  };
  if (a.is_number() && b.is_number()) {
    const bool flt = a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat;
    if ((op == "/" || op == "//" || op == "%") && b.as_double() == 0) in.fail(line, "division by zero");
    if (op == "/") return Value::floating(a.as_double() / b.as_double());
    if (flt) {
      const double x = a.as_double(), y = b.as_double();
      if (op == "+") return Value::floating(x + y);
      if (op == "-") return Value::floating(x - y);
      if (op == "*") return Value::floating(x * y);
      if (op == "//") return Value::floating(std::floor(x / y));
      if (op == "%") return Value::floating(x - y * std::floor(x / y));
      if (op == "**") return Value::floating(std::pow(x, y));
    } else {
      const int64_t x = a.as_int(), y = b.as_int();
      if (op == "+") return Value::integer(x + y);
      if (op == "-") return Value::integer(x - y);
      if (op == "*") return Value::integer(x * y);
      const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);
      if (op == "//") return Value::integer(q);
      if (op == "%") return Value::integer(x - y * q);
      if (op == "**") {
        if (y < 0) return Value::floating(std::pow(static_cast<double>(x), static_cast<double>(y)));
        int64_t r = 1;
        for (int64_t i = 0; i < y; ++i)
          r *= x;
        return Value::integer(r);
      }
    }
    return type_error();
  }
  if (op == "+" && a.is_string() && b.is_string()) return Value::string(a.str() + b.str());
  if (op == "+" && a.is_list() && b.is_list()) {
    List out = a.items();
    out.insert(out.end(), b.items().begin(), b.items().end());
    return Value::list(std::move(out), a.is_tuple());
  }
  if (op == "*" && (a.is_string() || a.is_list()) && b.is_number() && b.kind() != Value::Kind::kFloat) {
    if (a.is_string()) {
      std::string out;
      for (int64_t i = 0; i < b.as_int(); ++i)
        out += a.str();
      return Value::string(out);
    }
    List out;
    for (int64_t i = 0; i < b.as_int(); ++i)
      out.insert(out.end(), a.items().begin(), a.items().end());
    return Value::list(std::move(out));
  }
  if (op == "%" && a.is_string()) in.unsupported(line, "printf-style string formatting (`str % value`)");
  if (a.is_undefined() || b.is_undefined()) {
    const Value& u = a.is_undefined() ? a : b;
    in.fail(line, "'" + (u.undefined_name().empty() ? std::string("value") : u.undefined_name()) +
                      "' is undefined (used with " + op + ")");
  }
  return type_error();
}

bool less_than(Interpreter& in, const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 order is code point order
  if (a.is_list() && b.is_list()) {
    const auto& x = a.items();
    const auto& y = b.items();
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equal(x[i], y[i])) return less_than(in, x[i], y[i], line);
    }
    return x.size() < y.size();
  }
  in.fail(line, "'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

}  // namespace accel::llm::detail::jinja

#pragma once
// The values a chat template computes with (private to the data room). They follow Python's semantics, since
// transformers renders templates with jinja2 on Python objects: dicts keep insertion order, `str()` of a list
// is Python's repr, 1 == 1.0 == True, strings index by code point.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::llm::detail::jinja {

class Value;
struct Dict;
struct Callable;
using List = std::vector<Value>;
using KwArgs = std::vector<std::pair<std::string, Value>>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };

  Value() = default;  // undefined
  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value floating(double f);
  static Value string(std::string s);
  static Value list(List items, bool tuple = false);
  static Value dict(std::shared_ptr<Dict> d);
  static Value empty_dict();
  static Value namespace_(std::shared_ptr<Dict> d);
  static Value callable(std::shared_ptr<Callable> c);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_tuple() const { return tuple_; }

  bool as_bool() const { return b_; }
  int64_t as_int() const;  // bool and int
  double as_double() const;
  const std::string& str() const { return s_; }
  const List& items() const { return *list_; }
  const std::shared_ptr<List>& list_ptr() const { return list_; }
  Dict& dict() const { return *dict_; }
  const std::shared_ptr<Dict>& dict_ptr() const { return dict_; }
  Callable& fn() const { return *fn_; }
  const std::string& undefined_name() const { return s_; }

  bool truthy() const;
  std::string type_name() const;  // Python's name: 'str', 'list', 'dict', 'NoneType' ...

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
};

/// An insertion-ordered str -> Value map (a Python dict with string keys, or a jinja namespace).
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

class Interpreter;
/// A builtin function, a bound method or a macro.
struct Callable {
  std::string name;
  std::function<Value(Interpreter&, List&, KwArgs&)> call;
};

/// Python's str(v) (what `{{ v }}` prints): None -> "None", lists in repr form, undefined -> "".
std::string py_str(const Value& v);
/// Python's repr(v).
std::string py_repr(const Value& v);
/// Python's repr of a float ("1.0", "0.1", "1e+20").
std::string py_float(double f);
/// json.dumps(v, ensure_ascii=False, indent=indent (<0: none), sort_keys) with Python's default separators.
std::string to_json(const Value& v, int indent, bool sort_keys, const std::string& item_sep,
                    const std::string& key_sep);
/// Python ==.
bool equal(const Value& a, const Value& b);

// UTF-8 helpers: Python indexes strings by code point.
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);
bool py_isspace(char32_t c);

}  // namespace accel::llm::detail::jinja

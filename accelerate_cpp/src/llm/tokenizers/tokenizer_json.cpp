// tokenizer.json and tokenizer_config.json -> pipeline stages. Every stage type the reader does not know, and
// every option it cannot honour exactly, is a ConfigError naming the file and the JSON path.
#include "llm/tokenizers/tokenizer_json.hpp"

#include <accel/errors.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace accel::llm::detail {
namespace {

using nlohmann::json;

std::string join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw ConfigError(file_ + ": " + key + ": " + problem, file_, 0, key);
  }
  [[noreturn]] void unsupported(const std::string& key, const json& value,
                                const std::string& supported) const {
    fail(key, "unsupported " +
                  (value.is_string() ? "value \"" + value.get<std::string>() + "\"" : value.dump()) +
                  " (accelerate-cpp reads " + supported +
                  "); a tokenizer it cannot reproduce exactly is refused rather than approximated");
  }
  const json& need(const json& obj, const std::string& key, const std::string& path) const {
    if (!obj.is_object() || !obj.contains(key)) fail(join(path, key), "missing (required)");
    return obj.at(key);
  }
  std::string str(const json& obj, const std::string& key, const std::string& path) const {
    const json& v = need(obj, key, path);
    if (!v.is_string()) fail(join(path, key), "expected a string, found " + v.dump());
    return v.get<std::string>();
  }
  std::optional<std::string> opt_str(const json& obj, const std::string& key, const std::string& path) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return std::nullopt;
    return str(obj, key, path);
  }
  bool flag(const json& obj, const std::string& key, const std::string& path, bool fallback) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    const json& v = obj.at(key);
    if (!v.is_boolean()) fail(join(path, key), "expected true or false, found " + v.dump());
    return v.get<bool>();
  }
  std::string type_of(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path, "expected an object with a \"type\", found " + obj.dump().substr(0, 80));
    return str(obj, "type", path);
  }

  std::unique_ptr<Normalizer> normalizer(const json& j, const std::string& path) const;
  std::unique_ptr<PreTokenizer> pre_tokenizer(const json& j, const std::string& path) const;
  std::unique_ptr<Decoder> decoder(const json& j, const std::string& path) const;
  PostProcessor post_processor(const json& j, const std::string& path) const;
  std::unique_ptr<BpeModel> model(const json& j, const std::string& path) const;
  std::vector<AddedToken> added_tokens(const json& j, const std::string& path) const;
  AddedToken added_token(const json& j, const std::string& path) const;
  Regex regex(const std::string& pattern, const std::string& path) const {
    try {
      return Regex(pattern);
    } catch (const std::invalid_argument& e) {
      fail(path, "the regex \"" + pattern + "\" does not compile: " + e.what());
    }
  }
  // {"String": s} or {"Regex": r}: literal (with `literal` set) or compiled regex.
  std::optional<Regex> pattern(const json& j, const std::string& path, std::string& literal) const {
    if (j.is_object() && j.contains("String") && j.at("String").is_string()) {
      literal = j.at("String").get<std::string>();
      if (literal.empty()) fail(path + ".String", "an empty pattern is not supported");
      return std::nullopt;
    }
    if (j.is_object() && j.contains("Regex") && j.at("Regex").is_string())
      return regex(j.at("Regex").get<std::string>(), path + ".Regex");
    fail(path, "expected {\"String\": ...} or {\"Regex\": ...}, found " + j.dump());
  }
  PrependScheme prepend_scheme(const json& j, const std::string& path) const;

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

std::unique_ptr<Normalizer> Reader::normalizer(const json& j, const std::string& path) const {
  const std::string type = type_of(j, path);
  if (type == "NFC") return make_unicode_normalizer(UnicodeForm::kNfc);
  if (type == "NFKC") return make_unicode_normalizer(UnicodeForm::kNfkc);
  if (type == "NFD") return make_unicode_normalizer(UnicodeForm::kNfd);
  if (type == "NFKD") return make_unicode_normalizer(UnicodeForm::kNfkd);
  if (type == "Prepend") return make_prepend_normalizer(str(j, "prepend", path));
  if (type == "Replace") {
    std::string literal;
    auto re = pattern(need(j, "pattern", path), path + ".pattern", literal);
    std::string content = str(j, "content", path);
    return re ? make_replace_normalizer(std::move(*re), std::move(content))
              : make_replace_normalizer(std::move(literal), std::move(content));
  }
  if (type == "Sequence") {
    const json& list = need(j, "normalizers", path);
    if (!list.is_array()) fail(path + ".normalizers", "expected an array");
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (std::size_t i = 0; i < list.size(); ++i)
      parts.push_back(normalizer(list[i], path + ".normalizers[" + std::to_string(i) + "]"));
    return make_sequence_normalizer(std::move(parts));
  }
  unsupported(path + ".type", j.at("type"), "normalizers NFC, NFKC, NFD, NFKD, Prepend, Replace, Sequence");
}

PrependScheme Reader::prepend_scheme(const json& j, const std::string& path) const {
  if (j.contains("prepend_scheme")) {
    const std::string s = str(j, "prepend_scheme", path);
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    unsupported(path + ".prepend_scheme", j.at("prepend_scheme"), "always, first, never");
  }
  // Files written before prepend_scheme existed: add_prefix_space true means "always".
  return flag(j, "add_prefix_space", path, true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

SplitBehavior split_behavior(const Reader& r, const json& j, const std::string& path) {
  const std::string s = r.str(j, "behavior", path);
  if (s == "Removed") return SplitBehavior::kRemoved;
  if (s == "Isolated") return SplitBehavior::kIsolated;
  if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (s == "Contiguous") return SplitBehavior::kContiguous;
  r.unsupported(path + ".behavior", j.at("behavior"),
                "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

std::unique_ptr<PreTokenizer> Reader::pre_tokenizer(const json& j, const std::string& path) const {
  const std::string type = type_of(j, path);
  if (type == "ByteLevel")
    return make_byte_level_pre_tokenizer(flag(j, "add_prefix_space", path, true),
                                         flag(j, "use_regex", path, true));
  if (type == "Split") {
    std::string literal;
    auto re = pattern(need(j, "pattern", path), path + ".pattern", literal);
    Regex compiled = re ? std::move(*re) : Regex::literal(literal);
    return make_split_pre_tokenizer(std::move(compiled), split_behavior(*this, j, path),
                                    flag(j, "invert", path, false));
  }
  if (type == "Metaspace") {
    std::string replacement = str(j, "replacement", path);
    return make_metaspace_pre_tokenizer(std::move(replacement), prepend_scheme(j, path),
                                        flag(j, "split", path, true));
  }
  if (type == "Digits") return make_digits_pre_tokenizer(flag(j, "individual_digits", path, false));
  if (type == "Sequence") {
    const json& list = need(j, "pretokenizers", path);
    if (!list.is_array()) fail(path + ".pretokenizers", "expected an array");
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    for (std::size_t i = 0; i < list.size(); ++i)
      parts.push_back(pre_tokenizer(list[i], path + ".pretokenizers[" + std::to_string(i) + "]"));
    return make_sequence_pre_tokenizer(std::move(parts));
  }
  unsupported(path + ".type", j.at("type"), "pre-tokenizers ByteLevel, Split, Metaspace, Digits, Sequence");
}

std::unique_ptr<Decoder> Reader::decoder(const json& j, const std::string& path) const {
  const std::string type = type_of(j, path);
  if (type == "ByteLevel") return make_byte_level_decoder();
  if (type == "Metaspace")
    return make_metaspace_decoder(str(j, "replacement", path), prepend_scheme(j, path));
  if (type == "ByteFallback") return make_byte_fallback_decoder();
  if (type == "Fuse") return make_fuse_decoder();
  if (type == "Replace") {
    std::string literal;
    auto re = pattern(need(j, "pattern", path), path + ".pattern", literal);
    std::string content = str(j, "content", path);
    return re ? make_replace_decoder(std::move(*re), std::move(content))
              : make_replace_decoder(std::move(literal), std::move(content));
  }
  if (type == "Strip") {
    const json& start = need(j, "start", path);
    const json& stop = need(j, "stop", path);
    if (!start.is_number_unsigned() || !stop.is_number_unsigned())
      fail(path, "start and stop must be non-negative integers");
    return make_strip_decoder(str(j, "content", path), start.get<std::size_t>(), stop.get<std::size_t>());
  }
  if (type == "Sequence") {
    const json& list = need(j, "decoders", path);
    if (!list.is_array()) fail(path + ".decoders", "expected an array");
    std::vector<std::unique_ptr<Decoder>> parts;
    for (std::size_t i = 0; i < list.size(); ++i)
      parts.push_back(decoder(list[i], path + ".decoders[" + std::to_string(i) + "]"));
    return make_sequence_decoder(std::move(parts));
  }
  unsupported(path + ".type", j.at("type"),
              "decoders ByteLevel, Metaspace, ByteFallback, Fuse, Replace, Strip, Sequence");
}

// TemplateProcessing's `single` template, resolved to ids around sequence A.
PostProcessor template_processing(const Reader& r, const json& j, const std::string& path) {
  const json& single = r.need(j, "single", path);
  const json& specials = r.need(j, "special_tokens", path);
  if (!single.is_array()) r.fail(path + ".single", "expected an array of pieces");
  PostProcessor out;
  bool seen_a = false;
  for (std::size_t i = 0; i < single.size(); ++i) {
    const std::string at = path + ".single[" + std::to_string(i) + "]";
    const json& piece = single[i];
    if (piece.is_object() && piece.contains("Sequence")) {
      const std::string id = r.str(piece.at("Sequence"), "id", at + ".Sequence");
      if (id != "A" || seen_a) r.fail(at, "a single-sequence template must hold sequence A exactly once");
      seen_a = true;
      continue;
    }
    if (!piece.is_object() || !piece.contains("SpecialToken"))
      r.fail(at, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}, found " + piece.dump());
    const std::string name = r.str(piece.at("SpecialToken"), "id", at + ".SpecialToken");
    if (!specials.is_object() || !specials.contains(name))
      r.fail(path + ".special_tokens", "no entry for \"" + name + "\", which the template uses");
    const json& ids = r.need(specials.at(name), "ids", path + ".special_tokens." + name);
    auto& dest = seen_a ? out.suffix : out.prefix;
    for (const auto& id : ids) {
      if (!id.is_number_unsigned())
        r.fail(path + ".special_tokens." + name + ".ids", "expected non-negative ids");
      dest.push_back(id.get<int64_t>());
    }
  }
  if (!seen_a) r.fail(path + ".single", "the template has no sequence A");
  return out;
}

PostProcessor Reader::post_processor(const json& j, const std::string& path) const {
  const std::string type = type_of(j, path);
  if (type == "ByteLevel") return {};  // offsets only
  if (type == "TemplateProcessing") return template_processing(*this, j, path);
  if (type == "Sequence") {
    const json& list = need(j, "processors", path);
    if (!list.is_array()) fail(path + ".processors", "expected an array");
    PostProcessor out;
    for (std::size_t i = 0; i < list.size(); ++i) {
      PostProcessor p = post_processor(list[i], path + ".processors[" + std::to_string(i) + "]");
      wrap(out, p);
    }
    return out;
  }
  unsupported(path + ".type", j.at("type"), "post-processors TemplateProcessing, ByteLevel, Sequence");
}

std::vector<std::pair<std::string, std::string>> read_merges(const Reader& r, const json& merges,
                                                             const std::string& path) {
  if (!merges.is_array()) r.fail(path, "expected an array of merges");
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (std::size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const std::size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(path + "[" + std::to_string(i) + "]", "expected \"left right\", found \"" + s + "\"");
      out.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      out.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      r.fail(path + "[" + std::to_string(i) + "]",
             "expected \"left right\" or [left, right], found " + m.dump());
    }
  }
  return out;
}

std::unique_ptr<BpeModel> Reader::model(const json& j, const std::string& path) const {
  if (!j.is_object()) fail(path, "expected an object");
  const std::string type = j.contains("type") ? str(j, "type", path) : (j.contains("merges") ? "BPE" : "");
  if (type != "BPE")
    unsupported(path + ".type", j.contains("type") ? j.at("type") : json("(none)"), "model type BPE only");
  if (j.contains("dropout") && !j.at("dropout").is_null() &&
      !(j.at("dropout").is_number() && j.at("dropout").get<double>() == 0.0))
    fail(path + ".dropout",
         "BPE dropout " + j.at("dropout").dump() + " is random; only null or 0 is supported");
  const json& vocab = need(j, "vocab", path);
  if (!vocab.is_object()) fail(path + ".vocab", "expected an object {token: id}");
  std::vector<std::pair<std::string, uint32_t>> entries;
  entries.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() > 0x7FFFFFFF)
      fail(path + ".vocab." + it.key(), "expected a non-negative id, found " + it.value().dump());
    entries.emplace_back(it.key(), it.value().get<uint32_t>());
  }
  auto merges = read_merges(*this, need(j, "merges", path), path + ".merges");
  BpeOptions options;
  options.unk_token = opt_str(j, "unk_token", path);
  options.continuing_subword_prefix = opt_str(j, "continuing_subword_prefix", path).value_or("");
  options.end_of_word_suffix = opt_str(j, "end_of_word_suffix", path).value_or("");
  options.fuse_unk = flag(j, "fuse_unk", path, false);
  options.byte_fallback = flag(j, "byte_fallback", path, false);
  options.ignore_merges = flag(j, "ignore_merges", path, false);
  try {
    return std::make_unique<BpeModel>(std::move(entries), merges, std::move(options));
  } catch (const std::invalid_argument& e) {
    fail(path + ".merges", e.what());
  }
}

AddedToken Reader::added_token(const json& t, const std::string& at) const {
  AddedToken token;
  token.content = str(t, "content", at);
  token.single_word = flag(t, "single_word", at, false);
  token.lstrip = flag(t, "lstrip", at, false);
  token.rstrip = flag(t, "rstrip", at, false);
  token.special = flag(t, "special", at, false);
  token.normalized = flag(t, "normalized", at, !token.special);
  return token;
}

std::vector<AddedToken> Reader::added_tokens(const json& j, const std::string& path) const {
  std::vector<AddedToken> out;
  if (j.is_null()) return out;
  if (!j.is_array()) fail(path, "expected an array");
  for (std::size_t i = 0; i < j.size(); ++i)
    out.push_back(added_token(j[i], path + "[" + std::to_string(i) + "]"));
  return out;
}

json parse_file(const std::string& path, bool* mentions_byte_level = nullptr) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the file (does it exist and is it readable?)", path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  if (mentions_byte_level != nullptr) *mentions_byte_level = text.find("\"ByteLevel\"") != std::string::npos;
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw ConfigError(path + ": not valid JSON: " + e.what(), path);
  }
}

}  // namespace

Pipeline read_tokenizer_json(const std::string& path) {
  bool mentions_byte_level = false;
  const json root = parse_file(path, &mentions_byte_level);
  Reader r(path);
  if (!root.is_object()) r.fail("(root)", "expected a JSON object");
  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root.at(key).is_null())
      r.fail(key, std::string("is set, but encode() does not ") + (key[0] == 't' ? "truncate" : "pad") +
                      "; set it to null in the file and truncate or pad the ids yourself");
  }
  Pipeline p;
  if (root.contains("normalizer") && !root.at("normalizer").is_null())
    p.normalizer = r.normalizer(root.at("normalizer"), "normalizer");
  if (root.contains("pre_tokenizer") && !root.at("pre_tokenizer").is_null())
    p.pre_tokenizer = r.pre_tokenizer(root.at("pre_tokenizer"), "pre_tokenizer");
  p.model = r.model(r.need(root, "model", ""), "model");
  if (root.contains("decoder") && !root.at("decoder").is_null())
    p.decoder = r.decoder(root.at("decoder"), "decoder");
  if (root.contains("post_processor") && !root.at("post_processor").is_null())
    p.post_processor = r.post_processor(root.at("post_processor"), "post_processor");
  if (root.contains("added_tokens")) p.added_tokens = r.added_tokens(root.at("added_tokens"), "added_tokens");
  p.mentions_byte_level = mentions_byte_level;
  return p;
}

// extra_special_tokens (transformers 5), else additional_special_tokens: a list of strings or AddedToken
// objects, or a dict of named ones (its values).
void read_extra_special_tokens(const Reader& r, const json& root, std::vector<AddedToken>& out) {
  const char* key = "extra_special_tokens";
  if (!root.contains(key) || root.at(key).empty()) key = "additional_special_tokens";
  if (!root.contains(key) || root.at(key).is_null()) return;
  const json& list = root.at(key);
  if (!list.is_array() && !list.is_object())
    r.fail(key, "expected a list or an object, found " + list.dump());
  std::size_t i = 0;
  for (const auto& v : list) {
    const std::string at = std::string(key) + "[" + std::to_string(i++) + "]";
    AddedToken t;
    if (v.is_string()) {
      t.content = v.get<std::string>();
      t.normalized = false;
    } else if (v.is_object()) {
      t = r.added_token(v, at);
    } else {
      r.fail(at, "expected a string or an AddedToken object, found " + v.dump());
    }
    t.special = true;
    out.push_back(t);
  }
}

// special_tokens_map.json's entries over tokenizer_config.json's (lists of extra tokens are joined).
void merge_special_tokens_map(json& root, const std::string& map_path) {
  const json map = parse_file(map_path);
  if (!map.is_object()) Reader(map_path).fail("(root)", "expected a JSON object");
  for (auto it = map.begin(); it != map.end(); ++it) {
    const bool list = it.key() == "additional_special_tokens" || it.key() == "extra_special_tokens";
    if (list && it.value().is_array() && root.contains(it.key()) && root.at(it.key()).is_array()) {
      for (const auto& t : it.value())
        if (std::find(root[it.key()].begin(), root[it.key()].end(), t) == root[it.key()].end())
          root[it.key()].push_back(t);
    } else {
      root[it.key()] = it.value();
    }
  }
}

TokenizerConfig read_tokenizer_config(const std::string& path, const std::string& special_tokens_map) {
  json root = parse_file(path);
  Reader r(path);
  if (!root.is_object()) r.fail("(root)", "expected a JSON object");
  if (!root.contains("added_tokens_decoder") && !special_tokens_map.empty())
    merge_special_tokens_map(root, special_tokens_map);
  TokenizerConfig c;
  if (auto cls = r.opt_str(root, "tokenizer_class", "")) {
    c.tokenizer_class = *cls;
    if (c.tokenizer_class.size() > 4 &&
        c.tokenizer_class.compare(c.tokenizer_class.size() - 4, 4, "Fast") == 0)
      c.tokenizer_class.resize(c.tokenizer_class.size() - 4);
  }
  if (root.contains("add_prefix_space") && !root.at("add_prefix_space").is_null())
    c.add_prefix_space = r.flag(root, "add_prefix_space", "", true);
  if (root.contains("legacy") && !root.at("legacy").is_null()) c.legacy = r.flag(root, "legacy", "", true);
  auto special = [&](const char* key) -> std::optional<AddedToken> {
    if (!root.contains(key) || root.at(key).is_null()) return std::nullopt;
    const json& v = root.at(key);
    if (v.is_string()) {
      AddedToken t;
      t.content = v.get<std::string>();
      t.special = true;
      t.normalized = false;
      return t;
    }
    if (!v.is_object()) r.fail(key, "expected a string or an AddedToken object, found " + v.dump());
    AddedToken t = r.added_token(v, key);
    t.special = true;
    return t;
  };
  c.bos_token = special("bos_token");
  c.eos_token = special("eos_token");
  c.pad_token = special("pad_token");
  c.unk_token = special("unk_token");
  for (const char* key :
       {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (auto t = special(key)) c.special_tokens.push_back(*t);
  read_extra_special_tokens(r, root, c.special_tokens);
  if (r.flag(root, "split_special_tokens", "", false))
    r.fail("split_special_tokens", "true is not supported (special tokens are always matched in the text)");
  if (root.contains("added_tokens_decoder") && root.at("added_tokens_decoder").is_object()) {
    for (auto it = root.at("added_tokens_decoder").begin(); it != root.at("added_tokens_decoder").end();
         ++it) {
      uint32_t id = 0;
      try {
        id = static_cast<uint32_t>(std::stoul(it.key()));
      } catch (const std::exception&) {
        r.fail("added_tokens_decoder." + it.key(), "expected a numeric id as the key");
      }
      c.added_tokens_decoder.emplace_back(id, r.added_token(it.value(), "added_tokens_decoder." + it.key()));
    }
    std::sort(c.added_tokens_decoder.begin(), c.added_tokens_decoder.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  return c;
}

}  // namespace accel::llm::detail

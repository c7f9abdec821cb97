// accel::llm::Tokenizer: the Hugging Face pipeline (added tokens -> normalizer -> pre-tokenizer -> BPE ->
// post-processor; decoder for the way back), plus tokenizer_config.json as transformers' AutoTokenizer reads
// it.
#include <accel/llm/tokenizers/tokenizer.hpp>

#include "llm/tokenizers/tokenizer_json.hpp"
#include "llm/tokenizers/unicode.hpp"

#include <accel/errors.hpp>

#include <sys/stat.h>

#include <algorithm>

namespace accel::llm {

struct Tokenizer::Impl {
  detail::Pipeline pipeline;
  detail::AddedVocabulary added;
  detail::PostProcessor post;  // what add_special_tokens adds
  std::optional<int64_t> bos, eos, pad;
};

namespace {

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::unique_ptr<Tokenizer::Impl> build(detail::Pipeline pipeline) {
  auto impl = std::make_unique<Tokenizer::Impl>();
  impl->pipeline = std::move(pipeline);
  impl->added.add_tokens(impl->pipeline.added_tokens, *impl->pipeline.model, impl->pipeline.normalizer.get());
  if (impl->pipeline.post_processor) impl->post = *impl->pipeline.post_processor;
  return impl;
}

// Options of the BPE that a transformers class rebuilds; refused when the file's merges need a subword prefix
// or suffix the rebuilt model would not have.
void rebuild_bpe(detail::BpeModel& model, const std::string& cls, const std::string& file,
                 bool byte_fallback) {
  detail::BpeOptions o = model.options();
  if (!o.continuing_subword_prefix.empty() || !o.end_of_word_suffix.empty())
    throw ConfigError(file + ": model.continuing_subword_prefix / end_of_word_suffix: transformers' " + cls +
                          " rebuilds the BPE without them; set tokenizer_class to TokenizersBackend in "
                          "tokenizer_config.json to use tokenizer.json as it is",
                      file, 0, "tokenizer_class");
  o.unk_token.reset();
  o.fuse_unk = byte_fallback;
  o.byte_fallback = byte_fallback;
  o.ignore_merges = false;
  model.set_options(o);
}

// transformers 5 rebuilds the pipeline of some tokenizer classes from the file's vocabulary and merges
// (LlamaTokenizer.__init__, Qwen2Tokenizer.__init__); AutoTokenizer picks LlamaTokenizer when
// tokenizer_config.json names it and tokenizer.json holds no "ByteLevel".
void apply_tokenizer_class(detail::Pipeline& p, const detail::TokenizerConfig& c, const std::string& file) {
  using detail::PrependScheme;
  const std::string meta = "\xE2\x96\x81";  // U+2581
  if (c.tokenizer_class == "LlamaTokenizer" && !p.mentions_byte_level) {
    const bool prefix = c.add_prefix_space.value_or(true);
    const PrependScheme scheme =
        !prefix ? PrependScheme::kNever
                : (c.legacy.value_or(false) ? PrependScheme::kAlways : PrependScheme::kFirst);
    p.normalizer.reset();
    p.pre_tokenizer = detail::make_metaspace_pre_tokenizer(meta, scheme, false);
    std::vector<std::unique_ptr<detail::Decoder>> decoders;
    decoders.push_back(detail::make_replace_decoder(meta, " "));
    decoders.push_back(detail::make_byte_fallback_decoder());
    decoders.push_back(detail::make_fuse_decoder());
    if (prefix) decoders.push_back(detail::make_strip_decoder(" ", 1, 0));
    p.decoder = detail::make_sequence_decoder(std::move(decoders));
    rebuild_bpe(*p.model, c.tokenizer_class, file, true);
  } else if (c.tokenizer_class == "Qwen2Tokenizer") {
    p.normalizer = detail::make_unicode_normalizer(detail::UnicodeForm::kNfc);
    std::vector<std::unique_ptr<detail::PreTokenizer>> parts;
    parts.push_back(detail::make_split_pre_tokenizer(
        detail::Regex(
            R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"),
        detail::SplitBehavior::kIsolated, false));
    parts.push_back(detail::make_byte_level_pre_tokenizer(c.add_prefix_space.value_or(false), false));
    p.pre_tokenizer = detail::make_sequence_pre_tokenizer(std::move(parts));
    p.decoder = detail::make_byte_level_decoder();
    rebuild_bpe(*p.model, c.tokenizer_class, file, false);
  }
}

// TokenizersBackend.__init__ (transformers 5): the tokens of added_tokens_decoder and the named special
// tokens missing from the added vocabulary are added (as special tokens). add_bos_token / add_eos_token are
// not read: transformers 5 drops them whenever tokenizer.json exists
// (PreTrainedTokenizerBase._from_pretrained), so the post-processor of tokenizer.json alone decides what
// add_special_tokens adds.
void apply_config(Tokenizer::Impl& impl, const detail::TokenizerConfig& config) {
  const detail::BpeModel& model = *impl.pipeline.model;
  const detail::Normalizer* normalizer = impl.pipeline.normalizer.get();
  std::vector<detail::AddedToken> from_decoder;
  for (const auto& [id, token] : config.added_tokens_decoder)
    from_decoder.push_back(token);
  if (!from_decoder.empty()) impl.added.add_tokens(from_decoder, model, normalizer);
  std::vector<detail::AddedToken> named;
  for (const auto& t : config.special_tokens) {
    const bool queued =
        std::any_of(named.begin(), named.end(), [&](const auto& n) { return n.content == t.content; });
    if (!queued && !impl.added.token_to_id(t.content)) named.push_back(t);
  }
  if (!named.empty()) impl.added.add_tokens(named, model, normalizer);
  auto id_of = [&](const std::optional<detail::AddedToken>& t) -> std::optional<int64_t> {
    if (!t) return std::nullopt;
    if (auto id = impl.added.token_to_id(t->content)) return *id;
    if (auto id = model.token_to_id(t->content)) return *id;
    return std::nullopt;
  };
  impl.bos = id_of(config.bos_token);
  impl.eos = id_of(config.eos_token);
  impl.pad = id_of(config.pad_token);
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json) {
  return Tokenizer(build(detail::read_tokenizer_json(tokenizer_json)));
}

Tokenizer Tokenizer::from_pretrained(const std::string& dir) {
  const std::string json = dir + "/tokenizer.json";
  if (!file_exists(json))
    throw ConfigError(
        json + ": not found; from_pretrained needs a Hugging Face tokenizer.json in " + dir +
            " (a checkpoint with only tokenizer.model or vocab.json/merges.txt is not supported: "
            "save it with transformers' save_pretrained to get tokenizer.json)",
        json);
  detail::Pipeline pipeline = detail::read_tokenizer_json(json);
  const std::string config_path = dir + "/tokenizer_config.json";
  if (!file_exists(config_path)) return Tokenizer(build(std::move(pipeline)));
  const std::string map_path = dir + "/special_tokens_map.json";
  const detail::TokenizerConfig config =
      detail::read_tokenizer_config(config_path, file_exists(map_path) ? map_path : std::string());
  apply_tokenizer_class(pipeline, config, config_path);
  auto impl = build(std::move(pipeline));
  apply_config(*impl, config);
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const std::size_t bad = detail::first_invalid_utf8(text);
  if (bad != std::string::npos)
    throw UsageError("Tokenizer::encode: the text is not valid UTF-8 (byte " + std::to_string(bad) +
                     "); decode it to UTF-8 before encoding");
  const detail::Pipeline& p = impl_->pipeline;
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids.insert(ids.end(), impl_->post.prefix.begin(), impl_->post.prefix.end());
  thread_local std::vector<detail::Segment> segments;
  thread_local std::vector<detail::Piece> pieces;
  impl_->added.extract_and_normalize(p.normalizer.get(), text, segments);
  for (auto& segment : segments) {
    if (segment.id) {
      ids.push_back(*segment.id);
      continue;
    }
    pieces.clear();
    pieces.push_back(detail::Piece{std::move(segment.text), segment.at_origin});
    if (p.pre_tokenizer) p.pre_tokenizer->pre_tokenize(pieces);
    for (const auto& piece : pieces)
      p.model->tokenize(piece.text, ids);
  }
  if (add_special_tokens) ids.insert(ids.end(), impl_->post.suffix.begin(), impl_->post.suffix.end());
  return ids;
}

std::vector<std::vector<int64_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                          bool add_special_tokens) const {
  std::vector<std::vector<int64_t>> out;
  out.reserve(texts.size());
  for (const auto& text : texts)
    out.push_back(encode(text, add_special_tokens));
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    auto token = id_to_token(id);
    if (!token) continue;
    // Special by the added token's own content (a normalized one decodes to its normalized content).
    const auto* added = impl_->added.token_of(static_cast<uint32_t>(id));
    if (skip_special_tokens && impl_->added.is_special(added != nullptr ? added->content : *token)) continue;
    tokens.push_back(std::move(*token));
  }
  if (!impl_->pipeline.decoder) {
    std::string joined;
    for (std::size_t i = 0; i < tokens.size(); ++i)
      joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  impl_->pipeline.decoder->decode_chain(tokens);
  std::string joined;
  for (const auto& t : tokens)
    joined += t;
  return joined;
}

std::optional<int64_t> Tokenizer::token_to_id(const std::string& token) const {
  if (auto id = impl_->added.token_to_id(token)) return *id;
  if (auto id = impl_->pipeline.model->token_to_id(token)) return *id;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id > 0xFFFFFFFFLL) return std::nullopt;
  if (const auto* t = impl_->added.token_of(static_cast<uint32_t>(id))) {
    const auto* normalized = impl_->added.normalized_content(static_cast<uint32_t>(id));
    return normalized != nullptr ? *normalized : t->content;  // as tokenizers' id_to_token
  }
  if (const auto* t = impl_->pipeline.model->id_to_token(static_cast<uint32_t>(id))) return *t;
  return std::nullopt;
}

int64_t Tokenizer::size() const {
  return static_cast<int64_t>(impl_->pipeline.model->vocab_size() +
                              impl_->added.count_outside(*impl_->pipeline.model));
}

std::optional<int64_t> Tokenizer::bos_token_id() const {
  return impl_->bos;
}
std::optional<int64_t> Tokenizer::eos_token_id() const {
  return impl_->eos;
}
std::optional<int64_t> Tokenizer::pad_token_id() const {
  return impl_->pad;
}

}  // namespace accel::llm

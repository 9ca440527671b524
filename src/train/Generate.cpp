// `dtrain generate`: rebuild the GPT from a checkpoint and sample from it autoregressively.
#include "dtrain/train/Generate.h"

#include <torch/torch.h>

#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/data/Text.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::train {

std::string generate_text(const GenerateOptions& options,
                          const std::function<void(const std::string&)>& on_token) {
  DTRAIN_CHECK_INPUT(options.tokens >= 0, "--tokens must be >= 0, got ", options.tokens);
  DTRAIN_CHECK_INPUT(options.temperature >= 0, "--temperature must be >= 0, got ",
                     options.temperature);
  DTRAIN_CHECK_INPUT(options.top_k >= 0, "--top-k must be >= 0, got ", options.top_k);
  at::set_num_threads(options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const std::string checkpoint = resolve_checkpoint(options.checkpoint);
  const CheckpointMeta meta = read_meta(checkpoint);
  const auto model_it = meta.extras.find("model");
  const auto vocab_it = meta.extras.find("vocabulary");
  const auto bpe_it = meta.extras.find("tokenizer");
  DTRAIN_CHECK_INPUT(model_it != meta.extras.end() &&
                         (vocab_it != meta.extras.end() || bpe_it != meta.extras.end()),
                     checkpoint,
                     " holds no language model (dtrain generate reads checkpoints of "
                     "--model gpt with --dataset text or tokens)");
  const models::GptConfig config =
      models::gpt_config_from_json(model_it->second, checkpoint + "/meta.json");
  // The text's own tokenizer: characters, or the token shards' BPE (decoded as a whole, so a
  // character split over tokens comes out once complete).
  std::function<std::vector<int64_t>(const std::string&)> encode;
  std::function<std::string(const std::vector<int64_t>&)> decode;
  int64_t tokenizer_size = 0;
  int64_t end_of_text = -1;
  if (bpe_it != meta.extras.end()) {
    const auto bpe = std::make_shared<data::tokenizer::BpeTokenizer>(
        data::tokenizer::BpeTokenizer::from_json(bpe_it->second, checkpoint + "/meta.json"));
    encode = [bpe](const std::string& text) { return bpe->encode(text); };
    decode = [bpe](const std::vector<int64_t>& ids) { return bpe->decode(ids); };
    tokenizer_size = bpe->vocab_size();
    if (!options.ignore_eos) end_of_text = bpe->end_of_text();
    DTRAIN_CHECK_INPUT(tokenizer_size <= config.vocab, checkpoint, "/meta.json: a tokenizer of ",
                       tokenizer_size, " tokens for a model of ", config.vocab);
  } else {
    const auto chars = std::make_shared<data::CharTokenizer>(
        data::CharTokenizer::from_vocabulary(vocab_it->second));
    encode = [chars](const std::string& text) { return chars->encode(text); };
    decode = [chars](const std::vector<int64_t>& ids) { return chars->decode(ids); };
    tokenizer_size = chars->size();
    DTRAIN_CHECK_INPUT(tokenizer_size == config.vocab, checkpoint, "/meta.json: a vocabulary of ",
                       tokenizer_size, " characters for a model of ", config.vocab);
  }

  torch::manual_seed(options.seed);
  Model model = models::make_gpt(config);
  // The weights straight from the shards (any strategy and layout), checksums verified first.
  const std::string problem = verify_checkpoint(checkpoint);
  DTRAIN_CHECK_INPUT(problem.empty(), "checkpoint ", checkpoint, " does not verify: ", problem);
  {
    torch::NoGradGuard no_grad;
    std::vector<std::string> names;
    std::vector<at::Tensor> parameters;
    for (const auto& item : model.module->named_parameters()) {
      names.push_back(item.key());
      parameters.push_back(item.value());
    }
    parallel::NamedTensors buffers;
    for (const auto& item : model.module->named_buffers())
      buffers.emplace_back(item.key(), item.value());
    parallel::read_state_shards(checkpoint, parallel::whole_pieces(names, parameters), nullptr, {},
                                &buffers);
  }
  model.module->eval();

  std::vector<int64_t> ids;
  if (options.prompt.empty()) {
    try {
      ids = encode("\n");
    } catch (const InputError&) {
      ids = {0};
    }
  } else {
    ids = encode(options.prompt);
  }
  std::string text = options.prompt;
  if (on_token) on_token(options.prompt);
  at::Generator generator = at::detail::createCPUGenerator(options.seed);
  std::vector<int64_t> generated;
  size_t emitted = 0;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < options.tokens; ++i) {
    const auto begin =
        ids.size() > static_cast<size_t>(config.context) ? ids.end() - config.context : ids.begin();
    at::Tensor input = at::tensor(std::vector<int64_t>(begin, ids.end()), at::kLong).unsqueeze(0);
    at::Tensor logits = model(input).select(1, input.size(1) - 1).squeeze(0).to(at::kDouble);
    int64_t next = 0;
    if (options.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / options.temperature;
      if (options.top_k > 0 && options.top_k < logits.size(0)) {
        const at::Tensor kth = std::get<0>(logits.topk(options.top_k)).select(0, options.top_k - 1);
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
      }
      next = at::multinomial(at::softmax(logits, 0), 1, false, generator).item<int64_t>();
    }
    if (next == end_of_text) break;  // the document ends (transformers' eos_token_id)
    ids.push_back(next);
    generated.push_back(next);
    const std::string so_far = decode(generated);
    // Held back while it ends in a partial character (U+FFFD).
    if (so_far.size() >= 3 && so_far.compare(so_far.size() - 3, 3, "\xEF\xBF\xBD") == 0 &&
        i + 1 < options.tokens) {
      continue;
    }
    const std::string piece = so_far.substr(std::min(emitted, so_far.size()));
    emitted = so_far.size();
    text += piece;
    if (on_token) on_token(piece);
  }
  return text;
}

}  // namespace dtrain::train

// No Abseil header may be included here: see sentencepiece_train_for_test.h.
#include "tests/common/tokenizer/sentencepiece_train_for_test.h"

#include <sentencepiece_trainer.h>

#include <string>
#include <unordered_map>

namespace kvcm::testing {
namespace {

// Feeds the training lines from memory.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& lines) : lines_(lines) {}
  bool done() const override { return index_ >= lines_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return lines_[index_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  const std::vector<std::string>& lines_;
  size_t index_ = 0;
};

}  // namespace

std::string TrainSentencePieceForTest(
    const std::vector<std::string>& lines, const std::string& model_prefix, int vocab_size,
    const std::vector<std::pair<std::string, std::string>>& extra) {
  LineIterator iterator(lines);
  std::unordered_map<std::string, std::string> args = {
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", "bpe"},
      {"character_coverage", "1.0"},
      {"hard_vocab_limit", "false"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", "2"},
  };
  for (const auto& [name, value] : extra) args[name] = value;
  const sentencepiece::util::Status status =
      sentencepiece::SentencePieceTrainer::Train(args, &iterator);
  return status.ok() ? std::string() : status.ToString();
}

}  // namespace kvcm::testing

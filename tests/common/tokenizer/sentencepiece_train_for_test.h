#pragma once
// Trains a tiny SentencePiece model for the tokenizer tests. Like
// common/tokenizer/sentencepiece_backend.h, this header includes neither Abseil nor
// SentencePiece (their absl::string_view declarations collide).

#include <string>
#include <utility>
#include <vector>

namespace kvcm::testing {

// Trains a BPE model with <unk>=0, <s>=1, </s>=2 on `lines` and writes `model_prefix`.model
// (and .vocab: a piece and its score per line, in id order); `extra` trainer flags (name,
// value) are added or override. Returns "" on success, else the library's error.
std::string TrainSentencePieceForTest(
    const std::vector<std::string>& lines, const std::string& model_prefix, int vocab_size,
    const std::vector<std::pair<std::string, std::string>>& extra = {});

}  // namespace kvcm::testing

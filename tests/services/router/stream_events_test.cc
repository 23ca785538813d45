// services/router/stream_events.h writes the bytes nlohmann::json writes for the same event,
// built as a DOM the way the router built it before (services/router/http_frontend.cc):
// seeded random tokens, texts (ASCII, escapes, control characters, multi-byte UTF-8 and
// bytes that are no UTF-8), log-probabilities (any float bit pattern: NaN, infinities,
// subnormals, -0; written as ShownLogprob, finite) and last events.

#include "services/router/stream_events.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvcm::router {
namespace {

using json = nlohmann::json;

std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

// As the router's front end writes a log-probability: null when not computed, else its
// ShownLogprob (finite).
json Logprob(float value) { return std::isnan(value) ? json(nullptr) : json(ShownLogprob(value)); }

json TokenJson(const TgiStreamToken& t) {
  return {{"id", t.id},
          {"text", std::string(t.text)},
          {"logprob", Logprob(t.logprob)},
          {"special", t.special}};
}

json EventJson(const TgiStreamEvent& e) {
  json event = {{"index", e.index},
                {"token", TokenJson(e.token)},
                {"generated_text", nullptr},
                {"details", nullptr}};
  if (e.with_top_tokens) {
    json top = json::array();
    for (const TgiStreamToken& t : e.top_tokens) top.push_back(TokenJson(t));
    event["top_tokens"] = top;
  }
  if (e.end != nullptr) {
    event["generated_text"] = std::string(e.end->generated_text);
    event["details"] = {{"finish_reason", std::string(e.end->finish_reason)},
                        {"generated_tokens", e.end->generated_tokens},
                        {"input_length", e.end->input_length},
                        {"seed", e.end->seed.has_value() ? json(*e.end->seed) : json(nullptr)}};
  }
  return event;
}

std::string RandomText(std::mt19937& rng) {
  static const char* const kPieces[] = {"a",
                                        " the",
                                        "\"",
                                        "\\",
                                        "\n",
                                        "\t",
                                        "\r",
                                        "\b",
                                        "\f",
                                        "\x01",
                                        "\x1f",
                                        "\x7f",
                                        "/",
                                        "é",
                                        "€",
                                        "😀",
                                        "\xc3",
                                        "\xa9",
                                        "\xed\xa0\x80",
                                        "\xf4\x90\x80\x80",
                                        "\xc0\xaf",
                                        "\xff"};
  std::string text;
  const int n = static_cast<int>(rng() % 6);
  for (int i = 0; i < n; ++i) {
    const uint32_t pick = rng() % (std::size(kPieces) + 2);
    if (pick == std::size(kPieces)) {
      text.push_back('\0');
    } else if (pick == std::size(kPieces) + 1) {
      text.push_back(static_cast<char>(rng() & 0xFF));  // any byte
    } else {
      text += kPieces[pick];
    }
  }
  return text;
}

float RandomLogprob(std::mt19937& rng) {
  switch (rng() % 4) {
    case 0: {  // any bit pattern
      const uint32_t bits = rng();
      float value;
      std::memcpy(&value, &bits, sizeof(value));
      return value;
    }
    case 1:
      return -std::uniform_real_distribution<float>(0.0f, 30.0f)(rng);
    case 2:
      return std::numeric_limits<float>::quiet_NaN();
    default: {
      const float special[] = {0.0f,
                               -0.0f,
                               -1.0f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(),
                               -1e-7f,
                               -123456.0f};
      return special[rng() % std::size(special)];
    }
  }
}

TEST(StreamEventsTest, EventsAreTheBytesOfTheJsonDom) {
  constexpr uint32_t kSeed = 20261202;
  std::printf("seed %u\n", kSeed);
  std::mt19937 rng(kSeed);
  for (int round = 0; round < 20000; ++round) {
    SCOPED_TRACE(round);
    std::vector<std::string> texts;
    for (int i = 0; i < 8; ++i) texts.push_back(RandomText(rng));
    auto token = [&](size_t k) {
      TgiStreamToken t;
      t.id = static_cast<int32_t>(rng());
      t.logprob = RandomLogprob(rng);
      t.text = texts[k];
      t.special = rng() % 2 == 0;
      return t;
    };
    std::vector<TgiStreamToken> top;
    TgiStreamEvent event;
    event.index = rng() % 3 == 0 ? rng() : rng() % 100;
    event.token = token(0);
    event.with_top_tokens = rng() % 3 == 0;
    if (event.with_top_tokens) {
      const size_t n = rng() % 4;
      for (size_t k = 1; k <= n; ++k) top.push_back(token(k));
      event.top_tokens = top;
    }
    TgiStreamEnd end;
    if (rng() % 3 == 0) {
      end.generated_text = texts[5];
      end.finish_reason = rng() % 2 == 0 ? "length" : "eos_token";
      end.generated_tokens = rng() % 4096;
      end.input_length = 1 + rng() % 4096;
      if (rng() % 2 == 0) end.seed = (uint64_t{rng()} << 32) | rng();
      event.end = &end;
    }
    std::string written = "prefix:";
    AppendTgiStreamEvent(event, &written);
    ASSERT_EQ(written, "prefix:" + Dump(EventJson(event)));
  }
}

TEST(StreamEventsTest, StringsAndNumbersAreNlohmannsAlone) {
  constexpr uint32_t kSeed = 7;
  std::printf("seed %u\n", kSeed);
  std::mt19937 rng(kSeed);
  for (int round = 0; round < 20000; ++round) {
    const std::string text = RandomText(rng);
    std::string written;
    AppendJsonString(text, &written);
    ASSERT_EQ(written, Dump(json(text))) << "round " << round;
    const double value = round % 2 == 0 ? double{RandomLogprob(rng)}
                                        : std::uniform_real_distribution<double>(-1e6, 1e6)(rng);
    written.clear();
    AppendJsonNumber(value, &written);
    ASSERT_EQ(written, Dump(json(value))) << "round " << round;
  }
}

TEST(StreamEventsTest, ALogprobOfMinusInfinityIsWrittenAsAFiniteNumber) {
  // A token of probability 0 (sampled at temperature 1e-40, or a top token after it) has a
  // log-probability of -inf: nlohmann writes null, which the OpenAPI document's number
  // refuses. It reads as kMinLogprob, -9999 (docs/router.md, "Log-probabilities").
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ShownLogprob(-kInf), kMinLogprob);
  EXPECT_EQ(ShownLogprob(-1e30f), kMinLogprob);
  EXPECT_EQ(ShownLogprob(kInf), 0.0f);
  EXPECT_EQ(ShownLogprob(-2.5f), -2.5f);
  EXPECT_TRUE(std::isnan(ShownLogprob(std::numeric_limits<float>::quiet_NaN())));
  const TgiStreamToken top[] = {{7, -kInf, "b", false}};
  TgiStreamEvent event;
  event.token = {5, -kInf, "a", false};
  event.with_top_tokens = true;
  event.top_tokens = top;
  std::string written;
  AppendTgiStreamEvent(event, &written);
  const json parsed = json::parse(written, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << written;
  ASSERT_TRUE(parsed["token"]["logprob"].is_number()) << written;
  EXPECT_EQ(parsed["token"]["logprob"].get<double>(), -9999.0);
  ASSERT_TRUE(parsed["top_tokens"][0]["logprob"].is_number()) << written;
  EXPECT_EQ(parsed["top_tokens"][0]["logprob"].get<double>(), -9999.0);
}

}  // namespace
}  // namespace kvcm::router

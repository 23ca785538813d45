// RequestFraming (services/router/http_framing.h): what reaches libevent of each request, and
// which requests are refused with what, whatever pieces the bytes arrive in.

#include "services/router/http_framing.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/services/router/framing_driver.h"

namespace kvcm::router {
namespace {

using ::testing::HasSubstr;

using testing::Framed;

// `input` framed in pieces of the given sizes (the rest in one piece).
Framed Frame(std::string_view input, FramingLimits limits = {},
             const std::vector<size_t>& pieces = {}) {
  Framed framed = testing::FrameInPieces(input, limits, pieces);
  EXPECT_TRUE(framed.steps_in_bounds) << "a step took more bytes than there were";
  return framed;
}

const std::string kGet = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

std::string Post(const std::string& path, const std::string& body) {
  return absl::StrCat("POST ", path,
                      " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ", body.size(), "\r\n\r\n",
                      body);
}

std::string ChunkedHead(const std::string& path) {
  return absl::StrCat("POST ", path,
                      " HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n");
}

TEST(RequestFramingTest, HeadsAndContentLengthBodiesPassUnchanged) {
  const std::string input = kGet + Post("/generate", R"({"inputs":"a"})") + kGet;
  const Framed framed = Frame(input);
  EXPECT_EQ(framed.out, input);
  EXPECT_FALSE(framed.refusal.has_value());
  EXPECT_EQ(framed.heads, 3u);
}

TEST(RequestFramingTest, WhatPassesDoesNotDependOnThePiecesTheBytesArriveIn) {
  const std::string input =
      absl::StrCat(kGet, Post("/generate", std::string(300, 'x')), ChunkedHead("/generate"),
                   "5;name=value\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n", "\r\n", kGet);
  const Framed whole = Frame(input);
  ASSERT_FALSE(whole.refusal.has_value());
  const unsigned seed = 20261206;
  std::printf("seed %u\n", seed);
  std::mt19937 random(seed);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<size_t> pieces;
    for (size_t total = 0; total < input.size();) {
      pieces.push_back(1 + random() % (trial % 2 == 0 ? 4 : 64));
      total += pieces.back();
    }
    const Framed split = Frame(input, {}, pieces);
    ASSERT_EQ(split.out, whole.out) << "trial " << trial;
    ASSERT_FALSE(split.refusal.has_value());
    ASSERT_EQ(split.heads, 4u);
  }
}

TEST(RequestFramingTest, ChunkExtensionsAndTrailersAreLeftOutAndTheChunksPass) {
  // libevent 2.1 answers a legal chunk extension with 413 "Request Entity Too Large".
  const Framed framed =
      Frame(ChunkedHead("/generate") + "30;ext=1\r\n" + std::string(48, 'a') + "\r\n" +
            "A ; a=\"b\"\r\n0123456789\r\n0;last\r\nExpires: never\r\n\r\n");
  EXPECT_FALSE(framed.refusal.has_value());
  EXPECT_EQ(framed.out, ChunkedHead("/generate") + "30\r\n" + std::string(48, 'a') +
                            "\r\na\r\n0123456789\r\n0\r\n\r\n");
}

TEST(RequestFramingTest, ABodyOverTheLimitIsRefusedAtItsHeadWith413AndItsPath) {
  const FramingLimits limits{.max_head_bytes = 1024, .max_body_bytes = 100};
  const Framed fits = Frame(Post("/v1/completions", std::string(100, 'x')), limits);
  EXPECT_FALSE(fits.refusal.has_value());
  // Only the head: the refusal needs no byte of the body.
  const Framed over =
      Frame("POST /v1/completions HTTP/1.1\r\nContent-Length: 101\r\nExpect: 100-continue\r\n\r\n",
            limits);
  ASSERT_TRUE(over.refusal.has_value());
  EXPECT_EQ(over.refusal->status, 413);
  EXPECT_EQ(over.refusal->path, "/v1/completions");
  EXPECT_THAT(over.refusal->message, HasSubstr("--max-request-body-bytes"));
  // libevent reads a bodiless request in its place, the first on the connection.
  EXPECT_EQ(over.out, RequestFraming::kRefusedHead);
  EXPECT_EQ(over.refused_request, 1u);
  const Framed huge = Frame(
      "POST /generate HTTP/1.1\r\nContent-Length: 99999999999999999999999"
      "\r\n\r\n");
  ASSERT_TRUE(huge.refusal.has_value());
  EXPECT_EQ(huge.refusal->status, 413);
}

TEST(RequestFramingTest, AChunkedBodyOverTheLimitIsRefusedWith413AndEndedForLibevent) {
  const FramingLimits limits{.max_head_bytes = 1024, .max_body_bytes = 100};
  const std::string head = ChunkedHead("/generate");
  const std::string first = "32\r\n" + std::string(50, 'a') + "\r\n";
  const Framed framed =
      Frame(head + first + "33\r\n" + std::string(51, 'b') + "\r\n0\r\n\r\n" + kGet, limits);
  ASSERT_TRUE(framed.refusal.has_value());
  EXPECT_EQ(framed.refusal->status, 413);
  EXPECT_EQ(framed.refused_request, 1u);
  // The body so far, then its end: libevent dispatches the request, whose handler answers
  // the refusal; nothing after it passes.
  EXPECT_EQ(framed.out, head + first + "\r\n0\r\n\r\n");
  // A size no limit allows.
  const Framed huge = Frame(head + "fffffffffffffffffff\r\n");
  ASSERT_TRUE(huge.refusal.has_value());
  EXPECT_EQ(huge.refusal->status, 413);
}

TEST(RequestFramingTest, MalformedChunkedBodiesAreRefusedWith400) {
  const std::string head = ChunkedHead("/v1/chat/completions");
  const std::string cases[] = {
      "zz\r\nhello\r\n0\r\n\r\n",       // not hexadecimal
      "5\r\nhelloXX0\r\n\r\n",          // no CRLF after the data
      "5\nhello\r\n0\r\n\r\n",          // a size line ended by LF alone
      "-5\r\nhello\r\n0\r\n\r\n",       // a sign
      "0x5\r\nhello\r\n0\r\n\r\n",      // a prefix
      "5 x\r\nhello\r\n0\r\n\r\n",      // not an extension
      "5;a\x01\r\nhello\r\n0\r\n\r\n",  // a control character in an extension
      "0\r\nnot a field\r\n\r\n",       // a trailer line that is no field
      std::string(5000, '1'),           // a size line too long
  };
  for (const std::string& body : cases) {
    SCOPED_TRACE(body.substr(0, 40));
    const Framed framed = Frame(head + body + kGet);
    ASSERT_TRUE(framed.refusal.has_value());
    EXPECT_EQ(framed.refusal->status, 400);
    EXPECT_THAT(framed.refusal->message, HasSubstr("malformed chunked body"));
    EXPECT_EQ(framed.refusal->path, "/v1/chat/completions");
    EXPECT_EQ(framed.refused_request, 1u);
    EXPECT_EQ(framed.out.find("GET /health"), std::string::npos) << "nothing after it passes";
  }
}

TEST(RequestFramingTest, AmbiguousFramingIsRefusedWith400) {
  const std::string body = R"({"inputs":"a"})";
  const std::string head = "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n";
  const std::string cases[] = {
      absl::StrCat(head, "Content-Length: ", body.size(), "\r\nContent-Length: ", body.size() + 1,
                   "\r\n\r\n", body),
      absl::StrCat(head, "Content-Length: +", body.size(), "\r\n\r\n", body),
      absl::StrCat(head, "Content-Length: -0\r\n\r\n"),
      absl::StrCat(head, "Transfer-Encoding : chunked\r\n\r\n"),
      absl::StrCat(head, "Content-Length\t: 5\r\n\r\n"),
      absl::StrCat(head, "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"),
      absl::StrCat(head, "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"),
      absl::StrCat(head, "Transfer-Encoding: gzip, chunked\r\n\r\n"),
      absl::StrCat(head, "X-A: 1\r\n folded\r\n\r\n"),
      absl::StrCat("HEAD /health HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"),
      absl::StrCat("TRACE / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
  };
  for (const std::string& request : cases) {
    SCOPED_TRACE(request);
    const Framed framed = Frame(request + kGet);
    ASSERT_TRUE(framed.refusal.has_value());
    EXPECT_EQ(framed.refusal->status, 400);
    EXPECT_THAT(framed.refusal->message, HasSubstr("ambiguous framing"));
    EXPECT_EQ(framed.out, RequestFraming::kRefusedHead);
  }
  // What RFC 9112 allows passes: the same Content-Length twice.
  const std::string twice = absl::StrCat(head, "Content-Length: ", body.size(),
                                         "\r\ncontent-length:  ", body.size(), " \r\n\r\n", body);
  EXPECT_FALSE(Frame(twice).refusal.has_value());
}

TEST(RequestFramingTest, AHeadOverTheLimitIsRefusedWith431WithOrWithoutItsEnd) {
  const FramingLimits limits{.max_head_bytes = 200, .max_body_bytes = 100};
  const std::string big = absl::StrCat("GET /v1/models HTTP/1.1\r\nX-Pad: ", std::string(300, 'a'));
  for (const std::string& input : {big, big + "\r\n\r\n"}) {
    const Framed framed = Frame(input, limits);
    ASSERT_TRUE(framed.refusal.has_value());
    EXPECT_EQ(framed.refusal->status, 431);
    EXPECT_EQ(framed.refusal->path, "/v1/models");
  }
  const std::string fits =
      absl::StrCat("GET / HTTP/1.1\r\nX-Pad: ", std::string(150, 'a'), "\r\n\r\n");
  EXPECT_FALSE(Frame(fits, limits).refusal.has_value());
}

TEST(RequestFramingTest, MalformedRequestLinesAndUnknownMethodsAreRefused) {
  struct Case {
    std::string line;
    int status;
  };
  const Case cases[] = {
      {"GET /health\r\n\r\n", 400},
      {"GET  /health HTTP/1.1\r\n\r\n", 400},
      {"GET /health HTTP/x\r\n\r\n", 400},
      {"GET /health HTTP/1.9\r\n\r\n", 505},
      {"GET /health HTTP/0.9\r\n\r\n", 505},
      {"GET /health HTTP/2.0\r\n\r\n", 505},
      {"GET http://a/health HTTP/1.1\r\n\r\n", 400},
      {"GET //v1/completions HTTP/1.1\r\n\r\n", 400},
      {"GET //ge\x80n HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nExpect: nothing\r\n\r\n", 417},
      {"GET /a\x01 HTTP/1.1\r\n\r\n", 400},
      {"BREW /pot HTTP/1.1\r\n\r\n", 501},
      {"G(ET / HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400},
      {std::string("GET / HTTP/1.1\r\nX: a\0b\r\n\r\n",
                   sizeof("GET / HTTP/1.1\r\nX: a\0b\r\n\r\n") - 1),
       400},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line);
    const Framed framed = Frame(c.line);
    ASSERT_TRUE(framed.refusal.has_value());
    EXPECT_EQ(framed.refusal->status, c.status);
  }
}

TEST(RequestFramingTest, EmptyLinesBeforeARequestAreSkippedAndLfAloneEndsHeadLines) {
  const Framed framed = Frame("\r\n\nGET / HTTP/1.0\nHost: a\n\n");
  EXPECT_FALSE(framed.refusal.has_value());
  EXPECT_EQ(framed.out, "GET / HTTP/1.0\nHost: a\n\n");
  EXPECT_EQ(framed.heads, 1u);
}

TEST(RequestFramingTest, ARefusalAfterServedRequestsNamesItsOwnIndex) {
  const Framed framed = Frame(kGet + kGet +
                              "GET /x HTTP/1.1\r\nContent-Length: 1\r\n"
                              "Content-Length: 2\r\n\r\n" +
                              kGet);
  ASSERT_TRUE(framed.refusal.has_value());
  EXPECT_EQ(framed.refused_request, 3u);
  EXPECT_EQ(framed.out, kGet + kGet + std::string(RequestFraming::kRefusedHead));
}

}  // namespace
}  // namespace kvcm::router

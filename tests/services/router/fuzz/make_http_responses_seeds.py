#!/usr/bin/env python3
# Writes the seed corpus and the regression inputs of the http_responses fuzz target
# (tests/services/router/http_responses_fuzz_target.cc, whose comment gives the format):
#   python3 tests/services/router/fuzz/make_http_responses_seeds.py tests/services/router/fuzz
# into DIR/http_responses/ (a whole response of each shape) and
# DIR/http_responses_regressions/ (one input per value that broke the router's replies:
# log-probabilities of -inf, +inf, NaN, denormals and below -9999; token counts and seeds of
# 2^64 - 1; stop sequences as long as the target makes (16 KiB); texts that are not UTF-8 or
# hold control bytes). In requests (shapes 1 to 6) a token's id names an entry of the
# tokenizer the target builds (its Vocabulary): the same id with the same text and special
# flag is the same token; a special token decodes to nothing (its text is not shown), and so
# does one of no text. The regression tgi_stream_token_text_holding_data_colon is not
# written here: libFuzzer found it (a bug of the target's own), and it is kept as found.
import os
import struct
import sys

# Reader::Logprob's selectors of kSpecial.
MINUS_INF, PLUS_INF, NAN, MINUS_NAN, DENORM_MIN, MINUS_DENORM_MIN, MINUS_FLT_MIN, \
    MINUS_FLT_MAX, FLT_MAX, MIN_LOGPROB, BELOW_MIN_LOGPROB, MINUS_10000, ZERO, MINUS_ZERO, \
    MINUS_1E_40, MINUS_1E30 = range(16)
LENGTH, EOS, STOP = 0, 1, 2  # kFinishReasons


def byte(v):
    return bytes([v & 0xFF])


def u16(v):
    return struct.pack("<H", v)


def u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def boolean(v):
    return byte(1 if v else 0)


def special(selector):
    return byte(selector)


def ordinary(value):
    # -(selector - 16) / 8, selector in [16, 0x80)
    selector = 16 + round(-value * 8)
    assert 16 <= selector < 0x80, value
    return byte(selector)


def bits(value):
    return byte(0x80) + u32(value)


def raw_float(value):
    return byte(0x80) + struct.pack("<f", value)


def text(s, repeat=None):
    if isinstance(s, str):
        s = s.encode()
    if repeat is None:
        assert len(s) < 0x80
        return byte(len(s)) + s
    assert 0 < len(s) < 0x80
    return byte(0x80 | len(s)) + s + u16(repeat)


def token(id, s, logprob, special_token=False, top=()):
    out = u32(id) + text(s) + boolean(special_token) + logprob
    for t in top:
        out += u32(t[0]) + text(t[1]) + boolean(False) + t[2]
    return out


def request(shape, flags=0, top_n=0, seed=0, created=1767225600, prompt_tokens=3, cached=0,
            model="tiny", completion_id=1, prompt_text="Hi!", prompt=None, stops=(),
            choices=None, shown=1, failure="", fail_after=0):
    """choices: [(finish, [token bytes...], stop index or None)]"""
    prompt = prompt or [(1, "H", special(NAN)), (2, "i", ordinary(-1.5)), (3, "!", ordinary(-0.25))]
    out = byte(shape) + byte(flags) + byte(top_n) + u64(seed) + u64(created) + u64(prompt_tokens)
    out += u32(cached) + text(model) + u32(completion_id) + text(prompt_text)
    out += byte(len(prompt) - 1)
    for id, s, lp in prompt:
        out += token(id, s, lp)
    out += byte(len(stops))
    for s in stops:
        out += s
    out += byte(len(choices) - 1) + byte(shown - 1)
    for finish, tokens, stop in choices:
        out += byte(finish) + byte(len(tokens) - 1)
        for t in tokens:
            out += t
        if finish == STOP:
            out += byte(stop)
    out += text(failure) + byte(fail_after)
    return out


DETAILS, SAMPLE, ECHO, LOGPROBS, PROMPT_LOGPROBS, USAGE, AS_LIST, FAIL = (1 << i for i in range(8))


def top2(a, b):
    return [(40, "a", a), (41, " b", b)]


def ordinary_tokens(n, top=0):
    out = []
    for i in range(n):
        alternatives = [(50 + k, "t%d" % k, ordinary(-(k + 1))) for k in range(top)]
        out.append(token(100 + i, " w%d" % i, ordinary(-0.5 * (i % 4)), False, alternatives))
    return out


def event(index, tok, top=None, end=None):
    out = u64(index) + tok
    out += boolean(top is not None) + byte(len(top or []))
    for t in top or []:
        out += t
    if end is None:
        return out + boolean(False)
    generated_text, finish, generated_tokens, seed = end
    out += boolean(True) + text(generated_text) + byte(finish) + u64(generated_tokens)
    return out + boolean(seed is not None) + u64(seed or 0)


def errors(cases):
    out = byte(7) + byte(len(cases) - 1)
    for openai, status, key, value, as_parameter, validation in cases:
        out += boolean(openai) + byte(status) + key + value + boolean(as_parameter)
        out += boolean(validation)
    return out


SEEDS = {
    "tgi_stream_events": byte(0) + byte(3)
    + event(0, token(72, "Hello", ordinary(-0.5)))
    + event(1, token(44, ",", ordinary(-1.0)),
            top=[token(44, ",", ordinary(-1.0)), token(33, "!", ordinary(-2.0))])
    + event(2, token(2, "", ordinary(-0.125), special_token=True),
            end=("Hello,", EOS, 3, 42)),
    "tgi_stream_sampled": request(1, flags=SAMPLE, top_n=2, seed=7, choices=[
        (LENGTH, ordinary_tokens(4, top=2), None)]),
    "tgi_generate_details_best_of": request(2, flags=DETAILS | SAMPLE | PROMPT_LOGPROBS | AS_LIST,
                                            top_n=3, seed=11, choices=[
                                                (LENGTH, ordinary_tokens(3, top=3), None),
                                                (EOS, ordinary_tokens(2, top=3), None)], shown=2),
    "openai_completion_logprobs_echo": request(3, flags=LOGPROBS | ECHO | PROMPT_LOGPROBS, top_n=2,
                                               stops=[text(" w1")], choices=[
                                                   (STOP, ordinary_tokens(2, top=2), 0),
                                                   (LENGTH, ordinary_tokens(3, top=2), None)],
                                               shown=1),
    "openai_completion_stream_usage": request(4, flags=LOGPROBS | USAGE, top_n=1, choices=[
        (LENGTH, ordinary_tokens(3, top=1), None), (EOS, ordinary_tokens(2, top=1), None)]),
    "chat_completion_logprobs": request(5, flags=LOGPROBS, top_n=2, cached=2, choices=[
        (EOS, ordinary_tokens(3, top=2), None)]),
    "chat_stream": request(6, flags=LOGPROBS | USAGE, top_n=1, choices=[
        (LENGTH, ordinary_tokens(3, top=1), None)]),
    # Special tokens (decoding to nothing: TGI's special, OpenAI's "token_id:N"), one of no
    # text, and ids repeated (the same token chosen and among the alternatives).
    "special_and_repeated_tokens": request(4, flags=LOGPROBS | ECHO | PROMPT_LOGPROBS, top_n=2,
                                           choices=[(EOS, [
                                               token(5, "x", ordinary(-1), False,
                                                     [(5, "x", ordinary(-1)),
                                                      (2, "", ordinary(-2))]),
                                               token(2, "", ordinary(-0.5), True,
                                                     [(2, "", ordinary(-0.5)),
                                                      (6, "", ordinary(-3))])], None)]),
    "error_bodies": errors([
        (False, 4, text("typical_p"), text("0.5"), True, True),
        (True, 0, text("logit_bias"), text("x", repeat=2000), True, True),
        (True, 5, text(""), text("too many requests"), False, False)]),
}

INVALID = b"\xff\xc3\x00\x01\x1f\x7f\xed\xa0\x80\xf4\x90\x80\x80\xc0\xaf\"\\\n\r\t"

REGRESSIONS = {
    # A temperature of 1e-40: every alternative's log-probability -inf, written null where the
    # document types a number (chat, completions' top_logprobs, TGI's details).
    "minus_infinity_logprob_in_chat": request(5, flags=LOGPROBS, top_n=2, choices=[
        (EOS, [token(7, "a", special(MINUS_INF), False,
                     top2(special(MINUS_INF), special(MINUS_INF)))], None)]),
    "minus_infinity_logprob_in_completion": request(3, flags=LOGPROBS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(MINUS_INF), False,
                        top2(special(MINUS_INF), special(MINUS_INF)))], None)]),
    "minus_infinity_logprob_in_tgi_details": request(2, flags=DETAILS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(MINUS_INF), False,
                        top2(special(MINUS_INF), special(MINUS_INF)))], None)]),
    "plus_infinity_logprob_in_tgi_stream": byte(0) + byte(1) + event(
        0, token(7, "a", special(PLUS_INF)), top=[token(8, "b", special(PLUS_INF))]),
    "nan_logprob_in_tgi_stream": request(1, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(NAN), False, top2(special(NAN), bits(0xFFC00001)))],
         None)]),
    # Named by kNaNWrittenNullWhereANumberIsTyped.
    "nan_logprob_in_chat": request(6, flags=LOGPROBS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(NAN), False, top2(special(MINUS_NAN), special(NAN)))],
         None)]),
    "nan_logprob_in_completion_top_logprobs": request(3, flags=LOGPROBS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(NAN), False, top2(special(NAN), bits(0x7F800001)))],
         None)]),
    "denormal_logprobs": request(4, flags=LOGPROBS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(MINUS_DENORM_MIN), False,
                        top2(special(DENORM_MIN), special(MINUS_1E_40))),
                  token(8, "b", bits(0x80000001), False,
                        top2(special(MINUS_FLT_MIN), special(MINUS_ZERO)))], None)]),
    "below_min_logprob": request(5, flags=LOGPROBS, top_n=2, choices=[
        (LENGTH, [token(7, "a", special(MINUS_FLT_MAX), False,
                        top2(special(BELOW_MIN_LOGPROB), special(MINUS_10000))),
                  token(8, "b", special(MINUS_1E30), False,
                        top2(special(FLT_MAX), raw_float(-1e38)))], None)]),
    "huge_token_counts_in_tgi_stream": byte(0) + byte(1) + event(
        2**64 - 1, token(2**31 - 1, "z", special(MIN_LOGPROB)),
        end=("z", LENGTH, 2**64 - 1, 2**64 - 1)),
    "huge_token_counts_in_usage": request(4, flags=USAGE, prompt_tokens=2**64 - 1,
                                          cached=2**31 - 1, created=2**63, seed=2**64 - 1,
                                          choices=[(LENGTH, ordinary_tokens(2), None)]),
    "huge_seed_in_tgi_details": request(2, flags=DETAILS | SAMPLE, seed=2**64 - 1, choices=[
        (LENGTH, ordinary_tokens(2), None), (LENGTH, ordinary_tokens(2), None)]),
    # A stop sequence of 16 KiB (the most the target makes) that is not UTF-8: OpenAI's text
    # is cut before it, mid character.
    "long_stop_sequence_not_utf8": request(3, flags=LOGPROBS | ECHO, top_n=1,
                                           stops=[text(INVALID, repeat=4000), text(b"\xe2\x82")],
                                           choices=[(STOP, [token(9, b"\xe2\x82\xac", ordinary(-1),
                                                                  False,
                                                                  [(10, b"\xff", ordinary(-2))])],
                                                     0)]),
    "texts_not_utf8_with_control_bytes": request(6, flags=LOGPROBS | USAGE, top_n=1,
                                                 model=b"m\xff\x01", prompt_text=INVALID[:20],
                                                 choices=[(LENGTH, [
                                                     token(9, INVALID[:10], ordinary(-1), False,
                                                           [(10, INVALID[10:], ordinary(-2))]),
                                                     token(11, b"\x00", ordinary(-1), False,
                                                           [(12, b"\x1b[0m", ordinary(-3))])],
                                                     None)]),
    "texts_not_utf8_in_tgi_stream": request(1, flags=SAMPLE | ECHO, top_n=1,
                                            prompt_text=b"\xc3", choices=[(STOP, [
                                                token(9, b"\xc3", ordinary(-1), False,
                                                      [(10, b"\xa9\x00", ordinary(-2))])], 0)],
                                            stops=[text(b"\x01" * 100, repeat=600)]),
    "long_error_quote_not_utf8": errors([
        (True, 4, text(INVALID, repeat=3000), text(INVALID, repeat=3000), True, True),
        (False, 6, text(INVALID), text(INVALID, repeat=3000), False, False)]),
    "stream_failed_after_tokens": request(4, flags=LOGPROBS | FAIL, top_n=1, failure=INVALID,
                                          choices=[(LENGTH, ordinary_tokens(3, top=1), None)],
                                          fail_after=2),
}


def main():
    root = sys.argv[1]
    for folder, inputs in (("http_responses", SEEDS), ("http_responses_regressions", REGRESSIONS)):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        for name, data in inputs.items():
            assert len(data) <= 4096, (name, len(data))
            with open(os.path.join(root, folder, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Hugging Face `tokenizers` as the reference for kvcm's BpeTokenizer.

Subcommands (every output is derived from a fixed seed, printed on stdout):
  smollm2 --gguf PATH --out-dir DIR   the bundled SmolLM2 GGUF's tokens and merges with
                                      SmolLM2's tokenizer.json configuration
  train --family llama3|qwen2|gpt2 --out-dir DIR
                                      a small BPE trained by tokenizers' own trainer with the
                                      family's published pre-tokenizer
  normalizers --gguf PATH --out-dir DIR
                                      the bundled GGUF's vocabulary and merges with each of
                                      NORMALIZERS in DIR/NAME (its pre-tokenizer, specials
                                      and an added token "kvcm" matched after normalization)
  sentencepiece --out-dir DIR         a small BPE with byte_fallback trained by tokenizers' own
                                      trainer, written as the SentencePiece-style tokenizer.json
                                      files Llama 2, Mistral and Gemma ship (one folder per
                                      SENTENCEPIECE_FLAVOURS entry), expected.json also holding
                                      "decode_cases" ({"ids", "decoded"}: ids no text encodes to)
  corpus --out FILE                   the test corpus alone (JSON list of strings)
  bench --dir DIR --corpus FILE       seconds to encode the corpus, one thread

DIR receives tokenizer.json, tokenizer_config.json, expected.json ({"seed", "family",
"add_bos", "bos_id", "cases": [{"text", "ids", "decoded"}]}) and, for smollm2,
gguf_vocab.json (the GGUF's tokenizer.ggml.* arrays).
"""

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import normalizers, processors, trainers  # noqa: E402

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

FRAGMENTS = {
    # Decomposed (NFD) and compatibility forms: an NFC normalizer (Qwen2's) changes them.
    "decomposed": ["e\u0301cole", "Cafe\u0301 cre\u0300me", "An\u0303o nin\u0303o",
                   "A\u030angstro\u0308m", "\u212b unit", "\u1100\u1161\u11a8 \u1112\u1161\u11ab",
                   "Zu\u0308rich Stra\u00dfe", "o\u0302\u0323 dia"],
    "latin": ["Crème brûlée à la façon de Noël", "Ñandú y pingüino", "Ærøskøbing", "Straße",
              "Déjà vu", "naïve café", "Łódź", "Český Krumlov", "İstanbul ılık", "Ångström",
              "C'est l'été", "São Paulo", "Ça va?", "Œuvre", "the quick brown fox",
              "Hello, World!", "HELLO world", "KV cache blocks"],
    "cyrillic": ["Привет, мир!", "Съешь же ещё этих мягких французских булок", "Україна",
                 "Ёжик в тумане", "ПРОГРАММА"],
    "greek": ["Καλημέρα κόσμε", "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία", "ΑΒΓΔ"],
    "arabic": ["مرحبا بالعالم", "العربية لغة جميلة ١٢٣", "كتاب"],
    "hebrew": ["שלום עולם", "עברית", "ספר"],
    "devanagari": ["नमस्ते दुनिया", "हिन्दी भाषा १२३", "संस्कृतम्"],
    "chinese": ["你好，世界！", "我们今天去公园散步。", "机器学习和人工智能", "中文没有空格所以整句是一个词"],
    "japanese": ["こんにちは世界", "東京は日本の首都です。", "カタカナとひらがな", "ｶﾀｶﾅ"],
    "korean": ["안녕하세요 세계", "한국어는 재미있어요", "ㄱㄴㄷ"],
    "thai": ["สวัสดีชาวโลก", "ภาษาไทยไม่มีช่องว่าง"],
    "python": ["def f(x):\n    return x ** 2\n", "for i in range(10):\n\tprint(f'{i:03d}')",
               "class Foo(Bar):\n    pass", "import numpy as np\nnp.zeros((3, 4))",
               "    if a == b:  # comment\n        raise ValueError('bad')"],
    "cpp": ["#include <vector>\nint main() { std::vector<int> v{1,2,3}; return v[0]; }",
            "template <typename T>\nT add(T a, T b) { return a + b; }",
            "if (x != nullptr && *x >= 0) { ++count; }", "auto [k, v] = *it;  // C++17",
            "std::cout << \"hi\\n\";"],
    "json": ['{"key": "value", "list": [1, 2.5, -3e10], "nested": {"a": null}}',
             '[{"id":1,"ok":true},{"id":2,"ok":false}]', '{\n  "name": "kvcm",\n  "v": 2\n}'],
    "whitespace": ["  ", "\t\t", "\n\n\n", "\r\n", " \r\n ", "a  b   c    d",
                   "line1\r\nline2\r\n", "\t \t \n", "    indented", "trailing   ", "\n",
                   " ", "\u00a0nbsp\u00a0", "\u3000ideographic\u3000space", "a\u0085b",
                   "x\u2028y", "!\u0085\u0085 ?"],
    "digits": ["1234567890", "3.14159265358979", "2024-01-15", "12,345,678", "007",
               "٣٤٥", "१२३", "½ ² ³", "１２３", "0x1F", "1e-9", "99999999999999999999"],
    "contractions": ["it's", "I'M", "we'll", "they're", "you've", "he'd", "IT'S", "We'LL",
                     "don't", "'s 'RE 'll", "'S", "o'clock", "rock'n'roll"],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇫🇷🇯🇵", "❤️", "🧑🏿‍💻", "✨🎉",
              "I ❤️ NY"],
    "specials": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>",
                 "<|eot_id|>", "<|start_header_id|>", "<repo_name>", "<file_sep>", "<mask>",
                 "[END]", "kvcm", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                 "<|im_start|>assistant\n", "<|im_start|", "<|im_end|>\n<|endoftext|>"],
    "misc": ["Hello", " Hello", "Hello ", "e-mail: a.b@c.de",
             "https://example.com/path?q=1&r=2#frag", "zero\u200bwidth", "tab\tsep\tvalues",
             "~!@#$%^&*()_+", "...", "—–-", "«quotes» “smart” ‘single’", "a kvcm b",
             "akvcmb", "x <mask> y", "z [END]  w",
             # Long words (the heap merge): letters, CJK, Thai, spaces, punctuation.
             "Pneumonoultramicroscopicsilicovolcanoconiosis", "中文" * 30, "x" + " " * 70 + "y",
             "=" * 80, "ภาษาไทยไม่มีช่องว่างภาษาไทยไม่มีช่องว่าง", "ab" * 40],
}
SEPARATORS = [" ", "", "\n", "\t", "  ", "\r\n", ". ", ", ", "\n\n", " \n"]
# Code point ranges for random runs (no surrogates, nothing unassigned-looking at the edges).
RANGES = [(0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x17F), (0x391, 0x3C9), (0x410, 0x44F),
          (0x5D0, 0x5EA), (0x620, 0x64A), (0x905, 0x939), (0xE01, 0xE2E), (0x3041, 0x3093),
          (0x30A1, 0x30F6), (0x4E00, 0x4FFF), (0xAC00, 0xAFFF), (0x1F600, 0x1F64F),
          (0x30, 0x39)]


def make_corpus(seed, count):
    rng = random.Random(seed)
    cases = [""]
    for group in FRAGMENTS.values():
        cases.extend(group)
    categories = sorted(FRAGMENTS)
    while len(cases) < count:
        parts = []
        for _ in range(rng.randint(1, 5)):
            roll = rng.random()
            if roll < 0.1:
                lo, hi = rng.choice(RANGES)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 12))))
            elif roll < 0.17:
                parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 20))))
            elif roll < 0.22:
                parts.append(rng.choice([" ", "\t", "\n", "\r\n"]) * rng.randint(1, 9))
            else:
                parts.append(rng.choice(FRAGMENTS[rng.choice(categories)]))
        text = ""
        for i, part in enumerate(parts):
            text += (rng.choice(SEPARATORS) if i else "") + part
        if rng.random() < 0.15:
            text = rng.choice([" ", "  ", "\n", "\t", " \n"]) + text
        if rng.random() < 0.15:
            text += rng.choice([" ", "  ", "\n", "\t", "\r\n"])
        cases.append(text)
    return cases


def write_expected(tok, family, seed, count, out_dir, bos_token=None, extra=()):
    corpus = make_corpus(seed, count) + list(extra)
    cases = []
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=False).ids
        normalized = tok.normalizer.normalize_str(text) if tok.normalizer else text
        cases.append({"text": text, "ids": ids, "normalized": normalized,
                      "decoded": tok.decode(ids, skip_special_tokens=True)})
    bos_id = tok.token_to_id(bos_token) if bos_token else None
    with_special = tok.encode("a", add_special_tokens=True).ids
    add_bos = bos_id is not None and len(with_special) > 0 and with_special[0] == bos_id
    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "family": family, "add_bos": add_bos,
                   "bos_id": -1 if bos_id is None else bos_id, "cases": cases}, f,
                  ensure_ascii=False)
    print(f"{family}: {len(cases)} cases, seed {seed}, vocab {tok.get_vocab_size()}")


# Texts the normalizers treat specially, after the corpus: final sigma (Lowercase maps each
# character alone), full case mappings, Unicode whitespace at both ends, BERT's controls,
# formats, U+FFFD and CJK (Extension B too), compatibility forms, stacked marks.
NORMALIZER_TEXTS = ["ΟΔΟΣ ΣΑΣ", "İ ẞ ǅ ΐ", "\u3000 a \u2028", "\u0085",
                    "a\u0000b\ufffdc\u200bd\te\u0085f\u4e00g\U00020000h\ue000i",
                    "ﬁ ① ㍿ Ⅻ ｶ", "e\u0301\u0327 \u1e9b\u0323", "x  y\t\tz", "kvcm KVCM"]

# Normalizers as real tokenizer.json files have them (Llama 2 and Mistral: Prepend + Replace;
# BERT's; Unicode forms; case), each built by `tokenizers` itself.
NORMALIZERS = {
    "nfd": lambda: normalizers.NFD(),
    "nfkc": lambda: normalizers.NFKC(),
    "nfkd": lambda: normalizers.NFKD(),
    "lowercase": lambda: normalizers.Lowercase(),
    "strip": lambda: normalizers.Strip(),
    "strip_right": lambda: normalizers.Strip(left=False, right=True),
    "strip_accents": lambda: normalizers.Sequence([normalizers.NFD(),
                                                   normalizers.StripAccents()]),
    "sentencepiece": lambda: normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")]),
    "replace_regex": lambda: normalizers.Replace(Regex(r"\s{2,}|[0-9]+"), "#"),
    "bert": lambda: normalizers.BertNormalizer(),
    "bert_cased": lambda: normalizers.BertNormalizer(lowercase=False, strip_accents=True,
                                                     handle_chinese_chars=False),
    "sequence": lambda: normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                              normalizers.Strip(),
                                              normalizers.Replace("'", "\u2019")]),
}


def smollm2_tokenizer(tokens, merges, token_type):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    # SmolLM2's tokenizer.json.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if token_type[i] == 3])
    return tok


def gguf_vocab(path):
    from gguf import GGUFReader
    reader = GGUFReader(path)
    return {name: reader.fields[f"tokenizer.ggml.{name}"].contents()
            for name in ("tokens", "merges", "token_type")}


def normalized(args):
    v = gguf_vocab(args.gguf)
    # One tokenizer (building it is most of the time), its normalizer swapped per file.
    tok = smollm2_tokenizer(v["tokens"], v["merges"], v["token_type"])
    tok.add_tokens([AddedToken("kvcm", normalized=True)])
    for name, make in NORMALIZERS.items():
        tok.normalizer = make()
        out_dir = os.path.join(args.out_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        tok.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, f)
        write_expected(tok, name, args.seed, args.count, out_dir, extra=NORMALIZER_TEXTS)


def smollm2(args):
    from gguf import GGUFReader
    reader = GGUFReader(args.gguf)

    def field(name):
        return reader.fields[name].contents()

    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    token_type = field("tokenizer.ggml.token_type")
    tok = smollm2_tokenizer(tokens, merges, token_type)
    os.makedirs(args.out_dir, exist_ok=True)
    # SmolLM2's file spells merges as "a b" strings; keep that spelling.
    data = json.loads(tok.to_str())
    data["model"]["merges"] = [" ".join(m) for m in data["model"]["merges"]]
    with open(os.path.join(args.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_prefix_space": False, "bos_token": "<|im_start|>",
                   "eos_token": "<|im_end|>", "model_max_length": 8192}, f)
    with open(os.path.join(args.out_dir, "gguf_vocab.json"), "w", encoding="utf-8") as f:
        json.dump({"tokens": list(tokens), "merges": list(merges),
                   "token_type": [int(t) for t in token_type],
                   "pre": str(field("tokenizer.ggml.pre")),
                   "bos_id": int(field("tokenizer.ggml.bos_token_id")),
                   "eos_id": int(field("tokenizer.ggml.eos_token_id")),
                   "add_bos": bool(field("tokenizer.ggml.add_bos_token"))}, f,
                  ensure_ascii=False)
    tok = Tokenizer.from_file(os.path.join(args.out_dir, "tokenizer.json"))
    write_expected(tok, "smollm2", args.seed, args.count, args.out_dir)


def train(args):
    family = args.family
    byte_level_alone = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if family == "llama3":
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            byte_level_alone])
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]
        bos = "<|begin_of_text|>"
    elif family == "qwen2":
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            byte_level_alone])
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bos = None
    elif family == "gpt2":
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
        bos = None
    else:
        sys.exit(f"unknown family {family}")
    tok = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()  # as Qwen2's published tokenizer.json has it
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=2,
                                  special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    training = make_corpus(args.seed + 1, 4000)
    tok.train_from_iterator(training, trainer)
    if family == "llama3":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    if family == "gpt2":
        # The added-token flags: RoBERTa's lstrip <mask>, an rstrip special, a single_word one.
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                                AddedToken("[END]", rstrip=True, special=True)])
        tok.add_tokens([AddedToken("kvcm", single_word=True, normalized=True)])
    os.makedirs(args.out_dir, exist_ok=True)
    tok.save(os.path.join(args.out_dir, "tokenizer.json"))
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w") as f:
        config = {"eos_token": specials[1] if family == "llama3" else specials[-1]}
        if bos:
            config["bos_token"] = bos
        json.dump(config, f)
    write_expected(Tokenizer.from_file(os.path.join(args.out_dir, "tokenizer.json")), family,
                   args.seed, args.count, args.out_dir, bos)


# Texts SentencePiece-style tokenizers treat specially, after the corpus: spaces at either end
# and in runs, newlines and tabs, "▁" itself, and characters the trained vocabulary has never
# seen (CJK, emoji, combining marks, U+FFFD, NUL), which fall back to their bytes.
SENTENCEPIECE_TEXTS = ["", " ", "  ", "   ", " a", "  a", "a ", "a  ", " a ", "a  b   c", "\n",
                       "\n\n",
                       " \n ", "line1\nline2\n", "\tindented", "a\tb", "\r\n", "\u2581",
                       "\u2581\u2581", "a\u2581b", "\u2581a \u2581", " \u2581", "\u4e2d\u6587",
                       "\u9f98\u9f49", "\U0001f600", "\U0001f9d1\u200d\U0001f4bb", "e\u0301\u0327",
                       "\u0301", "\ufffd", "\u0000", "a\u0000b", "\U00020000", "\ue000",
                       "\u4e2d\ud55c\u4e2d", "\U0001f600\u4e2d\U0001f600", "x \u4e2d y",
                       "<s>", "</s>", "<unk>", "a<s>b", "<s> a", " <s>", "Hello world",
                       "Hello", " Hello", "Hello ", "hello  world", "<0x41>", "\u2581<0xE4>"]

SPECIAL = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
           "special": True}
PREPEND_REPLACE = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "\u2581"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
REPLACE_FALLBACK_FUSE = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                         {"type": "ByteFallback"}, {"type": "Fuse"}]
METASPACE_FIRST = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                   "split": False}
METASPACE_LEGACY = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}
# name: (normalizer, pre_tokenizer, decoder, merges as "a b" strings, model options)
SENTENCEPIECE_FLAVOURS = {
    # Llama 2 and Mistral v0.1 as transformers' LlamaConverter wrote them.
    "llama2": (PREPEND_REPLACE, None,
               {"type": "Sequence", "decoders": REPLACE_FALLBACK_FUSE + [
                   {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}, True, {}),
    # The newer non-legacy spelling: no normalizer, the Metaspace pre-tokenizer.
    "metaspace": (None, METASPACE_FIRST, METASPACE_FIRST, False, {"ignore_merges": False}),
    # The legacy spelling (before prepend_scheme): add_prefix_space, split by default, so
    # "always" with every word its own piece.
    "metaspace_legacy": (None, METASPACE_LEGACY, METASPACE_LEGACY, True, {}),
    # Gemma: spaces replaced, nothing prepended, no Strip.
    "gemma": ({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}, None,
              {"type": "Sequence", "decoders": REPLACE_FALLBACK_FUSE}, True, {}),
    # Llama 2's shape with two byte tokens misspelled (so "<0xE4>" and "<0xF0>" are not in the
    # vocabulary: CJK and emoji become <unk>) and fuse_unk off.
    "llama2_unk": (PREPEND_REPLACE, None,
                   {"type": "Sequence", "decoders": REPLACE_FALLBACK_FUSE + [
                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}, True,
                   {"fuse_unk": False}),
}


def sentencepiece_vocab(seed, vocab_size, alphabet):
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  limit_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(make_corpus(seed + 1, 4000), trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                            for m in model["merges"]]


def sentencepiece_json(vocab, merges, flavour):
    normalizer, pre, decoder, string_merges, options = SENTENCEPIECE_FLAVOURS[flavour]
    vocab = dict(vocab)
    if flavour == "llama2_unk":
        for byte in ("<0xE4>", "<0xF0>"):
            vocab[byte.lower()] = vocab.pop(byte)
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>",
             "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
             "byte_fallback": True}
    model.update(options)
    model["vocab"] = vocab
    model["merges"] = [" ".join(m) if string_merges else list(m) for m in merges]
    single = [{"SpecialToken": {"id": "<s>", "type_id": 0}},
              {"Sequence": {"id": "A", "type_id": 0}}]
    pair = single + [{"SpecialToken": {"id": "<s>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}]
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [dict({"id": vocab[t], "content": t}, **SPECIAL)
                             for t in ("<unk>", "<s>", "</s>")],
            "normalizer": normalizer, "pre_tokenizer": pre,
            "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                               "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]],
                                                          "tokens": ["<s>"]}}},
            "decoder": decoder, "model": model}


def decode_cases(tok, seed):
    """Id sequences no text encodes to (bytes that are no UTF-8, split characters, lone "▁",
    specials between bytes), with what tokenizers decodes them to."""
    rng = random.Random(seed)
    size = tok.get_vocab_size()
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    byte = {b: i for b, i in byte.items() if i is not None}
    meta = tok.token_to_id("\u2581")
    fixed = [[byte[0xE4]] if 0xE4 in byte else [], [byte[0x41], byte[0xC3]], [meta], [meta, meta],
             [1, meta], [meta, 2, meta], [byte[0x20], meta]]
    cases = [ids for ids in fixed if ids]
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(1, 10)):
            roll = rng.random()
            if roll < 0.45:
                ids.append(rng.choice(list(byte.values())))
            elif roll < 0.55:
                ids.append(rng.randint(0, 2))
            elif roll < 0.65:
                ids.append(meta)
            else:
                ids.append(rng.randrange(size))
        cases.append(ids)
    return [{"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)} for ids in cases]


def sentencepiece(args):
    vocab, merges = sentencepiece_vocab(args.seed, args.vocab_size, args.alphabet)
    for flavour in SENTENCEPIECE_FLAVOURS:
        out_dir = os.path.join(args.out_dir, flavour)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(sentencepiece_json(vocab, merges, flavour), f, ensure_ascii=False,
                      indent=1)
            f.write("\n")
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}, f)
            f.write("\n")
        tok = Tokenizer.from_file(path)
        cases = []
        for text in make_corpus(args.seed, args.count) + SENTENCEPIECE_TEXTS:
            ids = tok.encode(text, add_special_tokens=False).ids
            cases.append({"text": text, "ids": ids,
                          "decoded": tok.decode(ids, skip_special_tokens=True)})
        with_bos = tok.encode("a", add_special_tokens=True).ids
        with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"seed": args.seed, "family": flavour, "tokenizers": tokenizers_version(),
                       "add_bos": with_bos[0] == tok.token_to_id("<s>"),
                       "bos_id": tok.token_to_id("<s>"), "eos_id": tok.token_to_id("</s>"),
                       "cases": cases, "decode_cases": decode_cases(tok, args.seed)},
                      f, ensure_ascii=False)
            f.write("\n")
        print(f"{flavour}: {len(cases)} cases, seed {args.seed}, vocab {tok.get_vocab_size()}, "
              f"{len(merges)} merges")


def tokenizers_version():
    import tokenizers
    return tokenizers.__version__


def corpus(args):
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(make_corpus(args.seed, args.count), f, ensure_ascii=False)
    print(f"corpus: {args.count} strings, seed {args.seed}")


def bench(args):
    tok = Tokenizer.from_file(os.path.join(args.dir, "tokenizer.json"))
    with open(args.corpus, encoding="utf-8") as f:
        texts = json.load(f)
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    batch, single = [], []
    for _ in range(args.repetitions):
        start = time.perf_counter()
        tok.encode_batch(texts, add_special_tokens=False)
        batch.append(time.perf_counter() - start)
        start = time.perf_counter()
        for text in texts:
            tok.encode(text, add_special_tokens=False)
        single.append(time.perf_counter() - start)
    print(json.dumps({"tokens": tokens, "encode_batch_seconds": batch,
                      "encode_seconds": single}))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("smollm2", "normalizers", "train", "sentencepiece", "corpus", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--seed", type=int, default=20240917)
        p.add_argument("--count", type=int, default=1200)
        if name in ("smollm2", "normalizers", "train", "sentencepiece"):
            p.add_argument("--out-dir", required=True)
        if name in ("smollm2", "normalizers"):
            p.add_argument("--gguf", required=True)
        if name == "train":
            p.add_argument("--family", required=True)
            p.add_argument("--vocab-size", type=int, default=3500)
        if name == "sentencepiece":
            p.add_argument("--vocab-size", type=int, default=700)
            p.add_argument("--alphabet", type=int, default=150)
        if name == "corpus":
            p.add_argument("--out", required=True)
        if name == "bench":
            p.add_argument("--dir", required=True)
            p.add_argument("--corpus", required=True)
            p.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    {"smollm2": smollm2, "normalizers": normalized, "train": train,
     "sentencepiece": sentencepiece, "corpus": corpus, "bench": bench}[args.command](args)


if __name__ == "__main__":
    main()

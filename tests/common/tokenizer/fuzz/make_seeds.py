# Writes the seed corpus of the tokenizer_json fuzz target
# (tests/common/tokenizer/fuzz/tokenizer_json/): small byte-level BPE tokenizer.json files
# in the shapes common/tokenizer/tokenizer_json.cc reads (every byte, a few merges, added
# tokens with each flag, pre-tokenizers and normalizers of every kind, a TemplateProcessing
# post-processor), and SentencePiece-style ones (byte_fallback; Llama 2's normalizer and
# decoder, the Metaspace pre-tokenizer and decoder).
#   python3 tests/common/tokenizer/fuzz/make_seeds.py tests/common/tokenizer/fuzz/tokenizer_json
import json
import sys


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer(pre_tokenizer, normalizer=None, post_processor=None, merges_as_strings=False):
    spelled = bytes_to_unicode()
    vocab = {spelled[b]: b for b in range(256)}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("e", "ll"), ("H", "ell")]:
        vocab.setdefault(a + b, len(vocab))
        merges.append(f"{a} {b}" if merges_as_strings else [a, b])
    added = []
    for content, special, lstrip, rstrip, single in [("<|end|>", True, False, False, False),
                                                     ("<mask>", True, True, False, False),
                                                     ("[END]", True, False, True, False),
                                                     ("kvcm", False, False, False, True)]:
        added.append({"id": len(vocab) + len(added), "content": content, "single_word": single,
                      "lstrip": lstrip, "rstrip": rstrip, "normalized": not special,
                      "special": special})
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                      "byte_fallback": False, "ignore_merges": True, "vocab": vocab,
                      "merges": merges}}


byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
seeds = {
    "sequence_of_every_pre_tokenizer.json": tokenizer(
        {"type": "Sequence", "pretokenizers": [
            {"type": "Split",
             "pattern": {"Regex": r"(?i:'s|'ll)|\p{L}+|\p{N}{1,3}|\s+(?!\S)|\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithNext",
             "invert": False},
            {"type": "Digits", "individual_digits": True},
            byte_level]},
        post_processor={"type": "TemplateProcessing",
                        "single": [{"SpecialToken": {"id": "<|end|>", "type_id": 0}},
                                   {"Sequence": {"id": "A", "type_id": 0}}],
                        "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [262],
                                                       "tokens": ["<|end|>"]}}}),
    "byte_level_nfc.json": tokenizer(dict(byte_level, add_prefix_space=True),
                                     normalizer={"type": "NFC"}, merges_as_strings=True),
    "split_removed.json": tokenizer(
        {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Removed",
             "invert": False},
            {"type": "Split", "pattern": {"String": ","}, "behavior": "MergedWithPrevious",
             "invert": False},
            {"type": "Split", "pattern": {"Regex": r"\p{N}"}, "behavior": "Contiguous",
             "invert": True},
            dict(byte_level, use_regex=False)]},
        normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}]}),
    "every_normalizer.json": tokenizer(
        dict(byte_level, add_prefix_space=True),
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "NFD"}, {"type": "StripAccents"}, {"type": "NFKC"}, {"type": "NFKD"},
            {"type": "NFC"}, {"type": "Lowercase"},
            {"type": "Strip", "strip_left": True, "strip_right": False},
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            {"type": "Replace", "pattern": {"Regex": r"\s{2,}|x*"}, "content": "-"},
            {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
             "strip_accents": None, "lowercase": True}]}),
}


def sentencepiece_tokenizer(normalizer, pre_tokenizer, decoder):
    """A SentencePiece-style BPE (Llama 2's layout: <unk>, <s>, </s>, the 256 byte-fallback
    tokens, then text with "▁" for spaces)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "e", "h", "l", "o", "t", "\u4e2d"]:
        vocab[piece] = len(vocab)
    merges = []
    for a, b in [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("l", "l"), ("e", "ll"),
                 ("\u2581", "a")]:
        vocab.setdefault(a + b, len(vocab))
        merges.append(f"{a} {b}")
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for t in ("<unk>", "<s>", "</s>")]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                        {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                          "tokens": ["<s>"]}}},
            "decoder": decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                      "merges": merges}}


replace_fallback_fuse = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                         {"type": "ByteFallback"}, {"type": "Fuse"}]
metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
             "split": False}
seeds["llama2_byte_fallback.json"] = sentencepiece_tokenizer(
    {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    None,
    {"type": "Sequence", "decoders": replace_fallback_fuse + [
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})
seeds["metaspace_byte_fallback.json"] = sentencepiece_tokenizer(None, metaspace, metaspace)
seeds["metaspace_legacy_split.json"] = sentencepiece_tokenizer(
    None, {"type": "Sequence", "pretokenizers": [
        {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True},
        {"type": "Digits", "individual_digits": True}]},
    {"type": "Sequence", "decoders": replace_fallback_fuse})

for name, value in seeds.items():
    with open(f"{sys.argv[1]}/{name}", "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))

# Writes the seed corpus of the tokenizer_json fuzz target
# (tests/common/tokenizer/fuzz/tokenizer_json/): small byte-level BPE tokenizer.json files
# in the shapes common/tokenizer/tokenizer_json.cc reads (every byte, a few merges, added
# tokens with each flag, pre-tokenizers and normalizers of every kind, a TemplateProcessing
# post-processor).
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
for name, value in seeds.items():
    with open(f"{sys.argv[1]}/{name}", "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, separators=(",", ":"))

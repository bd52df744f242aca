"""BPE pre-tokenizers: `tokenizer.ggml.pre` -> split patterns and the flags llama.cpp ties to it.

Copied from llama_vocab::impl::load and llm_tokenizer_bpe (src/llama-vocab.cpp). The patterns are
llama.cpp's adapted ones, not the tokenizer.json originals: the four that llama.cpp special-cases
run through the hand-written splitters in `unicode.py`, the rest through its std::regex fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamir.frontend.unicode import (
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    NEWLINES_PATTERN,
    QWEN2_PATTERN,
    QWEN35_PATTERN,
)

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_CJK = "[一-龥ࠀ-一가-\ud7ff]+"
_CJK_KANA = "[一-龥\u3040-ゟ゠-ヿ]+"
_ASCII_PUNCT_WORD = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
_CASED_WORDS = (  # tekken/gpt-4o: an optional leading char, upper-ish letters, then lower-ish letters
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + "{c}"
    + "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + "{c}"
)
_CASED_CLASSES = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    + _CONTRACTIONS + "?"
    + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    + _CONTRACTIONS + "?"
)
_TAIL = "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_TAIL_SLASH = "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"

# llama_vocab_pre_type -> the patterns applied one after another
PATTERNS: dict[str, tuple[str, ...]] = {
    "default": ("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2_PATTERN, "\\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (LLAMA3_PATTERN,),
    "jais2": (LLAMA3_PATTERN.replace(
        "\\s+(?!\\S)|\\s+",
        "".join(f"\\s{{{n}}}(?!\\S)|" for n in (512, 256, 128, 64, 32, 16, 8, 4))
        + "\\s{1,2}(?!\\S)|\\s{1}"),),
    "deepseek_llm": (
        "[\r\n]",
        (
            "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
            "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
            "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
            "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
            "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
            "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
            "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
            "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
            "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
            "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
            "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
            "\U000118df\U0001e900-\U0001e943]+"
        ),  # written escaped: NFC would fold some of these code points
        "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        "\\s+$",
        _CJK,
        "\\p{N}+",
    ),
    "deepseek3_llm": (
        "\\p{N}{1,3}",
        _CJK_KANA,
        _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*"
        "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "spark2_5": (
        "\\p{N}{1,3}",
        _CJK_KANA,
        _ASCII_PUNCT_WORD + "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]"
        "|\\s+(?!\\S)|\\s+",
        "\\p{N}",
    ),
    "youtu": (
        "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _CJK_KANA,
        _CASED_CLASSES + "|\\p{N}" + _TAIL_SLASH,
    ),
    "deepseek_coder": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}"),
    "falcon": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2_PATTERN, "[0-9][0-9][0-9]"),
    "starcoder": ("\\p{N}", GPT2_PATTERN),
    "gpt2": (GPT2_PATTERN,),
    "qwen2": (QWEN2_PATTERN,),
    "qwen35": (QWEN35_PATTERN,),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, "\\p{N}"),
    "tekken": (_CASED_WORDS.replace("{c}", "") + "|\\p{N}" + _TAIL_SLASH,),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        GPT2_PATTERN,
    ),
    "gpt4o": (_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?") + "|\\p{N}{1,3}" + _TAIL_SLASH,),
    "granite_emb_multi": (
        _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?").replace("(?=[\\p{L}])", "(?=[\\p{L}\\p{M}])")
        + "|\\p{N}{1,3}" + _TAIL_SLASH,
    ),
    "tiny_aya": ("\\d{1,3}(?=(?:\\d{3})*\\b)", _CASED_CLASSES + "|\\p{N}{1,3}" + _TAIL_SLASH),
    "superbpe": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "bailingmoe": (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    "seed_coder": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "ufakzeka": ("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}" + _TAIL,),
    "afmoe": (
        "\\p{AFMoE_digits}",
        "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
        _ASCII_PUNCT_WORD + "|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "laguna": (NEWLINES_PATTERN, QWEN2_PATTERN),
    "exaone_moe": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    "gemma4": (NEWLINES_PATTERN,),
    "sarvam_moe": (NEWLINES_PATTERN,),
    "kimi_k2": ("\\p{Han}+",),
    "minicpm5": ("\\p{N}{1,3}", QWEN2_PATTERN.replace("|\\p{N}|", "|\\p{N}+|")),
}
PATTERNS["chatglm4"] = PATTERNS["llama3"]  # same text as llama3, so also its hand-written splitter


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """What one `tokenizer.ggml.pre` value selects in llama.cpp."""

    kind: str                      # a key of PATTERNS
    clean_spaces: bool = True      # clean_up_tokenization_spaces when detokenizing
    ignore_merges: bool = False    # a word that is already a token skips the merges
    add_bos: bool = False
    add_sep: bool = False
    escape_whitespaces: bool = False  # SPM-style BPE: spaces become U+2581 before splitting
    no_bos: bool = False           # chatglm/glm: no default BOS token

    @property
    def patterns(self) -> tuple[str, ...]:
        return PATTERNS[self.kind]

    @property
    def byte_level(self) -> bool:
        """GPT-2 byte encoding of the words; SPM-style BPE (gemma4, sarvam) works on raw UTF-8."""
        return self.kind not in ("gemma4", "sarvam_moe")


def _names(kind: str, names: str, **flags: bool) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(kind, **flags) for name in names.split()}


KEEP = {"clean_spaces": False}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", "default"),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
    **_names("llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             ignore_merges=True, add_bos=True),
    **_names("deepseek_llm", "deepseek-llm", **KEEP),
    **_names("deepseek_coder", "deepseek-coder", **KEEP),
    **_names("deepseek3_llm", "deepseek-v3 hunyuan-dense hy_v4 joyai-llm", **KEEP),
    **_names("spark2_5", "spark2_5", **KEEP),
    **_names("youtu", "youtu", ignore_merges=True, **KEEP),
    **_names("falcon", "falcon"),
    **_names("gpt2", "mpt olmo jais"),
    **_names("starcoder", "starcoder refact codeshell exaone minerva-7b mellum2"),
    **_names("gpt2", "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum"),
    **_names("gpt2", "modern-bert exaone4"),
    **_names("jais2", "jais-2"),
    **_names("gemma4", "gemma4 granite-embed-multi-311m", escape_whitespaces=True),
    **_names("sarvam_moe", "sarvam-moe", escape_whitespaces=True, **KEEP),
    **_names("gpt2", "jina-v1-en jina-v2-code roberta-bpe", add_sep=True),
    **_names("starcoder", "command-r smollm", **KEEP),
    **_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", **KEEP),
    **_names("qwen2", "stablelm2 megrez"),
    **_names("qwen35", "qwen35", **KEEP),
    **_names("llama3", "dbrx smaug-bpe"),
    **_names("bloom", "poro-chat", **KEEP),
    **_names("bloom", "bloom gpt3-finnish"),
    **_names("chatglm4", "chatglm-bpe", no_bos=True),
    **_names("chatglm4", "glm4 glm5", no_bos=True, ignore_merges=True),
    **_names("viking", "viking", **KEEP),
    **_names("tekken", "tekken", ignore_merges=True, add_bos=True, **KEEP),
    **_names("exaone_moe", "exaone-moe"),
    **_names("chameleon", "chameleon", add_bos=True, **KEEP),
    **_names("gpt4o", "gpt-4o llama4 kanana2 talkie minimax-m2", **KEEP),
    **_names("granite_emb_multi", "granite-embed-multi-97m", ignore_merges=True, **KEEP),
    **_names("tiny_aya", "tiny_aya cohere2moe", **KEEP),
    **_names("superbpe", "superbpe", **KEEP),
    **_names("gpt2", "trillion granite-docling", **KEEP),
    **_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe", **KEEP),
    **_names("seed_coder", "seed-coder", **KEEP),
    **_names("ufakzeka", "ufakzeka", **KEEP),
    **_names("qwen2", "grok-2", **KEEP),
    **_names("afmoe", "afmoe", **KEEP),
    **_names("laguna", "laguna", **KEEP),
    **_names("kimi_k2", "kimi-k2", **KEEP),
}

# known to llama.cpp, but not ported: the pre-tokenizer of the "whitespace" tokenizer model
UNSUPPORTED_PRE = {"whitespace"}

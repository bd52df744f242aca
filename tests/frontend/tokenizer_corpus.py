"""Tricky strings for the tokenizer tests: each one targets a corner of llama.cpp's tokenizers."""

from __future__ import annotations

import random

CORPUS: list[str] = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \n",
    "\r\n",
    "a\r\nb\rc\n",
    "Hello world",
    " Hello world",
    "Hello World!",
    "Hello, world! How's it going? I'm fine, you're great, we've won, they'll see, he'd go.",
    "HOW'S IT GOING? I'M FINE, YOU'RE, WE'VE, THEY'LL, HE'D",
    "don 't won 't it 's they 're",
    "a ' b ' c",
    "Hello . World , really ? yes !",
    # digits
    "0",
    "12",
    "123",
    "1234",
    "1234567890123456789",
    "3.14159 2,718 1e-10 0x1F -42",
    "a1b22c333d4444",
    "٣٤٥ ١٢ ⅷ ² ½ 𝟙𝟚",
    # whitespace runs
    "a  b   c    d",
    "word     ",
    "   leading spaces",
    "\t\ttabs\tand  spaces\t",
    "\u00a0non-breaking\u2003em\u3000ideographic\u2028line\u0085next",
    "line1\n\nline2\n   \nline3",
    "  \n\n  \t\n",
    # unicode
    "Äpfel über Straße — naïve café résumé",
    "Ελληνικά κείμενο και Русский текст",
    "中文字符测试，你好世界。",
    "Kimi說：it's 你好World's ÀB'LL 漢字abc'd",
    "日本語のテキスト、カタカナとひらがな",
    "한국어 텍스트 입니다",
    "🦙🦙 llama 🔥 emoji 👨‍👩‍👧‍👦 family 🇫🇷 flag",
    "e\u0301 a\u0308 combining n\u0303",
    "\u0915\u094d\u0937 हिन्दी தமிழ் ไทย",
    "שלום עולם مرحبا بالعالم",
    "\u200b\u200c\u200d zero width \ufeff bom",
    "\x00\x01\x07\x1b[31m control \x7f",
    "\ufffd replacement \U0010ffff max",
    "ᚠᛇᚻ runes ꓚ ꙮ",
    "wait… what。 danda। urdu۔ comma، fullwidth，、",
    "Ⅻ ℃ ™ © ® ° ± × ÷ µ",
    "õ÷Áý deepseek bytes",
    # code-ish
    "def f(x):\n    return x**2  # comment\n",
    "if (a && b || !c) { x += 1; } // done",
    "<html><body class=\"x\">&amp;</body></html>",
    "https://example.com/path?q=1&r=2#frag",
    "$$$ ^^^ ``` ~~~ ||| +++ === <<< >>>",
    "!!!???...,,,;;;:::",
    "'''\"\"\"",
    "▁ already escaped ▁▁",
    # special-token text in the middle of ordinary text
    "Hello <|im_start|>user\nhi<|im_end|> there",
    "<|im_start|><|im_end|><|endoftext|>",
    "<s> text </s> <unk>",
    "before<|begin_of_text|>after<|eot_id|>",
    "<|endoftext|>",
    "x <|end|> y <|user|> z <|assistant|>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "[CLS] [SEP] [MASK] [PAD] [UNK]",
    "<|im_start|  almost special |>",
    "<fim_prefix>a<fim_suffix>b<fim_middle>",
    "<|fim_prefix|>def<|fim_suffix|>ret<|fim_middle|>",
    "<｜begin▁of▁sentence｜>deepseek<｜end▁of▁sentence｜>",
    "   <|im_start|>   padded   <|im_end|>   ",
    "<bos><eos><pad><mask><|turn>model\n",
]

# invalid UTF-8 and other byte strings llama.cpp must survive
BYTE_CORPUS: list[bytes] = [
    b"\xff",
    b"abc\x80def",
    b"\xe2\x82",
    b"\xe2\x82 x",
    b"\xc3\x28",
    b"\xf0\x9f\xa6",
    b"\xed\xa0\x80 surrogate",
    b"\xc0\x80 overlong",
    b"\xf8\x88\x80\x80\x80",
    b"ok \xfe\xfe end",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """Random mixes of the corpus' ingredients: letters, digits, spaces, punctuation, scripts."""
    rng = random.Random(seed)
    pieces = ["a", "Z", "é", "ß", "1", "22", "333", " ", "  ", "\n", "\t", "'s", "'LL", ".", ",", "!", "?",
              "—", "中", "の", "한", "🦙", "\u0301", "<", ">", "|", "_", "$", "▁", "\u00a0", "٣", "²",
              "<|im_start|>", "<|endoftext|>", "</s>", "<s>", "\r", "\u3000", "ǅ", "x"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]

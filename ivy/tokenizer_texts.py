"""Texts on which a fast tokenizer must reproduce the model's tokenizer.json before Ivy uses it
(checked at load, and by tests/test_tokenizer.py): unicode edge cases, whitespace, long words."""

EDGE_CASES = [
    "",
    " ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "a",
    "A",
    "hello world",
    "  leading",
    "trailing  ",
    "   both sides   ",
    "many     inner      spaces",
    "tabs\tand\t\ttabs",
    "new\nlines\n\nand\r\ncarriage\rreturns",
    "mixed \t \n whitespace \u00a0 nbsp \u2003 em-space \u3000 ideographic",
    # combining marks: decomposed vs precomposed, stacked, on a space, alone
    "cafe\u0301 caf\u00e9 Cafe\u0301",
    "e\u0301\u0302\u0323 a\u0308\u0308 o\u0338",
    " \u0301 \u0301\u0301",
    "\u0301",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357",
    # NFKC-affected: ligatures, full-width, super/subscripts, fractions, roman numerals, compatibility
    "\ufb01nance \ufb02oor \ufb00 \ufb03",
    "\uff28\uff45\uff4c\uff4c\uff4f \uff37\uff4f\uff52\uff4c\uff44 \uff11\uff12\uff13\uff01",
    "x\u00b2 + y\u00b3 = z\u2074, H\u2082O, \u00bd \u00bc \u2153, \u2160\u2161\u2162 \u2166",
    "\u2460\u2461\u2462 \u3231 \u33a1 \u2122 \u2116 \u212b \u2126",
    "\u30ac\u30ac \uff76\uff9e\uff76\uff9e \uff8a\uff9f\uff8a\uff9f",  # half-width kana with voiced marks
    "\u1100\u1161\u11a8 \uac00",  # conjoining jamo vs syllable
    "\u00c5ngstr\u00f6m \u212bngstr\u00f6m A\u030angstro\u0308m",
    # CJK, Japanese, Korean, Thai (no spaces)
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u6211\u559c\u6b22\u5728\u5468\u672b\u53bb\u516c\u56ed\u6563\u6b65\u3002",
    "\uc11c\uc6b8\uc740 \ub300\ud55c\ubbfc\uad6d\uc758 \uc218\ub3c4\uc785\ub2c8\ub2e4.",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e22\u0e34\u0e19\u0e14\u0e35\u0e15\u0e49\u0e2d\u0e19\u0e23\u0e31\u0e1a",
    "\U00020000\U0002a6d6 \u3400 \u9fff",  # CJK extensions
    # emoji: single, ZWJ sequences, skin tones, flags, keycaps, variation selectors
    "I \u2764\ufe0f pizza \U0001f355 and sushi \U0001f363!!!",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \U0001f44d\U0001f3fd \U0001f1e9\U0001f1ea\U0001f1eb\U0001f1f7 1\ufe0f\u20e3 #\ufe0f\u20e3",
    "\U0001f600\U0001f602\U0001f923\U0001f60a\U0001f60d\U0001f64f\U0001f44d\U0001f525\u2728\U0001f389",
    # RTL, bidi controls
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0643\u0645 \u0641\u064a \u0645\u0648\u0642\u0639\u0646\u0627",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd \u202bembedded\u202c \u200fRLM\u200e LRM \u2067isolate\u2069",
    "\u0627\u0644\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u064e\u0651\u0629\u064f \ufefb \ufdfa",  # harakat, lam-alef, ligature
    # zero-width and invisible characters
    "zero\u200bwidth\u200cnon\u200djoiner\u2060word\ufeffbom",
    "\u200b\u200b\u200b",
    "soft\u00adhyphen",
    "\u0000null\u0001control\u001f\u007f\u0085next-line",
    "line\u2028separator\u2029paragraph",
    # Devanagari, other scripts with combining signs
    "\u0928\u092e\u0938\u094d\u0924\u0947, \u0906\u092a \u0915\u0948\u0938\u0947 \u0939\u0948\u0902? \u0915\u093c \u0915\u093c",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5 \u1f00\u1f10 \u03ac\u0301",
    "Vi\u1ec7t Nam Vie\u0323\u0302t Nam",
    # long words and runs
    "supercalifragilisticexpialidocious " * 3,
    "a" * 300,
    "ab" * 400,
    "\u00e9" * 100 + " " + "\u6f22" * 200,
    "x" * 2000 + " y",
    "-" * 50 + "=" * 50 + "." * 50,
    "https://example.com/path/to/resource?query=1&other=two#fragment",
    "C:\\Users\\name\\file.txt  /usr/local/bin  ~/.config",
    "<s> </s> <pad> <unk> <mask> [CLS] [SEP] [MASK]",
    "\ud7ff \ue000 \uf8ff \ufffd \ufffe",
    "''quoted'' ``backticks`` \"double\" \u201csmart\u201d \u2018single\u2019",
    "\u2026 \u2014 \u2013 \u00b7 \u2022 \u00bf\u00a1",
    "MiXeD CaSe \u0130stanbul \u0131 \u00df \u1e9e \u01c5 \u01c4",
]


SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Embedding models map text to dense vectors for semantic search, 2026-12-01 at 10:00.",
    "Die Katze sitzt auf der Matte. Größe, Übermaß und Ölpreis: eine Analyse der Märkte.",
    "Le café est très chaud, fais attention à ne pas te brûler. ¿Dónde está la estación?",
    "Привет, как дела? Сегодня хорошая погода. Γειά σου Κόσμε.",
    "東京は日本の首都です。我喜欢在周末去公园散步。서울은 대한민국의 수도입니다.",
    "مرحبا بكم في موقعنا الإلكتروني. שלום עולם. नमस्ते, आप कैसे हैं?",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)",
    "SELECT id, name FROM users WHERE created_at > NOW() - INTERVAL '7 days';",
    "Call me at +1 (555) 010-2030 or email jane.doe@example.com; total $1,234.56.",
]

"""Fuzzed texts for Ivy's native encoders (ivy/native.c), and the sanitizer run over them.

    python -m benchmarks.fuzz_native [--texts 20000] [--seed 0] [--models preset:bge-m3,default] [--exact]

Builds ivy/native.c with `-fsanitize=address,undefined -fno-sanitize-recover=all` (the first report
aborts the run), then runs itself again with the compiler's libasan preloaded (Python is not built
with ASan; leak detection off: the interpreter's own allocations are not ours) and sends `--texts`
fuzzed texts (`fuzz_texts`) through the Unigram encoder of the bge-m3 preset's stand-in vocabulary and
the WordPiece encoder of all-MiniLM-L6-v2 (`default`), each text whole and cut to a random budget, on
encoders with the default word cache and with a 16-entry one (cache resets). `--exact` also compares
each text's ids with `tokenizers`'. Exit status 0: no sanitizer report and (with `--exact`) no
difference. tests/test_tokenizer_fuzz.py draws its texts from `fuzz_texts` too.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")
MARK = "IVY_FUZZ_NATIVE_CHILD"  # set in the re-run under the preloaded sanitizer runtime

# what each class of text is drawn from
LATIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèêëàâäôöüçñßÅøæœ"
SCRIPTS = [LATIN, "абвгдежзийклмнопрстуфхцчшщъыьэюяЖЩЁ", "αβγδεζηθικλμνξοπρστυφχψωΆΏ", "אבגדהוזחטיכלמנסעפצקרשת",
           "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "नमस्तेकखगघचछजझटठडढणतथदधपफबभमयरलवशषसह", "สวัสดีกขคงจฉชซญดตถทธนบปผพฟภมยรลวศษสหอฮ",
           "東京日本語中文漢字学生先生大小山川", "가나다라마바사아자차카타파하한국어", "あいうえおかきくけこアイウエオカキクケコ",
           "ｶｷｸｹｺﾊﾋﾌﾍﾎｱｲｳ", "ԱԲԳԴԵԶაბგდევზთ", "ሀለሐመሠረሰ", "ᚠᚢᚦᚨᚱᚲ"]
COMBINING = ([chr(c) for c in range(0x300, 0x370)] + [chr(c) for c in (0x483, 0x591, 0x5B0, 0x64B, 0x650, 0x670,
             0x93C, 0x94D, 0x9BC, 0xE31, 0xE33, 0xE48, 0x1AB0, 0x1DC0, 0x20D0, 0x20E3, 0x302A, 0x3099, 0x309A,
             0xFE20, 0xFF9E, 0xFF9F, 0x1D165, 0xE0100)])
EMOJI = ["😀", "👍", "❤", "👨", "👩", "👧", "👦", "🧑", "💻", "🚀", "🏳", "🌈", "🏴", "☠", "🤝", "✋", "1", "#"]
MODIFIERS = ["\U0001F3FB", "\U0001F3FC", "\U0001F3FD", "\U0001F3FE", "\U0001F3FF", "\ufe0f", "\ufe0e", "\u20e3"]
FLAGS = ["\U0001F1E9\U0001F1EA", "\U0001F1FA\U0001F1F8", "\U0001F1EF\U0001F1F5", "\U0001F1EB", "\U0001F1E6"]
TAGS = "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F"  # the Scotland flag
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u1680", "\u2000", "\u2003", "\u2009", "\u200a",
          "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\u0085", "\u180e", "\u200b", "\ufeff", "\x0b", "\x0c"]
DIGITS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "０１２３４５６７８９", "¹²³⁴⁵⁶⁷⁸⁹⁰", "₀₁₂₃",
          "①②③④⑤⑩⑳", "ⅠⅡⅢⅣⅫ", "๐๑๒๓", "〇一二三"]
PUNCT = ".,;:!?-–—'\"()[]{}<>/\\@#$%^&*_+=~`|«»„“”‘’…·•‰€£¥₹"


def _code_point(rng: random.Random) -> str:
    """Any scalar value (no surrogates), weighted towards the BMP."""
    while True:
        c = rng.randrange(0x80, 0x10000) if rng.random() < 0.8 else rng.randrange(0x10000, 0x110000)
        if not 0xD800 <= c < 0xE000:
            return chr(c)


def _word(rng: random.Random, words: list[str]) -> str:
    if words and rng.random() < 0.5:
        return rng.choice(words)
    pool = rng.choice(SCRIPTS)
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 9)))


def _repeated(rng: random.Random, alphabet: list[str]) -> str:
    c = rng.choice(alphabet) if alphabet and rng.random() < 0.7 else _code_point(rng)
    if rng.random() < 0.2:  # two characters taking turns
        d = rng.choice(alphabet) if alphabet else _code_point(rng)
        return (c + d) * rng.randint(1, 15)
    return c * rng.randint(1, 28)


def _combining(rng: random.Random, words: list[str]) -> str:
    out = [] if rng.random() < 0.8 else [rng.choice(COMBINING)]  # sometimes a mark with nothing before it
    for _ in range(rng.randint(1, 4)):
        base = rng.choice(LATIN + "ｶﾊアあ가नส") if rng.random() < 0.7 else _word(rng, words)
        out.append(base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(0, 6))))
        out.append(rng.choice(["", " ", ""]))
    return "".join(out)


def _zwj(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if r < 0.5:  # ZWJ sequences with skin tones and variation selectors
            parts = [rng.choice(EMOJI) + (rng.choice(MODIFIERS) if rng.random() < 0.5 else "")
                     for _ in range(rng.randint(1, 5))]
            out.append("\u200d".join(parts) + ("\u200d" if rng.random() < 0.1 else ""))
        elif r < 0.75:
            out.append("".join(rng.choice(FLAGS) for _ in range(rng.randint(1, 3))))
        elif r < 0.85:
            out.append(TAGS)
        else:
            out.append(rng.choice("0123456789#*") + "\ufe0f\u20e3")
        out.append(rng.choice(["", " ", "\u200c", "\u200d", "a"]))
    return "".join(out)


def _mixed(rng: random.Random, words: list[str]) -> str:
    sep = rng.choice(["", " ", " ", "-", "\u200b"])
    return sep.join(_word(rng, words) for _ in range(rng.randint(1, 8)))


def _spaces(rng: random.Random, words: list[str]) -> str:
    out = []
    for _ in range(rng.randint(1, 6)):
        out.append("".join(rng.choice(SPACES) for _ in range(rng.randint(1, 5))))
        if rng.random() < 0.7:
            out.append(_word(rng, words))
    return "".join(out)


def _digits(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 5)):
        pool = DIGITS[0] if rng.random() < 0.6 else rng.choice(DIGITS)
        run = "".join(rng.choice(pool) for _ in range(rng.randint(1, 24)))
        if rng.random() < 0.3:  # a number with separators
            run = rng.choice([",", ".", " ", "'", "\u202f"]).join(run[i:i + 3] for i in range(0, len(run), 3))
        out.append(run + rng.choice(["", " ", "%", "€", "km", ".", "-"]))
    return "".join(out)


def _noise(rng: random.Random) -> str:
    """Anything: unassigned, private-use, noncharacters, controls, the word mark, specials' look-alikes."""
    picks = [lambda: _code_point(rng), lambda: chr(rng.randrange(0, 0x80)), lambda: "\u2581",
             lambda: rng.choice(PUNCT), lambda: rng.choice(["<s>", "</s", "<unk", "[CLS", "##", "<mask"])]
    return "".join(rng.choice(picks)() for _ in range(rng.randint(1, 12)))


def fuzz_texts(n: int, seed: int, alphabet: list[str] | None = None, words: list[str] | None = None) -> list[str]:
    """`n` seeded texts, a class drawn for each (a few mixed, and a few long ones made of many):
    repeated characters (from `alphabet`, e.g. a vocabulary's single-character pieces, or any),
    combining marks, ZWJ / flag / keycap / tag emoji sequences, mixed scripts (`words` among them),
    whitespace runs, digits in several scripts, random code points."""
    rng = random.Random(seed)
    alphabet, words = alphabet or [], words or []
    makers = [lambda: _repeated(rng, alphabet), lambda: _combining(rng, words), lambda: _zwj(rng),
              lambda: _mixed(rng, words), lambda: _spaces(rng, words), lambda: _digits(rng), lambda: _noise(rng)]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.7:
            out.append(rng.choice(makers)())
        elif r < 0.98:
            out.append(rng.choice(["", " ", "\n"]).join(rng.choice(makers)() for _ in range(rng.randint(2, 6))))
        else:  # long: the scratch arrays grow, words over the cached length
            out.append("".join(rng.choice(makers)() for _ in range(rng.randint(50, 400))))
    return out


def _models(names: list[str]) -> list[Path]:
    from trellis.modelref import resolve_model_path

    return [resolve_model_path(m) for m in names]


def _child(args: argparse.Namespace, so: Path) -> int:
    import json

    import numpy as np
    from tokenizers import Tokenizer

    from ivy.native import NativeEncoder, load
    from ivy.wraps import fixed_wrap

    lib = load(so)
    rng = random.Random(args.seed)
    failed = 0
    names = args.models.split(",")
    for name, path in zip(names, _models(names)):
        tj = path / "tokenizer.json"
        ref = Tokenizer.from_file(str(tj))
        ref.no_padding()
        ref.no_truncation()
        wrap = fixed_wrap(ref)
        model = json.loads(tj.read_text())["model"]
        pieces = [p for p, _ in model["vocab"]] if model["type"] == "Unigram" else list(model["vocab"])
        alphabet = [p for p in pieces if len(p) == 1]
        words = [p.lstrip("\u2581") for p in pieces[1000:3000]]
        texts = fuzz_texts(args.texts, args.seed, alphabet, words)
        encoders = [NativeEncoder(tj, wrap, lib=lib), NativeEncoder(tj, wrap, cache_bits=4, lib=lib)]
        t0 = time.monotonic()
        calls = back = differ = 0
        for text in texts:
            for enc in encoders:
                for budget in (None, rng.randint(0, 40)):
                    ids = enc.ids(text, budget)
                    calls += 1
                    if ids is None:
                        back += 1
                    elif args.exact and budget is None and ids.tolist() != ref.encode(text).ids:
                        differ += 1
                        if differ <= 5:
                            print(f"  differs: {text[:60]!r}", flush=True)
                    assert ids is None or ids.dtype == np.int32
        stats = encoders[1].stats()
        print(f"{name} ({model['type']}): {len(texts)} texts, {calls} encodes under ASan + UBSan in "
              f"{time.monotonic() - t0:.1f} s, {back} handed back to tokenizers, small cache resets "
              f"{stats['resets']}" + (f", {differ} differ from tokenizers" if args.exact else ""), flush=True)
        failed += differ
    return 1 if failed else 0


def sanitized(source: Path, flags: tuple[str, ...], mark: str, module: str, args: list[str]) -> int | None:
    """`source` (one of Ivy's C files) built with `flags` (ASan + UBSan) in a temporary directory, then
    `python -m module --so BUILD *args` run with the sanitizers' runtime preloaded and `mark` set (the child
    loads that build): its exit status; None (said on stderr) without a C compiler or ASan's runtime."""
    from ivy import native

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        print("no C compiler", file=sys.stderr)
        return None
    runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isfile(runtime):
        print(f"{cc} has no libasan.so ({runtime!r})", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        so = native.build(Path(tmp) / f"{source.stem}-sanitized.so", flags, source)
        env = dict(os.environ, **{mark: "1", "LD_PRELOAD": os.path.realpath(runtime),
                                  "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
                                  "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
        argv = [sys.executable, "-m", module, "--so", str(so), *args]
        return subprocess.run(argv, env=env, cwd=Path(__file__).resolve().parent.parent).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=20000, help="fuzzed texts per model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="preset:bge-m3,default", help="comma-separated model references")
    ap.add_argument("--exact", action="store_true", help="also compare the ids with tokenizers'")
    ap.add_argument("--so", help=argparse.SUPPRESS)  # the sanitized build, in the re-run
    args = ap.parse_args(argv)
    if os.environ.get(MARK):
        return _child(args, Path(args.so))
    from ivy.native import SOURCE

    rc = sanitized(SOURCE, SANITIZE, MARK, "benchmarks.fuzz_native",
                   ["--texts", str(args.texts), "--seed", str(args.seed), "--models", args.models]
                   + (["--exact"] if args.exact else []))
    if rc is None:
        return 2
    print("clean: no sanitizer report" if rc == 0 else f"FAILED: exit status {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

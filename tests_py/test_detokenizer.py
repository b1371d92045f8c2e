"""Incremental detokenization and stop strings, checked against whole-sequence decode.

Tokenizers: a byte-level BPE (GPT-2 / SmolLM2 style) and a SentencePiece-style
BPE with byte fallback (Llama style), both trained here in milliseconds, plus
the default model's real tokenizer when its model directory can be built.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.stop_strings import StopStringStream, check_stop, held_back_length
from pagedserve.engine.tokenizer import apply_chat_template, encode_prompt, eos_token_ids, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "Déjà vu: naïve café façade, crème brûlée and jalapeño. Ünïcödé everywhere.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀 🚀 👩‍💻 🇫🇷 ❤️ and math ∑∫√ with symbols €£¥.",
    "def main():\n    print('tabs\\tand newlines')\n    return 42\n",
]
SAMPLE_TEXTS = [
    "Hello world, the fox is naïve. Déjà vu!",
    "日本語と中文 mixed with English 😀🚀 and more 👩‍💻 text.",
    "crème brûlée 🇫🇷 ❤️ ∑∫√ €£¥ — end",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "ひらがな カタカナ 漢字 한국어 Ελληνικά русский עברית العربية",
]


def wrap(tok: Tokenizer, **special) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def build_byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return wrap(tok, eos_token="<|endoftext|>", bos_token="<|im_start|>")


def build_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Metaspace + byte fallback: ASCII words in the vocabulary, everything else as <0xNN>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=260, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([CORPUS[0], CORPUS[4]] * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first_byte_id = len(vocab)
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", first_byte_id + byte)
    spec["model"]["byte_fallback"] = True
    return wrap(Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>",
                unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    return build_byte_level_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    return build_sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def default_model_tokenizer():
    try:
        from pagedserve.models.default_model import default_model_dir
    except ImportError as err:
        pytest.skip(f"pagedserve.models.default_model is not available yet ({err})")
    try:
        model_dir = default_model_dir()
    except Exception as err:  # no network, no pip, a failed conversion: say which
        pytest.skip(f"the default model directory could not be built: {err!r}")
    from pagedserve.engine.tokenizer import load_tokenizer
    return load_tokenizer(model_dir)


@pytest.fixture(params=["byte_level", "sentencepiece", "default_model"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def stream(tokenizer, prompt_ids, output_ids, chunk_sizes=None, skip_special_tokens=True):
    """Feeds output_ids in chunks; returns the pieces (flush last) and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces, i = [], 0
    while i < len(output_ids):
        size = 1 if chunk_sizes is None else next(chunk_sizes)
        pieces.append(detok.step(output_ids[i:i + size]))
        i += size
    pieces.append(detok.flush())
    return pieces, detok


def char_boundary_at_or_after(tokenizer, ids, split: int) -> int:
    """A prompt encoded from text never ends inside a character; keep splits that way too."""
    while decode(tokenizer, ids[:split]).endswith("\ufffd"):
        split += 1
    return split


def expected_output_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    full = decode(tokenizer, prompt_ids + output_ids, skip_special_tokens)
    prompt = decode(tokenizer, prompt_ids, skip_special_tokens)
    assert full.startswith(prompt)
    return full[len(prompt):]


# -- incremental detokenization ----------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_streamed_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for split in (0, 1, len(ids) // 2):
        split = char_boundary_at_or_after(tokenizer, ids, split)
        prompt, output = ids[:split], ids[split:]
        pieces, detok = stream(tokenizer, prompt, output)
        assert "".join(pieces) == expected_output_text(tokenizer, prompt, output)
        assert detok.output_text == "".join(pieces)
        assert pieces[-1] == ""  # valid UTF-8 never needs the final flush
        assert not any("\ufffd" in piece for piece in pieces)


class DecodeOnly:
    """A tokenizer without a Rust backend (like a slow, Python-only one)."""

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens,
                                 clean_up_tokenization_spaces=clean_up_tokenization_spaces)


def test_tokenizers_without_a_rust_backend(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode(SAMPLE_TEXTS[1], add_special_tokens=False)
    split = char_boundary_at_or_after(tok, ids, 3)
    pieces, _ = stream(DecodeOnly(tok), ids[:split], ids[split:])
    assert "".join(pieces) == expected_output_text(tok, ids[:split], ids[split:])


def test_multibyte_characters_are_held_until_complete(byte_level_tokenizer):
    tok = byte_level_tokenizer
    ids = tok.encode("a 👩‍💻 b", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "the test needs a character split across tokens"
    pieces, _ = stream(tok, [], ids)
    assert "" in pieces[:-1]  # some step finalized nothing: it was holding bytes back
    assert "".join(pieces) == "a 👩‍💻 b"


def test_chunked_steps_give_the_same_text(tokenizer):
    rng = random.Random(0)
    text = " ".join(SAMPLE_TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = iter(lambda: rng.randint(1, 4), None)
    pieces, _ = stream(tokenizer, ids[:3], ids[3:], chunk_sizes=chunks)
    assert "".join(pieces) == expected_output_text(tokenizer, ids[:3], ids[3:])


def random_token_stream(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Uniform token ids, or for byte-fallback vocabularies, whole characters.

    A byte-fallback decoder turns a whole run of <0xNN> tokens into U+FFFDs as
    soon as any byte in it is invalid, even bytes already streamed as valid
    text; so for those tokenizers the stream draws valid byte runs (random
    code points) between ordinary tokens, as a model writing text does.
    """
    vocab = tokenizer.get_vocab()
    byte_ids = {int(piece[3:5], 16): i for piece, i in vocab.items()
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")}
    if not byte_ids:
        return [rng.randrange(len(tokenizer)) for _ in range(length)]
    ordinary = sorted(set(range(len(tokenizer))) - set(byte_ids.values()))
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.5:
            ids.append(rng.choice(ordinary))
        else:
            char = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x3040, 0x9FFF),
                                   rng.randrange(0x1F300, 0x1FAFF)]))
            ids.extend(byte_ids[b] for b in char.encode("utf-8"))
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_random_token_streams_match_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode(SAMPLE_TEXTS[seed % len(SAMPLE_TEXTS)], add_special_tokens=False)
    output = random_token_stream(tokenizer, rng, 60)
    pieces, _ = stream(tokenizer, prompt, output)
    assert "".join(pieces) == expected_output_text(tokenizer, prompt, output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(byte_level_tokenizer, skip):
    tok = byte_level_tokenizer
    words = tok.encode(" hello world", add_special_tokens=False)
    output = words[:1] + [tok.eos_token_id] + words[1:] + [tok.eos_token_id]
    pieces, _ = stream(tok, tok.encode("Say:", add_special_tokens=False), output,
                       skip_special_tokens=skip)
    text = "".join(pieces)
    assert text == decode(tok, output, skip_special_tokens=skip)
    assert ("<|endoftext|>" in text) is (not skip)


def test_sentencepiece_keeps_the_space_between_prompt_and_output(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode("hello world the fox", add_special_tokens=False)
    assert tok.decode(ids[1:2]) == tok.decode(ids[1:2]).lstrip()  # alone, no leading space
    pieces, _ = stream(tok, ids[:1], ids[1:])
    assert "".join(pieces) == " world the fox"


# -- stop strings ------------------------------------------------------------------


def naive_first_stop(text: str, stops: list[str], include: bool):
    """Character by character: the first stop string to complete, the longest on a tie."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return s, end if include else end - len(s)
    return None


@pytest.mark.parametrize("text, stops, include, expected", [
    ("Hello STOP there", ["STOP"], False, ("STOP", 6)),
    ("Hello STOP there", ["STOP"], True, ("STOP", 10)),
    ("abcdef", ["cd", "bcdef", "x"], False, ("cd", 2)),
    ("abcdef", ["bcd", "cd"], False, ("bcd", 1)),  # same end: the longer one
    ("no stop here", ["STOP"], False, None),
    ("line\n\nnext", ["\n\n"], True, ("\n\n", 6)),
])
def test_check_stop(text, stops, include, expected):
    match = check_stop(text, stops, include)
    assert (None if match is None else (match.stop, match.cut)) == expected


def test_check_stop_only_searches_the_new_tail():
    assert check_stop("STOP and more", ["STOP"], False, new_text_len=4) is None
    match = check_stop("xx STOP", ["STOP"], False, new_text_len=1)
    assert match is not None and match.cut == 3


def test_held_back_length():
    assert held_back_length("Hello ST", ["STOP"]) == 2
    assert held_back_length("Hello STOP", ["STOP"]) == 0  # a full match is not a partial one
    assert held_back_length("abab", ["abac"]) == 2
    assert held_back_length("xaba", ["abac", "ba!"]) == 3
    assert held_back_length("xyz", ["abc"]) == 0


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_stop_stream_matches_naive_for_random_chunkings(include, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c\n") for _ in range(40))
    stops = ["".join(rng.choice("abc\n") for _ in range(rng.randint(1, 4))) for _ in range(2)]
    expected = naive_first_stop(text, stops, include)
    final = text if expected is None else text[:expected[1]]
    stopper = StopStringStream(stops, include)
    released, i = "", 0
    while i < len(text) and stopper.match is None:
        size = rng.randint(1, 5)
        delta = stopper.feed(text[i:i + size])
        released += delta.text
        assert final.startswith(released)  # never hands out text that gets cut later
        i += size
    released += stopper.flush()
    assert released == final == stopper.output_text
    assert (stopper.match and (stopper.match.stop, stopper.match.cut)) == (expected or None)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tokenizer, include):
    text = "The answer is 42.\n###\nIgnored trailing text"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "\n###\n"
    boundaries = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in boundaries), "stop must span tokens"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    stopper = StopStringStream([stop], include)
    released = ""
    for token in ids:
        delta = stopper.feed(detok.step([token]))
        released += delta.text
        if delta.match is not None:
            break
        assert stop[:2] not in released or include  # a partial "\n#" stays held back
    assert stopper.match is not None and stopper.match.stop == stop
    assert released == ("The answer is 42.\n###\n" if include else "The answer is 42.")
    with pytest.raises(ValueError, match="already stopped"):
        stopper.feed("more")


# -- tokenizer helpers -------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def saved_bos_tokenizer_dir(tmp_path):
    """A Llama-style tokenizer directory: adds BOS on encode and has a chat template."""
    tok = build_sentencepiece_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_load_tokenizer_and_encode_prompt_with_bos(saved_bos_tokenizer_dir):
    tok = load_tokenizer(saved_bos_tokenizer_dir)
    body = tok.encode("hello world", add_special_tokens=False)
    assert encode_prompt(tok, "hello world") == [tok.bos_token_id] + body
    # A prompt that already carries BOS as text keeps exactly one.
    ids = encode_prompt(tok, "<s>hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == tok.decode(body)


def test_encode_prompt_without_bos(byte_level_tokenizer):
    ids = encode_prompt(byte_level_tokenizer, "hello world")
    assert ids == byte_level_tokenizer.encode("hello world", add_special_tokens=False)
    assert byte_level_tokenizer.decode(ids) == "hello world"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises((ValueError, OSError)):
        load_tokenizer(tmp_path)


def test_apply_chat_template(saved_bos_tokenizer_dir):
    tok = load_tokenizer(saved_bos_tokenizer_dir)
    messages = [{"role": "user", "content": "hello"}]
    ids = apply_chat_template(tok, messages)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, none added on top
    assert tok.decode(ids) == "<s>user: hello\nassistant:"
    assert tok.decode(apply_chat_template(tok, messages, add_generation_prompt=False)) == \
        "<s>user: hello\n"
    with pytest.raises(ValueError, match="role"):
        apply_chat_template(tok, [{"content": "no role"}])


def test_apply_chat_template_without_template_raises(byte_level_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(byte_level_tokenizer, [{"role": "user", "content": "hi"}])


def test_eos_token_ids_merge_config_and_tokenizer(byte_level_tokenizer):
    eos = byte_level_tokenizer.eos_token_id
    assert eos_token_ids(byte_level_tokenizer, None) == [eos]
    assert eos_token_ids(byte_level_tokenizer, 7) == [7, eos]
    assert eos_token_ids(byte_level_tokenizer, [7, eos, 9]) == [7, eos, 9]


def test_default_model_chat_template(default_model_tokenizer):
    tok = default_model_tokenizer
    ids = apply_chat_template(tok, [{"role": "user", "content": "What is 2+2?"}])
    text = tok.decode(ids)
    assert "What is 2+2?" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id in eos_token_ids(tok, None)

"""A character-level text corpus that needs no download, its tokenizer, and batches for a GPT.

    >>> import torch
    >>> from perflab.data import char_corpus, get_batch
    >>> corpus = char_corpus()                   # ~1 MB of generated English-like text, in under a second
    >>> corpus
    CharCorpus(43 characters; 900131 train + 100015 val tokens)
    >>> x, y = get_batch(corpus.train, batch_size=32, block_size=128, generator=torch.Generator().manual_seed(0))
    >>> corpus.tokenizer.decode(x[0][:40])
    ' wolves help the quick wolf, so there is'

The text comes from a small probabilistic grammar with structure a small model can learn and
a bigram model cannot: spelling, "a" vs "an", subject-verb agreement ("the cat sleeps", "the
cats sleep", "Alice and Bob sleep"), questions with "does"/"do"/"did" and the bare verb,
quoted speech, capitals after a full stop, and one tense held through each paragraph.

Used in: lecture 04 (mixed precision), lecture 07 (ddp), lecture 08 (flash attention), lab 05.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["CharCorpus", "CharTokenizer", "char_corpus", "get_batch", "make_text"]

# (singular, plural) nouns; verbs as (base, third person singular, past).
_NOUNS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("fox", "foxes"),
    ("bird", "birds"),
    ("child", "children"),
    ("mouse", "mice"),
    ("wolf", "wolves"),
    ("farmer", "farmers"),
    ("robot", "robots"),
    ("owl", "owls"),
    ("teacher", "teachers"),
    ("sailor", "sailors"),
    ("baker", "bakers"),
    ("elephant", "elephants"),
]
_NAMES = ["Alice", "Bob", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Oscar"]
_ADJECTIVES = [
    "small",
    "old",
    "quick",
    "quiet",
    "brave",
    "tired",
    "happy",
    "clever",
    "red",
    "grey",
    "angry",
    "young",
    "orange",
    "empty",
    "hungry",
    "ugly",
    "elegant",
]
_TRANSITIVE = [
    ("see", "sees", "saw"),
    ("chase", "chases", "chased"),
    ("follow", "follows", "followed"),
    ("find", "finds", "found"),
    ("watch", "watches", "watched"),
    ("help", "helps", "helped"),
    ("call", "calls", "called"),
    ("carry", "carries", "carried"),
    ("feed", "feeds", "fed"),
]
_INTRANSITIVE = [
    ("sleep", "sleeps", "slept"),
    ("run", "runs", "ran"),
    ("sing", "sings", "sang"),
    ("wait", "waits", "waited"),
    ("laugh", "laughs", "laughed"),
    ("rest", "rests", "rested"),
    ("hide", "hides", "hid"),
    ("dance", "dances", "danced"),
]
_PLACES = ["garden", "river", "market", "forest", "old bridge", "village", "hill", "kitchen", "harbour", "orchard"]
_PREPOSITIONS = ["in", "near", "under", "behind", "across", "beside"]
_ADVERBS = ["slowly", "quietly", "happily", "again", "every morning", "at night", "all day"]
_NUMBERS = ["two", "three", "four", "five", "many", "some"]
_SPEECH_VERBS = ["said", "replied", "whispered", "shouted"]
_CONJUNCTIONS = ["and", "but", "because", "while", "so"]


class _Grammar:
    """Sentences from the word lists above, every choice drawn from one seeded ``random.Random``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def maybe(self, probability: float) -> bool:
        return self.rng.random() < probability

    def noun_phrase(self) -> tuple[str, bool]:
        """A subject or object, and whether it is plural."""
        kind = self.rng.random()
        if kind < 0.15:
            return self.rng.choice(_NAMES), False
        if kind < 0.22:
            first, second = self.rng.sample(_NAMES, 2)
            return f"{first} and {second}", True
        if kind < 0.6:
            return self.some_thing()
        plural = self.maybe(0.35)
        return f"the {self.noun(plural)}", plural

    def some_thing(self) -> tuple[str, bool]:
        """An indefinite noun phrase ("an old owl", "three foxes"), and whether it is plural."""
        plural = self.maybe(0.35)
        noun = self.noun(plural)
        if plural:
            return f"{self.rng.choice(_NUMBERS)} {noun}", True
        return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}", False

    def noun(self, plural: bool) -> str:
        noun = self.rng.choice(_NOUNS)[plural]
        return f"{self.rng.choice(_ADJECTIVES)} {noun}" if self.maybe(0.5) else noun

    def verb(self, forms: tuple[str, str, str], plural: bool, past: bool) -> str:
        return forms[2] if past else forms[0 if plural else 1]

    def be(self, plural: bool, past: bool) -> str:
        return ("were" if plural else "was") if past else ("are" if plural else "is")

    def place(self) -> str:
        return f"{self.rng.choice(_PREPOSITIONS)} the {self.rng.choice(_PLACES)}"

    def clause(self, past: bool) -> str:
        subject, plural = self.noun_phrase()
        kind = self.rng.random()
        if kind < 0.35:
            words = [subject, self.verb(self.rng.choice(_TRANSITIVE), plural, past), self.noun_phrase()[0]]
        elif kind < 0.65:
            words = [subject, self.verb(self.rng.choice(_INTRANSITIVE), plural, past)]
            if self.maybe(0.5):
                words.append(self.rng.choice(_ADVERBS))
        elif kind < 0.85:
            words = [subject, self.be(plural, past), self.rng.choice(_ADJECTIVES)]
        else:
            thing, plural = self.some_thing()
            return f"there {self.be(plural, past)} {thing} {self.place()}"
        if self.maybe(0.4):
            words.append(self.place())
        return " ".join(words)

    def question(self, past: bool) -> str:
        subject, plural = self.noun_phrase()
        auxiliary = "did" if past else ("do" if plural else "does")
        return f"{auxiliary} {subject} {self.rng.choice(_TRANSITIVE)[0]} {self.noun_phrase()[0]}?"

    def sentence(self, past: bool) -> str:
        kind = self.rng.random()
        if kind < 0.12:
            text = self.question(past)
        elif kind < 0.24:
            spoken = self.clause(past)
            speaker = self.rng.choice(_NAMES)
            text = f'"{spoken[0].upper()}{spoken[1:]}," {self.rng.choice(_SPEECH_VERBS)} {speaker}.'
        elif kind < 0.45:
            text = f"{self.clause(past)}, {self.rng.choice(_CONJUNCTIONS)} {self.clause(past)}."
        else:
            text = f"{self.clause(past)}."
        return text[0].upper() + text[1:]

    def paragraph(self) -> str:
        past = self.maybe(0.5)
        return " ".join(self.sentence(past) for _ in range(self.rng.randint(3, 7)))


def make_text(num_chars: int = 1_000_000, *, seed: int = 0) -> str:
    """About ``num_chars`` characters (whole paragraphs, a blank line between them), the same for the same seed.

    >>> print(make_text(200, seed=1))
    A happy teacher saw the owl behind the old bridge, but some small mice hid. A farmer found the quiet cat ...
    """
    if not (isinstance(num_chars, int) and num_chars > 0):
        raise ValueError(f"num_chars must be a positive int, got {num_chars!r}")
    grammar, paragraphs, length = _Grammar(seed), [], 0
    while length < num_chars:
        paragraphs.append(grammar.paragraph())
        length += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs) + "\n"


class CharTokenizer:
    """Characters <-> integer ids; the vocabulary is the sorted set of characters of ``text``.

    >>> tokenizer = CharTokenizer("hello world")
    >>> tokenizer.encode("hello")
    tensor([3, 2, 4, 4, 5])
    >>> tokenizer.decode(tokenizer.encode("hello"))
    'hello'
    """

    def __init__(self, text: str):
        self.chars = tuple(sorted(set(text)))
        self._ids = {char: i for i, char in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as an int64 tensor of ids, one per character."""
        try:
            return torch.tensor([self._ids[char] for char in text], dtype=torch.int64)
        except KeyError as missing:
            raise ValueError(f"{missing.args[0]!r} is not in this tokenizer's {self.vocab_size} characters") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of a 1-D sequence of ids."""
        return "".join(self.chars[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))

    def __repr__(self) -> str:
        return f"CharTokenizer({self.vocab_size} characters: {''.join(self.chars)!r})"


@dataclass(frozen=True)
class CharCorpus:
    """A tokenizer and the token ids of a text, cut into a leading train part and a trailing val part."""

    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor

    def __repr__(self) -> str:
        sizes = f"{len(self.train)} train + {len(self.val)} val tokens"
        return f"CharCorpus({self.tokenizer.vocab_size} characters; {sizes})"


def char_corpus(text: str | None = None, *, val_fraction: float = 0.1) -> CharCorpus:
    """``text`` (default: ``make_text()``) tokenized by character, its last ``val_fraction`` held out.

    >>> corpus = char_corpus("the cat sat on the mat. " * 20)
    >>> corpus
    CharCorpus(11 characters; 432 train + 48 val tokens)
    >>> corpus.tokenizer
    CharTokenizer(11 characters: ' .acehmnost')
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction!r}")
    text = make_text() if text is None else text
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    cut = round(len(tokens) * (1 - val_fraction))
    return CharCorpus(tokenizer, tokens[:cut], tokens[cut:])


def get_batch(
    tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``block_size`` tokens, and the same windows shifted by one: the targets.

    >>> import torch
    >>> corpus = char_corpus("the cat sat on the mat. " * 20)
    >>> x, y = get_batch(corpus.train, 4, 8, generator=torch.Generator().manual_seed(0))
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([4, 8]), True)
    >>> corpus.tokenizer.decode(x[0]), corpus.tokenizer.decode(y[0])
    ('cat sat ', 'at sat o')
    """
    if len(tokens) <= block_size:
        raise ValueError(f"{len(tokens)} tokens hold no window of {block_size} tokens plus a target")
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    positions = starts[:, None] + torch.arange(block_size)  # [batch_size, block_size]: one gather, no Python loop
    return tokens[positions], tokens[positions + 1]
